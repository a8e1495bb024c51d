from __future__ import annotations

import threading

import pytest

from tiermemd.scheduler import CpuScheduler


def test_tenants_take_turns() -> None:
    sched = CpuScheduler()
    gate = threading.Event()
    order: list[str] = []
    first = sched.submit("blocker", gate.wait)  # hold the executor while the queues fill
    futures = [sched.submit("a", lambda i=i: order.append(f"a{i}")) for i in range(4)]
    futures += [sched.submit("b", lambda i=i: order.append(f"b{i}")) for i in range(2)]
    gate.set()
    for f in [first, *futures]:
        f.result(5)
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3"]
    sched.close()


def test_cancel_drops_queued_work_of_one_tenant_only() -> None:
    sched = CpuScheduler()
    gate = threading.Event()
    sched.submit("x", gate.wait)
    doomed = [sched.submit("dead", lambda: 1) for _ in range(3)]
    kept = sched.submit("alive", lambda: 2)
    assert sched.cancel("dead") == 3
    gate.set()
    assert kept.result(5) == 2
    assert all(f.cancelled() for f in doomed)
    sched.close()


def test_exceptions_reach_the_waiter_and_the_executor_survives() -> None:
    sched = CpuScheduler()

    def boom() -> None:
        raise ValueError("bad chunk")

    with pytest.raises(ValueError, match="bad chunk"):
        sched.submit("a", boom).result(5)
    assert sched.submit("a", lambda: 7).result(5) == 7
    assert sched.busy_seconds()["a"] >= 0
    sched.close()


def test_submit_after_close_is_refused() -> None:
    sched = CpuScheduler()
    sched.close()
    with pytest.raises(Exception, match="shut down"):
        sched.submit("a", lambda: 1)

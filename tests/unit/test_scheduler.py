from __future__ import annotations

import threading
import time

import pytest

from tiermemd.scheduler import CpuScheduler, SchedulerStats


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


def _after(sched: CpuScheduler, tasks: int) -> SchedulerStats:
    """The stats once ``tasks`` tasks are counted (a task's future completes just before its accounting)."""
    deadline = time.monotonic() + 5
    while (stats := sched.stats()).tasks < tasks:
        assert time.monotonic() < deadline, stats
        time.sleep(0.001)
    return stats


def test_tasks_back_to_back_make_one_busy_period_and_an_idle_gap_starts_another() -> None:
    sched = CpuScheduler()
    gate = threading.Event()
    futures = [sched.submit("blocker", gate.wait)]
    futures += [sched.submit(name, lambda: time.sleep(0.02)) for name in ("rank0", "rank1", "rank2", "rank3")]
    time.sleep(0.03)
    gate.set()
    for f in futures:
        f.result(5)
    one = _after(sched, 5)
    assert one.busy_periods == 1, one
    assert one.busy_period_s >= one.busy_s >= 0.03 + 4 * 0.02, one  # the gate's wait is a task's time too
    time.sleep(0.05)  # idle: not in any period
    sched.submit("rank0", lambda: time.sleep(0.01)).result(5)
    two = _after(sched, 6)
    assert two.busy_periods == 2, two
    assert 0.01 <= two.busy_period_s - one.busy_period_s < 0.05, (one, two)
    sched.close()

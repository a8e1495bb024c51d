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


def test_run_here_runs_in_the_callers_thread_when_the_executor_is_idle_and_is_counted() -> None:
    sched = CpuScheduler()
    ran_in: list[str] = []
    future = sched.run_here("a", lambda: ran_in.append(threading.current_thread().name) or 5)
    assert future.done() and future.result() == 5
    assert ran_in == [threading.current_thread().name]
    with pytest.raises(ValueError, match="bad chunk"):
        sched.run_here("a", lambda: (_ for _ in ()).throw(ValueError("bad chunk"))).result(0)
    stats = _after(sched, 2)
    assert stats.tasks == 2 and stats.busy_periods == 2 and sched.busy_seconds()["a"] >= 0
    sched.close()
    with pytest.raises(Exception, match="shut down"):
        sched.run_here("a", lambda: 1)


def test_run_here_while_the_executor_works_queues_behind_it_in_turn() -> None:
    sched = CpuScheduler()
    gate = threading.Event()
    order: list[str] = []
    first = sched.submit("blocker", gate.wait)
    queued = sched.submit("b", lambda: order.append("b0"))
    here = sched.run_here("a", lambda: order.append(f"a0 on {threading.current_thread().name}"))
    assert not here.done()  # the executor is busy: handed over, not run here
    gate.set()
    for f in (first, queued, here):
        f.result(5)
    assert order == ["b0", "a0 on tiermem-cpu"]
    sched.close()


def test_a_task_run_here_holds_the_executor_off_until_it_ends() -> None:
    sched = CpuScheduler()
    inside, release = threading.Event(), threading.Event()
    events: list[str] = []

    def long_task() -> None:
        inside.set()
        release.wait(5)
        events.append("here done")

    caller = threading.Thread(target=lambda: sched.run_here("a", long_task))
    caller.start()
    assert inside.wait(5)
    other = sched.submit("b", lambda: events.append("executor ran"))
    time.sleep(0.05)
    assert not other.done()  # one task at a time: the executor waits for the task run in its caller
    release.set()
    other.result(5)
    caller.join(5)
    assert events == ["here done", "executor ran"]
    sched.close()

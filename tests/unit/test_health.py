"""The progress registry behind the watchdog and the heartbeats (``tiermemd.health``)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import pytest

from tiermemd import health
from tiermemd.health import Health


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_thread_is_never_stalled_however_long_it_waits() -> None:
    clock = Clock()
    registry = Health(stall_s=10, clock=clock)
    beacon = registry.register("tiermemd-session-1", kind="session")
    clock.now += 3600
    assert not beacon.is_stalled() and registry.check()


def test_a_busy_thread_without_progress_past_its_limit_is_stalled_and_a_tick_clears_it() -> None:
    clock = Clock()
    registry = Health(stall_s=10, clock=clock)
    beacon = registry.register("tiermem-cpu")
    beacon.enter()
    clock.now += 9
    assert registry.check() and registry.workers_ok()
    clock.now += 2
    assert [b.name for b in registry.stalled()] == ["tiermem-cpu"]
    assert not registry.check() and not registry.workers_ok()
    beacon.tick()
    assert registry.check()
    clock.now += 11
    beacon.leave()
    assert registry.check()


def test_a_stalled_session_does_not_count_against_the_shared_workers() -> None:
    clock = Clock()
    registry = Health(stall_s=5, clock=clock)
    session = registry.register("tiermemd-session-7 (pid 1, uid 0)", kind="session")
    registry.register("tiermem-cpu")
    session.enter()
    clock.now += 6
    assert session.is_stalled()
    assert registry.workers_ok()  # the other clients' heartbeats go on
    assert not registry.check()  # but the watchdog is not fed


def test_a_stall_is_logged_once_by_name_and_its_end_too(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    registry = Health(stall_s=5, clock=clock)
    beacon = registry.register("tiermem-job/0 pipeline")
    beacon.enter()
    clock.now += 6
    with caplog.at_level(logging.WARNING, logger="tiermemd.health"):
        for _ in range(5):
            registry.check()
        beacon.tick()
        registry.check()
    named = [r for r in caplog.records if "tiermem-job/0 pipeline" in r.getMessage()]
    assert [r.levelno for r in named] == [logging.ERROR, logging.WARNING]


def test_forgotten_beacons_leave_the_registry() -> None:
    registry = Health(stall_s=5)
    beacon = registry.register("x")
    registry.forget(beacon)
    assert registry.beacons() == []


def test_track_binds_the_current_thread_so_tick_moves_its_beacon() -> None:
    clock = Clock()
    registry = Health(stall_s=5, clock=clock)
    with health.track("worker", health=registry) as beacon:
        clock.now += 6
        assert beacon.is_stalled()
        health.tick()
        assert not beacon.is_stalled()
    assert registry.beacons() == []
    health.tick()  # no beacon bound: nothing to move, no error


def test_wait_ticks_while_the_awaited_work_goes_on_and_returns_its_result() -> None:
    registry = Health(stall_s=60)
    future: Future[int] = Future()
    ticks = []

    class Recording(health.Beacon):
        def tick(self) -> None:
            ticks.append(1)
            super().tick()

    beacon = Recording("session", "session", 60, registry._clock)
    health.bind(beacon)
    try:
        timer = threading.Timer(1.5, lambda: future.set_result(42))
        timer.start()
        assert health.wait(future) == 42
        timer.join()
    finally:
        health.bind(None)
    assert ticks  # at least one slice of waiting ticked


def test_wait_reraises_the_awaited_error() -> None:
    future: Future[int] = Future()
    future.set_exception(TimeoutError("the work itself timed out"))
    with pytest.raises(TimeoutError, match="work itself"):
        health.wait(future)

"""Progress of the daemon's worker threads: who is busy, who is wedged.

Every thread that does work for clients holds a ``Beacon``: the session
threads (busy while they handle a request), the CPU scheduler (busy while a
task runs), each rank's pipeline thread (busy while it applies an update) and
the pidfd watcher (busy while it handles what it saw).  A busy thread ticks
its beacon as it makes progress (a request starts, an update piece ends, a
wait on another tracked thread's work goes on); a beacon is *stalled* when it
has been busy for longer than its ``stall_s`` without a tick.  An idle thread
(blocked in ``recv``, ``accept``, or waiting for a task) is never stalled.

What the verdict drives:

- the systemd watchdog (``WatchdogSec``) is fed only while no beacon is
  stalled, so a wedged thread gets the daemon restarted; each stall is logged
  once, by the thread's name, and its end is logged too;
- the server's heartbeats to a busy client stop while that client's session
  or any shared worker is stalled, so the client's timeout fires
  (``tiermem.net.frames``) instead of it waiting forever.

Waiting threads tick through ``wait`` (a ``Future`` waited for in slices):
a session blocked on an update that runs on the scheduler is not wedged
itself; if that update is, the scheduler's or pipeline's own beacon says so.

Thread-local binding (``track``) lets code deep in the update path tick the
current thread's beacon (``tick()``) without being handed it.  The registry
is plain bookkeeping with an injectable clock; ``REGISTRY`` is the daemon's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

__all__ = ["DEFAULT_STALL_S", "REGISTRY", "Beacon", "Health", "bind", "tick", "track", "wait"]

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_STALL_S = 120.0
"""Busy without progress for this long counts as wedged (``server.stall_timeout_s``)."""
_WAIT_SLICE_S = 1.0


class Beacon:
    """One thread's progress: busy or idle, and when it last moved."""

    def __init__(self, name: str, kind: str, stall_s: float, clock: Callable[[], float]) -> None:
        self.name = name
        self.kind = kind
        """"session" (one client's) or "worker" (shared by every client)."""
        self.stall_s = stall_s
        self._clock = clock
        self._busy_since: float | None = None
        self._last = clock()
        self.stalled = False
        """Whether the last check found it stalled (so a stall is logged once)."""

    def enter(self) -> None:
        now = self._clock()
        self._busy_since = now
        self._last = now

    def tick(self) -> None:
        self._last = self._clock()

    def leave(self) -> None:
        self._busy_since = None
        self._last = self._clock()

    @property
    def busy(self) -> bool:
        return self._busy_since is not None

    def busy_for(self) -> float:
        """Seconds since the current piece of work began (0 when idle)."""
        since = self._busy_since
        return 0.0 if since is None else self._clock() - since

    def silent_for(self) -> float | None:
        """Seconds busy without a tick, or None when idle."""
        if self._busy_since is None:
            return None
        return self._clock() - self._last

    def is_stalled(self) -> bool:
        silent = self.silent_for()
        return silent is not None and silent > self.stall_s


class Health:
    """The registry of beacons, and the verdict over them."""

    def __init__(self, stall_s: float = DEFAULT_STALL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self._clock = clock
        self._lock = threading.Lock()
        self._beacons: set[Beacon] = set()

    def register(self, name: str, kind: str = "worker", stall_s: float | None = None) -> Beacon:
        beacon = Beacon(name, kind, self.stall_s if stall_s is None else stall_s, self._clock)
        with self._lock:
            self._beacons.add(beacon)
        return beacon

    def forget(self, beacon: Beacon) -> None:
        with self._lock:
            self._beacons.discard(beacon)

    def beacons(self) -> list[Beacon]:
        with self._lock:
            return list(self._beacons)

    def stalled(self) -> list[Beacon]:
        return [b for b in self.beacons() if b.is_stalled()]

    def workers_ok(self) -> bool:
        """No shared worker (scheduler, pipeline, watcher) is stalled."""
        return not any(b.kind == "worker" and b.is_stalled() for b in self.beacons())

    def check(self) -> bool:
        """True when no beacon is stalled; logs each stall once by name, and each recovery."""
        ok = True
        for beacon in self.beacons():
            stalled = beacon.is_stalled()
            if stalled and not beacon.stalled:
                log.error(
                    "thread %r is wedged: busy %.0fs without progress (limit %.0fs); not feeding the watchdog",
                    beacon.name,
                    beacon.silent_for() or 0.0,
                    beacon.stall_s,
                )
            elif beacon.stalled and not stalled:
                log.warning("thread %r made progress again", beacon.name)
            beacon.stalled = stalled
            ok = ok and not stalled
        return ok


REGISTRY = Health()
"""The daemon's beacons (one process, one registry)."""

_local = threading.local()


@contextlib.contextmanager
def track(name: str, *, kind: str = "worker", health: Health | None = None) -> Iterator[Beacon]:
    """Register a busy beacon for the current thread for the duration of the block."""
    registry = REGISTRY if health is None else health
    beacon = registry.register(name, kind)
    outer = getattr(_local, "beacon", None)
    _local.beacon = beacon
    beacon.enter()
    try:
        yield beacon
    finally:
        beacon.leave()
        _local.beacon = outer
        registry.forget(beacon)


def bind(beacon: Beacon | None) -> None:
    """Make ``beacon`` the current thread's (what ``tick`` and ``wait`` move); None unbinds."""
    _local.beacon = beacon


def tick() -> None:
    """Progress of the current thread (a no-op on a thread without a beacon)."""
    beacon: Beacon | None = getattr(_local, "beacon", None)
    if beacon is not None:
        beacon.tick()


def wait(future: Future[T]) -> T:
    """``future.result()``, ticking the current thread's beacon while the work it waits for goes on."""
    while True:
        try:
            return future.result(timeout=_WAIT_SLICE_S)
        except FutureTimeout:
            if future.done():
                return future.result()
            tick()

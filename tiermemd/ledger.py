"""The node's budget: who holds how much window, pool and swap space.

Pure bookkeeping, no syscalls.  Every reservation is checked here before the
memory or disk space is touched, so a job that would not fit is refused at
admission with an ``AdmissionError`` naming the resource, what was asked, what
is left and who holds the rest, instead of running out of memory mid-step.

Invariant: for every resource, the sum of holdings never exceeds its capacity.
A job's quota (when set) caps its own holdings of a resource.
"""

from __future__ import annotations

import enum
import threading
from collections import defaultdict
from dataclasses import dataclass, field

from tiermem.core.errors import AdmissionError
from tiermem.core.units import format_size

__all__ = ["Budget", "Ledger", "LedgerStats", "Resource"]


class Resource(enum.Enum):
    WINDOW = "window"
    """Shared windows handed to clients (memfds created at attach)."""
    POOL = "pool"
    """The daemon's private pool: fp32 state on the CPU tier, staging buffers."""
    SWAP = "swap"
    """Preallocated swap file space on the NVMe tier."""
    STORAGE = "storage"
    """Shared storage of the trainers' params and grads (memfds created at register)."""


RESOURCE_NAMES = {
    Resource.WINDOW: "staging-window budget",
    Resource.POOL: "host-memory pool",
    Resource.SWAP: "swap space",
    Resource.STORAGE: "shared-storage budget",
}
RESOURCE_KNOBS = {
    Resource.WINDOW: "raise jobs.window_budget (TIERMEM_JOBS_WINDOW_BUDGET) or ask for a smaller window_nbytes",
    Resource.POOL: (
        "raise pool.size (TIERMEM_POOL_SIZE; a private daemon: connect(pool_size=...)), or close other jobs"
    ),
    Resource.SWAP: "free space in the swap directories (swap.dirs) or add one",
    Resource.STORAGE: "raise jobs.storage_budget (TIERMEM_JOBS_STORAGE_BUDGET)",
}
"""What an operator or a user changes when a resource is short (named in the admission error)."""


@dataclass(frozen=True)
class Budget:
    """One resource's capacity and what all jobs together hold of it."""

    resource: Resource
    capacity: int
    held: int


@dataclass(frozen=True)
class LedgerStats:
    """A snapshot of the ledger: every resource's budget, and each job's holdings."""

    budgets: tuple[Budget, ...]
    jobs: tuple[tuple[str, tuple[tuple[Resource, int], ...]], ...]
    """``(job id, ((resource, bytes held), ...))`` for every job holding anything."""

    def budget(self, resource: Resource) -> Budget:
        for b in self.budgets:
            if b.resource is resource:
                return b
        return Budget(resource, 0, 0)

    def held_by(self, job: str) -> dict[Resource, int]:
        for name, holdings in self.jobs:
            if name == job:
                return dict(holdings)
        return {}


@dataclass
class _Account:
    held: dict[Resource, int] = field(default_factory=lambda: defaultdict(int))
    quota: dict[Resource, int] = field(default_factory=dict)


class Ledger:
    """Capacities per resource and the holdings of each job against them (thread-safe)."""

    def __init__(self, capacity: dict[Resource, int]) -> None:
        self._capacity = dict(capacity)
        self._accounts: dict[str, _Account] = {}
        self._lock = threading.Lock()

    def capacity(self, resource: Resource) -> int:
        return self._capacity.get(resource, 0)

    def held(self, resource: Resource, job: str | None = None) -> int:
        with self._lock:
            if job is not None:
                account = self._accounts.get(job)
                return account.held.get(resource, 0) if account else 0
            return sum(a.held.get(resource, 0) for a in self._accounts.values())

    def available(self, resource: Resource) -> int:
        return self.capacity(resource) - self.held(resource)

    def quota(self, job: str, resource: Resource) -> int | None:
        """``job``'s quota of ``resource`` (None: no cap but the capacity)."""
        with self._lock:
            account = self._accounts.get(job)
            return account.quota.get(resource) if account else None

    def set_quota(self, job: str, resource: Resource, nbytes: int) -> None:
        with self._lock:
            self._accounts.setdefault(job, _Account()).quota[resource] = nbytes

    def reserve(self, job: str, resource: Resource, nbytes: int) -> None:
        """Add ``nbytes`` of ``resource`` to ``job``'s holdings, or raise ``AdmissionError``."""
        if nbytes < 0:
            raise AdmissionError(f"cannot reserve a negative amount of {resource.value}: {nbytes}")
        with self._lock:
            account = self._accounts.setdefault(job, _Account())
            total = sum(a.held.get(resource, 0) for a in self._accounts.values())
            free = self._capacity.get(resource, 0) - total
            if nbytes > free:
                holders = sorted(
                    ((j, a.held.get(resource, 0)) for j, a in self._accounts.items() if a.held.get(resource, 0)),
                    key=lambda item: -item[1],
                )
                who = ", ".join(f"{j}: {format_size(n)}" for j, n in holders[:4]) or "nobody"
                capacity = self._capacity.get(resource, 0)
                raise AdmissionError(
                    f"job {job!r} asked for {nbytes} bytes ({format_size(nbytes)}) of the daemon's "
                    f"{RESOURCE_NAMES[resource]} but only {free} bytes ({format_size(free)}) of its "
                    f"{capacity} bytes ({format_size(capacity)}) are free (held by {who}); "
                    f"{RESOURCE_KNOBS[resource]}"
                )
            quota = account.quota.get(resource)
            mine = account.held.get(resource, 0)
            if quota is not None and mine + nbytes > quota:
                raise AdmissionError(
                    f"job {job!r} asked for {format_size(nbytes)} more {resource.value}, which exceeds its "
                    f"quota of {format_size(quota)} ({format_size(mine)} already held)"
                )
            account.held[resource] = mine + nbytes

    def release(self, job: str, resource: Resource, nbytes: int) -> None:
        with self._lock:
            account = self._accounts.get(job)
            mine = account.held.get(resource, 0) if account else 0
            if nbytes > mine:
                raise AdmissionError(
                    f"job {job!r} released {format_size(nbytes)} of {resource.value} but holds {format_size(mine)}"
                )
            if account is not None:
                account.held[resource] = mine - nbytes

    def release_all(self, job: str) -> dict[Resource, int]:
        """Drop every holding of ``job``; returns what it held."""
        with self._lock:
            account = self._accounts.pop(job, None)
        return {r: n for r, n in account.held.items() if n} if account else {}

    def stats(self) -> LedgerStats:
        with self._lock:
            budgets = tuple(
                Budget(r, self._capacity.get(r, 0), sum(a.held.get(r, 0) for a in self._accounts.values()))
                for r in Resource
            )
            jobs = tuple(
                (job, tuple((r, n) for r, n in a.held.items() if n))
                for job, a in sorted(self._accounts.items())
                if any(a.held.values())
            )
        return LedgerStats(budgets, jobs)

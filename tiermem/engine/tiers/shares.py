"""``PoolShares``: the node's owner of the pool memory its tier managers borrow above their guarantees.

One pool per node, one ``TierManager`` per rank whose state is on the NVMe
tier.  Each such manager is a tenant: its floor (``cpu_budget_nbytes``) is
guaranteed (the node's ledger reserved it at admission) and it borrows free
pool memory up to its ceiling, so a node's jobs share its memory elastically.
When an allocation fits neither a free block nor after compaction, the pool
calls ``evict`` (this object is the pool's eviction callback): the tenants
give borrowed memory back, the tensors needed furthest in the future first,
across jobs (``policy.choose_node_victims``), never below a tenant's floor.
Only tier managers register, so memory that is not paged (a job placed on
the CPU tier, staging buffers) is never taken.

Locking, and why no deadlock is possible: ``evict`` runs on the allocating
thread with the pool's lock held.  It holds its own lock only to copy the
tenant list (nothing is called under it).  It then calls each chosen
manager's ``node_candidates`` and ``give_back``; those take the manager's
lock only for bookkeeping and wait for their writes with it released.  A
manager never holds its lock while calling the pool, a rank's step waits on
its manager's condition with no pool lock held, and the threads that complete
I/O (the engine's reaper, the store's verifiers) take neither the pool's lock
nor a manager's for longer than a queue append.  The only nestings are pool
lock -> shares lock and pool lock -> manager lock; neither is ever taken in the
other order, and nothing the waiting thread needs is behind them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from tiermem.core.errors import InvalidArgument, InvalidState
from tiermem.core.units import format_size
from tiermem.engine.tiers.manager import TierManager
from tiermem.engine.tiers.policy import choose_node_victims

__all__ = ["PoolShares", "SharesStats"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SharesStats:
    tenants: int
    borrowed_nbytes: int
    """Pool bytes tenants hold above their floors now."""
    evictions: int
    """Calls of ``evict`` that freed something."""
    refused: int
    """Calls of ``evict`` that found nothing to take back (the allocation then fails)."""
    given_back_nbytes: int
    """Bytes paged out for other allocations, in total."""


class PoolShares:
    """The pool's eviction callback over the node's tier managers; see the module docstring."""

    def __init__(self) -> None:
        self._tenants: dict[str, TierManager] = {}
        self._lock = threading.Lock()
        self._counts = {"evictions": 0, "refused": 0, "given_back_nbytes": 0}

    def register(self, tenant: str, manager: TierManager) -> None:
        """Let ``manager`` borrow above its floor and be asked to give it back; ``tenant`` names it (job/rank)."""
        with self._lock:
            if tenant in self._tenants:
                raise InvalidState(f"pool tenant {tenant!r} is already registered")
            self._tenants[tenant] = manager

    def unregister(self, tenant: str) -> None:
        with self._lock:
            if self._tenants.pop(tenant, None) is None:
                raise InvalidArgument(f"pool tenant {tenant!r} is not registered")

    def evict(self, nbytes_needed: int) -> bool:
        """The pool's callback (pool lock held): take back borrowed memory, furthest next use first."""
        with self._lock:
            tenants = dict(self._tenants)
        spare: dict[str, int] = {}
        candidates = []
        for name, manager in tenants.items():
            spare[name], offered = manager.node_candidates(name)
            candidates.extend(offered)
        victims = choose_node_victims(candidates, nbytes_needed, spare)
        by_tenant: dict[str, list[str]] = {}
        for v in victims:
            by_tenant.setdefault(v.tenant, []).append(v.key)
        freed = False
        for name, keys in by_tenant.items():
            freed = tenants[name].give_back(keys) or freed
        given = sum(v.nbytes for v in victims) if freed else 0
        with self._lock:
            self._counts["evictions" if freed else "refused"] += 1
            self._counts["given_back_nbytes"] += given
        if freed:
            log.debug(
                "took %s back from %s for an allocation of %s",
                format_size(given),
                ", ".join(sorted(by_tenant)),
                format_size(nbytes_needed),
            )
        return freed

    def stats(self) -> SharesStats:
        with self._lock:
            tenants = list(self._tenants.values())
            counts = dict(self._counts)
        borrowed = 0
        for m in tenants:
            s = m.stats()
            borrowed += max(0, s.cpu_nbytes - s.cpu_budget_nbytes)
        return SharesStats(tenants=len(tenants), borrowed_nbytes=borrowed, **counts)

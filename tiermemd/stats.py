"""One snapshot of the node's figures, gathered from the owners, and the STATS reply built from it.

Owns ``NodeStats`` (the owners' typed records taken together: pool, ledger,
scheduler, server, every job and rank, the Adam kernels' build states) and ``RetiredRanks`` (what ranks that
ended counted, so that the node's counters never go down when a job is
reclaimed).  Nothing is counted here: every number comes from the part that
owns it, read at the moment of a scrape or a STATS request, and every figure
is declared once, on the owner's field (``tiermem.core.figures``).  Sums over
ranks are derived from those declarations (``total``), the wire records are
filled by their keys (``build``); what is written out below is only what no
owner's field carries: counts of jobs and ranks, a job's highest step, sums
of per-reason counts.  The Prometheus collector (``tiermemd.metrics``) walks
the same declarations over the same snapshot.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiermem import __version__
from tiermem.core.figures import build, ended, total, zero
from tiermem.core.protocol import (
    AdamReport,
    BudgetReport,
    JobReport,
    NodeReport,
    NvmeReport,
    PoolReport,
    PrefetchReport,
    RankReport,
    ServerReport,
    StatsReply,
    SwapReport,
)
from tiermem.core.protocol.report import MAX_REPORTED_JOBS
from tiermem.engine.pool import PoolStats
from tiermem.engine.swap.records import SwapStats
from tiermem.engine.tiers.records import TierStats
from tiermemd.kernel import KernelStatus, kernel_statuses
from tiermemd.ledger import LedgerStats, Resource
from tiermemd.rank import RankOptimizer, RankStats
from tiermemd.scheduler import SchedulerStats
from tiermemd.serverstats import ServerStats

if TYPE_CHECKING:
    from tiermemd.service import Service

__all__ = ["JobStats", "NodeStats", "RetiredRanks", "node_stats", "stats_reply"]


class RetiredRanks:
    """The summed counters of ranks that were closed (thread-safe: reclaims run on several threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = zero(RankStats)

    def add(self, stats: RankStats) -> None:
        part = ended(stats)
        with self._lock:
            self._totals = total(RankStats, (self._totals, part))

    def totals(self) -> RankStats:
        """A ``RankStats`` of the ended ranks' counters summed (its gauges zero)."""
        with self._lock:
            return self._totals


@dataclass(frozen=True)
class JobStats:
    job_id: str
    owner_uid: int
    state: str
    world_size: int
    ranks: tuple[RankStats, ...]
    """Ranks holding state in the daemon (a rank restored from a job file and not re-registered has none)."""
    waiting_ranks: int
    """Ranks restored from a previous daemon that wait for their trainer."""


@dataclass(frozen=True)
class NodeStats:
    pool: PoolStats
    ledger: LedgerStats
    scheduler: SchedulerStats
    server: ServerStats | None
    """None before the server exists (a snapshot taken during start-up)."""
    jobs: tuple[JobStats, ...]
    retired: RankStats
    """What ranks that ended counted (``RetiredRanks.totals``)."""
    kernels: tuple[KernelStatus, ...] = ()
    """Where each Adam kernel is: building, built, failed (the fallback runs) or off (``tiermemd.kernel``)."""
    deferred_commits: int = 0
    """NVMe ranks whose last periodic commit was deferred (``tiermemd.durability``)."""

    @property
    def ranks(self) -> tuple[RankStats, ...]:
        """The ranks holding state now, and the ended ones as one more (its gauges zero)."""
        return (*(r for job in self.jobs for r in job.ranks), self.retired)

    @property
    def totals(self) -> RankStats:
        """Node figures over ranks: counters of every rank that ever ran, gauges of those holding state now."""
        return total(RankStats, self.ranks)


def node_stats(service: Service) -> NodeStats:
    """Ask every owner for its record, now."""
    jobs = []
    for job in service.jobs.jobs():
        ranks = tuple(r.stats() for r in list(job.ranks.values()) if isinstance(r, RankOptimizer))
        jobs.append(
            JobStats(
                job_id=job.job_id,
                owner_uid=job.owner_uid,
                state=job.state.value,
                world_size=job.world_size,
                ranks=ranks,
                waiting_ranks=len(job.restored),
            )
        )
    server = getattr(service, "server", None)
    return NodeStats(
        pool=service.pool.stats(),
        ledger=service.ledger.stats(),
        scheduler=service.scheduler.stats(),
        server=server.stats() if server is not None else None,
        jobs=tuple(jobs),
        retired=service.retired.totals(),
        kernels=kernel_statuses(service.kernel),
        deferred_commits=len(service.durability.deferred),
    )


# --------------------------------------------------------------------------- the STATS reply


def _node_report(node: NodeStats) -> NodeReport:
    t = node.totals
    swap = t.state.swap or zero(SwapStats)
    server = node.server or zero(ServerStats)
    return NodeReport(
        version=__version__,
        pool=build(PoolReport, node.pool),
        swap=build(
            SwapReport,
            swap,
            capacity_nbytes=node.ledger.budget(Resource.SWAP).capacity,
            io_errors=swap.read_errors + swap.write_errors + swap.commit_errors,
        ),
        budgets=tuple(BudgetReport(b.resource.value, b.capacity, b.held) for b in node.ledger.budgets),
        adam=build(AdamReport, t, node.scheduler, steps=t.last_step),
        prefetch=build(PrefetchReport, t.state.tiers or zero(TierStats)),
        server=build(ServerReport, server, disconnects=sum(n for _, n in server.disconnects)),
        jobs=len(node.jobs),
        queued_tasks=node.scheduler.queued,
    )


def _job_report(job: JobStats) -> JobReport:
    t = total(RankStats, job.ranks)
    return build(
        JobReport,
        job,
        t,
        t.state,
        ranks=len(job.ranks) + job.waiting_ranks,
        failed_ranks=int(t.failed),  # bools sum to a count
        last_step=max((r.last_step for r in job.ranks), default=0),
        staleness_steps=max((r.staleness_steps for r in job.ranks), default=0),
        state_dtypes=tuple(sorted({r.state_dtype for r in job.ranks if r.state_dtype})),
        kernel_paths=tuple(sorted({r.kernel_path for r in job.ranks if r.kernel_path})),
    )


def rank_report(r: RankStats) -> RankReport:
    tiers = r.state.tiers
    return build(RankReport, r, r.state, nvme=build(NvmeReport, tiers) if tiers is not None else None)


def stats_reply(node: NodeStats, *, uid: int | None, rank: RankStats | None) -> StatsReply:
    """The STATS reply for a caller of ``uid`` (None: one who may see every job), attached to ``rank``."""
    visible = [job for job in node.jobs if uid is None or job.owner_uid == uid]
    return StatsReply(
        node=_node_report(node),
        jobs=tuple(_job_report(job) for job in visible[:MAX_REPORTED_JOBS]),
        rank=rank_report(rank) if rank is not None else None,
    )

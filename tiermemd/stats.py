"""One snapshot of the node's figures, gathered from the owners, and the STATS reply built from it.

Owns ``NodeStats`` (the owners' typed records taken together: pool, ledger,
scheduler, server, every job and rank), ``Totals`` (node counters summed over
ranks) and ``RetiredRanks`` (the last figures of ranks that ended, so that the
node's counters never go down when a job is reclaimed).  Nothing is counted
here: every number comes from the part that owns it, read at the moment of a
scrape or a STATS request.  ``stats_reply`` turns a snapshot into the wire
message (``tiermem.core.protocol.report``); the Prometheus collector
(``tiermemd.metrics``) reads the same snapshot.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tiermem import __version__
from tiermem.core.histogram import IO_SECONDS, UPDATE_SECONDS, HistogramSnapshot
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
from tiermemd.ledger import LedgerStats, Resource
from tiermemd.rank import RankOptimizer, RankStats
from tiermemd.scheduler import SchedulerStats
from tiermemd.serverstats import ServerStats

if TYPE_CHECKING:
    from tiermemd.service import Service

__all__ = ["JobStats", "NodeStats", "RetiredRanks", "Totals", "node_stats", "stats_reply"]


def _empty(bounds: tuple[float, ...]) -> HistogramSnapshot:
    return HistogramSnapshot.empty(bounds)


@dataclass(frozen=True)
class Totals:
    """Counters of ranks summed (monotonic over the daemon's life once retired ranks are added)."""

    steps: int = 0
    skipped_steps: int = 0
    updates: int = 0
    updated_elements: int = 0
    update_s: float = 0.0
    update_seconds: HistogramSnapshot = field(default_factory=lambda: _empty(UPDATE_SECONDS))
    grad_stats_s: float = 0.0
    adopted_elements: int = 0
    swap_read_nbytes: int = 0
    swap_written_nbytes: int = 0
    swap_reads: int = 0
    swap_writes: int = 0
    swap_read_errors: int = 0
    swap_write_errors: int = 0
    swap_checksum_failures: int = 0
    swap_read_seconds: HistogramSnapshot = field(default_factory=lambda: _empty(IO_SECONDS))
    swap_write_seconds: HistogramSnapshot = field(default_factory=lambda: _empty(IO_SECONDS))
    prefetch_acquires: int = 0
    prefetch_hits: int = 0
    prefetch_stall_s: float = 0.0
    page_ins: int = 0
    page_outs: int = 0

    @classmethod
    def of(cls, ranks: Iterable[RankStats]) -> Totals:
        return sum((cls.of_rank(r) for r in ranks), cls())

    @classmethod
    def of_rank(cls, r: RankStats) -> Totals:
        tiers, swap = r.state.tiers, r.state.swap
        out = cls(
            steps=r.last_step,
            skipped_steps=r.skipped_steps,
            updates=r.updates,
            updated_elements=r.updated_elements,
            update_s=r.update_s,
            update_seconds=r.update_seconds,
            grad_stats_s=r.grad_stats_s,
            adopted_elements=r.adopted_elements,
        )
        if tiers is not None:
            out = replace(
                out,
                prefetch_acquires=tiers.acquires,
                prefetch_hits=tiers.hits,
                prefetch_stall_s=tiers.wait_s,
                page_ins=tiers.page_ins,
                page_outs=tiers.page_outs,
            )
        if swap is not None:
            out = replace(
                out,
                swap_read_nbytes=swap.bytes_read,
                swap_written_nbytes=swap.bytes_written,
                swap_reads=swap.reads,
                swap_writes=swap.writes,
                swap_read_errors=swap.read_errors,
                swap_write_errors=swap.write_errors,
                swap_checksum_failures=swap.corruptions,
                swap_read_seconds=swap.read_seconds,
                swap_write_seconds=swap.write_seconds,
            )
        return out

    def __add__(self, other: Totals) -> Totals:
        values: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            a, b = getattr(self, name), getattr(other, name)
            values[name] = HistogramSnapshot.merge(a.bounds, (a, b)) if isinstance(a, HistogramSnapshot) else a + b
        return Totals(**values)


class RetiredRanks:
    """The summed last figures of ranks that were closed (thread-safe: reclaims run on several threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = Totals()

    def add(self, stats: RankStats) -> None:
        part = Totals.of_rank(stats)
        with self._lock:
            self._totals = self._totals + part

    def totals(self) -> Totals:
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

    @property
    def window_nbytes(self) -> int:
        return sum(r.window_nbytes for r in self.ranks)

    @property
    def storage_nbytes(self) -> int:
        return sum(r.storage_nbytes for r in self.ranks)

    @property
    def cpu_state_nbytes(self) -> int:
        return sum(r.state.cpu_nbytes for r in self.ranks)

    @property
    def nvme_state_nbytes(self) -> int:
        return sum(r.state.nvme_nbytes for r in self.ranks)

    @property
    def last_step(self) -> int:
        return max((r.last_step for r in self.ranks), default=0)

    @property
    def staleness_steps(self) -> int:
        return max((r.staleness_steps for r in self.ranks), default=0)

    @property
    def failed_ranks(self) -> int:
        return sum(1 for r in self.ranks if r.failed)


@dataclass(frozen=True)
class NodeStats:
    pool: PoolStats
    ledger: LedgerStats
    scheduler: SchedulerStats
    server: ServerStats | None
    """None before the server exists (a snapshot taken during start-up)."""
    jobs: tuple[JobStats, ...]
    retired: Totals

    @property
    def totals(self) -> Totals:
        """Node counters: the live ranks' plus those of ranks that ended."""
        return Totals.of(r for job in self.jobs for r in job.ranks) + self.retired

    @property
    def swap_used_nbytes(self) -> int:
        return sum(job.nvme_state_nbytes for job in self.jobs)

    @property
    def swap_reserved_nbytes(self) -> int:
        return sum(r.state.swap.reserved_nbytes for job in self.jobs for r in job.ranks if r.state.swap is not None)


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
    )


# --------------------------------------------------------------------------- the STATS reply


def _node_report(node: NodeStats) -> NodeReport:
    pool, totals = node.pool, node.totals
    swap_budget = node.ledger.budget(Resource.SWAP)
    server = node.server
    return NodeReport(
        version=__version__,
        pool=PoolReport(
            capacity_nbytes=pool.capacity,
            used_nbytes=pool.used,
            free_nbytes=pool.free,
            largest_free_nbytes=pool.largest_free,
            locked_nbytes=pool.locked,
            blocks=pool.blocks,
            compactions=pool.compactions,
            moved_nbytes=pool.bytes_moved,
        ),
        swap=SwapReport(
            capacity_nbytes=swap_budget.capacity,
            reserved_nbytes=node.swap_reserved_nbytes,
            used_nbytes=node.swap_used_nbytes,
            read_nbytes=totals.swap_read_nbytes,
            written_nbytes=totals.swap_written_nbytes,
            reads=totals.swap_reads,
            writes=totals.swap_writes,
            io_errors=totals.swap_read_errors + totals.swap_write_errors,
            checksum_failures=totals.swap_checksum_failures,
        ),
        budgets=tuple(BudgetReport(b.resource.value, b.capacity, b.held) for b in node.ledger.budgets),
        adam=AdamReport(
            updates=totals.updates,
            updated_elements=totals.updated_elements,
            update_s=totals.update_s,
            steps=totals.steps,
            skipped_steps=totals.skipped_steps,
            cpu_busy_s=node.scheduler.busy_s,
            busy_periods=node.scheduler.busy_periods,
            busy_period_s=node.scheduler.busy_period_s,
        ),
        prefetch=PrefetchReport(
            acquires=totals.prefetch_acquires, hits=totals.prefetch_hits, stall_s=totals.prefetch_stall_s
        ),
        server=ServerReport(
            sessions=server.sessions if server else 0,
            attaches=server.attaches if server else 0,
            disconnects=sum(n for _, n in server.disconnects) if server else 0,
            refused=server.refused if server else 0,
            protocol_errors=server.protocol_errors if server else 0,
            auth_errors=server.auth_errors if server else 0,
        ),
        jobs=len(node.jobs),
        queued_tasks=node.scheduler.queued,
    )


def _job_report(job: JobStats) -> JobReport:
    return JobReport(
        job_id=job.job_id,
        owner_uid=job.owner_uid,
        state=job.state,
        world_size=job.world_size,
        ranks=len(job.ranks) + job.waiting_ranks,
        failed_ranks=job.failed_ranks,
        last_step=job.last_step,
        window_nbytes=job.window_nbytes,
        storage_nbytes=job.storage_nbytes,
        cpu_state_nbytes=job.cpu_state_nbytes,
        nvme_state_nbytes=job.nvme_state_nbytes,
        updated_elements=sum(r.updated_elements for r in job.ranks),
        staleness_steps=job.staleness_steps,
    )


def rank_report(r: RankStats) -> RankReport:
    tiers = r.state.tiers
    nvme = None
    if tiers is not None:
        nvme = NvmeReport(
            page_ins=tiers.page_ins,
            page_outs=tiers.page_outs,
            read_nbytes=tiers.bytes_in,
            written_nbytes=tiers.bytes_out,
            acquires=tiers.acquires,
            hits=tiers.hits,
            stall_s=tiers.wait_s,
            io_errors=tiers.io_errors,
        )
    return RankReport(
        rank=r.rank,
        placement=r.placement,
        last_step=r.last_step,
        skipped_steps=r.skipped_steps,
        failed=r.failed,
        tensors=r.tensors,
        numel=r.numel,
        window_nbytes=r.window_nbytes,
        storage_nbytes=r.storage_nbytes,
        cpu_state_nbytes=r.state.cpu_nbytes,
        nvme_state_nbytes=r.state.nvme_nbytes,
        overlapped_tensors=r.overlapped_tensors,
        adopted_elements=r.adopted_elements,
        updates=r.updates,
        updated_elements=r.updated_elements,
        update_s=r.update_s,
        grad_stats_s=r.grad_stats_s,
        wait_s=r.wait_s,
        staleness_steps=r.staleness_steps,
        nvme=nvme,
    )


def stats_reply(node: NodeStats, *, uid: int | None, rank: RankStats | None) -> StatsReply:
    """The STATS reply for a caller of ``uid`` (None: one who may see every job), attached to ``rank``."""
    visible = [job for job in node.jobs if uid is None or job.owner_uid == uid]
    return StatsReply(
        node=_node_report(node),
        jobs=tuple(_job_report(job) for job in visible[:MAX_REPORTED_JOBS]),
        rank=rank_report(rank) if rank is not None else None,
    )

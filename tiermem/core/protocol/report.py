"""The records of a STATS_REPLY: the node, the jobs the caller may see, and the caller's own rank.

Owns ``NodeReport`` (with ``PoolReport``, ``SwapReport``, ``BudgetReport``,
``AdamReport``, ``PrefetchReport``, ``ServerReport``), ``JobReport``,
``RankReport`` and ``NvmeReport``: typed, declared once with ``@wire`` like
every other record, and part of the protocol version (a field added or
renamed is a version change, see docs/protocol.md).  They are the protocol's
view of the daemon's figures, not metric names: the Prometheus names live in
the daemon's collector and can change without touching the wire.

Units are in the field names: ``*_nbytes`` bytes, ``*_s`` seconds, the rest
counts.  Counters count since the daemon started (those of ended jobs
included).  Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from tiermem.core.protocol.records import ID_PATTERN, MAX_ID, NBYTES, NON_NEGATIVE, PLACEMENTS, STEP_NO
from tiermem.core.protocol.spec import Choice, Int, List, Opt, Str, Wire, wire

__all__ = [
    "BUDGET_RESOURCES",
    "MAX_REPORTED_JOBS",
    "AdamReport",
    "BudgetReport",
    "JobReport",
    "NodeReport",
    "NvmeReport",
    "PoolReport",
    "PrefetchReport",
    "RankReport",
    "ServerReport",
    "SwapReport",
]

MAX_COUNT = (1 << 62) - 1
MAX_REPORTED_JOBS = 1024
"""Jobs listed in one STATS_REPLY (about 300 bytes each, well inside a 1 MiB frame)."""
BUDGET_RESOURCES = ("window", "pool", "swap", "storage")
COUNT = Int(0, MAX_COUNT)
SECONDS = NON_NEGATIVE


@wire
@dataclass(frozen=True, slots=True)
class PoolReport(Wire):
    """The daemon's host-memory pool."""

    capacity_nbytes: Annotated[int, NBYTES]
    used_nbytes: Annotated[int, NBYTES]
    free_nbytes: Annotated[int, NBYTES]
    largest_free_nbytes: Annotated[int, NBYTES]
    locked_nbytes: Annotated[int, NBYTES]
    blocks: Annotated[int, COUNT]
    compactions: Annotated[int, COUNT]
    moved_nbytes: Annotated[int, NBYTES]


@wire
@dataclass(frozen=True, slots=True)
class SwapReport(Wire):
    """The NVMe tier: the swap budget, the bytes the jobs' stores use, and their I/O."""

    capacity_nbytes: Annotated[int, NBYTES]
    """Free space of the swap directories at start: the swap budget."""
    reserved_nbytes: Annotated[int, NBYTES]
    """Preallocated in the jobs' swap files."""
    used_nbytes: Annotated[int, NBYTES]
    """Holding state (current versions and older ones not yet freed)."""
    read_nbytes: Annotated[int, NBYTES]
    written_nbytes: Annotated[int, NBYTES]
    reads: Annotated[int, COUNT]
    writes: Annotated[int, COUNT]
    io_errors: Annotated[int, COUNT]
    """Reads and writes that failed (errno, short transfer)."""
    checksum_failures: Annotated[int, COUNT]


@wire
@dataclass(frozen=True, slots=True)
class BudgetReport(Wire):
    resource: Annotated[str, Choice(BUDGET_RESOURCES)]
    capacity_nbytes: Annotated[int, NBYTES]
    held_nbytes: Annotated[int, NBYTES]


@wire
@dataclass(frozen=True, slots=True)
class AdamReport(Wire):
    """The CPU Adam updates of every rank."""

    updates: Annotated[int, COUNT]
    updated_elements: Annotated[int, COUNT]
    update_s: Annotated[float, SECONDS]
    steps: Annotated[int, COUNT]
    """Steps applied, summed over ranks (skipped steps are ``skipped_steps``)."""
    skipped_steps: Annotated[int, COUNT]
    """Steps skipped (``GradScaler`` found an inf/nan grad), summed over ranks."""
    cpu_busy_s: Annotated[float, SECONDS]
    """Time the node's CPU scheduler spent running tasks (the kernels of every rank)."""
    busy_periods: Annotated[int, COUNT]
    """Busy periods of the scheduler that ended (a task started on an idle executor to one ended with none
    queued)."""
    busy_period_s: Annotated[float, SECONDS]
    """Their total length: the tasks and the gaps between them."""


@wire
@dataclass(frozen=True, slots=True)
class PrefetchReport(Wire):
    """The NVMe tier's chunk cache: how often the state was already resident when the update needed it."""

    acquires: Annotated[int, COUNT]
    hits: Annotated[int, COUNT]
    stall_s: Annotated[float, SECONDS]
    """Time updates waited for page-ins that the prefetch did not hide."""


@wire
@dataclass(frozen=True, slots=True)
class ServerReport(Wire):
    sessions: Annotated[int, COUNT]
    """Connections served now."""
    attaches: Annotated[int, COUNT]
    disconnects: Annotated[int, COUNT]
    refused: Annotated[int, COUNT]
    protocol_errors: Annotated[int, COUNT]
    auth_errors: Annotated[int, COUNT]


@wire
@dataclass(frozen=True, slots=True)
class NodeReport(Wire):
    version: Annotated[str, Str(64)]
    """The daemon's tiermem version."""
    pool: PoolReport
    swap: SwapReport
    budgets: Annotated[tuple[BudgetReport, ...], List(BudgetReport, len(BUDGET_RESOURCES))]
    adam: AdamReport
    prefetch: PrefetchReport
    server: ServerReport
    jobs: Annotated[int, COUNT]
    """Jobs known to the daemon (all of them, also those the reply does not list)."""
    queued_tasks: Annotated[int, COUNT]
    """CPU tasks waiting for the scheduler."""


@wire
@dataclass(frozen=True, slots=True)
class NvmeReport(Wire):
    """A rank's NVMe-placed state: its tier manager and swap store."""

    page_ins: Annotated[int, COUNT]
    page_outs: Annotated[int, COUNT]
    read_nbytes: Annotated[int, NBYTES]
    written_nbytes: Annotated[int, NBYTES]
    acquires: Annotated[int, COUNT]
    hits: Annotated[int, COUNT]
    stall_s: Annotated[float, SECONDS]
    io_errors: Annotated[int, COUNT]


@wire
@dataclass(frozen=True, slots=True)
class RankReport(Wire):
    """The caller's own rank (the one its connection is attached to)."""

    rank: Annotated[int, COUNT]
    placement: Annotated[str, Choice(("", *PLACEMENTS))]
    """Where the state is; empty before REGISTER."""
    last_step: Annotated[int, STEP_NO]
    skipped_steps: Annotated[int, COUNT]
    failed: bool
    tensors: Annotated[int, COUNT]
    numel: Annotated[int, COUNT]
    window_nbytes: Annotated[int, NBYTES]
    storage_nbytes: Annotated[int, NBYTES]
    cpu_state_nbytes: Annotated[int, NBYTES]
    nvme_state_nbytes: Annotated[int, NBYTES]
    overlapped_tensors: Annotated[int, COUNT]
    adopted_elements: Annotated[int, COUNT]
    updates: Annotated[int, COUNT]
    updated_elements: Annotated[int, COUNT]
    update_s: Annotated[float, SECONDS]
    grad_stats_s: Annotated[float, SECONDS]
    wait_s: Annotated[float, SECONDS]
    """Time requests waited for a delayed update."""
    staleness_steps: Annotated[int, Int(0, 1)]
    """1 while a delayed update (DPU) is still running, else 0."""
    nvme: Annotated[NvmeReport | None, Opt(NvmeReport)]


@wire
@dataclass(frozen=True, slots=True)
class JobReport(Wire):
    """One job, its ranks' figures summed (``last_step``: the highest)."""

    job_id: Annotated[str, Str(MAX_ID, pattern=ID_PATTERN)]
    owner_uid: Annotated[int, Int(0, 0xFFFFFFFF)]
    state: Annotated[str, Str(32)]
    world_size: Annotated[int, COUNT]
    ranks: Annotated[int, COUNT]
    """Ranks the daemon holds (attached or waiting for a reattach)."""
    failed_ranks: Annotated[int, COUNT]
    last_step: Annotated[int, STEP_NO]
    window_nbytes: Annotated[int, NBYTES]
    storage_nbytes: Annotated[int, NBYTES]
    cpu_state_nbytes: Annotated[int, NBYTES]
    nvme_state_nbytes: Annotated[int, NBYTES]
    updated_elements: Annotated[int, COUNT]
    staleness_steps: Annotated[int, Int(0, 1)]

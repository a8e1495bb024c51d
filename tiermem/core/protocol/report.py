"""The records of a STATS_REPLY: the node, the jobs the caller may see, and the caller's own rank.

Owns ``NodeReport`` (with ``PoolReport``, ``SwapReport``, ``BudgetReport``,
``AdamReport``, ``PrefetchReport``, ``ServerReport``), ``JobReport``,
``RankReport`` and ``NvmeReport``: typed, declared once with ``@wire`` like
every other record, and part of the protocol version (a field added or
renamed is a version change, see docs/protocol.md).  They are the protocol's
view of the daemon's figures, each declared once on the field of the owner's
stats record that carries it (``tiermem.core.figures``: its key here, its
Prometheus families); the daemon fills these records by key, so a Prometheus
name can change without touching the wire, and a key no record carries fails
at the first reply.

Units are in the field names: ``*_nbytes`` bytes, ``*_s`` seconds, the rest
counts.  Counters count since the daemon started (those of ended jobs
included).  Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from tiermem.core.modes import STATE_DTYPES, Placement
from tiermem.core.protocol.records import ID_PATTERN, MAX_ID, NBYTES, NON_NEGATIVE, STEP_NO
from tiermem.core.protocol.spec import Choice, Int, List, Opt, Str, Wire, wire

__all__ = [
    "BUDGET_RESOURCES",
    "KERNEL_PATHS",
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
KERNEL_PATHS = ("native", "compiled", "fallback")
"""The code a rank's Adam update runs: ``native`` (torch's fused fp32 AdamW, or the C kernel of compressed
moments), ``compiled`` (an inductor kernel), ``fallback`` (the eager update or the plain-torch reference: no
compiler, a failed build, or ``adam.compile = false``)."""
Count = Annotated[int, Int(0, MAX_COUNT)]
Nbytes = Annotated[int, NBYTES]
Seconds = Annotated[float, NON_NEGATIVE]


@wire
@dataclass(frozen=True, slots=True)
class PoolReport(Wire):
    """The daemon's host-memory pool."""

    capacity_nbytes: Nbytes
    used_nbytes: Nbytes
    free_nbytes: Nbytes
    largest_free_nbytes: Nbytes
    locked_nbytes: Nbytes
    blocks: Count
    compactions: Count
    moved_nbytes: Nbytes


@wire
@dataclass(frozen=True, slots=True)
class SwapReport(Wire):
    """The NVMe tier: the swap budget, the bytes the jobs' stores use, and their I/O."""

    capacity_nbytes: Nbytes
    """Free space of the swap directories at start: the swap budget."""
    reserved_nbytes: Nbytes
    """Preallocated in the jobs' swap files."""
    used_nbytes: Nbytes
    """Holding state (current versions and older ones not yet freed)."""
    read_nbytes: Nbytes
    written_nbytes: Nbytes
    reads: Count
    writes: Count
    io_errors: Count
    """Reads, writes and commits that failed (errno, short transfer, a manifest that could not be written)."""
    checksum_failures: Count


@wire
@dataclass(frozen=True, slots=True)
class BudgetReport(Wire):
    resource: Annotated[str, Choice(BUDGET_RESOURCES)]
    capacity_nbytes: Nbytes
    held_nbytes: Nbytes


@wire
@dataclass(frozen=True, slots=True)
class AdamReport(Wire):
    """The CPU Adam updates of every rank."""

    updates: Count
    updated_elements: Count
    update_s: Seconds
    steps: Count
    """Steps applied, summed over ranks (skipped steps are ``skipped_steps``)."""
    skipped_steps: Count
    """Steps skipped (``GradScaler`` found an inf/nan grad), summed over ranks."""
    cpu_busy_s: Seconds
    """Time the node's CPU scheduler spent running tasks (the kernels of every rank)."""
    busy_periods: Count
    """Busy periods of the scheduler that ended (a task started on an idle executor to one ended with none
    queued)."""
    busy_period_s: Seconds
    """Their total length: the tasks and the gaps between them."""


@wire
@dataclass(frozen=True, slots=True)
class PrefetchReport(Wire):
    """The NVMe tier's chunk cache: how often the state was already resident when the update needed it."""

    acquires: Count
    hits: Count
    stall_s: Seconds
    """Time updates waited for page-ins that the prefetch did not hide."""


@wire
@dataclass(frozen=True, slots=True)
class ServerReport(Wire):
    sessions: Count
    """Connections served now."""
    attaches: Count
    disconnects: Count
    refused: Count
    protocol_errors: Count
    auth_errors: Count


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
    jobs: Count
    """Jobs known to the daemon (all of them, also those the reply does not list)."""
    queued_tasks: Count
    """CPU tasks waiting for the scheduler."""


@wire
@dataclass(frozen=True, slots=True)
class NvmeReport(Wire):
    """A rank's NVMe-placed state: its tier manager and swap store."""

    page_ins: Count
    page_outs: Count
    read_nbytes: Nbytes
    written_nbytes: Nbytes
    acquires: Count
    hits: Count
    stall_s: Seconds
    io_errors: Count


@wire
@dataclass(frozen=True, slots=True)
class RankReport(Wire):
    """The caller's own rank (the one its connection is attached to)."""

    rank: Count
    placement: Annotated[Placement | None, Choice(Placement, blank=True)]
    """Where the state is (``cpu`` or ``nvme``); None (empty on the wire) before REGISTER."""
    last_step: Annotated[int, STEP_NO]
    skipped_steps: Count
    failed: bool
    tensors: Count
    numel: Count
    window_nbytes: Nbytes
    storage_nbytes: Nbytes
    cpu_state_nbytes: Nbytes
    nvme_state_nbytes: Nbytes
    overlapped_tensors: Count
    adopted_elements: Count
    updates: Count
    updated_elements: Count
    update_s: Seconds
    grad_stats_s: Seconds
    wait_s: Seconds
    """Time requests waited for a delayed update."""
    staleness_steps: Annotated[int, Int(0, 1)]
    """1 while a delayed update (DPU) is still running, else 0."""
    nvme: Annotated[NvmeReport | None, Opt(NvmeReport)]
    state_dtype: Annotated[str, Choice(("", *STATE_DTYPES))] = ""
    """How the moments are stored (``fp32``, ``bf16``, ``int8``); empty before REGISTER."""
    kernel_path: Annotated[str, Choice(("", *KERNEL_PATHS))] = ""
    """The code its last update ran (``KERNEL_PATHS``); empty before one."""


@wire
@dataclass(frozen=True, slots=True)
class JobReport(Wire):
    """One job, its ranks' figures summed (``last_step``: the highest)."""

    job_id: Annotated[str, Str(MAX_ID, pattern=ID_PATTERN)]
    owner_uid: Annotated[int, Int(0, 0xFFFFFFFF)]
    state: Annotated[str, Str(32)]
    world_size: Count
    ranks: Count
    """Ranks the daemon holds (attached or waiting for a reattach)."""
    failed_ranks: Count
    last_step: Annotated[int, STEP_NO]
    window_nbytes: Nbytes
    storage_nbytes: Nbytes
    cpu_state_nbytes: Nbytes
    nvme_state_nbytes: Nbytes
    updated_elements: Count
    staleness_steps: Annotated[int, Int(0, 1)]
    state_dtypes: Annotated[tuple[str, ...], List(Choice(STATE_DTYPES), len(STATE_DTYPES))] = ()
    """How its ranks store the Adam moments (``fp32``, ``bf16``, ``int8``), each once, sorted: several where
    ranks differ; empty before any rank registered."""
    kernel_paths: Annotated[tuple[str, ...], List(Choice(KERNEL_PATHS), len(KERNEL_PATHS))] = ()
    """The code its ranks' last updates ran (``KERNEL_PATHS``), each once, sorted; empty before any update."""

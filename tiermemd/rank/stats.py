"""``RankStats``: a snapshot of one rank's figures, taken by ``RankOptimizer.stats()``.

Pure data: the rank fills it from the numbers its parts keep (the update
runner's counters and histogram, the state's bytes per tier and its NVMe
counters).  Its figures are declared on its fields (``tiermem.core.figures``):
summed over ranks they are the node's figures, over a job's ranks the job's;
the STATS reply and the metrics collector both read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from tiermem.core.figures import Family, Kind, counter, gauge, histogram
from tiermem.core.histogram import UPDATE_SECONDS, HistogramSnapshot
from tiermem.core.modes import Placement
from tiermemd.state import StateStats

__all__ = ["RankStats"]

STEPS = Family(
    "tiermem_steps", "Steps applied: each rank's last applied step, summed over ranks (skips are not steps)."
)
JOB_LAST_STEP = Family(
    "tiermem_job_last_step", "The highest step a job's ranks applied.", per_job=True, kind=Kind.GAUGE, peak=True
)
SKIPPED_STEPS = Family(
    "tiermem_skipped_steps",
    "Steps skipped on an inf/nan grad under loss scaling (the GradScaler's verdict), summed over ranks.",
)
FAILED = Family("tiermem_failed_ranks", "Ranks whose last update failed (FAILED until reloaded).")
JOB_FAILED = Family("tiermem_job_failed_ranks", "Ranks of a job that are FAILED.", per_job=True)
WINDOW = Family("tiermem_window_bytes", "Staging windows of all jobs.")
JOB_WINDOW = Family("tiermem_job_window_bytes", "A job's staging windows.", per_job=True)
STORAGE = Family("tiermem_storage_bytes", "Shared param and grad storage of all jobs.")
JOB_STORAGE = Family("tiermem_job_storage_bytes", "A job's shared param and grad storage.", per_job=True)
UPDATES = Family("tiermem_adam_updates", "CPU Adam updates that completed (a step or a bucket).")
UPDATED = Family("tiermem_adam_updated_params", "Parameter elements stepped by the CPU Adam updates.")
JOB_UPDATED = Family("tiermem_job_updated_params", "Parameter elements a job's Adam updates stepped.", per_job=True)
UPDATE_TIME = Family("tiermem_adam_update_seconds", "Duration of one rank's Adam update.", buckets=UPDATE_SECONDS)
GRAD_STATS = Family("tiermem_adam_grad_stats_seconds", "Time spent on gradient norms and overflow checks.")
STALENESS = Family(
    "tiermem_dpu_staleness_steps",
    "Largest lag of the params behind the state over ranks (1: a delayed update is running).",
    peak=True,
)
JOB_STALENESS = Family(
    "tiermem_job_dpu_staleness_steps",
    "Lag of a job's params behind its state (1: delayed update running).",
    per_job=True,
    peak=True,
)


@dataclass(frozen=True)
class RankStats:
    job_id: str
    rank: int
    placement: Placement | None
    """``CPU`` or ``NVME``; None before REGISTER."""
    last_step: Annotated[int, counter(STEPS, JOB_LAST_STEP)]
    skipped_steps: Annotated[int, counter(SKIPPED_STEPS)]
    """Steps skipped (the trainer's GradScaler found an inf/nan grad): never counted in ``last_step``."""
    failed: Annotated[bool, gauge(FAILED, JOB_FAILED)]
    overlapped_tensors: int
    tensors: int
    numel: int
    window_nbytes: Annotated[int, gauge(WINDOW, JOB_WINDOW)]
    storage_nbytes: Annotated[int, gauge(STORAGE, JOB_STORAGE)]
    state_keys: int
    adopted_elements: int
    """Elements of low-precision params whose in-place edits were taken into the fp32 master (fp32 params
    are the update's input themselves: their edits need no adopting)."""
    updates: Annotated[int, counter(UPDATES)]
    """Adam updates (one per applied step or overlapped bucket) that completed."""
    updated_elements: Annotated[int, counter(UPDATED, JOB_UPDATED)]
    update_s: Annotated[float, counter()]
    update_seconds: Annotated[HistogramSnapshot, histogram(UPDATE_TIME)]
    grad_stats_s: Annotated[float, counter(GRAD_STATS)]
    """Time spent on gradient norms and overflow checks."""
    wait_s: float
    """Time requests waited for a delayed update."""
    staleness_steps: Annotated[int, gauge(STALENESS, JOB_STALENESS)]
    """Steps the params in the storage lag behind the state: 1 while a delayed update runs (DPU), else 0."""
    state: StateStats
    state_dtype: str = ""
    """How the moments are stored (``fp32``, ``bf16``, ``int8``); empty before REGISTER."""
    kernel_path: str = ""
    """The code its last update ran (``native``, ``compiled``, ``fallback``: ``KERNEL_PATHS``); empty before
    one."""

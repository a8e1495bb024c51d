"""``RankStats``: a snapshot of one rank's figures, taken by ``RankOptimizer.stats()``.

Pure data: the rank fills it from the numbers its parts keep (the update
runner's counters and histogram, the state's bytes per tier and its NVMe
counters); the metrics collector and the STATS reply read it.  Nothing here
is a metric name: those live in ``tiermemd.metrics`` and
``tiermem.core.protocol.stats``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiermem.core.histogram import HistogramSnapshot
from tiermemd.state import StateStats

__all__ = ["RankStats"]


@dataclass(frozen=True)
class RankStats:
    job_id: str
    rank: int
    placement: str
    """``cpu`` or ``nvme``; empty before REGISTER."""
    last_step: int
    skipped_steps: int
    """Steps skipped (the trainer's GradScaler found an inf/nan grad): never counted in ``last_step``."""
    failed: bool
    overlapped_tensors: int
    tensors: int
    numel: int
    window_nbytes: int
    storage_nbytes: int
    state_keys: int
    adopted_elements: int
    updates: int
    """Adam updates (one per applied step or overlapped bucket) that completed."""
    updated_elements: int
    update_s: float
    update_seconds: HistogramSnapshot
    grad_stats_s: float
    """Time spent on gradient norms and overflow checks."""
    wait_s: float
    """Time requests waited for a delayed update."""
    staleness_steps: int
    """Steps the params in the storage lag behind the state: 1 while a delayed update runs (DPU), else 0."""
    state: StateStats

    @property
    def nvme_io_errors(self) -> int:
        tiers = self.state.tiers
        return tiers.io_errors if tiers is not None else 0

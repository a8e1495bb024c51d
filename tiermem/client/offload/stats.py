"""``OptimizerStats``: what ``OffloadAdam.stats()`` returns, the daemon's figures with the client's.

Pure data.  ``rank`` and ``node`` are the daemon's STATS reply
(``tiermem.core.protocol.report``); the rest is what only the client knows.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiermem.core.protocol import NodeReport, RankReport

__all__ = ["OptimizerStats"]


@dataclass(frozen=True)
class OptimizerStats:
    rank: RankReport
    """The daemon's figures of this optimizer's rank (steps, bytes per tier, update time, NVMe paging)."""
    node: NodeReport
    """The node's: pool, swap, budgets, sessions."""
    steps: int
    """Steps this optimizer sent."""
    client_skipped_steps: int
    """Steps skipped on the client's side (a ``GradScaler`` that found inf/nan)."""
    staleness_steps: int
    """1 while a delayed update (``delayed_update=True``) is in flight, else 0."""
    last_grad_norm: float | None
    """The last step's global grad norm (when one was computed)."""
    frozen_params: int = 0
    """Params of the groups that are not registered (``requires_grad=False`` and no state): no state, no
    shared storage, no bytes in the daemon until they get a grad."""
    frozen_numel: int = 0
    """Their elements."""

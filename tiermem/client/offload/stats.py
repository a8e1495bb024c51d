"""``OptimizerStats``: what ``OffloadAdam.stats()`` returns, the daemon's figures with the client's.

Pure data.  ``rank`` and ``node`` are the daemon's STATS reply
(``tiermem.core.protocol.report``); the rest is what only the client knows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    crossed_nbytes: dict[str, int] = field(default_factory=dict)
    """Bytes this optimizer's copies moved through the staging window since it registered (across the
    host/device boundary where the params are on a GPU), keyed ``"<direction>.<state key>"``:
    ``to_host.grad`` (grads pushed), ``to_host.master`` (params written as their master), ``to_device.param``
    (params fetched), and the state a checkpoint reads or writes (``tiermem.client.offload.transfer``).  A
    fp16/bf16 model's params and grads cross as 2 bytes an element, a fp32 model's as 4.  Nothing of the
    shared exchange's params and grads is here: they never leave the shared storage."""
    crossed_numel: dict[str, int] = field(default_factory=dict)
    """The elements of ``crossed_nbytes``, by the same keys."""

    def crossed_bytes_per_element(self, name: str) -> float:
        """``crossed_nbytes[name] / crossed_numel[name]`` (0.0 where nothing crossed): 2.0 for a bf16 model's
        ``to_host.grad``."""
        numel = self.crossed_numel.get(name, 0)
        return self.crossed_nbytes.get(name, 0) / numel if numel else 0.0

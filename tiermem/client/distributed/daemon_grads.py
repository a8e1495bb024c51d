"""The grad feed of a paged layer owner (``LayerShardedAdam(paged=True)``): its grads are already in the daemon.

``LayerShardedAdam`` writes each layer's reduced grads to the owner's daemon
(its ``grad`` key) as the reduce lands; this feed only records which tensors
have one this step, and whether one was written twice (gradient
accumulation), for the owner's ``OffloadAdam``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["DaemonGrads"]


class DaemonGrads:
    """The grad feed of a paged owner's ``OffloadAdam``: the grads are in the daemon's ``grad`` key, written
    by ``LayerShardedAdam`` as each layer's reduce lands; the feed only says which tensors have one."""

    def __init__(self) -> None:
        self.landed: set[int] = set()
        self.accumulated = False
        self.changed_after_landing = False
        self.buffer = 0
        self._by_param: dict[int, Any] = {}

    def land(self, tid: int) -> bool:
        """Tensor ``tid``'s grad is being written; True when it adds to one written earlier in the step."""
        again = tid in self.landed
        self.accumulated = self.accumulated or again
        self.landed.add(tid)
        return again

    def check(self) -> list[int]:
        return sorted(self.landed)

    def reset(self) -> None:
        self.landed.clear()
        self.accumulated = False

    def zero(self, *, set_to_none: bool) -> None:
        self.reset()

    def hook(self) -> None:
        """Nothing to hook: the layer's reduce lands the grads."""

    def unhook(self) -> None:
        """Nothing hooked."""

    # the rest of the Feed protocol (tiermem.client.offload.feeds)
    @property
    def releases_grads(self) -> bool:
        return True  # in the daemon's grad key, written by the reduce

    def retire(self, *, send_edits: bool) -> None:
        """Nothing to send or unhook."""

    def drain(self) -> None:
        """The pushes are synchronous."""

    def send(self, ids: Sequence[int]) -> None:
        """The grads are there already."""

    def receive(self, ids: Sequence[int]) -> None:
        """Nothing resident: the next forward gathers the updated layers."""

    def send_params(self) -> None:
        """The params live in the daemon."""

    def new_step(self, buffer: int, *, early: bool) -> None:
        self.reset()
        self.buffer = buffer

"""The client's step policy: what each step asks of the daemon.  Pure: no torch, no daemon.

``StepPolicy`` decides, per step, whether the update is delayed (after the
warm-up of the delayed mode) and whether buckets may be updated as they land
(the overlap mode).  The overlap contract (no loss scaling, no clipping, no
gradient accumulation) is checked before anything is applied early: the
first step of an overlap run is synchronous and is the one that shows what
the training loop does; a loop that scales or accumulates is refused at that
step, before its update, and never overlaps.

``plan_buckets`` groups tensors into buckets of about ``bucket_nbytes`` in
reverse registration order (backward produces the last layers' grads first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tiermem.core.errors import InvalidArgument, InvalidState
from tiermem.core.layout import group_buckets
from tiermem.core.modes import StepMode

__all__ = ["Buckets", "StepPolicy", "plan_buckets"]


@dataclass(frozen=True)
class Buckets:
    members: tuple[tuple[int, ...], ...]
    """Tensor indices of each bucket, ascending; bucket 0 fills first."""
    bucket_of: tuple[int, ...]
    """Bucket index of each tensor."""


def plan_buckets(nbytes: Sequence[int], bucket_nbytes: int) -> Buckets:
    if bucket_nbytes <= 0:
        raise InvalidArgument(f"bucket_nbytes must be > 0, got {bucket_nbytes}")
    groups = group_buckets(list(nbytes), bucket_nbytes)
    bucket_of = [0] * len(nbytes)
    for b, members in enumerate(groups):
        for index in members:
            bucket_of[index] = b
    return Buckets(tuple(tuple(g) for g in groups), tuple(bucket_of))


@dataclass
class StepPolicy:
    mode: StepMode
    warmup_steps: int = 0
    verified: bool = False
    """Overlap mode: a synchronous step showed the loop needs no scaling, clipping or accumulation."""
    notes: list[str] = field(default_factory=list)

    def delayed(self, step: int) -> bool:
        """Whether step ``step`` (1-based) runs delayed."""
        return self.mode is StepMode.DELAYED and step > self.warmup_steps

    @property
    def overlap_now(self) -> bool:
        """Whether buckets of the coming backward may be updated as they land."""
        return self.mode is StepMode.OVERLAP and self.verified

    @property
    def grad_buffers(self) -> int:
        return 2 if self.mode is StepMode.DELAYED else 1

    def check_step(self, *, scaled: bool, accumulated: bool, changed: bool, applied_early: int) -> None:
        """At ``step()``, before anything of it is applied (beyond ``applied_early`` tensors of an overlapped
        backward): refuse what the overlap mode cannot do."""
        if self.mode is not StepMode.OVERLAP:
            return
        problems = []
        if scaled:
            problems.append("a GradScaler scales the loss (the early update would apply scaled grads)")
        if accumulated:
            problems.append("grads were accumulated over several backward passes (the early update saw only the first)")
        if changed:
            problems.append(
                "grads changed after backward produced them (clip_grad_norm_, unscale_, DDP's all-reduce: the "
                "early update saw them before)"
            )
        if not problems:
            self.verified = True
            return
        self.verified = False
        done = (
            f"{applied_early} tensor(s) were already updated as their buckets landed and keep that update"
            if applied_early
            else "nothing of this step was applied"
        )
        raise InvalidState(
            "overlap_update=True cannot run this training loop: " + "; ".join(problems) + f". {done}. "
            "Use overlap_update=False for loops with loss scaling, clipping, gradient accumulation or DDP "
            "(tiermem.distributed.ShardedOffloadAdam(overlap_comm=True) overlaps its reduction with backward)"
        )

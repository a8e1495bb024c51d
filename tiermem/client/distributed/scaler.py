"""``ShardedGradScaler``: ``torch.amp.GradScaler`` whose overflow check is global across the ranks.

Each rank's ``GradScaler`` checks its own local grads for inf/nan.  With the
grads reduced at ``step()`` (``ShardedOffloadAdam``), an overflow on one rank
is in the sum every rank's shard gets, so every rank must skip the step and
back off its scale together, or the ranks' scales and params drift apart.
This scaler all-reduces (max) the found-inf flags it computes over the
optimizer's process group, and hands them to the optimizer, which also sets
them when the reduced grads themselves overflow (a sum of finite fp16 grads
can).  Everything else is torch's ``GradScaler``.

The ZeRO-3 optimizers (``LayerShardedAdam(paged=True)``, ``ShardedPagedAdam``)
hold no grads in the trainer: each owner's reduced grads went to its daemon
as they landed, and the owner recorded whether any was non-finite.  For them
the scaler asks the optimizer (``unscale_shards``) for those flags instead of
looking at ``param_groups``; the unscaling itself happens in the daemon (the
inverse scale is part of the STEP's grad scale), and the flags are
all-reduced the same way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tiermem.core.errors import InvalidState

__all__ = ["ShardedGradScaler", "shard_scaler_inputs"]


class ShardedGradScaler(torch.amp.GradScaler):
    """Use it exactly as ``torch.amp.GradScaler`` (``scale``, ``step``, ``update``, ``unscale_``)."""

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        shards = getattr(optimizer, "unscale_shards", None)
        per_device: dict[torch.device, torch.Tensor]
        if shards is not None:  # the grads are in the owners' daemons: the owner knows whether its overflowed
            per_device = {found_inf.device: shards(inv_scale, found_inf)}
        else:
            per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        group: Any = getattr(optimizer, "process_group", None)
        if dist.is_available() and dist.is_initialized():
            for flag in per_device.values():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        take = getattr(optimizer, "take_found_inf", None)
        if take is not None:  # ZeRO-2: the optimizer raises the flags when its reduced grads overflow
            take(per_device)
        return per_device


def shard_scaler_inputs(optimizer: Any, *, checked: bool, unscaled_by: float) -> tuple[float, bool]:
    """For a ZeRO-3 optimizer's ``step()``: (the inverse scale its daemons apply, whether to skip the step), from
    what ``GradScaler.step`` set on it (``grad_scale``: None after ``unscale_``, when ``unscaled_by`` is the
    inverse; ``found_inf``).  ``checked``: ``ShardedGradScaler`` asked the optimizer this step; a plain
    ``GradScaler`` did not, and looked at grads that are not in the trainer: refused."""
    grad_scale = getattr(optimizer, "grad_scale", False)
    if grad_scale is False:
        return 1.0, False
    if not checked:
        raise InvalidState(
            f"a torch.amp.GradScaler cannot see {type(optimizer).__name__}'s grads (they are in the daemons) and "
            "checks only this rank; use tiermem.distributed.ShardedGradScaler (the same API)"
        )
    inv_scale = unscaled_by
    if grad_scale is not None:
        inv_scale = float(torch.as_tensor(grad_scale).double().reciprocal().float())
    found_inf = getattr(optimizer, "found_inf", None)
    return inv_scale, found_inf is not None and float(found_inf) > 0

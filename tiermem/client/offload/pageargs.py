"""What ``offload_params`` accepts: its checks of the model, the optimizer, the budget and the params to page,
and the placeholder an absent param holds.  Pure checks, raising ``InvalidArgument`` / ``InvalidState``
with what to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tiermem.core.errors import InvalidArgument, InvalidState
from tiermem.core.modes import Exchange, StepMode
from tiermem.core.units import parse_size

if TYPE_CHECKING:
    from tiermem.client.offload.optimizer import OffloadAdam

__all__ = ["check_budget", "check_optimizer", "paged_tensors", "placeholder"]


def placeholder(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What the model holds of an absent param: one NaN element expanded to its shape."""
    return torch.full((), float("nan"), dtype=p.dtype, device=device).expand(p.shape)


def check_buffers(model: nn.Module, who: str) -> None:
    """A model made on the meta device gets its params' values (``reset_parameters()``, ``init``), not its
    buffers': ``InvalidArgument`` naming any buffer on the meta device (it would fail the first forward)."""
    meta = [name for name, b in model.named_buffers() if b.is_meta]
    if meta:
        raise InvalidArgument(
            f"buffer(s) {meta[:4]} of the model are on the meta device, and {who} initializes only params; give "
            "them values first (make them outside torch.device('meta'), or assign real tensors to them before)"
        )


def check_optimizer(model: nn.Module, optimizer: OffloadAdam) -> None:
    """``offload_params``' refusals of a model or an optimizer it cannot page."""
    from tiermem.client.offload.optimizer import OffloadAdam

    if not isinstance(model, nn.Module):
        raise InvalidArgument(f"offload_params pages an nn.Module's params, got {type(model).__name__}")
    if not isinstance(optimizer, OffloadAdam):
        raise InvalidArgument(f"offload_params needs the model's OffloadAdam, got {type(optimizer).__name__}")
    if optimizer.paged:
        raise InvalidState("this optimizer's params are already paged (offload_params was called on it)")
    if optimizer.exchange is not Exchange.STAGED:
        raise InvalidArgument(
            "offload_params needs an OffloadAdam made with exchange='staged' (the daemon keeps each param as "
            f"its master state key); this one uses exchange={optimizer.exchange.value!r}"
        )
    if optimizer.policy.mode is not StepMode.SYNC:
        raise InvalidArgument(
            f"offload_params needs the synchronous step; this OffloadAdam uses {optimizer.policy.mode.value} "
            "(overlap_update and delayed_update need the params resident)"
        )


def check_budget(device_budget: int | str, prefetch: int) -> int:
    """``device_budget`` in bytes, checked with ``prefetch``."""
    try:
        budget = parse_size(device_budget)
    except ValueError as exc:
        raise InvalidArgument(f"device_budget: {exc}") from None
    if budget <= 0:
        raise InvalidArgument(f"device_budget must be > 0, got {device_budget!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise InvalidArgument(f"prefetch must be an int >= 0 (uses fetched ahead), got {prefetch!r}")
    return budget


def paged_tensors(
    model: nn.Module, optimizer: OffloadAdam, params: list[nn.Parameter] | None
) -> tuple[list[nn.Parameter], dict[int, str]]:
    """The params to page (tensor i: the optimizer's tensor i), and the model's names of its params by id:
    every param of the model, each in the optimizer."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = list(optimizer.tensors) if params is None else list(params)
    if len(tensors) != len(optimizer.tensors):
        raise InvalidArgument(f"{len(tensors)} params for an optimizer of {len(optimizer.tensors)} tensors")
    by_id = {id(p) for p in tensors}
    for p_id, name in names.items():
        if p_id not in by_id:
            raise InvalidArgument(f"param {name!r} of the model is not in the optimizer; give it every param")
    for i, p in enumerate(tensors):
        if id(p) not in names:
            raise InvalidArgument(f"optimizer param {i} (shape {tuple(p.shape)}) is not in the model")
    return tensors, names

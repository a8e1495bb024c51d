"""``Feed``: the declared plug-in point of ``OffloadAdam`` for where grads come from and params go back.

Three feeds implement it; ``OffloadAdam`` talks to whichever it holds through these methods only (no
``isinstance`` on the feed, no feed writing the optimizer's fields):

- ``SharedFeed`` (``tiermem.client.offload.shared``): CPU params live in the daemon's shared storage;
  grads land beside them; nothing is sent or received around a STEP (the daemon updates in place);
- ``StagedFeed`` (``tiermem.client.offload.staged``): params stay where they are (a GPU); edited params
  and the grads go through the staging window before the STEP, the updated params come back after it;
- ``ParamPager`` (``tiermem.client.offload.paging``): params are paged in per submodule; grads go to the
  daemon as backward makes them; nothing comes back after the STEP (the next forward fetches).

The optimizer installs its own feed at registration and ``offload_params`` hands it a pager through
``OffloadAdam.use_feed``, which retires the old one (``retire``: its pending edits are sent, its hooks
removed).  A step's calls, in order: ``drain`` (pending transfers done), ``check`` (the ids with a grad;
refuses changed dtypes, devices, shapes), ``send`` (before the STEP), then ``receive`` (after an applied
step, or when a delayed step's params are installed); ``new_step`` between steps; ``zero`` for
``zero_grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from tiermem.core.errors import GradsAfterRelease

__all__ = ["Feed", "grads_after_release", "hook_grads", "remove_hooks", "zero_grads"]


def hook_grads(params: Iterable[torch.Tensor], on_grad: Callable[[torch.Tensor], None]) -> list[Any]:
    """``on_grad`` as the post-accumulate-grad hook of each param that takes a grad; the hooks' handles."""
    return [p.register_post_accumulate_grad_hook(on_grad) for p in params if p.requires_grad]


def zero_grads(
    params: Iterable[torch.Tensor], *, set_to_none: bool, zeroed: Callable[[int, torch.Tensor], torch.Tensor]
) -> None:
    """``zero_grad`` over ``params`` that have a grad: None, or ``zeroed(i, grad)`` (the i-th param's grad,
    zeroed: the feed decides where it lives)."""
    for i, p in enumerate(params):
        if p.grad is None:
            continue
        p.grad = None if set_to_none else zeroed(i, p.grad)


def grads_after_release(params: Sequence[str]) -> GradsAfterRelease:
    """The refusal of grads written after ``release_grads`` handed them over (``params``: their
    descriptions)."""
    more = f" (and {len(params) - 1} other params)" if len(params) > 1 else ""
    return GradsAfterRelease(
        f"{params[0]}{more} has a grad written after release_grads handed its grad to tiermemd: DDP all-reduces "
        "the grads after backward released them and writes the averages into p.grad (as does a p.grad set by "
        "hand after backward), and adding them to the released grads would train on the wrong sum. Nothing of "
        "this step was applied. Under DDP, use release_grads=False (the grads then stay in the shared buffer "
        "DDP averages) or tiermem.distributed.ShardedOffloadAdam (ZeRO-2)"
    )


def remove_hooks(handles: list[Any]) -> None:
    """Remove every hook of ``handles`` (emptied)."""
    for handle in handles:
        handle.remove()
    handles.clear()


class Feed(Protocol):
    """See the module docstring."""

    buffer: int
    """The grad buffer this step's grads land in (the delayed update alternates two)."""
    accumulated: bool
    """A grad landed twice in this step (gradient accumulation)."""

    @property
    def releases_grads(self) -> bool:
        """Grads go to the daemon as they land and ``p.grad`` is None after backward (a ``GradScaler``
        cannot check them)."""
        ...

    @property
    def changed_after_landing(self) -> bool:
        """A grad was changed in place after it landed (``clip_grad_norm_``, ``GradScaler.unscale_``)."""
        ...

    def hook(self) -> None:
        """Install the backward hooks that land grads."""

    def unhook(self) -> None:
        """Remove them (and stop any transfer thread)."""

    def retire(self, *, send_edits: bool) -> None:
        """Another feed takes over: send the params edited since the last step (``send_edits``), unhook."""

    def drain(self) -> None:
        """Wait for transfers still running (a pager's page-ins and grad pushes)."""

    def check(self) -> list[int]:
        """At ``step()``: land what the hooks did not see; the ids of the tensors with a grad."""
        ...

    def send(self, ids: Sequence[int]) -> None:
        """Before the STEP: what the daemon needs that it does not share (edited params, the grads)."""

    def receive(self, ids: Sequence[int]) -> None:
        """After an applied step (or a delayed step's install): bring the updated params of ``ids`` back."""

    def send_params(self) -> None:
        """Make every param the model holds the daemon's (``load_state_dict``: the model is the truth)."""

    def new_step(self, buffer: int, *, early: bool) -> None:
        """A new step lands in grad buffer ``buffer``; ``early``: push grads as they land (overlap, release)."""

    def zero(self, *, set_to_none: bool) -> None:
        """``zero_grad``."""

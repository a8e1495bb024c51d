"""A ZeRO-3 optimizer's model inside ``DistributedDataParallel``: DDP's grad reduction turned off.

HF Trainer and accelerate wrap the model in DDP whenever they run on several
ranks (accelerate does so for every multi-process CPU run, and on GPUs
whenever a param needs a grad), and PyTorch Lightning's ``ddp`` strategy wraps
it before ``configure_optimizers`` makes the optimizer.  A ZeRO-3 optimizer
(``LayerShardedAdam``, ``ShardedPagedAdam``) reduces every grad itself, to
the rank that keeps it, so DDP's all-reduce is a second reduction of the same
grads at best, and over the placeholders the model holds between uses it
breaks: ``LayerShardedAdam``'s empty placeholders made DDP's reducer fail its
second step with torch's internal assertion "grad.numel() ==
bucket_view.numel()".

So the strategy's own forward pre-hooks (``LayerStrategy._before_forward``
once a unit is gathered, the pager's outermost ``PageUses._enter``) call
``DdpOff`` with the module about to run, which looks for the DDP whose
forward is running (torch's own record of it,
``DistributedDataParallel._active_ddp_module``, which ``torch.compile`` reads
too) and sets its ``require_backward_grad_sync`` to False: what DDP's
``no_sync()`` does, so the forward prepares no reduction and DDP's autograd
hooks return at once.  It is set again in every forward, because
``no_sync()`` puts back the value it found.  DDP's buffer broadcast stops
with it (as inside ``no_sync()``): buffers stay each rank's own, as without
DDP.

Refused, on the first forward, naming the way out:

- a DDP that also reduces trainable params the optimizer does not hold: they
  would go unreduced (give them to the optimizer, or freeze them);
- ``static_graph=True``: DDP then reduces at the end of backward whatever the
  flag says;
- a DDP made over ``LayerShardedAdam``'s empty placeholders (HF Trainer makes
  it after the optimizer): it keeps each param's grad accumulator from then,
  sized 0, and autograd reuses it, so backward would fail ("Function
  TBackward0 returned an invalid gradient").  ``ShardedPagedAdam``'s
  placeholders keep their shapes, but DDP's constructor cannot write them
  (its broadcast of rank 0's values: "more than one element of the
  written-to tensor refers to a single memory location"), unless a
  ``model.to()`` copied them first, as HF Trainer's move to ``cpu:0`` does on
  CPU ranks (``PagedParam.holds_a_copy``).  Where neither works, wrap the
  model before making the optimizer.

Left: a DDP keeps the grad buckets it sized at its construction, never used
here.  Over whole params (Lightning makes it before the optimizer; HF Trainer
on CPU ranks makes it after ``model.to("cpu:0")``, which copies every
placeholder whole) that is one grad-sized buffer per rank.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tiermem.core.errors import InvalidArgument

__all__ = ["DdpOff", "running_ddp"]

log = logging.getLogger(__name__)


def running_ddp() -> DistributedDataParallel | None:
    """The DDP whose forward is running on this thread, if any (None on a torch that does not record it)."""
    return getattr(DistributedDataParallel, "_active_ddp_module", None)


class DdpOff:
    """Called in a forward with the module about to run (its params gathered): turns off the grad reduction of
    a DDP around the model of the optimizer named ``name`` over ``params``; see the module docstring.  About
    0.1 us a call outside a DDP; a hook of its own on every module cost 6.5 us a module's forward."""

    def __init__(self, name: str, model: nn.Module, params: Iterable[nn.Parameter]) -> None:
        self.name = name
        self._ours = {id(p) for p in params}
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._checked: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()

    def __call__(self, module: nn.Module) -> None:
        ddp = running_ddp()
        if ddp is None:
            return
        if ddp not in self._checked and torch.is_grad_enabled():
            self._check(ddp)
            self._check_accumulators(module)
            self._checked.add(ddp)
            log.info(
                "%s: DistributedDataParallel wraps the model; its grad all-reduce is off (the optimizer reduces "
                "every grad to the rank that keeps it)",
                self.name,
            )
        ddp.require_backward_grad_sync = False

    def _check(self, ddp: DistributedDataParallel) -> None:
        if ddp.static_graph:
            raise InvalidArgument(
                f"{self.name} reduces the grads itself, and DistributedDataParallel(static_graph=True) all-reduces "
                "them again at the end of every backward: drop static_graph=True (HF Trainer: "
                "ddp_static_graph=False), or leave the model unwrapped"
            )
        ignored: set[str] = getattr(ddp, "parameters_to_ignore", set())
        extra = [
            n
            for n, p in ddp.module.named_parameters()
            if p.requires_grad and id(p) not in self._ours and n not in ignored
        ]
        if extra:
            shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
            raise InvalidArgument(
                f"DistributedDataParallel wraps a module with trainable params that {self.name} does not hold "
                f"({shown}). The optimizer turns DDP's grad all-reduce off (it reduces its own params' grads), "
                "which would leave these unreduced: give the optimizer the whole wrapped model, or freeze them "
                "(requires_grad_(False))"
            )

    def _check_accumulators(self, module: nn.Module) -> None:
        """The grad accumulators of ``module``'s params (gathered now) were made for their shapes.  A DDP made
        over empty placeholders (after ``LayerShardedAdam``) holds accumulators made then, which autograd
        reuses while DDP lives: backward would fail with "Function TBackward0 returned an invalid gradient".
        """
        for p in module.parameters(recurse=False):
            if id(p) not in self._ours or not p.requires_grad:
                continue
            with torch._C.DisableTorchFunction():  # a pager's mode would take the read as a use
                node = p.view_as(p).grad_fn
            metadata = getattr(node.next_functions[0][0], "_input_metadata", None) if node is not None else None
            if not metadata or tuple(metadata[0].shape) == tuple(p.shape):
                continue
            raise InvalidArgument(
                f"DistributedDataParallel was made over {self.name}'s placeholders (param "
                f"{self._names.get(id(p), '?')!r} was empty then, and is {tuple(p.shape)} now): DDP keeps each "
                "param's grad accumulator from its construction, and backward would fail. Wrap the model in DDP before "
                "making the optimizer (PyTorch Lightning does; with accelerate, prepare the model first, then make "
                "the optimizer over the unwrapped model); HF Trainer wraps it after the optimizer is made: there, "
                "use ShardedPagedAdam, whose placeholders keep their shapes"
            )

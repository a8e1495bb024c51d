"""``SharedFeed``, the feed of CPU params (``tiermem.client.offload.feeds.Feed``): one record per registered
tensor, binding the model's tensors to the shared storage.

At registration every param's data moves into the daemon's shared storage
(``p.data`` becomes a view of it; the old memory is freed), so the daemon
reads and updates the model's own params with no copy, and edits the trainer
makes in place (``p.data.clamp_()``, ``model.load_state_dict``) are what the
daemon sees.  Grads land in the storage's grad buffer:

- a post-accumulate-grad hook copies a fresh grad into the tensor's grad
  view and makes ``p.grad`` that view (the fresh grad is freed); later
  backward passes accumulate into it in place, so grads edited afterwards,
  through ``.data`` too (``p.grad.data.clamp_()``), are what the daemon reads;
- with ``release_grads`` the hook hands the grad to the daemon, into its
  ``grad`` state key through the staging window (paged with the rest of the
  state on the NVMe tier), and sets ``p.grad`` to None (DeepSpeed's engine
  does the same); further backward passes of the step add into it there;
- ``check`` (at ``step()``) catches what the hooks could not see: a grad set
  by hand, a param whose storage was replaced (``p.data = t``: its values are
  copied in and it is bound again), and refuses dtype, device or shape
  changes (``model.to(torch.bfloat16)``) naming the param;
- a param whose storage torch moved into a segment of its own, in place
  (``model.share_memory()``, or the tensor sent through a
  ``torch.multiprocessing`` queue), moves its view along with it: the hooks
  and ``check`` find the view off its address and put the param, and its
  grads, back into the shared storage (``_rehome``), with a warning.

The delayed update reads step t's grad buffer while step t+1's grads land, so
that mode has two buffers, alternating per step.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tiermem.client.offload.feeds import grads_after_release, hook_grads, remove_hooks, zero_grads
from tiermem.client.offload.policy import Buckets
from tiermem.core.errors import DTypeError, InvalidArgument, InvalidState

__all__ = ["SharedFeed", "TensorEntry"]

log = logging.getLogger(__name__)


@dataclass
class TensorEntry:
    index: int
    param: torch.nn.Parameter
    view: torch.Tensor
    """The param's storage in the shared segment."""
    grad_views: tuple[torch.Tensor, ...]
    """Its grad in each grad buffer."""
    bucket: int
    landed: bool = False
    """Its grad reached the grad buffer in this step."""
    landed_version: int = -1
    """Its grad view's version counter when its grad last landed (each grad view has a storage, and so a
    version counter, of its own)."""
    ptr: int = field(init=False)
    """``view``'s address: a param whose data is still at it, with the view's dtype and shape, is bound."""
    grad_ptrs: tuple[int, ...] = field(init=False)
    """Each grad view's address: a grad already there has landed."""

    def __post_init__(self) -> None:
        # the hooks and ``check`` compare these once per param and step, instead of reading dtype, device
        # and shape of both tensors (a few microseconds a param, on the critical path of every backward)
        self.ptr = self.view.data_ptr()
        self.grad_ptrs = tuple(g.data_ptr() for g in self.grad_views)

    def bound(self) -> bool:
        """The param is still the storage's view (its data at ``ptr``, with the view's dtype and shape; data
        at that address is in the storage's mapping, so on the CPU)."""
        p = self.param
        return p.data_ptr() == self.ptr and p.dtype is self.view.dtype and p.shape == self.view.shape

    def describe(self) -> str:
        return f"param {self.index} (shape {tuple(self.view.shape)}, {self.view.dtype})"


@dataclass
class SharedFeed:
    entries: list[TensorEntry]
    buckets: Buckets
    remap: Callable[[int, torch.Tensor], torch.Tensor]
    """A new tensor over the shared storage at an address, with the dtype and shape of the one given (a
    storage of its own, as every view here has): for a view whose storage was moved out (``_rehome``)."""
    release_grads: bool = False
    buffer: int = 0
    """The grad buffer this step's grads land in."""
    on_bucket: Callable[[int, list[int]], bool] | None = None
    """Called when every tensor of a bucket has landed (the overlapped update); True where the daemon now
    updates the bucket, in place, before ``step()``."""
    push: Callable[[int, torch.Tensor, bool], None] | None = None
    """With ``release_grads``: hand a grad to the daemon's ``grad`` state key (tensor id, grad, accumulate)
    instead of the storage's grad buffer, so no grad memory stays on this side."""
    accumulated: bool = False
    """A grad landed twice in this step (gradient accumulation)."""
    rehomed: int = 0
    """Params put back into the shared storage after their storage was moved out (``_rehome``)."""
    _rehomed_in_step: bool = False
    _updating: set[int] = field(default_factory=set)
    """This step's buckets the daemon updates in place already (the overlapped update)."""
    _by_param: dict[int, TensorEntry] = field(default_factory=dict)
    _left: list[int] = field(default_factory=list)
    _hooks: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._by_param = {id(e.param): e for e in self.entries}
        self.reset()

    # ----------------------------------------------------------------- binding

    @staticmethod
    def bind(param: torch.nn.Parameter, view: torch.Tensor, *, adopt: bool) -> None:
        """Move ``param`` into ``view``: copy its values in (or, ``adopt``, take the view's), then rebind."""
        with torch.no_grad():
            if not adopt:
                view.copy_(param.detach())
            param.data = view

    def hook(self) -> None:
        self._hooks += hook_grads((e.param for e in self.entries), self.land_grad)

    def unhook(self) -> None:
        remove_hooks(self._hooks)

    def reset(self) -> None:
        """A new step: nothing has landed."""
        for e in self.entries:
            e.landed = False
        self.accumulated = False
        self._rehomed_in_step = False
        self._updating.clear()
        self._left = [len(m) for m in self.buckets.members]

    # ----------------------------------------------------------------- the Feed protocol

    @property
    def releases_grads(self) -> bool:
        return self.release_grads

    def retire(self, *, send_edits: bool) -> None:
        self.unhook()  # the params are the storage's: nothing to send

    def drain(self) -> None:
        pass  # nothing runs in the background

    def send(self, ids: Sequence[int]) -> None:
        pass  # the daemon reads the grads and params where they are

    def receive(self, ids: Sequence[int]) -> None:
        pass  # the daemon updated the params in place

    def send_params(self) -> None:
        pass  # the daemon's params are the model's storage

    def new_step(self, buffer: int, *, early: bool) -> None:
        self.reset()
        self.buffer = buffer

    # ----------------------------------------------------------------- landing

    def land_grad(self, param: torch.Tensor) -> None:
        """``param``'s grad is final for this backward (autograd's hook, or a strategy that reduced it)."""
        entry = self._by_param.get(id(param))
        if entry is None or param.grad is None:
            return
        self._land(entry, param.grad)
        if self.on_bucket is not None:
            b = entry.bucket
            self._left[b] -= 1
            if self._left[b] == 0 and self.on_bucket(b, list(self.buckets.members[b])):
                self._updating.add(b)

    def _land(self, entry: TensorEntry, grad: torch.Tensor) -> None:
        """Bring ``grad`` into the grad buffer (unless it is the buffer) and point ``p.grad`` at it."""
        if not entry.bound():
            self._check_param(entry)
        if grad.layout is not torch.strided:  # sparse layouts included
            raise InvalidArgument(
                f"{entry.describe()} got a sparse gradient; OffloadAdam, like torch.optim.AdamW, takes dense "
                "gradients only (use sparse=False in the embedding, or torch.optim.SparseAdam for those params)"
            )
        if grad.dtype != entry.view.dtype:
            raise DTypeError(f"{entry.describe()} got a {grad.dtype} gradient; params and grads must share a dtype")
        if self.push is not None:
            self.push(entry.index, grad, entry.landed)
            self.accumulated = self.accumulated or entry.landed
            entry.landed = True
            entry.param.grad = None
            return
        target = entry.grad_views[self.buffer]
        if grad.data_ptr() != entry.grad_ptrs[self.buffer] or grad.shape != target.shape:
            self._copy_in(target, grad, accumulate=entry.landed and self.release_grads)
        if entry.landed:
            self.accumulated = True
        entry.landed = True
        entry.param.grad = None if self.release_grads else target
        entry.landed_version = target._version

    @property
    def changed_after_landing(self) -> bool:
        """Grads were changed in place after the last hook ran (``clip_grad_norm_``, ``GradScaler.unscale_``;
        edits through ``.data`` do not count: torch's version counters do not see them)."""
        if self.push is not None:
            return False  # the grads went to the daemon as they landed; none stays here to be edited
        return any(e.landed and e.grad_views[self.buffer]._version != e.landed_version for e in self.entries)

    @staticmethod
    def _copy_in(target: torch.Tensor, grad: torch.Tensor, *, accumulate: bool) -> None:
        """The one copy of the grad path: a fresh grad into the shared grad buffer.

        A plain copy (same dtype, both contiguous, on the CPU) is one ``memmove`` on the calling thread, not
        ``target.copy_(grad)``: torch runs a large copy over its OpenMP team, and a team waits at the end
        of each region for its slowest thread.  Where the node's cores are shared (dataloader workers,
        another job) one of the team's threads is often descheduled, and backward would add a region per
        param: beside another training job the CPU tier's forward and backward took 1.35-1.5x AdamW's
        (``benchmarks/bench_busy.py``, 100M, one neighbour).  One thread copies at about the memory's speed
        anyway; ``ctypes.memmove`` releases the GIL.
        """
        if grad.requires_grad:
            grad = grad.detach()  # a grad of a graph (backward with create_graph=True): the copy records nothing
        if accumulate:
            target.add_(grad)
        elif (
            grad.dtype is target.dtype and grad.device.type == "cpu" and grad.is_contiguous() and target.is_contiguous()
        ):
            ctypes.memmove(target.data_ptr(), grad.data_ptr(), target.numel() * target.element_size())
        else:
            target.copy_(grad)

    def check(self) -> list[int]:
        """At ``step()``: bind replaced params again, land grads the hooks did not see; ids with a grad.  A
        grad written after its release (``GradsAfterRelease``) is refused before any is landed."""
        if self.push is not None:
            late = [e.describe() for e in self.entries if e.landed and e.param.grad is not None]
            if late:
                raise grads_after_release(late)
        ids = []
        for e in self.entries:
            if not e.bound():
                self._check_param(e)
            grad = e.param.grad
            if grad is not None:
                if not (e.landed and grad.data_ptr() == e.grad_ptrs[self.buffer]):
                    self._land(e, grad)
                ids.append(e.index)
            elif e.landed:
                ids.append(e.index)  # released to the daemon
        return ids

    def _check_param(self, e: TensorEntry) -> None:
        p = e.param
        if e.view.data_ptr() != e.ptr:
            self._rehome(e)
        if p.dtype != e.view.dtype:
            raise DTypeError(
                f"param {e.index} was registered as {e.view.dtype} and is now {p.dtype} (model.to(dtype) after the "
                "optimizer was made?); create the optimizer after changing the model's dtype"
            )
        if p.device.type != "cpu":
            raise InvalidState(
                f"param {e.index} moved to {p.device} after registration; create the optimizer after moving the model"
            )
        if p.shape != e.view.shape:
            raise InvalidState(f"param {e.index} changed shape from {tuple(e.view.shape)} to {tuple(p.shape)}")
        if p.data_ptr() != e.view.data_ptr():
            self.bind(p, e.view, adopt=False)  # ``p.data = t``: take its values and live in the storage again

    def _rehome(self, e: TensorEntry) -> None:
        """The param's storage, and with it the view it shares, was moved out of the shared storage: torch's
        ``share_memory_()`` (``model.share_memory()``) and a tensor sent through a ``torch.multiprocessing``
        queue swap a storage's memory for a shared segment of torch's own, in place.  The daemon would go on
        reading and updating the old bytes while the model used the copy.  New views over the old bytes
        take the param's values and its grads back (the values the model has: the daemon writes the params
        only within ``step()``), and the param and its grad are bound to them again; whatever now holds the
        moved segment (a process the tensor was sent to) keeps a copy that no longer follows training.  A
        bucket the overlapped update is updating keeps the old bytes' values: the daemon's, written there
        after (or while) the move copied them."""
        p = e.param
        daemons = e.bucket in self._updating
        fresh = self.remap(e.ptr, e.view)
        grads = tuple(self.remap(ptr, g) for ptr, g in zip(e.grad_ptrs, e.grad_views, strict=True))
        with torch.no_grad():
            for old, new in zip(e.grad_views, grads, strict=True):
                if old.data_ptr() != new.data_ptr() and not daemons:
                    new.copy_(old)
                if p.grad is old:
                    p.grad = new
            moved = e.view
            e.view, e.grad_views = fresh, grads
            if p.data_ptr() == moved.data_ptr():  # else ``p.data = t`` as well: ``_check_param`` binds that
                self.bind(p, fresh, adopt=daemons)
        if e.landed:
            e.landed_version = grads[self.buffer]._version
        self.rehomed += 1
        if not self._rehomed_in_step:  # one line a step, whatever the model's size
            self._rehomed_in_step = True
            log.warning(
                "%s (and maybe others) was moved out of tiermemd's shared storage (share_memory_(), or sent "
                "through torch.multiprocessing); its values and grads were copied back and it was bound to the "
                "storage again. Send copies (t.clone()) to other processes: training no longer reaches the "
                "moved tensors",
                e.describe(),
            )

    # ----------------------------------------------------------------- zeroing

    def zero(self, *, set_to_none: bool) -> None:
        """``zero_grad``: with ``set_to_none=False`` the grads become the next step's zeroed grad views (in
        the delayed mode the current buffer is still being read by the update)."""
        zero_grads(
            (e.param for e in self.entries),
            set_to_none=set_to_none,
            zeroed=lambda i, _grad: self.entries[i].grad_views[self.buffer].zero_(),
        )

    def params_of(self, ids: Sequence[int]) -> list[torch.nn.Parameter]:
        return [self.entries[i].param for i in ids]

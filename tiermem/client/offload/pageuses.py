"""Param paging's schedule of uses: when a paged param is on the device.  A part of ``ParamPager`` (a mixin
over its records, residency and I/O, as ``PagedState`` is).

- forward: a pre-hook on each submodule owning params leases them (a fetch
  through the staging window, or one already prefetched), a post-hook
  releases them; params used outside the submodule that owns them are caught
  by ``CatchParams`` during forward and leased to the innermost running
  module;
- saved tensors: a ``saved_tensors_hooks`` pair packs a saved param view as a
  reference (``SavedParam``) and unpacks it by fetching the param again, in
  backward with the other saved params of its submodule, held until their
  grads land or the backward pass ends (``_watch_backward``);
- prefetch: the recorded uses ahead (``FetchTrace``) are fetched within the
  budget, and a released param about to be used again is kept.

The module docstring of ``tiermem.client.offload.paging`` says why, and what
``torch.utils.checkpoint`` needs of the budget.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tiermem.client.offload.pagedparam import GradUnits, PagedParam, PagerRecords, Residency, SavedParam
from tiermem.client.offload.pagehooks import CatchParams, Frame, in_backward, in_checkpoint_region
from tiermem.client.offload.trace import FetchTrace
from tiermem.core.errors import InvalidState

__all__ = ["PageUses"]


class PageUses(PagerRecords):
    trace: FetchTrace
    prefetch: int
    _frames: list[Frame]
    _tasks: set[int]
    _mode: CatchParams
    _grad_units: GradUnits[Any]
    _unhooked: list[PagedParam]
    """Params without a grad hook: frozen when the pager was made."""
    _on_grad: Callable[[torch.Tensor], None]
    _hooks: list[Any]

    if TYPE_CHECKING:

        def _materialize(self, group: list[PagedParam], *, event: str) -> None: ...
        def _start_fetches(self, entries: list[PagedParam], *, event: str) -> None: ...
        def _release(self, e: PagedParam) -> None: ...
        def _land(self, e: PagedParam, grad: torch.Tensor) -> None: ...
        def _push_rest(self) -> None: ...

    # ----------------------------------------------------------------- forward hooks

    def _enter(self, own: list[PagedParam], module: nn.Module, args: Any) -> None:
        frame = Frame(module)
        if not self._frames:
            if self.on_forward is not None:
                self.on_forward(module)
            self._saving.clear()  # (a save that raised between its hooks)
            if self._unhooked:
                self._hook_unfrozen()
            self._mode.__enter__()
            frame.contexts.append(self._mode)
            if torch.is_grad_enabled() and not in_backward() and not in_checkpoint_region():
                saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                saved.__enter__()
                frame.contexts.append(saved)
        self._frames.append(frame)
        if own:
            self._use(own, lease=True)

    def _hook_unfrozen(self) -> None:
        """At a forward's start: params frozen when the pager was made (torch takes no grad hook on them) and
        trained now get their grad hook, so their grads land, and end their holds, as the others' do."""
        for e in [e for e in self._unhooked if e.param.requires_grad]:
            self._hooks.append(e.param.register_post_accumulate_grad_hook(self._on_grad))
            self._unhooked.remove(e)

    def _exit(self, own: list[PagedParam], module: nn.Module, args: Any, output: Any) -> None:
        if not self._frames or self._frames[-1].module is not module:
            return  # a pre-hook that raised before its frame was pushed
        self._pop_frame()

    def _pop_frame(self) -> None:
        frame = self._frames.pop()
        for e in frame.leased:
            self._unlease(e)
        for ctx in reversed(frame.contexts):
            ctx.__exit__(None, None, None)

    def _interrupted(self) -> None:
        """The model's forward ended by a ``BaseException`` that is not an ``Exception`` (a Ctrl-C's
        ``KeyboardInterrupt``): torch runs the always-called post-hooks for an ``Exception`` only, so every
        frame it left is closed here, its leases, this pager's torch-function mode and its saved-tensor hooks
        with it, as the post-hooks would have."""
        while self._frames:
            self._pop_frame()

    # ----------------------------------------------------------------- saved tensors

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._by_storage or type(t) not in (torch.Tensor, nn.Parameter):
            return t
        e = self._by_storage.get(t.untyped_storage().data_ptr())
        if e is None:
            return t
        e.saved = True
        return SavedParam(e, t.size(), t.stride(), int(t.storage_offset()))

    def _unpack(self, saved: Any) -> Any:
        """A saved param is used again: in backward, with the other params of its submodule saved for it, in
        one fetch (one all-gather at ZeRO-3), held until their grads land.  A frozen param gets no grad to
        end a hold, so it is not held: it may be released as soon as its node has its view, whose buffer
        ``BufferCache.give`` then drops rather than reuses, and autograd frees with the node.  Held like a
        trained one, it stayed until backward ended, so a backward through every frozen layer (LoRA's base)
        needed them all within ``device_budget`` at once."""
        if not isinstance(saved, SavedParam):
            return saved
        e = saved.entry
        if not in_backward():
            self._use([e], lease=False)
            return self._saved_view(e, saved)
        frozen = not e.param.requires_grad  # no grad will end a hold of it: pinned only while it is fetched
        e.leases += frozen
        try:
            self._use([x for x in self._grad_units.owner(e) if x is e or x.saved], lease=False, hold=True)
            view = self._saved_view(e, saved)
        finally:
            e.leases -= frozen
        if frozen:
            self._settle(e)  # may go at once: its buffer is not reused while the node views it (BufferCache.give)
        return view

    def _saved_view(self, e: PagedParam, saved: SavedParam) -> torch.Tensor:
        if e.data is None:  # pragma: no cover - _use makes it resident
            raise InvalidState(f"{e.describe()} is not on the device after its fetch")
        return e.data.as_strided(saved.size, saved.stride, saved.offset)

    # ----------------------------------------------------------------- uses, leases, holds

    def _absent_entry(self, value: Any) -> PagedParam | None:
        if not isinstance(value, nn.Parameter):
            return None
        e = self._by_param.get(id(value))
        if e is None or e.residency is Residency.RESIDENT:
            return None
        return e

    def _use(self, group: list[PagedParam], *, lease: bool, hold: bool = False) -> None:
        """A use of ``group``: on the device when this returns; leased to the running module or held by
        the running backward; then the next recorded uses are prefetched."""
        self.trace.use(tuple(e.index for e in group))
        self._materialize(group, event="fetch")
        if lease:
            frame = self._frames[-1]
            for e in group:
                e.leases += 1
                frame.leased.append(e)
        if hold:
            task = self._watch_backward()
            for e in group:
                if e.param.requires_grad:  # a frozen one gets no grad to end the hold (``_unpack``)
                    e.hold_task, e.hold_saved = task, True
        self._look_ahead()

    def _unlease(self, e: PagedParam) -> None:
        e.leases -= 1
        if e.leases > 0:
            return
        if in_backward() and torch.is_grad_enabled() and e.param.requires_grad:
            # a recomputation (checkpoint) inside backward: its saved tensors keep the param until its grad lands
            e.hold_task, e.hold_saved = self._watch_backward(), False
            return
        self._settle(e)

    def _settle(self, e: PagedParam) -> None:
        """Nobody needs ``e`` now: keep it for an upcoming use, else drop it."""
        if e.idle and e.index not in self._upcoming:
            self._release(e)

    def _watch_backward(self) -> int:
        """The running backward pass (its graph task), which calls ``_backward_done`` when it ends."""
        task = int(torch._C._current_graph_task_id())
        if task not in self._tasks:
            self._tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._backward_done, task))
        return task

    def _backward_done(self, task: int) -> None:
        """A backward pass ended: the grads of submodules it left incomplete go (in module order), and the
        params it held are settled."""
        self._tasks.discard(task)
        self._push_rest()
        for e in list(self._present.values()):
            if e.hold_task == task:
                e.hold_task = -1
                self._settle(e)

    def _look_ahead(self) -> None:
        upcoming = self.trace.upcoming(self.prefetch)
        self._upcoming = {i for g in upcoming for i in g}
        for e in list(self._present.values()):
            self._settle(e)
        for g in upcoming:  # each use whole or not at all: one fetch (one collective) per use
            wanted = [self.entries[i] for i in dict.fromkeys(g) if self.entries[i].residency is Residency.ABSENT]
            if sum(e.nbytes for e in wanted) > self.budget - self.nbytes:
                return
            self._start_fetches(wanted, event="prefetch")

    # ----------------------------------------------------------------- grads

    def _grad_ready(self, param: torch.Tensor) -> None:
        e = self._by_param.get(id(param))
        grad = param.grad
        if e is None or grad is None:
            return
        param.grad = None
        self._land(e, grad)
        if e.hold_task >= 0:
            e.hold_task = -1
            self._settle(e)

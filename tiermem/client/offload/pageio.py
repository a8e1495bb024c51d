"""Param paging's transfers: fetches into the device budget and grad pushes, on the pager's one I/O thread.
A part of ``ParamPager`` (a mixin over its records and counters, as ``PagedState`` is).

Every transfer runs on the I/O thread, in the order the trainer's thread
submitted them (``_submit``); the trainer's thread only waits.  A fetch of a
submodule's params is one transfer (they share the window's slots); a param
goes ABSENT -> FETCHING -> RESIDENT and back to ABSENT when released, its
device buffer kept for reuse (``BufferCache``) within the budget.  Grads
landed are pushed a submodule at a time (``GradUnits``); bytes waiting for
the I/O thread are bounded by the budget (``_reap``), a failed push is raised
to the trainer there.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tiermem.client.offload.copies import GradItem
from tiermem.client.offload.pagedparam import BufferCache, GradUnits, PagedParam, PagerRecords, Residency
from tiermem.client.offload.pagehooks import Probe, in_backward, probed
from tiermem.core.errors import DTypeError, InvalidArgument, InvalidState
from tiermem.core.units import format_size

__all__ = ["PageIO"]


class PageIO(PagerRecords):
    probe: Probe | None
    grad_nbytes: int
    peak_grad_nbytes: int
    accumulated: bool
    counters: collections.Counter[str]
    events: collections.deque[tuple[str, str]]
    _io: ThreadPoolExecutor
    _pushes: collections.deque[tuple[Future[None], int]]
    _grad_units: GradUnits[GradItem]
    _buffers: BufferCache
    _finishing: int

    if TYPE_CHECKING:

        def _watch_backward(self) -> int: ...

    # ----------------------------------------------------------------- residency

    def _submit(self, what: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """``fn(*args)`` on the I/O thread, after every transfer submitted before it."""
        if self.probe is None:
            return self._io.submit(fn, *args)
        return self._io.submit(probed, self.probe, what, fn, *args)

    def _materialize(self, group: list[PagedParam], *, event: str) -> None:
        need = [e for e in group if e.residency is Residency.ABSENT]
        self._make_room(need, keep=group)
        self._start_fetches(need, event=event)
        self._finish_fetches(group)

    def _finish_fetches(self, group: Iterable[PagedParam]) -> None:
        """Finish the fetches of ``group`` still under way.  Counted in ``_finishing``: a signal handler that
        interrupts this (saving a checkpoint, whose ``drain`` would finish them too) leaves them to it, as
        a fetch finished twice would make its param resident twice."""
        self._finishing += 1
        try:
            for e in group:
                if e.residency is Residency.FETCHING:
                    self._finish_fetch(e)
        finally:
            self._finishing -= 1

    def _make_room(self, need: list[PagedParam], keep: list[PagedParam]) -> None:
        nbytes = sum(e.nbytes for e in need)
        if self.nbytes + nbytes <= self.budget:
            return
        kept = {id(e) for e in keep}
        idle = [e for e in self._present.values() if e.idle and id(e) not in kept]
        idle.sort(key=lambda e: e.index in self._upcoming)  # the ones no upcoming use needs go first
        for e in idle:
            self._release(e)
            if self.nbytes + nbytes <= self.budget:
                return
        # then holds of backward nodes that are done: the param's grad has not landed (it is used by another
        # node still to come, as in one loss over two forwards) but no running node needs it now; one that
        # does still views the buffer, which is then dropped, never reused (``BufferCache.give``)
        spent = [e for e in self._present.values() if self._spent_hold(e) and id(e) not in kept]
        spent.sort(key=lambda e: e.index in self._upcoming)
        for e in spent:
            e.hold_task, e.hold_saved = -1, False
            self._release(e)
            self.counters["holds_given_up"] += 1
            if self.nbytes + nbytes <= self.budget:
                return
        held = [e for e in self._present.values() if not e.idle]
        raise InvalidState(
            f"device_budget {format_size(self.budget)} cannot hold {', '.join(e.name for e in need)} "
            f"({format_size(nbytes)}) as well: "
            f"{format_size(self.nbytes)} are in use by {len(held)} params "
            f"({', '.join(e.name for e in held[:6])}{', ...' if len(held) > 6 else ''}); raise device_budget"
        )

    @staticmethod
    def _spent_hold(e: PagedParam) -> bool:
        """Held only by a backward node's saved view (no lease, no recomputation), and resident."""
        return e.residency is Residency.RESIDENT and e.leases == 0 and e.hold_task >= 0 and e.hold_saved

    def _start_fetches(self, entries: list[PagedParam], *, event: str) -> None:
        """Fetch ``entries`` (a submodule's params) in one transfer: they share the window's slots."""
        if not entries:
            return
        self._check_untouched(entries)
        items = [(e.index, self._buffer_for(e)) for e in entries]
        names = ", ".join(e.name for e in entries) if self.probe is not None else ""
        if self.probe is not None:
            self.probe.at("fetch", names)
        after = self.copies.mark()  # the kernels that read a reused buffer's last param are enqueued before
        future = self._submit(f"fetch {names}", self.copies.fetch_many, self.transfer, items, after)
        for e in entries:
            e.fetch = future
            e.move(Residency.FETCHING)
            self._present[e.index] = e
            self.nbytes += e.nbytes
            self.peak_nbytes = max(self.peak_nbytes, self.nbytes)
            self.counters[f"{event}es"] += 1
            self.counters["fetched_nbytes"] += e.nbytes
            self.events.append((event, e.name))

    def _finish_fetch(self, e: PagedParam) -> None:
        future = e.fetch
        if future is None or e.data is None:  # pragma: no cover - FETCHING always has both
            raise InvalidState(f"{e.describe()} is fetching without a fetch")
        started = time.perf_counter()
        token = future.result()  # a Ctrl-C in this wait leaves the fetch to the next use, which waits again
        e.fetch = None
        self.counters["fetch_wait_us"] += int((time.perf_counter() - started) * 1e6)
        self.copies.ready(token)
        e.move(Residency.RESIDENT)
        with torch.no_grad():
            e.param.data = e.data
        if e.data.numel():
            self._by_storage[e.data.untyped_storage().data_ptr()] = e

    def _buffer_for(self, e: PagedParam) -> torch.Tensor:
        """A device tensor for ``e`` (a reused buffer when one fits); the caller made room in the budget."""
        numel = e.shape.numel()
        buf = self._buffers.take(numel, e.dtype)
        if buf is None:
            while self.nbytes + self._buffers.nbytes + e.nbytes > self.budget and self._buffers.drop_oldest():
                pass
            buf = self.copies.empty(torch.Size([numel]), e.dtype)
            self.counters["buffers_allocated"] += 1
        e.buffer = buf
        e.data = buf.view(e.shape)
        return e.data

    def _release(self, e: PagedParam) -> None:
        if e.residency is Residency.FETCHING:
            self._finish_fetch(e)
        if e.data is not None and e.data.numel():
            self._by_storage.pop(e.data.untyped_storage().data_ptr(), None)
        self._drop_data(e)
        e.move(Residency.ABSENT)
        del self._present[e.index]
        self.nbytes -= e.nbytes
        self.events.append(("release", e.name))

    def _drop_data(self, e: PagedParam) -> None:
        e.data = None
        buf, e.buffer = e.buffer, None
        if e.param.is_meta:
            torch.utils.swap_tensors(e.param, nn.Parameter(e.placeholder, requires_grad=e.param.requires_grad))
        else:
            with torch.no_grad():
                e.param.data = e.placeholder
        e.version = e.param._version
        if buf is not None:
            self._buffers.give(buf)

    def _check_untouched(self, entries: Iterable[PagedParam]) -> None:
        """Before a paged-out param is used (fetched, or read for a state dict): refuse one that was edited
        while it held its placeholder (an in-place write, new data, another dtype or device), which the daemon
        never saw.  Every changed placeholder is put back first, so the model trains on from the daemon's
        values; the error names the first, what was done, and the way that works.  Only an absent param is
        checked: one being released (a signal handler's save can land there) still has its data."""
        with torch._C.DisableTorchFunction():  # in a forward, reading an absent param would lease it (CatchParams)
            changed = []
            for e in entries:
                if e.residency is not Residency.ABSENT or not e.touched():
                    continue
                if e.holds_a_copy():
                    self._drop_data(e)  # no edit: the placeholder back, the copy's memory freed
                elif (how := e.change_while_absent()) is not None:
                    changed.append((e, how))
            if not changed:
                return
            first, how = changed[0]
            absent = (e for e in self.entries if e.residency is Residency.ABSENT)
            others = [e for e in absent if e.change_while_absent() is not None]
            for e in others:
                with torch.no_grad():
                    e.placeholder.fill_(float("nan"))  # one element, expanded: an in-place fill wrote it
                self._drop_data(e)
        more = f" (and {len(others) - 1} other params)" if len(others) > 1 else ""
        raise InvalidState(
            f"{first.describe()} was {how} while paged out{more}: between forwards a paged param is a placeholder "
            "in the model and its values live in tiermemd, which never saw this; the placeholders are put back "
            "and the daemon's values stand. Edit paged params with model.load_state_dict() (it writes them to "
            "tiermemd), or before offload_params; convert the model's dtype or device before making the optimizer"
        )

    def _release_all(self) -> None:
        for e in list(self._present.values()):
            if e.leases:
                raise InvalidState(f"{e.describe()} is in use by a running forward; call step() after backward")
            e.hold_task = -1
            self._release(e)
        self._upcoming.clear()

    def drain(self) -> None:
        """Wait for every transfer of the I/O thread (before anything else uses the connection).  Not from a
        signal handler that interrupted this thread inside an exchange (``Connection.reentered``): the I/O
        thread's transfers wait for this thread to let go of the connection, and are left to run after (a
        grad push, whose grads no checkpoint holds, or a fetch, which changes no state)."""
        if self.transfer.client.conn.reentered:
            return
        self._reap(wait_over=None)
        if not self._finishing:
            self._finish_fetches(list(self._present.values()))

    def _land(self, e: PagedParam, grad: torch.Tensor) -> None:
        if grad.is_sparse or grad.layout is not torch.strided:
            raise InvalidArgument(
                f"{e.describe()} got a sparse gradient; OffloadAdam, like torch.optim.AdamW, takes dense gradients"
            )
        if grad.dtype != e.dtype:
            raise DTypeError(f"{e.describe()} got a {grad.dtype} gradient; params and grads must share a dtype")
        if grad.shape != e.shape:
            raise InvalidArgument(f"{e.describe()} got a gradient of shape {tuple(grad.shape)}")
        accumulate = e.landed
        self.accumulated = self.accumulated or accumulate
        e.landed = True
        nbytes = grad.numel() * grad.element_size()
        self._reap(wait_over=self.budget - nbytes)
        if self.probe is not None:
            self.probe.at("grad", e.name)
        token = self.copies.grad_token(grad)
        self.grad_nbytes += nbytes
        self.peak_grad_nbytes = max(self.peak_grad_nbytes, self.grad_nbytes)
        self.counters["pushed_nbytes"] += nbytes
        self.events.append(("grad", e.name))
        for items in self._grad_units.land(e, (e.index, grad, accumulate, token)):
            self._push(items)
        if in_backward():
            self._watch_backward()  # its end pushes what it left incomplete

    def _push(self, items: list[GradItem]) -> None:
        """One submodule's grads to the daemon, in one transfer (after every transfer submitted before)."""
        nbytes = sum(grad.numel() * grad.element_size() for _, grad, _, _ in items)
        names = ", ".join(self.entries[tid].name for tid, _, _, _ in items) if self.probe is not None else ""
        what = f"push {names}"
        self._pushes.append((self._submit(what, self.copies.push_many, self.transfer, items), nbytes))

    def _push_rest(self) -> None:
        for items in self._grad_units.rest():
            self._push(items)

    def _reap(self, *, wait_over: int | None) -> None:
        """Forget finished grad pushes; wait for the oldest while more than ``wait_over`` bytes wait (None:
        wait for all).  A failed push is raised here."""
        while self._pushes:
            future, nbytes = self._pushes[0]
            if not future.done():
                if wait_over is not None and self.grad_nbytes <= wait_over:
                    return
                started = time.perf_counter()
                future.result()
                self.counters["push_wait_us"] += int((time.perf_counter() - started) * 1e6)
            if self._pushes and self._pushes[0][0] is future:  # (a signal handler's drain may have taken it)
                self._pushes.popleft()
                self.grad_nbytes -= nbytes
            future.result()

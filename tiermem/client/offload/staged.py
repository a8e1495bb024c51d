"""The staged exchange: params that live on a device (CUDA), exchanged through the bounded staging window.

Params on a device cannot be shared memory, so the daemon keeps each one's
fp32 master and grad as state keys, and they move piece by piece through the
staging window's ring of slots (``StateTransfer``, pipelined): grads go in
(``grad``), the daemon updates, and the new params come back out of the
master.  Both cross in the params' dtype (a bf16 param and its grad move 2
bytes an element each way): the daemon widens a grad to fp32 where the update
reads it, and rounds the master to the params' dtype where it is
(``tiermem.client.offload.transfer``).  The window is registered
with CUDA once (``cudaHostRegister``), so these copies are DMA, and it is
unregistered before it is unmapped.  Host memory per param is the daemon's
state only; nothing of the model is mirrored.

When grads go in:

- by default at ``step()``, after backward (so edits of the grads between
  backward and ``step()``, clipping included, are what the daemon gets);
- as they land, with ``release_grads`` (``p.grad`` becomes None at once) or
  with the overlapped update once its contract is verified: a
  post-accumulate-grad hook records a CUDA event on the producing stream and
  queues the grad; a pusher thread waits for the event (off the autograd
  thread), copies the grad into window slots on its own copy stream, so the
  copy overlaps the rest of backward, and sends it; once every grad of a
  bucket is in, the bucket is announced (``BUCKET_READY``) and the daemon
  updates it while backward goes on.  ``step()`` waits for the pusher first,
  and a push that failed fails the step.

Edits: a param changed between steps (by autograd-visible in-place ops, by
``.data``, or rebound) is noticed by its fingerprint (version counter, data
pointer and a checksum of its bits) and pushed as the new master before the
update.  A fp16/bf16 master pushed that way is the param's value widened.
A grad pushed as it landed and changed afterwards (its version counter or
storage moved) is reported as ``changed_after_landing``, which the overlap
policy refuses.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tiermem.client.offload.feeds import grads_after_release, hook_grads, remove_hooks, zero_grads
from tiermem.client.offload.policy import Buckets
from tiermem.client.offload.transfer import PushItem, StateTransfer
from tiermem.core.errors import DTypeError, InvalidArgument, InvalidState

__all__ = ["GradPusher", "ReentrantQueue", "StagedEntry", "StagedFeed"]


def fingerprint(p: torch.Tensor) -> tuple[int, int, int]:
    flat = p.detach().reshape(-1)
    bits = flat.view(torch.int32 if flat.element_size() == 4 else torch.int16)
    return (p._version, p.data_ptr(), int(bits.sum(dtype=torch.int64)))


class ReentrantQueue(queue.Queue):
    """``queue.Queue`` on a reentrant lock: a signal handler that interrupted this thread inside ``put`` (a grad
    hook queueing a grad) may ``join`` it (a checkpoint's drain) without waiting for good on the lock its own
    frame holds; ``join``'s wait lets the lock go, so the pusher goes on meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.mutex = threading.RLock()  # type: ignore[assignment]
        self.not_empty = threading.Condition(self.mutex)
        self.not_full = threading.Condition(self.mutex)
        self.all_tasks_done = threading.Condition(self.mutex)


@dataclass
class StagedEntry:
    index: int
    param: torch.nn.Parameter
    dtype: torch.dtype
    device: torch.device
    shape: torch.Size
    bucket: int = 0
    mark: tuple[int, int, int] = (0, 0, 0)
    """The param's fingerprint when its values last matched the daemon's master."""
    seen: bool = False
    """A grad of this step reached the hook."""
    landed: bool = False
    """A grad of this step was pushed as it landed."""
    grad_mark: tuple[int, int] = (0, 0)
    """(version, data pointer) of the grad when the hook last saw it."""

    def describe(self) -> str:
        return f"param {self.index} (shape {tuple(self.shape)}, {self.dtype} on {self.device})"


class GradPusher:
    """Pushes grads to the daemon's ``grad`` key from a thread of its own, in the order they were queued.

    Items are a grad to push (after its CUDA event, on a copy stream) or a bucket to announce once the
    grads queued before it are in.  Grads queued back to back are pushed as one pipelined transfer.  The
    first error is kept and raised by ``join``; later items are dropped until then."""

    def __init__(self, transfer: StateTransfer, on_bucket: Callable[[int, list[int]], None] | None) -> None:
        self.transfer = transfer
        self.on_bucket = on_bucket
        self._queue: queue.Queue[tuple[Any, ...] | None] = ReentrantQueue()
        self._error: BaseException | None = None
        self._streams: dict[int, Any] = {}
        self._thread = threading.Thread(target=self._run, name="tiermem-grad-pusher", daemon=True)
        self._thread.start()

    def grad(self, tid: int, grad: torch.Tensor, *, accumulate: bool) -> None:
        event = None
        if grad.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(grad.device))
        self._queue.put(("grad", tid, grad, accumulate, event))

    def bucket(self, bucket: int, members: list[int]) -> None:
        self._queue.put(("bucket", bucket, members))

    def join(self) -> None:
        """Wait until everything queued is pushed; raise the first error since the last ``join``."""
        self._queue.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            batch: list[tuple[Any, ...] | None] = [item]
            while item[0] == "grad":  # take the grads already queued behind it, up to a bucket
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                batch.append(nxt)
                if nxt is None or nxt[0] != "grad":
                    break
            try:
                self._handle(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if batch[-1] is None:
                return

    def _handle(self, batch: list[tuple[Any, ...] | None]) -> None:
        grads = [b for b in batch if b is not None and b[0] == "grad"]
        tail = batch[-1]
        if self._error is not None:
            return
        try:
            if grads:
                self._push(grads)
            if tail is not None and tail[0] == "bucket" and self.on_bucket is not None:
                self.on_bucket(tail[1], tail[2])
        except BaseException as exc:
            self._error = exc

    def _push(self, grads: list[tuple[Any, ...]]) -> None:
        items: list[PushItem] = []
        for _, tid, grad, accumulate, event in grads:
            if event is not None:
                event.synchronize()  # the grad is computed (waited here, not on the autograd thread)
            items.append((tid, "grad", grad.detach(), 0, accumulate))
        device = grads[0][2].device
        if device.type != "cuda":
            self.transfer.push_many(items)
            return
        stream = self._streams.get(device.index or 0)
        if stream is None:
            stream = self._streams[device.index or 0] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):  # D2H copies beside the compute stream, not behind it
            self.transfer.push_many(items)


@dataclass
class StagedFeed:
    entries: list[StagedEntry]
    transfer: StateTransfer
    buckets: Buckets | None = None
    release_grads: bool = False
    """Push each grad as it lands and set ``p.grad`` to None."""
    on_bucket: Callable[[int, list[int]], None] | None = None
    """Called (from the pusher thread) once every grad of a bucket is in the daemon (the overlapped update)."""
    early: bool = False
    """Push grads as they land in this step (``release_grads``, or the overlap mode once verified)."""
    _by_param: dict[int, StagedEntry] = field(default_factory=dict)
    accumulated: bool = False
    buffer: int = 0
    _left: list[int] = field(default_factory=list)
    _hooks: list[Any] = field(default_factory=list)
    _pusher: GradPusher | None = None

    def __post_init__(self) -> None:
        self._by_param = {id(e.param): e for e in self.entries}
        self.reset()

    # the Feed protocol (tiermem.client.offload.feeds)
    @property
    def releases_grads(self) -> bool:
        return self.release_grads

    def retire(self, *, send_edits: bool) -> None:
        if send_edits:
            self.push_params()
        self.unhook()

    def drain(self) -> None:
        pass  # pushes in flight are joined by ``check`` (``settle``)

    def send(self, ids: Sequence[int]) -> None:
        self.push_params()
        self.push_grads(list(ids))

    def receive(self, ids: Sequence[int]) -> None:
        self.pull_params(list(ids))

    def send_params(self) -> None:
        self.push_params(only_edited=False)

    def new_step(self, buffer: int, *, early: bool) -> None:
        self.reset()
        self.buffer = buffer
        self.early = early

    def hook(self) -> None:
        """Grads are pushed as they land only with ``release_grads`` or the overlapped update."""
        if not (self.release_grads or self.on_bucket is not None):
            return
        self._pusher = GradPusher(self.transfer, self.on_bucket)
        self._hooks += hook_grads((e.param for e in self.entries), self._grad_ready)

    def unhook(self) -> None:
        remove_hooks(self._hooks)
        if self._pusher is not None:
            try:
                self._pusher.join()
            finally:
                self._pusher.close()
                self._pusher = None

    def reset(self) -> None:
        """A new step: nothing has landed."""
        for e in self.entries:
            e.seen = e.landed = False
        self.accumulated = False
        self._left = [len(m) for m in self.buckets.members] if self.buckets is not None else []

    def _grad_ready(self, param: torch.Tensor) -> None:
        entry = self._by_param.get(id(param))
        grad = param.grad
        if entry is None or grad is None or self._pusher is None:
            return
        self._check_grad(entry, grad)
        if entry.seen:
            self.accumulated = True
        entry.seen = True
        entry.grad_mark = (grad._version, grad.data_ptr())
        if not self.early:
            return  # pushed at step(), after whatever the loop does to it
        self._pusher.grad(entry.index, grad, accumulate=entry.landed)
        entry.landed = True
        if self.release_grads:
            param.grad = None
        if self.on_bucket is not None and self.buckets is not None:
            b = entry.bucket
            self._left[b] -= 1
            if self._left[b] == 0:
                self._pusher.bucket(b, list(self.buckets.members[b]))

    @property
    def changed_after_landing(self) -> bool:
        """A grad was changed in place after its hook saw it (``clip_grad_norm_``, ``unscale_``; edits through
        ``.data`` do not count: torch's version counters do not see them)."""
        for e in self.entries:
            grad = e.param.grad
            if e.seen and grad is not None and (grad._version, grad.data_ptr()) != e.grad_mark:
                return True
        return False

    def settle(self) -> None:
        """Wait for the grads being pushed; raise a push's error."""
        if self._pusher is not None:
            self._pusher.join()

    def check(self) -> list[int]:
        self.settle()
        if self.release_grads:
            late = [e.describe() for e in self.entries if e.landed and e.param.grad is not None]
            if late:
                raise grads_after_release(late)
        ids = []
        for e in self.entries:
            p = e.param
            if p.dtype != e.dtype:
                raise DTypeError(
                    f"param {e.index} was registered as {e.dtype} and is now {p.dtype}; create the optimizer "
                    "after changing the model's dtype"
                )
            if p.device != e.device or p.shape != e.shape:
                raise InvalidState(f"{e.describe()} is now {tuple(p.shape)} on {p.device}; it may not change")
            if p.is_meta:
                raise InvalidState(
                    f"{e.describe()} is still on the meta device at step(): it has no values; page the model "
                    "with tiermem.offload_params(model, opt, init=...) before training, or build it on a real device"
                )
            grad = p.grad
            if grad is None:
                if e.landed:
                    ids.append(e.index)  # released to the daemon
                continue
            self._check_grad(e, grad)
            ids.append(e.index)
        return ids

    @staticmethod
    def _check_grad(e: StagedEntry, grad: torch.Tensor) -> None:
        if grad.is_sparse or grad.layout is not torch.strided:
            raise InvalidArgument(
                f"{e.describe()} has a sparse gradient; OffloadAdam, like torch.optim.AdamW, takes dense ones"
            )
        if grad.dtype != e.dtype:
            raise DTypeError(f"{e.describe()} has a {grad.dtype} gradient; params and grads must share a dtype")

    def zero(self, *, set_to_none: bool) -> None:
        zero_grads((e.param for e in self.entries), set_to_none=set_to_none, zeroed=lambda _i, g: g.detach_().zero_())

    # the exchange
    def push_params(self, entries: list[StagedEntry] | None = None, *, only_edited: bool = True) -> int:
        """Push params whose fingerprint changed (``only_edited``) into their masters; returns how many.  An
        edit is adopted: a low-precision master keeps the elements that round to the param's value
        (``StateTransfer.adopt_many``), so a state dict loaded over the values the model had, or one element
        edited, loses the rest nothing.  Every param (a registration, a load: the masters start from the
        params) is written whole, at the working dtype's size."""
        todo: list[tuple[StagedEntry, tuple[int, int, int]]] = []
        for e in entries if entries is not None else self.entries:
            if e.param.is_meta:  # no values here to push: they reach the daemon another way (an init, a pager)
                continue
            mark = fingerprint(e.param)
            if not only_edited or mark != e.mark:
                todo.append((e, mark))
        if only_edited:
            self.transfer.adopt_many([(e.index, e.param.detach()) for e, _ in todo])
        else:
            self.transfer.push_many([(e.index, "master", e.param.detach(), 0, False) for e, _ in todo])
        for e, mark in todo:
            e.mark = mark
        return len(todo)

    def push_grads(self, ids: list[int]) -> None:
        """Push the grads the hooks did not push as they landed (all of them unless grads go in early); a
        grad set after its release was refused by ``check``."""
        items: list[PushItem] = []
        for tid in ids:
            e = self.entries[tid]
            grad = e.param.grad
            if grad is None or (e.landed and not self.release_grads):
                continue
            items.append((tid, "grad", grad.detach(), 0, e.landed))
            if self.release_grads:
                e.param.grad = None
                e.landed = True
        self.transfer.push_many(items)

    def pull_params(self, ids: list[int] | range) -> None:
        """The updated params (the daemon's ``param``: the master cast to their dtype)."""
        chosen = [e for e in (self.entries[tid] for tid in ids) if not e.param.is_meta]  # a meta one has no room
        self.transfer.pull_many_into([(e.index, "param", e.param.data) for e in chosen])
        for e in chosen:
            e.mark = fingerprint(e.param)

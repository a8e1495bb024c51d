"""The update runner: applies planned pieces to a rank's state and storage.

One piece: acquire its state chunk (an NVMe read may wait), then on the CPU
scheduler adopt in-place edits of the params, run the fused Adam kernel, and
release the chunk (dirty).  At most ``state.max_acquired`` pieces are
outstanding, so an NVMe chunk cache is never over-committed.

Where the update reads and writes (``UpdateTarget``):

- the grads: the step's grad buffer of the shared storage;
- the master: the state's ``master`` key, or, when the rank keeps none, the
  fp32 params in the storage themselves (updated in place);
- the params: written in the same pass (cast to the working dtype) unless the
  step is delayed, whose params are installed later (``install``) because the
  trainer is reading them meanwhile; a staged rank's working-dtype ``param``
  key is always written in the same pass (the trainer reads it only after).

Edits: the storage params are what the trainer sees and may change in place
between steps (``p.data.clamp_()``, ``load_state_dict`` on the model).  Where a
master is kept, a piece first compares each param with its master cast to the
working dtype and adopts the param where they differ, so torch's semantics
(the update starts from the param as it is) hold without the trainer saying
what it edited.  A master that rounds to the same value is kept, so an fp32
master is never lost to an untouched bf16 param.

Errors: a failed piece is re-raised by ``run`` (or by the ``Future`` of
``run(wait=False)``) after every other outstanding piece has ended; the rank
marks itself FAILED.  Background work runs on one pipeline thread per rank, in
the order it was queued.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from tiermem.core.dtypes import adopt_edits
from tiermem.core.errors import InvalidState
from tiermem.core.histogram import UPDATE_SECONDS, Histogram
from tiermem.core.lowbit import LowbitMoments
from tiermem.core.protocol import ParamGroup
from tiermemd import health
from tiermemd.rank.planner import Piece
from tiermemd.scheduler import CpuScheduler
from tiermemd.state import StateChunks

__all__ = ["AdamKernel", "AdamSlices", "UpdateRunner", "UpdateTarget", "adopt_edits"]

_MASTER = ("master",)
_WRITTEN_WHOLE = ("param",)
"""What an update writes without reading: the working-dtype params it casts from the master."""


def _whole_chunks(state: StateChunks, pieces: Sequence[Piece]) -> dict[int, int]:
    """For each chunk the pieces cover whole, the index of its first piece (which may acquire the keys the
    update only writes without reading them; later pieces of the chunk find them written)."""
    first: dict[int, int] = {}
    covered: dict[int, int] = {}
    for i, piece in enumerate(pieces):
        first.setdefault(piece.chunk, i)
        covered[piece.chunk] = covered.get(piece.chunk, 0) + piece.hi - piece.lo
    whole = {}
    for chunk, count in covered.items():
        if count == min(state.chunk_numel, state.numel - chunk * state.chunk_numel):
            whole[chunk] = first[chunk]
    return whole


class AdamSlices(NamedTuple):
    """The operands of one piece's update: equal-length flat slices."""

    master: torch.Tensor
    moments: LowbitMoments
    """``exp_avg`` and ``exp_avg_sq`` in the rank's state dtype (fp32 ones are AdamW's, updated exactly)."""
    grad: torch.Tensor
    out: torch.Tensor | None
    """Receives the updated params cast down (None: no params written in this pass)."""


class AdamKernel(Protocol):
    """The arithmetic the daemon needs from the CPU Adam engine."""

    def grad_stats(self, grad: torch.Tensor, inv_scale: float) -> tuple[float, bool]:
        """(sum of squares of ``grad * inv_scale`` in fp32, whether any element is inf/nan)."""
        ...

    def update(self, ops: AdamSlices, *, group: ParamGroup, step: int, grad_scale: float) -> str | None:
        """One Adam/AdamW step over ``ops``, in place; the path it ran (``KERNEL_PATHS``), or None where the
        kernel does not say."""
        ...

    def prepare(self, state_dtype: str) -> None:
        """Make ready what updates of compressed moments (``state_dtype`` bf16 or int8) run."""
        ...


@dataclass(frozen=True)
class UpdateTarget:
    grads: torch.Tensor | None
    """The step's grad buffer (working dtype, the rank's flat element space); None: the state's ``grad``
    key (the staged exchange)."""
    params: torch.Tensor | None
    """The storage params (working dtype, same indexing); None: the staged exchange, whose params are
    read from the master by the client."""
    master_in_params: bool
    """The params are fp32 and are the master (the state has no master key)."""
    write_params: bool
    """Write the updated params in the same pass (False: a delayed step, installed later)."""


class UpdateRunner:
    def __init__(self, kernel: AdamKernel, scheduler: CpuScheduler, tenant: str) -> None:
        self.kernel = kernel
        self.scheduler = scheduler
        self.tenant = tenant
        self._pipeline: ThreadPoolExecutor | None = None
        self.update_s = 0.0
        self.updates = 0
        """Updates (``run`` calls) that completed."""
        self.updated_elements = 0
        """Elements those updates stepped."""
        self.update_seconds = Histogram(UPDATE_SECONDS)
        """Duration of each ``run``, failed ones included (one writer: runs of a rank never overlap)."""
        self.adopted = 0
        """Param elements whose in-place edits were taken into the master."""
        self.kernel_path = ""
        """The path the last update ran (``native``, ``compiled``, ``fallback``); empty before one."""

    def run(
        self,
        state: StateChunks,
        pieces: Sequence[Piece],
        target: UpdateTarget,
        grad_scale: float,
        *,
        consume: bool = False,
        wait: bool = True,
    ) -> Future[None]:
        """Apply ``pieces``; ``consume``: this run takes the last of the step's grads in the state's ``grad``
        key, so each chunk's grads are given up after its last piece (the next step writes them anew).

        ``wait``: return once applied (the future is done); ``wait=False``: run on the rank's pipeline thread,
        after what was queued there before, and return at once."""
        if wait:
            self._run(state, pieces, target, grad_scale, consume)
            done: Future[None] = Future()
            done.set_result(None)
            return done
        if self._pipeline is None:
            self._pipeline = ThreadPoolExecutor(1, thread_name_prefix=f"tiermem-{self.tenant}")
        return self._pipeline.submit(self._tracked_run, state, list(pieces), target, grad_scale, consume)

    def _tracked_run(
        self, state: StateChunks, pieces: Sequence[Piece], target: UpdateTarget, grad_scale: float, consume: bool
    ) -> None:
        with health.track(f"tiermem-{self.tenant} pipeline"):
            self._run(state, pieces, target, grad_scale, consume)

    def _run(
        self, state: StateChunks, pieces: Sequence[Piece], target: UpdateTarget, grad_scale: float, consume: bool
    ) -> None:
        started = time.perf_counter()
        last = {piece.chunk: i for i, piece in enumerate(pieces)} if consume else {}
        fresh = _whole_chunks(state, pieces)
        limit = getattr(state, "max_acquired", None)
        resident = getattr(state, "resident", None)
        # the NVMe placement pipelines: the next chunk is acquired (perhaps waiting for its page-in) while the
        # scheduler updates this one; where nothing waits (the CPU placement, or every chunk in the cache now)
        # the piece runs here when the scheduler is idle (no handoff to another thread: ``run_here``)
        here = limit is None or (resident is not None and resident())
        window: collections.deque[Future[None]] = collections.deque()
        error: BaseException | None = None
        try:
            for i, piece in enumerate(pieces):
                if limit is not None and len(window) >= limit:
                    health.wait(window.popleft())
                consumed = last.get(piece.chunk) == i
                overwrite = _WRITTEN_WHOLE if fresh.get(piece.chunk) == i else ()
                window.append(
                    self._piece(state, piece, target, grad_scale, here=here, consumed=consumed, overwrite=overwrite)
                )
                health.tick()  # progress of this thread (tiermemd.health): a piece was acquired
        except BaseException as exc:
            error = exc
        finally:
            for future in window:
                try:
                    health.wait(future)
                except CancelledError:
                    # nothing of that piece was applied: the update is incomplete, which is a failure
                    error = error or InvalidState("update pieces were cancelled (the scheduler is shutting down)")
                except BaseException as exc:
                    error = error or exc
            elapsed = time.perf_counter() - started
            self.update_s += elapsed
            self.update_seconds.observe(elapsed)
        if error is not None:
            raise error
        self.updates += 1 if pieces else 0
        self.updated_elements += sum(piece.hi - piece.lo for piece in pieces)

    def install(self, state: StateChunks, ranges: Sequence[tuple[int, int, int]], params: torch.Tensor) -> None:
        """Cast the master of ``(chunk, lo, hi)`` ranges into the storage params."""
        for chunk, lo, hi in ranges:
            c0 = chunk * state.chunk_numel
            tensors = state.acquire(chunk, _MASTER, advance=False)
            try:
                master = tensors.master
                if master is not None:
                    params[lo:hi].copy_(master[lo - c0 : hi - c0])
            finally:
                state.release(chunk, _MASTER, dirty=False)

    def adopt(self, state: StateChunks, ranges: Sequence[tuple[int, int, int]], params: torch.Tensor) -> None:
        """Take in-place edits of the storage params of ``(chunk, lo, hi)`` ranges into the master (before a
        delayed update, which does not write the params and so cannot adopt them piece by piece)."""
        for chunk, lo, hi in ranges:
            c0 = chunk * state.chunk_numel
            tensors = state.acquire(chunk, _MASTER, advance=False)
            try:
                if tensors.master is not None:
                    self.adopted += adopt_edits(tensors.master[lo - c0 : hi - c0], params[lo:hi])
            finally:
                state.release(chunk, _MASTER, dirty=True)

    def close(self) -> None:
        if self._pipeline is not None:
            self._pipeline.shutdown(wait=True)
            self._pipeline = None

    def _piece(
        self,
        state: StateChunks,
        piece: Piece,
        target: UpdateTarget,
        grad_scale: float,
        *,
        here: bool = False,
        consumed: bool = False,
        overwrite: tuple[str, ...] = (),
    ) -> Future[None]:
        c0 = piece.chunk * state.chunk_numel
        a, b = piece.lo, piece.hi
        tensors = state.acquire(piece.chunk, overwrite=overwrite)

        def work() -> None:
            try:
                params = target.params[a:b] if target.params is not None else None
                out: torch.Tensor | None = None
                cast: torch.Tensor | None = None
                if params is None and tensors.param is not None:
                    # the staged params kept in their working dtype, whatever the step (the trainer reads them
                    # from here, after the update): cast from the new master right after the update, not as
                    # the kernel's output, so the master comes from the same arithmetic as where none is kept
                    # (fp32 grads without an output take torch's fused AdamW, which rounds differently)
                    cast = tensors.param[a - c0 : b - c0]
                if target.master_in_params and params is not None:
                    master = params
                else:
                    if tensors.master is None:
                        raise InvalidState("the rank keeps no master, but its params are not in the storage")
                    master = tensors.master[a - c0 : b - c0]
                    if target.write_params and params is not None and params.dtype == torch.float32:
                        # fp32 params kept with a master (the NVMe placement persists it): the params, edits
                        # and all, are what the update starts from; the master gets the result in the same
                        # pass, instead of a compare pass to adopt edits and a copy back
                        master, out = params, master
                    elif target.write_params and params is not None:
                        self.adopted += adopt_edits(master, params)
                        out = params
                if target.grads is not None:
                    grads = target.grads[a:b]
                elif tensors.grad is not None:
                    grads = tensors.grad[a - c0 : b - c0]
                else:
                    raise InvalidState("the rank has neither a grad buffer nor staged grads")
                moments = tensors.moments(state.format.state_dtype, c0, a - c0, b - c0)
                ops = AdamSlices(master, moments, grads, out)
                path = self.kernel.update(ops, group=piece.group, step=piece.step, grad_scale=grad_scale)
                if path:
                    self.kernel_path = path
                if cast is not None:
                    cast.copy_(master)
            finally:
                state.release(piece.chunk, dirty=True, consumed=consumed)

        try:
            future = (self.scheduler.run_here if here else self.scheduler.submit)(self.tenant, work)
        except BaseException:
            state.release(piece.chunk, dirty=False)
            raise

        def give_back_if_cancelled(f: Future[None]) -> None:
            if f.cancelled():
                state.release(piece.chunk, dirty=False)

        future.add_done_callback(give_back_if_cancelled)
        return future

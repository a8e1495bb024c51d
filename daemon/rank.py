"""One rank's optimizer inside the daemon: registration, the step pipeline, state I/O.

A ``RankOptimizer`` owns the rank's shared window, the layout of its tensors
(``tiermem.layout``), its fp32 state chunks (``StateChunks``: pool or NVMe), the
hyper-parameters of its param groups and a step count per tensor (torch keeps
``step`` per parameter; a tensor without a gradient in a step is not updated
and its count does not advance).

Step pipeline (per ``STEP``), all CPU work on the shared ``CpuScheduler``:

1. ``BUCKET_READY`` messages arrive during backward, as the client copies each
   bucket's grads into the window.  Each one schedules the bucket's gradient
   statistics (squared norm of the unscaled grads, any inf/nan); on the NVMe
   tier the tier manager meanwhile reads ahead the chunks in update order.
2. ``STEP`` carries what only the end of backward knows: the loss scale, the
   clipping threshold, whether to skip on overflow, the current
   hyper-parameters.  Statistics of tensors that came in no bucket are computed
   now; then, as ``torch.amp.GradScaler`` does, an overflow skips the step (state
   and counts untouched); else the grads are multiplied by
   ``clip_coef / loss_scale`` inside the update, with ``clip_coef`` as in
   ``torch.nn.utils.clip_grad_norm_``.
3. The update runs over runs of tensors that share a group and a step count,
   cut at chunk boundaries; each piece reads grad + master/m/v and writes
   master/m/v and the working-precision param into the window in one pass.

The update waits for the whole step because clipping and overflow need every
bucket's statistics; what overlaps backward is the statistics and (NVMe) the
state reads, which are the parts that cost time before the update can run.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tiermem.errors import BoundsError, InvalidArgument, InvalidState, UnknownKey
from tiermem.layout import Layout, plan_layout
from tiermem.layout import TensorSpec as LayoutSpec
from tiermem.pool import Arena
from tiermem.protocol import (
    STATE_KEYS,
    BucketReady,
    MemRef,
    ParamGroup,
    StateChunk,
    StateRead,
    StateWrite,
    Step,
    StepDone,
    TensorSlot,
    TensorSpec,
)
from tiermemd.persist import RankRecord
from tiermemd.scheduler import CpuScheduler
from tiermemd.state import StateChunks, chunk_ranges

__all__ = ["AdamKernel", "RankOptimizer"]

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class AdamKernel(Protocol):
    """The arithmetic the daemon needs from the CPU Adam engine."""

    def grad_stats(self, grad: torch.Tensor, inv_scale: float) -> tuple[float, bool]:
        """(sum of squares of ``grad * inv_scale`` in fp32, whether any element is inf/nan)."""
        ...

    def update(
        self,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor,
        out: torch.Tensor | None,
        *,
        group: ParamGroup,
        step: int,
        grad_scale: float,
    ) -> None:
        """One Adam/AdamW step over equal-length flat slices; ``out`` receives the updated params cast down."""
        ...


@dataclass
class _StepState:
    step: int
    grad_buffer: int
    stats: dict[int, Future[tuple[float, bool]]] = field(default_factory=dict)
    """tensor id -> its gradient statistics (computed per bucket as buckets land)."""
    eager: set[int] = field(default_factory=set)
    """Tensors already updated by BUCKET_READY(update=True) in this step (the overlapped update)."""
    eager_groups: tuple[ParamGroup, ...] = ()
    eager_futures: list[Future[None]] = field(default_factory=list)


class RankOptimizer:
    def __init__(
        self,
        *,
        job_id: str,
        rank: int,
        window: Arena,
        window_id: int,
        kernel: AdamKernel,
        scheduler: CpuScheduler,
    ) -> None:
        self.job_id = job_id
        self.rank = rank
        self.window = window
        self.window_id = window_id
        self.kernel = kernel
        self.scheduler = scheduler
        self.tenant = f"{job_id}/{rank}"
        self._window_bytes = torch.frombuffer(window.view(0, window.nbytes), dtype=torch.uint8)
        self.layout: Layout | None = None
        self.restored: RankRecord | None = None
        """Set when the rank comes from a previous daemon's job file and waits for its REGISTER."""
        self.specs: tuple[TensorSpec, ...] = ()
        self.groups: tuple[ParamGroup, ...] = ()
        self.state: StateChunks | None = None
        self.steps: list[int] = []
        self.last_step = 0
        self.skipped_steps = 0
        self.overlapped_tensors = 0
        """Tensor updates applied as their bucket landed (BUCKET_READY with update)."""
        self._pending: _StepState | None = None
        self._inflight: list[Future[None]] = []
        self._pipeline: ThreadPoolExecutor | None = None
        """Update tasks of a delayed step still running (the next STEP/FETCH_PARAMS waits for them)."""
        self._stale: set[int] = set()
        """Tensors whose param slot does not hold their current master (FETCH_PARAMS rewrites them)."""
        self.timings: dict[str, float] = {"stats_s": 0.0, "update_s": 0.0, "wait_s": 0.0}

    # ----------------------------------------------------------------- registration

    def register(
        self,
        specs: Sequence[TensorSpec],
        groups: Sequence[ParamGroup],
        grad_buffers: int,
        make_state: Callable[[int], StateChunks],
    ) -> tuple[TensorSlot, ...]:
        """Lay out ``specs`` in the window and create their state with ``make_state(numel)``.

        Registering the same tensors again (a reattached client) returns the same slots.  A rank
        restored from a previous daemon's job file must be registered with the tensors it had; its
        state is then reopened (``make_state`` finds it in the swap store) and its step counts restored.
        """
        if self.layout is not None:
            if tuple(specs) != self.specs or len(self.layout.grad_offsets) != grad_buffers:
                raise InvalidState(
                    f"rank {self.rank} of job {self.job_id!r} is already registered with other tensors "
                    f"({len(self.specs)} tensors, {len(self.layout.grad_offsets)} grad buffer(s))"
                )
            self.groups = tuple(groups)
            return self._slots(self.layout)
        restored = self.restored
        if restored is not None and (tuple(specs) != restored.specs or grad_buffers != restored.grad_buffers):
            raise InvalidState(
                f"rank {self.rank} of job {self.job_id!r} was restored with {len(restored.specs)} tensors and "
                f"{restored.grad_buffers} grad buffer(s); register exactly those to continue"
            )
        if not groups:
            raise InvalidArgument("register at least one param group")
        for spec in specs:
            if spec.group >= len(groups):
                raise InvalidArgument(f"tensor {spec.name!r} names group {spec.group}, but {len(groups)} were given")
        layout = plan_layout(
            [LayoutSpec(s.name, tuple(s.shape), s.dtype, s.group) for s in specs],
            bucket_nbytes=1 << 62,
            grad_buffers=grad_buffers,
        )
        if layout.nbytes > self.window.nbytes:
            raise BoundsError(
                f"the registered tensors need a window of {layout.nbytes} bytes "
                f"({grad_buffers} grad buffer(s)), but the window is {self.window.nbytes} bytes; "
                "attach with a larger one"
            )
        self.state = make_state(layout.numel)
        self.layout = layout
        self.specs = tuple(specs)
        self.groups = tuple(groups)
        self.steps = list(restored.steps) if restored else [0] * len(specs)
        self.last_step = restored.last_step if restored else 0
        self.restored = None
        self._stale = set(range(len(specs)))
        return self._slots(layout)

    def _slots(self, layout: Layout) -> tuple[TensorSlot, ...]:
        return tuple(
            TensorSlot(
                slot.index,
                MemRef(self.window_id, layout.param_offset + slot.slot_offset, slot.nbytes),
                tuple(MemRef(self.window_id, g + slot.slot_offset, slot.nbytes) for g in layout.grad_offsets),
            )
            for slot in layout.slots
        )

    def _require_layout(self) -> tuple[Layout, StateChunks]:
        if self.layout is None or self.state is None:
            raise InvalidState(f"rank {self.rank} of job {self.job_id!r} has not registered tensors yet")
        return self.layout, self.state

    def _region(self, offset: int, layout: Layout) -> torch.Tensor:
        return self._window_bytes[offset : offset + layout.region_nbytes].view(_TORCH_DTYPES[layout.dtype])

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        n = len(self.specs)
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise InvalidArgument(f"tensor id {bad[0]} is not registered (ids are 0..{n - 1})")
        return sorted(set(ids)) if ids else list(range(n))

    # ----------------------------------------------------------------- the step

    def bucket_ready(self, msg: BucketReady) -> None:
        layout, _ = self._require_layout()
        if msg.grad_buffer >= len(layout.grad_offsets):
            raise InvalidArgument(
                f"grad_buffer {msg.grad_buffer} does not exist (the layout has {len(layout.grad_offsets)})"
            )
        if msg.step <= self.last_step:
            raise InvalidArgument(f"bucket for step {msg.step}, but step {self.last_step} was already applied")
        pending = self._pending
        if pending is None or pending.step != msg.step:
            pending = self._pending = _StepState(msg.step, msg.grad_buffer)
        grads = self._region(layout.grad_offsets[msg.grad_buffer], layout)
        if msg.update:
            self._update_bucket(pending, msg, grads, self._region(layout.param_offset, layout))
            return
        for tid in self._check_ids(msg.tensor_ids):
            # a tensor sent again (gradient accumulation, or changed after its hook) replaces its statistics
            stale = pending.stats.get(tid)
            if stale is not None:
                stale.cancel()
            pending.stats[tid] = self._stats_task(grads, tid, inv_scale=1.0)

    def _update_bucket(self, pending: _StepState, msg: BucketReady, grads: torch.Tensor, params: torch.Tensor) -> None:
        """The overlapped update: apply Adam to a bucket as soon as it lands, on the rank's pipeline thread."""
        state = self.state
        if state is None:  # pragma: no cover - checked by _require_layout
            raise InvalidState("no state")
        if len(msg.groups) != len(self.groups):
            raise InvalidArgument(f"bucket carries {len(msg.groups)} param groups, {len(self.groups)} are registered")
        if pending.eager_groups and pending.eager_groups != tuple(msg.groups):
            raise InvalidArgument(f"buckets of step {msg.step} carry different hyper-parameters")
        ids = self._check_ids(msg.tensor_ids)
        again = sorted(set(ids) & pending.eager)
        if again:
            raise InvalidState(
                f"tensor {again[0]} was already updated in step {msg.step}; an overlapped update needs each "
                "gradient exactly once per step (no accumulation over several backward passes)"
            )
        pending.eager.update(ids)
        pending.eager_groups = tuple(msg.groups)
        self.overlapped_tensors += len(ids)
        pieces = self._take_pieces(ids, msg.groups, state)
        pending.eager_futures.append(self._in_background(state, pieces, grads, params, 1.0))

    def _stats_task(self, grads: torch.Tensor, tid: int, inv_scale: float) -> Future[tuple[float, bool]]:
        slot = self.layout.slots[tid]  # type: ignore[union-attr]
        piece = grads[slot.start : slot.stop]
        return self.scheduler.submit(self.tenant, lambda: self.kernel.grad_stats(piece, inv_scale))

    def _wait_inflight(self) -> None:
        """Wait for a delayed step's update; its failure is raised here, at the next request."""
        inflight, self._inflight = self._inflight, []
        for future in inflight:
            future.result()

    def step(self, msg: Step) -> StepDone:
        layout, state = self._require_layout()
        if any(f.done() for f in self._inflight):
            for future in [f for f in self._inflight if f.done()]:
                future.result()  # surface a failed delayed update before accepting more work
        if msg.step <= self.last_step:
            raise InvalidArgument(f"step {msg.step} was already applied (last step {self.last_step})")
        if msg.grad_buffer >= len(layout.grad_offsets):
            raise InvalidArgument(
                f"grad_buffer {msg.grad_buffer} does not exist (the layout has {len(layout.grad_offsets)})"
            )
        if msg.groups:
            if len(msg.groups) != len(self.groups):
                raise InvalidArgument(f"step carries {len(msg.groups)} param groups, {len(self.groups)} are registered")
            self.groups = tuple(msg.groups)
        if msg.loss_scale <= 0 or not math.isfinite(msg.loss_scale):
            raise InvalidArgument(f"loss_scale must be a positive finite number, got {msg.loss_scale}")
        ids = self._check_ids(msg.tensor_ids)
        pending = self._pending if self._pending is not None and self._pending.step == msg.step else None
        self._pending = None
        if pending is not None and pending.grad_buffer != msg.grad_buffer:
            raise InvalidArgument(
                f"buckets of step {msg.step} named grad buffer {pending.grad_buffer}, the step {msg.grad_buffer}"
            )
        t0 = time.perf_counter()
        if pending is not None and pending.eager:
            for future in pending.eager_futures:
                future.result()  # the overlapped updates of this step are done (or raise here)
            if msg.loss_scale != 1.0 or msg.max_grad_norm is not None or msg.skip_nonfinite:
                raise InvalidState(
                    f"step {msg.step} asks for loss scaling or clipping, but {len(pending.eager)} tensor(s) were "
                    "already updated as their buckets landed; an overlapped update cannot be unscaled or clipped"
                )
            if msg.groups and tuple(msg.groups) != pending.eager_groups:
                raise InvalidState(
                    f"the hyper-parameters of step {msg.step} changed after its buckets were updated with the "
                    "earlier ones; set them before backward when updates overlap it"
                )
            ids = [tid for tid in ids if tid not in pending.eager]
        grads = self._region(layout.grad_offsets[msg.grad_buffer], layout)
        params = self._region(layout.param_offset, layout)
        inv_scale = 1.0 / msg.loss_scale
        need_stats = msg.max_grad_norm is not None or msg.skip_nonfinite
        grad_norm: float | None = None
        found_inf = False
        if need_stats:
            stats = pending.stats if pending else {}
            futures = [
                stats[tid] if tid in stats and not stats[tid].cancelled() else self._stats_task(grads, tid, 1.0)
                for tid in ids
            ]
            total_sq = 0.0
            for stats_future in futures:
                try:
                    sq, nonfinite = stats_future.result()
                except CancelledError:
                    raise InvalidState(f"step {msg.step} of job {self.job_id!r} rank {self.rank} was aborted") from None
                total_sq += sq
                found_inf = found_inf or nonfinite
            # statistics were taken on the scaled grads: unscale the squared norm once
            grad_norm = math.sqrt(total_sq) * inv_scale if math.isfinite(total_sq) else math.inf
            found_inf = found_inf or not math.isfinite(grad_norm)
        t1 = time.perf_counter()
        self.timings["stats_s"] += t1 - t0
        if found_inf and msg.skip_nonfinite:
            self.last_step = msg.step
            self.skipped_steps += 1
            return StepDone(step=msg.step, found_inf=True, grad_norm=grad_norm, timings=(("stats", t1 - t0),))
        clip_coef = 1.0
        if msg.max_grad_norm is not None and grad_norm is not None:
            clip_coef = min(1.0, msg.max_grad_norm / (grad_norm + 1e-6))
        grad_scale = inv_scale * clip_coef
        pieces = self._take_pieces(ids, self.groups, state)
        self.last_step = msg.step
        if msg.delayed:
            self._inflight.append(self._in_background(state, pieces, grads, params, grad_scale))
            return StepDone(
                step=msg.step,
                found_inf=found_inf,
                grad_norm=grad_norm,
                params_ready=False,
                timings=(("stats", t1 - t0),),
            )
        self._run_update(state, pieces, grads, params, grad_scale)
        t2 = time.perf_counter()
        return StepDone(
            step=msg.step,
            found_inf=found_inf,
            grad_norm=grad_norm,
            timings=(("stats", t1 - t0), ("update", t2 - t1)),
        )

    def _take_pieces(
        self, ids: list[int], groups: Sequence[ParamGroup], state: StateChunks
    ) -> list[tuple[int, int, int, ParamGroup, int]]:
        """The update pieces of ``ids`` (chunk, flat range, group, step count after it), and their step counts
        advanced: from here on the tensors count as stepped (their param slots will hold the new values)."""
        pieces = [
            (chunk, a, b, groups[group], step)
            for lo, hi, group, step in self._runs(ids)
            for chunk, a, b in chunk_ranges(lo, hi, state.chunk_numel)
        ]
        for tid in ids:
            self.steps[tid] += 1
        self._stale.difference_update(ids)
        return pieces

    def _in_background(
        self,
        state: StateChunks,
        pieces: list[tuple[int, int, int, ParamGroup, int]],
        grads: torch.Tensor,
        params: torch.Tensor,
        grad_scale: float,
    ) -> Future[None]:
        """Run an update on the rank's pipeline thread (delayed steps, overlapped buckets), in order."""
        if self._pipeline is None:
            self._pipeline = ThreadPoolExecutor(1, thread_name_prefix=f"tiermem-rank-{self.rank}")
        return self._pipeline.submit(self._run_update, state, pieces, grads, params, grad_scale)

    def _runs(self, ids: list[int]) -> list[tuple[int, int, int, int]]:
        """Maximal runs of consecutive tensors with one group and one step count: (start, stop, group, step)."""
        layout = self.layout
        runs: list[tuple[int, int, int, int]] = []
        for tid in ids:
            slot = layout.slots[tid]  # type: ignore[union-attr]
            key = (slot.spec.group, self.steps[tid] + 1)
            if runs and runs[-1][1] == slot.start and runs[-1][2:] == key:
                runs[-1] = (runs[-1][0], slot.stop, *key)
            elif slot.stop > slot.start:
                runs.append((slot.start, slot.stop, *key))
        return runs

    def _run_update(
        self,
        state: StateChunks,
        pieces: list[tuple[int, int, int, ParamGroup, int]],
        grads: torch.Tensor,
        params: torch.Tensor,
        grad_scale: float,
    ) -> None:
        """Acquire each piece's chunk (waiting for NVMe reads) and queue its update, keeping at most
        ``state.max_acquired`` pieces outstanding so the chunk cache is never over-committed."""
        started = time.perf_counter()
        limit = getattr(state, "max_acquired", None)
        window: collections.deque[Future[None]] = collections.deque()
        try:
            for chunk, a, b, group, step in pieces:
                if limit is not None and len(window) >= limit:
                    window.popleft().result()
                window.append(self._update_task(state, chunk, a, b, grads, params, group, step, grad_scale))
        finally:
            for future in window:
                with contextlib.suppress(CancelledError):
                    future.result()
            self.timings["update_s"] += time.perf_counter() - started  # delayed updates counted too

    def _update_task(
        self,
        state: StateChunks,
        chunk: int,
        a: int,
        b: int,
        grads: torch.Tensor,
        params: torch.Tensor,
        group: ParamGroup,
        step: int,
        grad_scale: float,
    ) -> Future[None]:
        c0 = chunk * state.chunk_numel
        tensors = state.acquire(chunk)

        def run() -> None:
            try:
                self.kernel.update(
                    tensors.master[a - c0 : b - c0],
                    tensors.exp_avg[a - c0 : b - c0],
                    tensors.exp_avg_sq[a - c0 : b - c0],
                    grads[a:b],
                    params[a:b],
                    group=group,
                    step=step,
                    grad_scale=grad_scale,
                )
            finally:
                state.release(chunk, dirty=True)

        future = self.scheduler.submit(self.tenant, run)
        future.add_done_callback(lambda f: f.cancelled() and state.release(chunk, dirty=False))
        return future

    # ----------------------------------------------------------------- params and state

    def write_params(self, ids: Sequence[int]) -> None:
        """Make the param slots of ``ids`` (all when empty) current: wait for a delayed update, and
        cast the fp32 master of every tensor whose slot is stale (after a state load) into it."""
        layout, state = self._require_layout()
        wait_s = time.perf_counter()
        self._wait_inflight()
        self.timings["wait_s"] += time.perf_counter() - wait_s
        params = self._region(layout.param_offset, layout)
        for tid in [t for t in self._check_ids(ids) if t in self._stale]:
            self._stale.discard(tid)
            slot = layout.slots[tid]
            for chunk, a, b in chunk_ranges(slot.start, slot.stop, state.chunk_numel):
                c0 = chunk * state.chunk_numel
                tensors = state.acquire(chunk)
                try:
                    params[a:b].copy_(tensors.master[a - c0 : b - c0])
                finally:
                    state.release(chunk, dirty=False)

    def _state_span(self, tid: int, key: str, offset: int, length: int) -> tuple[int, int]:
        layout, _ = self._require_layout()
        if key not in STATE_KEYS:
            raise UnknownKey(key, f"state keys {STATE_KEYS}")
        slot = layout.slots[self._check_ids([tid])[0]]
        total = slot.spec.numel * 4
        if offset % 4 or length % 4 or offset < 0 or offset + length > total:
            raise BoundsError(
                f"state range [{offset}, {offset + length}) of tensor {tid} {key} is not 4-byte aligned "
                f"inside its {total} bytes"
            )
        return slot.start + offset // 4, slot.start + (offset + length) // 4

    def _window_f32(self, ref: MemRef) -> torch.Tensor:
        ref.check_bounds(self.window.nbytes)
        if ref.window != self.window_id:
            raise BoundsError(f"window {ref.window} is not this rank's window ({self.window_id})")
        if ref.offset % 4 or ref.length % 4:
            raise BoundsError(f"fp32 staging area at offset {ref.offset}, length {ref.length} is not 4-byte aligned")
        return self._window_bytes[ref.offset : ref.offset + ref.length].view(torch.float32)

    def read_state(self, msg: StateRead) -> StateChunk:
        _, state = self._require_layout()
        self._wait_inflight()
        dest = self._window_f32(msg.dest)
        lo, hi = self._state_span(msg.tensor_id, msg.key, msg.offset, msg.dest.length)
        which = STATE_KEYS.index(msg.key)
        for chunk, a, b in chunk_ranges(lo, hi, state.chunk_numel):
            c0 = chunk * state.chunk_numel
            tensors = state.acquire(chunk)
            try:
                dest[a - lo : b - lo].copy_(tensors[which][a - c0 : b - c0])
            finally:
                state.release(chunk, dirty=False)
        total = self.specs[msg.tensor_id].numel * 4
        return StateChunk(
            tensor_id=msg.tensor_id,
            key=msg.key,
            offset=msg.offset,
            nbytes=msg.dest.length,
            total_nbytes=total,
            step=self.steps[msg.tensor_id],
        )

    def write_state(self, msg: StateWrite) -> None:
        _, state = self._require_layout()
        self._wait_inflight()
        self._stale.update(range(len(self.specs)))  # the client may have staged through param slots
        src = self._window_f32(msg.src)
        lo, hi = self._state_span(msg.tensor_id, msg.key, msg.offset, msg.src.length)
        which = STATE_KEYS.index(msg.key)
        for chunk, a, b in chunk_ranges(lo, hi, state.chunk_numel):
            c0 = chunk * state.chunk_numel
            tensors = state.acquire(chunk)
            try:
                tensors[which][a - c0 : b - c0].copy_(src[a - lo : b - lo])
            finally:
                state.release(chunk, dirty=True)
        self.steps[msg.tensor_id] = msg.step

    # ----------------------------------------------------------------- lifecycle

    def abort(self) -> int:
        """The client died: drop its queued statistics; an update already started runs to its end, so
        the state is never left half-stepped.  Returns how many tasks were cancelled."""
        pending, self._pending = self._pending, None
        if pending is None:
            return 0
        if pending.eager:
            # part of the step is applied already: it is the step the client was in; count it as done
            for future in pending.eager_futures:
                with contextlib.suppress(Exception):
                    future.result()
            self.last_step = max(self.last_step, pending.step)
        return sum(1 for future in pending.stats.values() if future.cancel())

    def close_pipeline(self) -> None:
        """Stop taking work: drop queued statistics, finish a delayed update, stop its thread."""
        self.abort()
        with contextlib.suppress(Exception):
            self._wait_inflight()
        if self._pipeline is not None:
            self._pipeline.shutdown(wait=True)
            self._pipeline = None

    def close(self, *, keep_swap: bool = False) -> None:
        """Release everything; the state is zeroed and freed (its swap files kept when ``keep_swap``)."""
        self.close_pipeline()
        if self.state is not None:
            if keep_swap and hasattr(self.state, "persist"):
                self.state.close(remove=False)
            else:
                self.state.close()
            self.state = None
        self._window_bytes = torch.empty(0, dtype=torch.uint8)

    def export(self, placement: str) -> RankRecord:
        """What a restarted daemon needs to reopen this rank (its state itself is in the swap store)."""
        return RankRecord(
            rank=self.rank,
            placement=placement,
            specs=self.specs,
            groups=self.groups,
            grad_buffers=len(self.layout.grad_offsets) if self.layout else 1,
            steps=tuple(self.steps),
            last_step=self.last_step,
        )

    def stats(self) -> dict[str, float]:
        out = {
            "last_step": float(self.last_step),
            "skipped_steps": float(self.skipped_steps),
            "overlapped_tensors": float(self.overlapped_tensors),
            "tensors": float(len(self.specs)),
            "numel": float(self.layout.numel if self.layout else 0),
            "window_bytes": float(self.window.nbytes),
        }
        out.update(self.timings)
        state_stats = getattr(self.state, "stats", None)
        if state_stats is not None:
            out.update(state_stats())
        return out

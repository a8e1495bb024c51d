"""State I/O of a rank: STATE_READ, STATE_WRITE and STATE_RESET through the staging window.

A part of ``RankOptimizer`` (a mixin over the rank's records, state and
window): every reference into the window is bounds-checked, every state range
is checked against its tensor, and the keys a rank does not keep are refused
by name.  ``master`` of a rank whose fp32 params are their own master reads
and writes the storage params.  ``param`` (read-only) is the params in their
working dtype: what a param fetch reads.  Where a paged rank keeps them apart
from the master, it reads only their 2 bytes an element from the tier;
elsewhere it reads the master.  A write of the master writes the kept
working-dtype params beside it.

How a range is staged in the window is the span's ``dtype``: fp32 (4 bytes an
element), or a working dtype, fp16 or bf16 (2 bytes), in which params and
grads cross the host/device boundary as the model holds them.  The daemon
converts where the state is, in the one copy between the window and the
state: a grad or a master written in bf16 is widened to fp32 there (exactly,
as a widening on the client would be), a param read in bf16 is the kept
param, or the master rounded to nearest-even (as the client's copy of fp32
values into a bf16 tensor rounds).  A state range is named in the state's
fp32 bytes (``offset``) whatever the staging dtype.

Compressed moments (``state_dtype`` bf16 or int8) move as fp32 values all
the same, so a checkpoint is AdamW's: a read dequantizes, a write quantizes
(stochastic rounding with the numbers of the step it carries).  An int8 write
re-quantizes the whole blocks it touches; a block holds one tensor's elements
only (the layout starts each tensor on a block), so no other tensor's moments
move.  Values a read gave quantize back to the same codes and scales
(``tiermem.core.lowbit``), so a checkpoint written back is exact when each
block comes in one write: one that covers part of a block quantizes it
against that part's largest, and the rest, written later, moves it again.
``StateTransfer`` cuts moments on blocks for this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from tiermem.core import dtypes
from tiermem.core.errors import BoundsError, InvalidArgument
from tiermem.core.layout import Layout
from tiermem.core.lowbit import LowbitMoments
from tiermem.core.protocol import (
    STATE_KEYS,
    MemRef,
    StateChunk,
    StateRead,
    StateReadMany,
    StateSpans,
    StateWrite,
    StateWriteMany,
)
from tiermem.engine.pool import Arena
from tiermemd.rank.planner import check_ids
from tiermemd.rank.records import PhaseRecord, RankPhase, TensorRecord
from tiermemd.state import MOMENTS, ChunkTensors, StateChunks, chunk_ranges

__all__ = ["StateIO"]


class StateIO:
    records: list[TensorRecord]
    window: Arena
    window_id: int
    phase: PhaseRecord
    layout: Layout | None
    _window_bytes: torch.Tensor
    _uninstalled: set[int]
    _delayed: Future[None] | None

    if TYPE_CHECKING:

        @property
        def master_in_params(self) -> bool: ...
        @property
        def staged(self) -> bool: ...
        def _parts(self) -> tuple[Layout, StateChunks]: ...
        def _region(self, offset: int) -> torch.Tensor: ...
        def _settle(self) -> None: ...
        def _wait_queued(self) -> None: ...
        def _install(self, ids: Sequence[int] | range, *, force: bool = False) -> None: ...

    def _state_span(self, tid: int, key: str, offset: int, length: int) -> tuple[int, int]:
        if key not in STATE_KEYS:
            raise InvalidArgument(f"unknown state key {key!r}; the keys are {', '.join(STATE_KEYS)}")
        _, state = self._parts()
        readable = key == "param" or (key == "master" and self.master_in_params)
        if key not in state.keys and not readable:
            raise InvalidArgument(f"this rank keeps no {key!r} state (its keys are {', '.join(state.keys)})")
        rec = self.records[check_ids([tid], len(self.records))[0]]
        total = rec.spec.numel * 4
        if offset >= 0 and length > total:
            raise BoundsError(
                f"state range of {length} bytes is too large for tensor {tid} {key}: it holds {total} bytes "
                f"({rec.spec.numel} fp32 elements)"
            )
        if offset < 0 or length < 0 or offset + length > total:
            raise BoundsError(
                f"state range [{offset}, {offset + length}) of tensor {tid} {key} falls outside its {total} bytes "
                f"({rec.spec.numel} fp32 elements)"
            )
        if offset % 4 or length % 4:
            raise BoundsError(f"state range [{offset}, {offset + length}) of tensor {tid} {key} is not 4-byte aligned")
        return rec.start + offset // 4, rec.start + (offset + length) // 4

    def _window_view(self, ref: MemRef, dtype: str = "float32") -> torch.Tensor:
        """The staging area ``ref`` as a tensor of ``dtype`` (checked: this rank's window, in bounds, aligned
        to the element size)."""
        if ref.window != self.window_id:
            raise BoundsError(f"window {ref.window} is not this rank's staging window ({self.window_id})")
        if ref.length > self.window.nbytes:
            raise BoundsError(
                f"a staging area of {ref.length} bytes is too large: this rank's staging window holds "
                f"{self.window.nbytes} bytes; move state in pieces of at most that"
            )
        ref.check_bounds(self.window.nbytes)
        kind = dtypes.by_name(dtype)
        if ref.offset % kind.itemsize or ref.length % kind.itemsize:
            raise BoundsError(
                f"{dtype} staging area at offset {ref.offset}, length {ref.length} is not {kind.itemsize}-byte aligned"
            )
        return self._window_bytes[ref.offset : ref.offset + ref.length].view(kind.torch)

    @staticmethod
    def _fp32_length(ref: MemRef, dtype: str) -> int:
        """The bytes, as fp32 state, of the elements ``ref`` stages as ``dtype``."""
        return ref.length // dtypes.by_name(dtype).itemsize * 4

    def _source(self, key: str) -> str:
        """The key whose values a read of ``key`` returns: ``param`` is the working-dtype params where the rank
        keeps them, else the master (which they equal, cast)."""
        _, state = self._parts()
        return "master" if key == "param" and "param" not in state.keys else key

    def _master_in_storage(self, *, dirty: bool) -> bool:
        """Whether the master's values are the storage params: where the rank keeps no master, and for a read
        where fp32 params are in the storage.  There they are what every update starts from, edits
        included; a kept master (the NVMe placement persists it) only receives each update's result, so
        it lags an edit until the next step and holds nothing for a tensor that never stepped."""
        if self.master_in_params:
            return True
        layout = self.layout
        return not dirty and not self.staged and layout is not None and layout.dtype == "float32"

    def _key_view(self, key: str, lo: int, hi: int, chunk: int, tensors: object, *, storage: bool) -> torch.Tensor:
        """The values of ``key`` for flat ``[lo, hi)``: a state section, or the fp32 storage params when they
        hold the master (``storage``: ``_master_in_storage``)."""
        _, state = self._parts()
        if key == "master" and storage:
            return self._region(self.layout.param_offset)[lo:hi]  # type: ignore[union-attr]
        c0 = chunk * state.chunk_numel
        values: torch.Tensor = getattr(tensors, key)
        return values[lo - c0 : hi - c0]

    def _transfer(
        self,
        tid: int,
        key: str,
        offset: int,
        ref: MemRef,
        apply: Callable[[torch.Tensor, torch.Tensor], None],
        *,
        dirty: bool,
        step: int = 0,
        dtype: str = "float32",
    ) -> None:
        """``apply(staged, values)`` over the range of ``key`` that ``ref`` stages as ``dtype``, one acquired
        chunk at a time; ``dirty``: the chunks are released as written; ``step``: the step count a written
        compressed moment is rounded with."""
        self._settle()
        self._wait_queued()
        _, state = self._parts()
        lo, hi = self._state_span(tid, key, offset, self._fp32_length(ref, dtype))
        staged = self._window_view(ref, dtype)
        self._install([tid])
        key = self._source(key)
        storage = self._master_in_storage(dirty=dirty)
        keys: tuple[str, ...] = () if key == "master" and storage else (key,)
        # a write of the master writes the working-dtype params beside it, which always equal it cast
        cast = dirty and key == "master" and "param" in state.keys
        if cast:
            keys = ("master", "param")
        compressed = key in MOMENTS and state.format.state_dtype != "fp32"
        if compressed:
            keys = MOMENTS  # what ``ChunkTensors.moments`` reads (one part: nothing more is paged in)
        for chunk, a, b in chunk_ranges(lo, hi, state.chunk_numel):
            tensors = state.acquire(chunk, keys, advance=False)
            try:
                if compressed:
                    self._transfer_moment(tensors, key, chunk, a, b, staged[a - lo : b - lo], apply, dirty, step)
                    continue
                values = self._key_view(key, a, b, chunk, tensors, storage=storage)
                apply(staged[a - lo : b - lo], values)
                if cast:
                    self._key_view("param", a, b, chunk, tensors, storage=storage).copy_(values)
            finally:
                state.release(chunk, keys, dirty=dirty, filled=b - a if dirty and key == "grad" else 0)

    def _moments(self, tensors: ChunkTensors, chunk: int, a: int, b: int) -> tuple[LowbitMoments, int]:
        """The compressed moments of the whole blocks that hold flat ``[a, b)`` of ``chunk``, and where ``a``
        is in them."""
        _, state = self._parts()
        c0 = chunk * state.chunk_numel
        block = state.format.block
        first = (a - c0) // block * block
        last = min(-(-(b - c0) // block) * block, state.chunk_numel, state.numel - c0)
        return tensors.moments(state.format.state_dtype, c0, first, last), a - c0 - first

    def _transfer_moment(
        self,
        tensors: ChunkTensors,
        key: str,
        chunk: int,
        a: int,
        b: int,
        staged: torch.Tensor,
        apply: Callable[[torch.Tensor, torch.Tensor], None],
        dirty: bool,
        step: int,
    ) -> None:
        """``_transfer`` of compressed moment ``key`` over flat ``[a, b)`` of ``chunk``: through fp32 values of
        the blocks that hold it, quantized back (with the numbers of ``step``) when written."""
        moments, at = self._moments(tensors, chunk, a, b)
        values = moments.dequantize_one(key)
        apply(staged, values[at : at + b - a])
        if dirty:
            moments.store_one(key, values, step=step)

    def read_state(self, msg: StateRead) -> StateChunk:
        self._transfer(msg.tensor_id, msg.key, msg.offset, msg.dest, _read, dirty=False)
        rec = self.records[msg.tensor_id]
        return StateChunk(
            tensor_id=msg.tensor_id,
            key=msg.key,
            offset=msg.offset,
            nbytes=msg.dest.length,
            total_nbytes=rec.spec.numel * 4,
            step=rec.step,
        )

    def write_state(self, msg: StateWrite) -> None:
        """Load a piece of ``key``.  The storage params are not touched: a loaded master that the model's
        param does not round to is replaced by the param at the next update (the model is the truth, as
        for ``torch.optim``), so loading the optimizer before or after the model gives the same result."""
        _check_writable(msg.key)
        apply = _accumulate if msg.accumulate else _write
        self._transfer(msg.tensor_id, msg.key, msg.offset, msg.src, apply, dirty=True, step=msg.step)
        if msg.key in MOMENTS:
            self.records[msg.tensor_id].step = msg.step

    def read_many(self, msg: StateReadMany) -> StateSpans:
        """STATE_READ of each span, in order; the reply carries each span's tensor's step count."""
        steps = []
        for span in msg.spans:
            self._transfer(span.tensor_id, span.key, span.offset, span.area, _read, dirty=False, dtype=span.dtype)
            steps.append(self.records[span.tensor_id].step)
        return StateSpans(steps=tuple(steps))

    def write_many(self, msg: StateWriteMany) -> None:
        """STATE_WRITE of each span, in order, after every span was checked (a bad one writes nothing)."""
        self._settle()
        for span in msg.spans:
            _check_writable(span.key)
            self._state_span(span.tensor_id, span.key, span.offset, self._fp32_length(span.area, span.dtype))
            self._window_view(span.area, span.dtype)
        for span in msg.spans:
            apply = _accumulate if span.accumulate else _write
            self._transfer(
                span.tensor_id, span.key, span.offset, span.area, apply, dirty=True, step=span.step, dtype=span.dtype
            )
            if span.key in MOMENTS:
                self.records[span.tensor_id].step = span.step

    def reset_state(self, ids: Sequence[int]) -> None:
        """Zero the moments of ``ids`` (empty: all) and their step counts; the master takes the storage
        params.  Resetting every tensor makes a FAILED rank usable again."""
        if self.phase.phase is not RankPhase.FAILED:
            self._settle()
        else:
            self._delayed = None
        layout, state = self._parts()
        wanted = check_ids(ids, len(self.records))
        params = None if self.staged else self._region(layout.param_offset)
        self._uninstalled.difference_update(wanted)
        for tid in wanted:
            rec = self.records[tid]
            for chunk, a, b in chunk_ranges(rec.start, rec.stop, state.chunk_numel):
                c0 = chunk * state.chunk_numel
                tensors = state.acquire(chunk, advance=False)
                try:
                    self._moments(tensors, chunk, a, b)[0].zero()
                    if tensors.grad is not None:
                        tensors.grad[a - c0 : b - c0].zero_()
                    if tensors.master is not None and params is not None:
                        tensors.master[a - c0 : b - c0].copy_(params[a:b])
                finally:
                    state.release(chunk, dirty=True)
            rec.step = 0
        if self.phase.phase is RankPhase.FAILED and len(wanted) == len(self.records):
            self.phase.move(RankPhase.IDLE)


def _check_writable(key: str) -> None:
    if key == "param":
        raise InvalidArgument("'param' is read-only (the params cast from the master); write 'master'")


def _read(staged: torch.Tensor, values: torch.Tensor) -> None:
    staged.copy_(values)


def _write(staged: torch.Tensor, values: torch.Tensor) -> None:
    values.copy_(staged)


def _accumulate(staged: torch.Tensor, values: torch.Tensor) -> None:
    values.add_(staged)

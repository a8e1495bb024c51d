"""Where a rank's Adam state lives: chunks of its state keys, in parts.

A rank's state is one flat buffer of ``numel`` elements per state key,
cut into chunks of ``chunk_numel`` elements; chunk ``c`` covers elements
``[c * chunk_numel, min((c + 1) * chunk_numel, numel))``.  The keys of a
chunk are grouped in parts (``chunk_parts``), each the unit a tier moves:

- ``param``: what a param fetch reads and a step writes: the params in their
  working dtype (``param``, bf16/fp16) where a paged rank keeps them apart
  from the master, else the fp32 ``master`` itself;
- ``state``: the fp32 master where ``param`` is kept, ``exp_avg`` and
  ``exp_avg_sq`` in the rank's ``state_dtype`` (fp32, bf16, or int8 codes
  and their block scales: ``tiermem.core.lowbit``); only an update and a
  checkpoint touch them;
- ``grad``: the staged exchange's grads (written as they land, read once by
  the update, then consumed).

``master`` and ``grad`` are fp32; ``param`` is in the rank's working dtype and
always equals the master cast to it (the update writes both in one pass; a
write of the master writes both).  How a part's bytes hold its keys is
``tiermem.core.statekeys.StateFormat``: exact bytes, so the pool and the swap
hold compressed moments compressed.  An int8 rank's chunks are a whole number
of quantization blocks, so a block never spans two chunks.

Why parts and not one record per chunk: a param fetch then moves the param's
bytes only, not the moments and the grad beside it; a grad push moves the
grad only; and consumed grads are dropped without being written back.  On
the NVMe tier that is the difference between 40 and 64+ B/param a paged
step (``benchmarks/bench_scale.py``).

``StateChunks`` is the interface the step pipeline uses: ``acquire(c, keys)``
returns the tensors of ``keys`` of chunk ``c`` (the others None; valid until
``release(c, keys)``).  ``CpuStateChunks`` keeps every chunk in the daemon's
pool, one block per chunk holding every part: a chunk is pinned only while it
is in use, so the pool may compact around idle state.  The NVMe tier
(``tiermemd.nvme``) pages each part of each chunk on its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, NamedTuple, Protocol

import torch

from tiermem.core.errors import InvalidArgument, InvalidState
from tiermem.core.figures import Family, gauge
from tiermem.core.lowbit import LowbitMoments
from tiermem.core.statekeys import ALL_KEYS, MOMENTS, PAGED_KEYS, STAGED_KEYS, StateFormat, chunk_parts
from tiermem.engine.pool import Block, BufferPool
from tiermem.engine.swap.records import SwapStats
from tiermem.engine.tiers.records import TierStats

__all__ = [
    "ALL_KEYS",
    "MOMENTS",
    "PAGED_KEYS",
    "STAGED_KEYS",
    "UPDATE_KEYS",
    "ChunkTensors",
    "CpuStateChunks",
    "StateChunks",
    "StateStats",
    "chunk_parts",
    "chunk_ranges",
]

UPDATE_KEYS = PAGED_KEYS
"""What an update may read and write (a rank acquires the ones it keeps)."""


class ChunkTensors(NamedTuple):
    """The tensors of one chunk's keys; a key the rank does not keep or that was not acquired is None."""

    param: torch.Tensor | None = None
    """The params in their working dtype, where the rank keeps them apart from the master."""
    master: torch.Tensor | None = None
    """None also when the rank keeps no master (its fp32 params in the shared storage are the master)."""
    exp_avg: torch.Tensor | None = None
    """In the rank's state dtype: fp32, bf16 or int8 codes."""
    exp_avg_sq: torch.Tensor | None = None
    """fp32, bf16 or uint8 codes."""
    grad: torch.Tensor | None = None
    """The staged exchange's fp32 grads (None: the grads are in the shared storage)."""
    exp_avg_scale: torch.Tensor | None = None
    """The int8 codes' block scales (None for fp32 and bf16 moments)."""
    exp_avg_sq_scale: torch.Tensor | None = None

    def need(self, key: str) -> torch.Tensor:
        """The tensor of ``key``, which the caller acquired: None here is a bug, said as such."""
        value: torch.Tensor | None = getattr(self, key)
        if value is None:
            raise InvalidState(f"state key {key!r} of this chunk was not acquired or is not kept by the rank")
        return value

    def moments(self, state_dtype: str, start: int, lo: int = 0, hi: int | None = None) -> LowbitMoments:
        """The acquired moments of the chunk's elements ``[lo, hi)`` (default: all) as one ``LowbitMoments``;
        ``start``: the chunk's first element.  Made on every piece of an update: fp32 and bf16 moments are
        sliced straight (an int8 piece goes through ``LowbitMoments.piece``, which checks its block)."""
        m, v = self.need("exp_avg"), self.need("exp_avg_sq")
        stop = m.numel() if hi is None else hi
        if state_dtype != "int8":
            return LowbitMoments(state_dtype, m[lo:stop], v[lo:stop], start=start + lo)
        whole = LowbitMoments(state_dtype, m, v, self.need("exp_avg_scale"), self.need("exp_avg_sq_scale"), start=start)
        return whole.piece(lo, stop)


_PER_TIER = "per tier (cpu: pool bytes, NVMe chunk caches included; nvme: swap bytes)."
STATE_BYTES = Family("tiermem_state_bytes", f"Optimizer state of all jobs, {_PER_TIER}", label="tier")
JOB_STATE_BYTES = Family("tiermem_job_state_bytes", f"A job's optimizer state, {_PER_TIER}", label="tier", per_job=True)


@dataclass(frozen=True)
class StateStats:
    """Where a rank's state is, in bytes per tier, and the counters of the NVMe tier's parts."""

    cpu_nbytes: Annotated[int, gauge(STATE_BYTES.at("cpu"), JOB_STATE_BYTES.at("cpu"), wire="cpu_state_nbytes")]
    """Pool bytes: all of the state on the CPU placement, the chunk cache on the NVMe one."""
    nvme_nbytes: Annotated[int, gauge(STATE_BYTES.at("nvme"), JOB_STATE_BYTES.at("nvme"), wire="nvme_state_nbytes")] = 0
    """Swap bytes holding the state's current (and not yet freed older) versions."""
    tiers: TierStats | None = None
    swap: SwapStats | None = None


class StateChunks(Protocol):
    numel: int
    chunk_numel: int
    keys: tuple[str, ...]
    format: StateFormat

    @property
    def nchunks(self) -> int: ...
    def acquire(
        self, chunk: int, keys: Iterable[str] = UPDATE_KEYS, *, advance: bool = True, overwrite: Iterable[str] = ()
    ) -> ChunkTensors:
        """The tensors of those of ``keys`` the rank keeps, resident until ``release`` with the same keys.

        ``advance``: a use of the update's pass (in chunk order, which the NVMe tier prefetches along);
        False for uses outside it (param fetches, grad pushes, checkpoints).  ``overwrite``: keys whose
        whole chunk the caller writes before anyone reads them (the NVMe tier then reads nothing for them)."""
        ...

    def release(
        self, chunk: int, keys: Iterable[str] = UPDATE_KEYS, *, dirty: bool, consumed: bool = False, filled: int = 0
    ) -> None:
        """End an ``acquire``; ``dirty``: its tensors were written; ``consumed``: the grads of the chunk are no
        longer needed (an update took them; the next step writes them anew), so they are not kept;
        ``filled``: grad elements of the chunk this use wrote (a push), so the NVMe tier keeps a grad part
        that is not whole yet in memory."""
        ...

    def close(self, *, remove: bool = True) -> None: ...
    def stats(self) -> StateStats: ...


def chunk_ranges(start: int, stop: int, chunk_numel: int) -> list[tuple[int, int, int]]:
    """Split the flat range ``[start, stop)`` at chunk boundaries: ``(chunk, lo, hi)`` triples."""
    out = []
    pos = start
    while pos < stop:
        chunk = pos // chunk_numel
        hi = min(stop, (chunk + 1) * chunk_numel)
        out.append((chunk, pos, hi))
        pos = hi
    return out


class CpuStateChunks:
    """Every chunk resident in the pool (the ``cpu`` placement)."""

    def __init__(
        self,
        pool: BufferPool,
        numel: int,
        chunk_numel: int,
        *,
        owner: str,
        keys: tuple[str, ...] = ALL_KEYS,
        state_dtype: str = "fp32",
    ) -> None:
        """``chunk_numel`` is rounded up to a whole number of the format's blocks (``StateFormat.chunk_numel``)."""
        if numel <= 0 or chunk_numel <= 0:
            raise InvalidArgument(f"state needs numel > 0 and chunk_numel > 0, got {numel} and {chunk_numel}")
        if "param" in keys:
            raise InvalidArgument("the cpu placement keeps no working-dtype params apart from the master")
        self.pool = pool
        self.numel = numel
        self.format = StateFormat(keys, state_dtype=state_dtype)
        self.chunk_numel = self.format.chunk_numel(chunk_numel)
        self.keys = keys
        self._blocks: list[Block] = []
        self._views: dict[int, tuple[tuple[int, int], dict[str, torch.Tensor]]] = {}
        """Per chunk: where its block was, and the sections over it then (a compaction moves unpinned
        blocks: the views serve again only while the block is where it was).  Made once instead of at each
        acquire, which took about 0.1 ms of a step's critical path."""
        self._lock = threading.Lock()
        try:
            for c in range(self.nchunks):
                block = pool.alloc(self.format.chunk_nbytes(self._chunk_len(c)), owner=owner)
                self._blocks.append(block)
                with pool.pinned(block) as view:
                    torch.frombuffer(view, dtype=torch.uint8).zero_()
        except BaseException:
            self.close()
            raise

    @property
    def nchunks(self) -> int:
        return (self.numel + self.chunk_numel - 1) // self.chunk_numel

    @property
    def nbytes(self) -> int:
        return self.format.nbytes(self.numel, self.chunk_numel)

    def _chunk_len(self, chunk: int) -> int:
        return min(self.chunk_numel, self.numel - chunk * self.chunk_numel)

    def acquire(
        self, chunk: int, keys: Iterable[str] = UPDATE_KEYS, *, advance: bool = True, overwrite: Iterable[str] = ()
    ) -> ChunkTensors:
        block = self._blocks[chunk]
        n = self._chunk_len(chunk)
        self.pool.pin(block)
        place = (block.arena, block.offset)  # pinned: it stays there until the release
        cached = self._views.get(chunk)
        if cached is None or cached[0] != place:
            try:
                cached = self._views[chunk] = (place, self._sections(block, n))
            except BaseException:
                self.pool.unpin(block)
                raise
        wanted, key_of = set(keys), self.format.section_keys
        return ChunkTensors(**{name: t for name, t in cached[1].items() if key_of[name] in wanted})

    def _sections(self, block: Block, n: int) -> dict[str, torch.Tensor]:
        """Every section of every part of a chunk's block (the parts in order, one after the other)."""
        raw = self.pool.tensor(block, torch.uint8, (self.format.chunk_nbytes(n),))
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for part in self.format.parts:
            size = self.format.part_nbytes(part, n)
            out.update(self.format.split(part, raw[offset : offset + size], n))
            offset += size
        return out

    def release(
        self, chunk: int, keys: Iterable[str] = UPDATE_KEYS, *, dirty: bool, consumed: bool = False, filled: int = 0
    ) -> None:
        self.pool.unpin(self._blocks[chunk])

    def stats(self) -> StateStats:
        with self._lock:
            return StateStats(cpu_nbytes=self.nbytes if self._blocks else 0)

    def close(self, *, remove: bool = True) -> None:
        """Zero and free every chunk (state of one job never leaks into another's blocks); ``remove`` is for
        the NVMe placement's swap files and means nothing here."""
        with self._lock:
            blocks, self._blocks = self._blocks, []
            self._views.clear()  # the tensors hold the pool's mapping
        for block in blocks:
            with self.pool.pinned(block) as view:
                torch.frombuffer(view, dtype=torch.uint8).zero_()
            self.pool.free(block)

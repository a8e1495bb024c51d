"""Where a rank's fp32 Adam state lives: chunks of its state keys (master, exp_avg, exp_avg_sq).

A rank's state is one flat fp32 buffer of ``numel`` elements per state key,
cut into chunks of ``chunk_numel`` elements; chunk ``c`` covers elements
``[c * chunk_numel, min((c + 1) * chunk_numel, numel))`` and is stored as one
block of consecutive sections, one per key in ``keys`` order (master |
exp_avg | exp_avg_sq, or exp_avg | exp_avg_sq when the rank's fp32 params
are their own master), so one I/O moves all of a chunk's state.

``StateChunks`` is the interface the step pipeline uses: ``acquire(c)`` returns
the three tensors of chunk ``c`` (valid until ``release``).  ``CpuStateChunks`` keeps every chunk in the daemon's
pool: a chunk is pinned only while it is in use, so the pool may compact
around idle state.  The NVMe tier pages chunks through the tier manager.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Annotated, NamedTuple, Protocol

import torch

from tiermem.core.errors import InvalidArgument
from tiermem.core.figures import Family, gauge
from tiermem.engine.pool import Block, BufferPool
from tiermem.engine.swap.records import SwapStats
from tiermem.engine.tiers.records import TierStats

__all__ = [
    "ALL_KEYS",
    "STAGED_KEYS",
    "ChunkTensors",
    "CpuStateChunks",
    "StateChunks",
    "StateStats",
    "chunk_ranges",
    "split_chunk",
]

ALL_KEYS = ("master", "exp_avg", "exp_avg_sq")
STAGED_KEYS = (*ALL_KEYS, "grad")
"""A rank whose params do not live in the shared storage (the staged exchange) also keeps its grads."""
STATE_BYTES_PER_ELEMENT = 4 * len(ALL_KEYS)
"""What a rank with a master keeps per element (fp32 master and both moments)."""


class ChunkTensors(NamedTuple):
    master: torch.Tensor | None
    """None when the rank keeps no master (its fp32 params in the shared storage are the master)."""
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor | None = None
    """The staged exchange's fp32 grads (None: the grads are in the shared storage)."""


def split_chunk(flat: torch.Tensor, n: int, keys: tuple[str, ...]) -> ChunkTensors:
    """The per-key sections of one chunk's flat fp32 block (``len(keys) * n`` elements)."""
    parts = {key: flat[i * n : (i + 1) * n] for i, key in enumerate(keys)}
    return ChunkTensors(parts.get("master"), parts["exp_avg"], parts["exp_avg_sq"], parts.get("grad"))


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

    @property
    def nchunks(self) -> int: ...
    def acquire(self, chunk: int) -> ChunkTensors: ...
    def release(self, chunk: int, *, dirty: bool) -> None: ...
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
        self, pool: BufferPool, numel: int, chunk_numel: int, *, owner: str, keys: tuple[str, ...] = ALL_KEYS
    ) -> None:
        if numel <= 0 or chunk_numel <= 0:
            raise InvalidArgument(f"state needs numel > 0 and chunk_numel > 0, got {numel} and {chunk_numel}")
        self.pool = pool
        self.numel = numel
        self.chunk_numel = chunk_numel
        self.keys = keys
        self._blocks: list[Block] = []
        self._lock = threading.Lock()
        try:
            for c in range(self.nchunks):
                block = pool.alloc(self._chunk_len(c) * 4 * len(keys), owner=owner)
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
        return self.numel * 4 * len(self.keys)

    def _chunk_len(self, chunk: int) -> int:
        return min(self.chunk_numel, self.numel - chunk * self.chunk_numel)

    def acquire(self, chunk: int) -> ChunkTensors:
        block = self._blocks[chunk]
        n = self._chunk_len(chunk)
        self.pool.pin(block)
        flat = self.pool.tensor(block, torch.float32, (len(self.keys) * n,))
        return split_chunk(flat, n, self.keys)

    def release(self, chunk: int, *, dirty: bool) -> None:
        self.pool.unpin(self._blocks[chunk])

    def stats(self) -> StateStats:
        with self._lock:
            return StateStats(cpu_nbytes=self.nbytes if self._blocks else 0)

    def close(self, *, remove: bool = True) -> None:
        """Zero and free every chunk (state of one job never leaks into another's blocks); ``remove`` is for
        the NVMe placement's swap files and means nothing here."""
        with self._lock:
            blocks, self._blocks = self._blocks, []
        for block in blocks:
            with self.pool.pinned(block) as view:
                torch.frombuffer(view, dtype=torch.uint8).zero_()
            self.pool.free(block)

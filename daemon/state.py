"""Where a rank's fp32 Adam state lives: chunks of (master, exp_avg, exp_avg_sq).

A rank's state is three flat fp32 buffers of ``numel`` elements, cut into
chunks of ``chunk_numel`` elements; chunk ``c`` covers elements
``[c * chunk_numel, min((c + 1) * chunk_numel, numel))`` and is stored as one
block of three consecutive sections (master | exp_avg | exp_avg_sq), so one
I/O moves all of a chunk's state.

``StateChunks`` is the interface the step pipeline uses: ``acquire(c)`` returns
the three tensors of chunk ``c`` (valid until ``release``).  ``CpuStateChunks`` keeps every chunk in the daemon's
pool: a chunk is pinned only while it is in use, so the pool may compact
around idle state.  The NVMe tier pages chunks through the tier manager.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Protocol

import torch

from tiermem.errors import InvalidArgument
from tiermem.pool import Block, BufferPool

__all__ = ["ChunkTensors", "CpuStateChunks", "StateChunks", "chunk_ranges"]

STATE_BYTES_PER_ELEMENT = 12


class ChunkTensors(NamedTuple):
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class StateChunks(Protocol):
    numel: int
    chunk_numel: int

    @property
    def nchunks(self) -> int: ...
    def acquire(self, chunk: int) -> ChunkTensors: ...
    def release(self, chunk: int, *, dirty: bool) -> None: ...
    def close(self, *, remove: bool = True) -> None: ...


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

    def __init__(self, pool: BufferPool, numel: int, chunk_numel: int, *, owner: str) -> None:
        if numel <= 0 or chunk_numel <= 0:
            raise InvalidArgument(f"state needs numel > 0 and chunk_numel > 0, got {numel} and {chunk_numel}")
        self.pool = pool
        self.numel = numel
        self.chunk_numel = chunk_numel
        self._blocks: list[Block] = []
        self._lock = threading.Lock()
        try:
            for c in range(self.nchunks):
                block = pool.alloc(self._chunk_len(c) * STATE_BYTES_PER_ELEMENT, owner=owner)
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
        return self.numel * STATE_BYTES_PER_ELEMENT

    def _chunk_len(self, chunk: int) -> int:
        return min(self.chunk_numel, self.numel - chunk * self.chunk_numel)

    def acquire(self, chunk: int) -> ChunkTensors:
        block = self._blocks[chunk]
        n = self._chunk_len(chunk)
        self.pool.pin(block)
        flat = self.pool.tensor(block, torch.float32, (3 * n,))
        return ChunkTensors(flat[:n], flat[n : 2 * n], flat[2 * n :])

    def release(self, chunk: int, *, dirty: bool) -> None:
        self.pool.unpin(self._blocks[chunk])

    def close(self, *, remove: bool = True) -> None:
        """Zero and free every chunk (state of one job never leaks into another's blocks); ``remove`` is for
        the NVMe placement's swap files and means nothing here."""
        with self._lock:
            blocks, self._blocks = self._blocks, []
        for block in blocks:
            with self.pool.pinned(block) as view:
                torch.frombuffer(view, dtype=torch.uint8).zero_()
            self.pool.free(block)

"""A short probe of a swap directory's device: read and write bandwidth by queue depth, and latency.

``probe_disk(directory)`` writes, then reads, ``nbytes`` of a scratch file
(O_DIRECT, libaio, from one pre-touched page-aligned buffer, the way the swap
store does I/O) at each queue depth of ``depths``, and times a single-block
read at depth 1.  It takes a fraction of a second on an NVMe or virtio disk
and removes its file.  The figures feed ``tiermem.engine.tiers.sizing``; the probe is
short, so on a busy disk they are indicative, which is why every decision it
feeds can be fixed in the configuration instead.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tiermem.core.errors import InvalidArgument
from tiermem.core.units import PAGE_SIZE, MiB
from tiermem.engine.swap.engine import IOOp, IORequest, buffer_address

__all__ = ["DEPTHS", "DiskPoint", "DiskProbe", "probe_disk"]

DEPTHS = (1, 4, 16, 64)


@dataclass(frozen=True, slots=True)
class DiskPoint:
    queue_depth: int
    read_bps: float
    """Bytes per second."""
    write_bps: float


@dataclass(frozen=True, slots=True)
class DiskProbe:
    """What a short probe measured on a swap directory's device."""

    block_nbytes: int
    points: tuple[DiskPoint, ...]
    latency_s: float
    """Seconds for one block read at queue depth 1."""

    def __post_init__(self) -> None:
        if not self.points:
            raise InvalidArgument("a disk probe needs at least one queue depth measured")
        if self.block_nbytes <= 0 or any(p.read_bps <= 0 or p.write_bps <= 0 for p in self.points):
            raise InvalidArgument(f"a disk probe needs positive sizes and bandwidths, got {self}")

    def at(self, queue_depth: int) -> DiskPoint:
        """The measured point at ``queue_depth`` (the nearest measured depth not above it, else the lowest)."""
        below = [p for p in self.points if p.queue_depth <= queue_depth]
        if below:
            return max(below, key=lambda p: p.queue_depth)
        return min(self.points, key=lambda p: p.queue_depth)

    def describe(self) -> str:
        cells = ", ".join(
            f"QD{p.queue_depth} {p.read_bps / 1e9:.2f}/{p.write_bps / 1e9:.2f}"
            for p in sorted(self.points, key=lambda p: p.queue_depth)
        )
        return (
            f"GB/s read/write by queue depth: {cells}; {self.block_nbytes // 1024}KiB read latency "
            f"{self.latency_s * 1e3:.2f} ms"
        )


def probe_disk(
    directory: str | os.PathLike[str],
    *,
    block_nbytes: int = MiB,
    nbytes: int = 8 * MiB,
    depths: Sequence[int] = DEPTHS,
) -> DiskProbe:
    """Measure the device under ``directory`` (see the module docstring); needs libaio and O_DIRECT there."""
    from tiermem.engine.swap.engine_libaio import LibaioEngine

    if block_nbytes <= 0 or block_nbytes % PAGE_SIZE or nbytes < block_nbytes or nbytes % block_nbytes:
        raise InvalidArgument(
            f"probe sizes must be whole 4KiB pages with nbytes a multiple of block_nbytes; got "
            f"block_nbytes={block_nbytes}, nbytes={nbytes}"
        )
    if not depths or any(d <= 0 for d in depths):
        raise InvalidArgument(f"probe queue depths must be positive, got {list(depths)}")
    buf = mmap.mmap(-1, nbytes)
    buf.write(os.urandom(PAGE_SIZE) * (nbytes // PAGE_SIZE))  # touched, and not all zeros
    address = buffer_address(memoryview(buf))
    fd, name = tempfile.mkstemp(prefix=".tiermem-probe-", dir=directory)
    os.close(fd)
    fd = os.open(name, os.O_RDWR | os.O_DIRECT)
    try:
        os.unlink(name)
        os.posix_fallocate(fd, 0, nbytes)
        points = []
        latency_s = 0.0
        for depth in depths:
            engine = LibaioEngine(block_size=block_nbytes, queue_depth=depth)
            try:
                write_s = _timed(engine, IORequest(IOOp.WRITE, fd, 0, address, nbytes, name))
                read_s = _timed(engine, IORequest(IOOp.READ, fd, 0, address, nbytes, name))
                if depth == min(depths):
                    latency_s = _timed(engine, IORequest(IOOp.READ, fd, 0, address, block_nbytes, name))
            finally:
                engine.close()
            points.append(DiskPoint(depth, nbytes / read_s, nbytes / write_s))
        return DiskProbe(block_nbytes, tuple(points), latency_s)
    finally:
        os.close(fd)
        buf.close()


def _timed(engine: object, request: IORequest) -> float:
    start = time.perf_counter()
    engine.submit([request])[0].result()  # type: ignore[attr-defined]
    return max(time.perf_counter() - start, 1e-9)

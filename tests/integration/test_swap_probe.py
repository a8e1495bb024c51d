"""The swap device probe and the libaio engine's adjustable queue depth.

Real O_DIRECT I/O on this machine's disk (/var/tmp); no figure is asserted
beyond being measured (timings are for benchmarks, not tests).
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiermem.core.errors import InvalidArgument
from tiermem.core.units import KiB, MiB
from tiermem.engine.swap.engine import IOOp, make_request
from tiermem.engine.swap.engine_libaio import LibaioEngine
from tiermem.engine.swap.probe import probe_disk


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tiermem-probe-", dir="/var/tmp") as d:
        yield Path(d)


def test_the_probe_measures_every_depth_and_leaves_no_file(disk_dir: Path) -> None:
    probe = probe_disk(disk_dir, block_nbytes=256 * KiB, nbytes=2 * MiB, depths=(1, 4))
    assert [p.queue_depth for p in probe.points] == [1, 4]
    assert all(p.read_bps > 0 and p.write_bps > 0 for p in probe.points)
    assert probe.latency_s > 0 and probe.block_nbytes == 256 * KiB
    assert "QD4" in probe.describe()
    assert list(disk_dir.iterdir()) == []


def test_the_probe_names_bad_sizes(disk_dir: Path) -> None:
    with pytest.raises(InvalidArgument, match="multiple of block_nbytes"):
        probe_disk(disk_dir, block_nbytes=MiB, nbytes=MiB + 4096)
    with pytest.raises(InvalidArgument, match="positive"):
        probe_disk(disk_dir, block_nbytes=MiB, nbytes=MiB, depths=(0,))


def test_a_lowered_queue_depth_bounds_the_blocks_in_the_kernel(disk_dir: Path) -> None:
    engine = LibaioEngine(block_size=4096, queue_depth=8, reaper_thread=False)
    fd = os.open(disk_dir / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    src = mmap.mmap(-1, 64 * 4096)
    src.write(os.urandom(len(src)))
    try:
        os.posix_fallocate(fd, 0, len(src))
        engine.set_queue_depth(2)
        assert engine.queue_depth == 2 and engine.capacity == 8
        (future,) = engine.submit([make_request(IOOp.WRITE, fd, 0, memoryview(src))])
        seen = []
        while not future.done():
            seen.append(engine.submitted)
            engine.reap()
        assert max(seen) <= 2
        assert future.result() == len(src)
        with pytest.raises(InvalidArgument, match=r"1\.\.8"):
            engine.set_queue_depth(9)
    finally:
        engine.close()
        os.close(fd)

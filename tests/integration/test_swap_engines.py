"""The I/O engines against real files: libaio with O_DIRECT on this disk, threads on tmpfs."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import mmap
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from faults import mounted

from tiermem.core.config import SwapConfig
from tiermem.core.errors import ConfigError, InvalidArgument, SwapIOError
from tiermem.engine.swap.engine import IOEngine, IOOp, IORequest, make_request
from tiermem.engine.swap.engine_libaio import LibaioEngine
from tiermem.engine.swap.engine_select import open_engine
from tiermem.engine.swap.engine_threads import ThreadEngine

P = 4096
DISK_TMP = "/var/tmp"  # ext4 on this machine's disk: O_DIRECT works there (tmpfs /dev/shm does not)


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tiermem-test-", dir=DISK_TMP) as d:
        yield Path(d)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tiermem-test-", dir="/dev/shm") as d:
        yield Path(d)


def _arena(nbytes: int, seed: int = 0) -> mmap.mmap:
    m = mmap.mmap(-1, nbytes)
    pattern = bytes((i * 7 + seed) % 251 for i in range(P))
    for off in range(0, nbytes, P):
        m[off : off + P] = pattern[off // P % P :] + pattern[: off // P % P]
    return m


def _open(path: Path, engine: IOEngine, nbytes: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if engine.direct else 0), 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    return fd


@contextlib.contextmanager
def engine_and_file(make: Callable[[], IOEngine], where: str, nbytes: int) -> Iterator[tuple[IOEngine, int]]:
    """An engine from ``make`` and a file of ``nbytes`` opened for it under ``where``; both closed at the end."""
    engine = make()
    with tempfile.TemporaryDirectory(dir=where) as d:
        fd = _open(Path(d) / "f", engine, nbytes)
        try:
            yield engine, fd
        finally:
            engine.close()
            os.close(fd)


ENGINES = [
    pytest.param(lambda: LibaioEngine(block_size=64 * 1024, queue_depth=8), DISK_TMP, id="libaio"),
    pytest.param(lambda: ThreadEngine(block_size=64 * 1024, threads=3), "/dev/shm", id="threads"),
]


@pytest.mark.parametrize(("make", "where"), ENGINES)
def test_batch_of_writes_then_reads_round_trips_split_blocks(make, where) -> None:  # type: ignore[no-untyped-def]
    n = 2 * 1024 * 1024 + 3 * P  # not a multiple of the block size: the last block is short
    src = _arena(n, seed=3)
    with engine_and_file(make, where, 2 * n) as (engine, fd):
        halves = [memoryview(src)[: n // 2 // P * P], memoryview(src)[n // 2 // P * P :]]
        writes = [make_request(IOOp.WRITE, fd, n, halves[1], "f"), make_request(IOOp.WRITE, fd, 0, halves[0], "f")]
        assert [f.result(timeout=30) for f in engine.submit(writes)] == [halves[1].nbytes, halves[0].nbytes]
        dst = mmap.mmap(-1, n)
        reads = [
            make_request(IOOp.READ, fd, 0, memoryview(dst)[: halves[0].nbytes], "f"),
            make_request(IOOp.READ, fd, n, memoryview(dst)[halves[0].nbytes :], "f"),
        ]
        for f in engine.submit(reads):
            f.result(timeout=30)
        assert dst[:] == src[:]


def test_libaio_more_blocks_than_queue_depth_all_complete(disk_dir: Path) -> None:
    engine = LibaioEngine(block_size=P, queue_depth=4)
    n = 256 * P
    src = _arena(n, seed=9)
    fd = _open(disk_dir / "f", engine, n)
    try:
        reqs = [
            make_request(IOOp.WRITE, fd, i * 8 * P, memoryview(src)[i * 8 * P : (i + 1) * 8 * P]) for i in range(32)
        ]
        for f in engine.submit(reqs):
            f.result(timeout=30)
        dst = mmap.mmap(-1, n)
        engine.submit([make_request(IOOp.READ, fd, 0, memoryview(dst))])[0].result(timeout=30)
        assert dst[:] == src[:]
        assert engine.in_flight == 0
    finally:
        engine.close()
        os.close(fd)


def test_libaio_completions_reaped_by_an_asyncio_loop_through_the_eventfd(disk_dir: Path) -> None:
    engine = LibaioEngine(block_size=64 * 1024, queue_depth=8, reaper_thread=False)
    n = 1024 * 1024
    src = _arena(n, seed=5)
    dst = mmap.mmap(-1, n)
    fd = _open(disk_dir / "f", engine, n)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(engine.fileno(), engine.reap)
        try:
            (w,) = engine.submit([make_request(IOOp.WRITE, fd, 0, memoryview(src))])
            assert await asyncio.wait_for(asyncio.wrap_future(w), 30) == n
            (r,) = engine.submit([make_request(IOOp.READ, fd, 0, memoryview(dst))])
            assert await asyncio.wait_for(asyncio.wrap_future(r), 30) == n
        finally:
            loop.remove_reader(engine.fileno())

    try:
        asyncio.run(main())
        assert dst[:] == src[:]
    finally:
        engine.close()
        os.close(fd)


@pytest.mark.parametrize(("make", "where"), ENGINES)
def test_read_past_end_of_file_is_a_short_transfer_error(make, where) -> None:  # type: ignore[no-untyped-def]
    with engine_and_file(make, where, 4 * P) as (engine, fd):
        dst = mmap.mmap(-1, 8 * P)
        (f,) = engine.submit([make_request(IOOp.READ, fd, 2 * P, memoryview(dst), "f")])
        with pytest.raises(SwapIOError, match="short transfer") as info:
            f.result(timeout=30)
        assert info.value.errno == 0 and info.value.path == "f"


@pytest.mark.parametrize(("make", "where"), ENGINES)
def test_errno_from_the_kernel_becomes_swap_io_error(make, where) -> None:  # type: ignore[no-untyped-def]
    with engine_and_file(make, where, 4 * P) as (engine, fd):
        closed = os.dup(fd)
        os.close(closed)  # a closed descriptor: the kernel answers EBADF
        buf = mmap.mmap(-1, P)
        (f,) = engine.submit([make_request(IOOp.WRITE, closed, 0, memoryview(buf), "gone")])
        with pytest.raises(SwapIOError) as info:
            f.result(timeout=30)
        assert info.value.errno == errno.EBADF and info.value.offset == 0 and info.value.nbytes == P


def test_libaio_rejects_misaligned_requests_before_submitting(disk_dir: Path) -> None:
    engine = LibaioEngine(block_size=P, queue_depth=2)
    try:
        buf = mmap.mmap(-1, 2 * P)
        with pytest.raises(InvalidArgument, match="aligned"):
            engine.submit([make_request(IOOp.READ, 0, 0, memoryview(buf)[1 : P + 1])])
        with pytest.raises(InvalidArgument, match="aligned"):
            engine.submit([IORequest(IOOp.READ, 0, 100, 0, P)])
    finally:
        engine.close()


def test_read_into_read_only_memory_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="writable"):
        make_request(IOOp.READ, 0, 0, memoryview(bytes(P)))


def test_open_engine_picks_libaio_on_disk_and_threads_where_o_direct_is_refused(disk_dir: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    on_disk = open_engine(SwapConfig(), disk_dir)
    try:
        assert (on_disk.name, on_disk.direct) == ("libaio", True)
    finally:
        on_disk.close()
    forced = open_engine(SwapConfig(engine="threads"), disk_dir)
    assert forced.name == "threads"
    forced.close()
    with mounted("ramfs") as ramfs:  # ramfs refuses O_DIRECT with EINVAL (recent kernels' tmpfs accepts it)
        with caplog.at_level(logging.WARNING, logger="tiermem.engine.swap.engine_select"):
            fallback = open_engine(SwapConfig(), [disk_dir, ramfs])
            again = open_engine(SwapConfig(), [disk_dir, ramfs])
        try:
            assert (fallback.name, fallback.direct) == ("threads", False)
            warnings = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
            assert len(warnings) <= 1  # logged once per reason (once per process: an earlier test may have)
        finally:
            fallback.close()
            again.close()
        with pytest.raises(ConfigError, match="O_DIRECT"):
            open_engine(SwapConfig(engine="libaio"), ramfs)

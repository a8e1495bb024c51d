"""SwapStore on real files: round trips, a dict model, striping, reopening, and injected faults."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from faults import Fault, FaultKind, FaultyEngine, failing_writeback, mounted
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.core import errors
from tiermem.core.errors import (
    CorruptionError,
    DataLostError,
    InvalidArgument,
    InvalidState,
    SwapFullError,
    SwapIOError,
    UnknownKey,
)
from tiermem.core.units import MiB
from tiermem.engine.swap.engine import IOEngine, IOOp
from tiermem.engine.swap.engine_libaio import LibaioEngine
from tiermem.engine.swap.engine_threads import ThreadEngine
from tiermem.engine.swap.store import SwapStore

P = 4096


class Arena:
    """Page-aligned buffers sliced out of one pre-touched mapping."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, nbytes)
        self.view = memoryview(self.map)

    def fill(self, offset: int, nbytes: int, seed: int) -> memoryview:
        block = bytes((seed * 31 + i) % 256 for i in range(256)) * (P // 256)
        for off in range(offset, offset + nbytes, P):
            self.view[off : off + P] = block
        self.view[offset : offset + 8] = seed.to_bytes(8, "little")
        return self.view[offset : offset + nbytes]


def expected(nbytes: int, seed: int) -> bytes:
    a = Arena(nbytes)
    return bytes(a.fill(0, nbytes, seed))


@pytest.fixture(scope="module")
def libaio() -> Iterator[LibaioEngine]:
    engine = LibaioEngine(block_size=256 * 1024, queue_depth=16)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def threads() -> Iterator[ThreadEngine]:
    engine = ThreadEngine(block_size=256 * 1024, threads=3)
    yield engine
    engine.close()


@pytest.fixture(params=["libaio", "threads"])
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[IOEngine, Path]]:
    """(engine, directory): libaio on this disk, the thread engine on /dev/shm."""
    where = "/var/tmp" if request.param == "libaio" else "/dev/shm"
    with tempfile.TemporaryDirectory(prefix="tiermem-test-", dir=where) as d:
        yield request.getfixturevalue(request.param), Path(d)


def test_write_read_overwrite_delete_round_trip(setup: tuple[IOEngine, Path]) -> None:
    engine, d = setup
    store = SwapStore.open([d], "job", engine, 16 * MiB)
    arena = Arena(8 * MiB)
    try:
        assert store.write("a", arena.fill(0, 3 * MiB, 1)).result(timeout=30) == 3 * MiB
        assert store.write("b", arena.fill(3 * MiB, P, 2)).result(timeout=30) == P
        store.write("a", arena.fill(0, 2 * P, 3)).result(timeout=30)
        out = arena.view[4 * MiB : 4 * MiB + 2 * P]
        store.read("a", out).result(timeout=30)
        assert bytes(out) == expected(2 * P, 3)
        store.delete("b")
        assert store.keys() == ["a"] and "b" not in store
        with pytest.raises(UnknownKey):
            store.read("b", arena.view[:P])
        with pytest.raises(InvalidArgument, match="holds 8192 bytes"):
            store.read("a", arena.view[:P])
        s = store.stats()
        assert (s.writes, s.reads, s.keys, s.reserved_nbytes) == (3, 1, 1, 16 * MiB)
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in store.paths)
    finally:
        store.close(remove=True)
    assert not any(d.iterdir())


def test_objects_are_striped_over_every_directory(libaio: LibaioEngine) -> None:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        dirs = [Path(d) / "nvme0", Path(d) / "nvme1", Path(d) / "nvme2"]
        store = SwapStore.open(dirs, "job", libaio, 12 * MiB, stripe_nbytes=64 * 1024)
        arena = Arena(4 * MiB)
        try:
            store.write("x", arena.fill(0, MiB + 5 * P, 7)).result(timeout=30)
            record = store.record("x")
            assert record is not None and record.current is not None
            assert sorted(e.file for e in record.current.extents) == [0, 1, 2]
            out = arena.view[2 * MiB : 3 * MiB + 5 * P]
            store.read("x", out).result(timeout=30)
            assert bytes(out) == expected(MiB + 5 * P, 7)
            store.commit()
            store.close()
            store = SwapStore.open(dirs, "job", libaio, 12 * MiB, stripe_nbytes=64 * 1024)
            out[:] = bytes(len(out))
            store.read("x", out).result(timeout=30)
            assert bytes(out) == expected(MiB + 5 * P, 7)
            with pytest.raises(InvalidArgument, match="same"):
                SwapStore.open(dirs[:2], "job", libaio, 12 * MiB, stripe_nbytes=64 * 1024)
        finally:
            store.close(remove=True)


KEYS = st.sampled_from(["k0", "k1", "k2", "k3"])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("write"), KEYS, st.integers(1, 24), st.integers(0, 10**6)),
        st.tuples(st.just("read"), KEYS),
        st.tuples(st.just("delete"), KEYS),
        st.tuples(st.just("commit")),
        st.tuples(st.just("reopen")),
    ),
    max_size=30,
)


@settings(max_examples=25)
@given(ops=OPS)
def test_operation_sequences_match_a_dict_model(setup: tuple[IOEngine, Path], ops: list[tuple]) -> None:  # type: ignore[type-arg]
    engine, base = setup
    with tempfile.TemporaryDirectory(dir=base) as d:
        store = SwapStore.open([d], "model", engine, 2 * MiB)
        arena = Arena(256 * P)
        model: dict[str, bytes] = {}
        durable: dict[str, bytes] = {}
        try:
            for op in ops:
                if op[0] == "write":
                    _, key, npages, seed = op
                    data = arena.fill(0, npages * P, seed)
                    store.write(key, data).result(timeout=30)
                    model[key] = bytes(data)
                elif op[0] == "read":
                    key = op[1]
                    if key in model:
                        out = arena.view[128 * P : 128 * P + len(model[key])]
                        store.read(key, out).result(timeout=30)
                        assert bytes(out) == model[key]
                    else:
                        with pytest.raises(UnknownKey):
                            store.read(key, arena.view[128 * P : 129 * P])
                elif op[0] == "delete":
                    if op[1] in model:
                        store.delete(op[1])
                        del model[op[1]]
                    else:
                        with pytest.raises(UnknownKey):
                            store.delete(op[1])
                elif op[0] == "commit":
                    store.commit()
                    durable = dict(model)
                else:
                    store.close()
                    store = SwapStore.open([d], "model", engine, 2 * MiB)
                    model = dict(durable)
                assert store.keys() == sorted(model)
        finally:
            store.close(remove=True)


# ---------------------------------------------------------------------- faults


def _store_with(engine: IOEngine, d: Path, quota: int = 8 * MiB) -> SwapStore:
    return SwapStore.open([d], "job", engine, quota)


@contextlib.contextmanager
def opened_store(engine: IOEngine, where: str, quota: int = 8 * MiB) -> Iterator[SwapStore]:
    """A store of ``_store_with`` in a fresh directory under ``where``, closed and removed at the end."""
    with tempfile.TemporaryDirectory(dir=where) as d:
        store = _store_with(engine, Path(d), quota)
        try:
            yield store
        finally:
            store.close(remove=True)


@contextlib.contextmanager
def faulty_store(libaio: LibaioEngine) -> Iterator[tuple[FaultyEngine, SwapStore, Arena]]:
    """A store on this disk over a ``FaultyEngine`` around ``libaio`` (to inject faults into), and a 1 MiB arena."""
    engine = FaultyEngine(libaio)
    with opened_store(engine, "/var/tmp") as store:
        yield engine, store, Arena(MiB)


def test_flipped_byte_in_a_swap_file_is_reported_and_the_next_good_version_reads(libaio: LibaioEngine) -> None:
    with opened_store(libaio, "/var/tmp") as store:
        arena = Arena(MiB)
        store.write("w", arena.fill(0, 4 * P, 1)).result(timeout=30)
        record = store.record("w")
        assert record is not None and record.current is not None
        extent = record.current.extents[0]
        with open(store.paths[0], "r+b") as f:
            f.seek(extent.offset + 3 * P + 17)
            byte = f.read(1)
            f.seek(extent.offset + 3 * P + 17)
            f.write(bytes([byte[0] ^ 0x40]))
        out = arena.view[8 * P : 12 * P]
        with pytest.raises(CorruptionError) as info:
            store.read("w", out).result(timeout=30)
        assert (info.value.key, info.value.path, info.value.offset) == ("w", str(store.paths[0]), extent.offset)
        assert store.stats().corruptions == 1
        store.write("w", arena.fill(0, 4 * P, 2)).result(timeout=30)  # a fresh extent: reads fine again
        store.read("w", out).result(timeout=30)
        assert bytes(out) == expected(4 * P, 2)


def test_truncated_swap_file_is_reported_on_read_and_after_reopen(libaio: LibaioEngine) -> None:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        store = _store_with(libaio, Path(d))
        arena = Arena(MiB)
        try:
            store.write("a", arena.fill(0, 2 * P, 1)).result(timeout=30)
            store.write("b", arena.fill(0, 2 * P, 2)).result(timeout=30)
            store.commit()
            record = store.record("b")
            assert record is not None and record.current is not None
            os.truncate(store.paths[0], record.current.extents[0].offset + P)
            with pytest.raises(SwapIOError, match="short transfer"):
                store.read("b", arena.view[: 2 * P]).result(timeout=30)
            store.close()
            store = _store_with(libaio, Path(d))  # preallocation refills the hole with zeros: checksums catch it
            with pytest.raises(CorruptionError):
                store.read("b", arena.view[: 2 * P]).result(timeout=30)
            store.read("a", arena.view[: 2 * P]).result(timeout=30)
            assert bytes(arena.view[: 2 * P]) == expected(2 * P, 1)
        finally:
            store.close(remove=True)


@pytest.mark.parametrize("kind", [FaultKind.ERRNO, FaultKind.SHORT])
def test_failed_write_keeps_the_previous_version_readable(libaio: LibaioEngine, kind: FaultKind) -> None:
    with faulty_store(libaio) as (engine, store, arena):
        store.write("k", arena.fill(0, 8 * P, 1)).result(timeout=30)
        used = store.stats().used_nbytes
        engine.inject(Fault(IOOp.WRITE, kind))
        with pytest.raises(SwapIOError) as info:
            store.write("k", arena.fill(0, 8 * P, 2)).result(timeout=30)
        assert info.value.errno == (errno.EIO if kind is FaultKind.ERRNO else 0)
        assert store.stats().used_nbytes == used  # the new extent was given back
        out = arena.view[64 * P : 72 * P]
        store.read("k", out).result(timeout=30)
        assert bytes(out) == expected(8 * P, 1)
        store.write("k", arena.fill(0, 8 * P, 3)).result(timeout=30)  # the key is writable again


@pytest.mark.parametrize("kind", [FaultKind.ERRNO, FaultKind.SHORT])
def test_failed_read_raises_and_the_data_stays_readable(libaio: LibaioEngine, kind: FaultKind) -> None:
    with faulty_store(libaio) as (engine, store, arena):
        store.write("k", arena.fill(0, 8 * P, 4)).result(timeout=30)
        engine.inject(Fault(IOOp.READ, kind))
        out = arena.view[64 * P : 72 * P]
        with pytest.raises(SwapIOError) as info:
            store.read("k", out).result(timeout=30)
        assert info.value.path == str(store.paths[0])
        store.read("k", out).result(timeout=30)
        assert bytes(out) == expected(8 * P, 4)


def test_write_while_a_write_of_the_same_key_is_in_flight_is_refused(threads: ThreadEngine) -> None:
    with opened_store(threads, "/dev/shm") as store:
        arena = Arena(4 * MiB)
        first = store.write("k", arena.fill(0, 2 * MiB, 1))
        if not first.done():
            with pytest.raises(InvalidState, match="in flight"):
                store.write("k", arena.view[2 * MiB : 3 * MiB])
        first.result(timeout=30)


def test_a_manifest_that_cannot_be_written_defers_the_commit_and_keeps_every_key(threads: ThreadEngine) -> None:
    with opened_store(threads, "/dev/shm") as store:
        arena = Arena(MiB)
        store.write("old", arena.fill(0, P, 1)).result(timeout=30)
        store.commit()
        store.write("old", arena.fill(0, P, 2)).result(timeout=30)
        store.write("new", arena.fill(0, P, 3)).result(timeout=30)
        blocker = store.manifest_path.with_name(store.manifest_path.name + ".tmp")
        blocker.mkdir()  # the manifest's temp name is taken by a directory: writing it fails with EISDIR
        with pytest.raises(errors.CommitDeferred, match="EISDIR") as info:
            store.commit()
        assert sorted(info.value.keys) == ["new", "old"]
        assert store.keys() == ["new", "old"] and store.generation == 1
        assert store.stats().commit_errors == 1
        store.read("old", arena.view[:P]).result(timeout=30)
        assert bytes(arena.view[:P]) == expected(P, 2)
        blocker.rmdir()
        store.commit()  # the deferred keys commit with it
        assert store.generation == 2
        path = store.manifest_path.parent
        store.close()
        reopened = _store_with(threads, path)
        assert reopened.keys() == ["new", "old"]
        reopened.read("new", arena.view[:P]).result(timeout=30)
        assert bytes(arena.view[:P]) == expected(P, 3)
        reopened.close()


def test_a_full_file_system_defers_the_commit_and_a_crash_comes_back_at_the_last_one(threads: ThreadEngine) -> None:
    with mounted("tmpfs", "size=4m") as small:
        store = SwapStore.open([small], "job", threads, 2 * MiB)
        arena = Arena(MiB)
        store.write("a", arena.fill(0, P, 1)).result(timeout=30)
        store.commit()
        filler = small / "filler"
        with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(bytes(65536))
        store.write("a", arena.fill(0, P, 2)).result(timeout=30)  # into the preallocated file: no room needed
        with pytest.raises(errors.CommitDeferred, match="ENOSPC") as info:
            store.commit()
        assert info.value.keys == ["a"]
        assert not store.manifest_path.with_name(store.manifest_path.name + ".tmp").exists()
        crashed = SwapStore.open([small], "job", threads, 2 * MiB)  # what a restart now would see
        crashed.read("a", arena.view[:P]).result(timeout=30)
        assert bytes(arena.view[:P]) == expected(P, 1) and crashed.generation == 1
        crashed.close()
        filler.unlink()
        store.commit()
        store.close()
        reopened = SwapStore.open([small], "job", threads, 2 * MiB)
        reopened.read("a", arena.view[:P]).result(timeout=30)
        assert bytes(arena.view[:P]) == expected(P, 2) and reopened.generation == 2
        reopened.close(remove=True)


def test_a_failed_fdatasync_at_commit_reports_lost_keys_and_rolls_them_back(threads: ThreadEngine) -> None:
    with failing_writeback() as broken:
        store = SwapStore.open([broken], "job", threads, 32 * MiB)
        arena = Arena(MiB)
        store.write("old", arena.fill(0, P, 1)).result(timeout=30)
        store.commit()
        for i in range(16):  # 16 MiB of dirty pages: more than the image's backing can take
            store.write(f"k{i:02d}", arena.view[:MiB]).result(timeout=30)
        with pytest.raises(DataLostError) as info:
            store.commit()
        assert sorted(info.value.keys) == [f"k{i:02d}" for i in range(16)]
        assert store.keys() == ["old"] and store.generation == 1
        assert store.stats().commit_errors == 1
        store.close()


def test_quota_exhaustion_is_a_swap_full_error_before_any_io(threads: ThreadEngine) -> None:
    with opened_store(threads, "/dev/shm", quota=MiB) as store:
        arena = Arena(2 * MiB)
        store.write("a", arena.fill(0, MiB // 2, 1)).result(timeout=30)
        with pytest.raises(SwapFullError, match="is full") as info:
            store.write("b", arena.fill(0, MiB, 2))
        assert info.value.requested == MiB
        assert "b" not in store
        store.reserve(MiB)
        store.write("b", arena.fill(0, MiB, 2)).result(timeout=30)


def test_rewriting_a_full_store_commits_to_reclaim_the_old_copies(threads: ThreadEngine) -> None:
    with opened_store(threads, "/dev/shm", quota=MiB) as store:
        arena = Arena(MiB)
        store.write("a", arena.fill(0, MiB // 2, 0)).result(timeout=30)
        store.commit()
        for i in range(1, 5):  # the committed copy stays until a commit: the second rewrite finds no room
            store.write("a", arena.fill(0, MiB // 2, i)).result(timeout=30)
        store.read("a", arena.view[: MiB // 2]).result(timeout=30)
        assert bytes(arena.view[: MiB // 2]) == expected(MiB // 2, 4)
        assert store.stats().commits >= 2


def test_full_filesystem_is_an_admission_error_naming_the_directory(threads: ThreadEngine) -> None:
    with mounted("tmpfs", "size=4m") as small:
        with pytest.raises(SwapFullError) as info:
            SwapStore.open([small], "big", threads, 8 * MiB)
        err = info.value
        assert err.path == str(small) and err.requested == 8 * MiB and err.available <= 4 * MiB
        assert str(small) in str(err) and "8MiB" in str(err)
        assert os.path.getsize(small / "big.swap") == 0  # nothing half-reserved stays behind
        store = SwapStore.open([small], "fits", threads, 2 * MiB)
        try:
            with pytest.raises(SwapFullError):
                store.reserve(4 * MiB)
            assert store.stats().reserved_nbytes == 2 * MiB
        finally:
            store.close(remove=True)

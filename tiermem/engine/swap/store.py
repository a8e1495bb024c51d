"""``SwapStore``: one job's keyed, checksummed, crash-consistent objects in swap files.

Owns the job's swap files (one per swap directory, see ``files``), one
``SwapRecord`` per key (``records``) and the manifest (``manifest``).  The I/O
engine is shared and owned by the caller.

Layout: an object's bytes are dealt in ``stripe_nbytes`` stripes round-robin
over extents in up to one file per directory (``extents``); each extent has a
CRC32C over its bytes, then the key and the version number, so bytes of another
key or of a stale version never verify.

Contract:
- ``write(key, memory)`` is out of place: the new version goes to fresh extents
  and the key points to it only after every block of it is written.  Until
  then, and whenever the write fails (``SwapIOError``), reads return the
  previous version.  The memory must stay unchanged until the future is done.
- ``read(key, memory)`` fills ``memory`` with the current version and verifies
  every extent's checksum.  On any error (``SwapIOError``, ``CorruptionError``)
  the future raises and the *contents of memory are unspecified* (they may hold
  the bad bytes): the caller must not use them.  The store's data is untouched.
- Durability: a write is durable once a later ``commit()`` returns.  ``commit``
  fdatasyncs the swap files, then replaces the manifest atomically (temp file,
  fsync, rename, fsync of the directory).  After a crash, ``open`` returns every
  key as of the last completed commit, bytes intact.  If the fdatasync fails,
  or the manifest's rename or the directory's fsync does, nothing is retried
  or trusted: keys written since the last commit go back to their last
  committed version (or disappear) and ``commit`` raises ``DataLostError``
  naming them.  If the new manifest cannot be written before its rename (a
  full file system: the swap files are preallocated, the manifest is not),
  the synced data is in no doubt and the old manifest still stands:
  ``commit`` raises ``CommitDeferred``, every key keeps its current version,
  and the keys stay uncommitted for the next ``commit`` to retry.
- Space: the swap files are preallocated to the quota at ``open`` (and by
  ``reserve``); a write that finds no room raises ``SwapFullError`` before any
  I/O.  Old versions stay allocated until no manifest names them, so a key
  rewritten between commits needs room for two copies; when space runs out and
  something was written since the last commit, the store commits once and
  retries (unless opened with ``auto_commit=False``: then only ``commit()``
  commits, so that every manifest is one the owner chose, e.g. at a step
  boundary, and a full store raises ``SwapFullError``).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import crc32c

from tiermem.core.errors import (
    CommitDeferred,
    CorruptionError,
    DataLostError,
    InvalidArgument,
    InvalidState,
    SwapFullError,
    UnknownKey,
)
from tiermem.core.histogram import IO_SECONDS, Histogram
from tiermem.core.units import PAGE_SIZE, MiB, align_up, format_size
from tiermem.engine.swap.engine import IOEngine, IOOp, IORequest, Memory, buffer_address, gather
from tiermem.engine.swap.extents import Extent, segments, stripe_shares
from tiermem.engine.swap.files import SwapFile, check_job_id
from tiermem.engine.swap.manifest import (
    Manifest,
    ManifestNotReplaced,
    ManifestRecord,
    read_manifest,
    write_manifest,
)
from tiermem.engine.swap.records import RecordState, SwapRecord, SwapStats, Version

__all__ = ["SwapStore"]

S = RecordState


class SwapStore:
    """One job's objects on the NVMe tier; see the module docstring."""

    def __init__(
        self,
        job_id: str,
        files: list[SwapFile],
        engine: IOEngine,
        *,
        stripe_nbytes: int,
        fsync: bool,
        manifest: Path,
        auto_commit: bool = True,
    ) -> None:
        self._job = job_id
        self._files = files
        self._engine = engine
        self._stripe = stripe_nbytes
        self._fsync = fsync
        self._auto_commit = auto_commit
        self._manifest_path = manifest
        self._generation = 0
        self._records: dict[str, SwapRecord] = {}
        self._dirty: set[str] = set()
        self._next_file = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._commit_lock = threading.Lock()
        self._inflight = 0
        self._closed = False
        self._verifier = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tiermem-verify")
        self._counts = dict.fromkeys(
            (
                "bytes_written",
                "bytes_read",
                "writes",
                "reads",
                "write_errors",
                "read_errors",
                "corruptions",
                "commits",
                "commit_errors",
            ),
            0,
        )
        self._read_seconds = Histogram(IO_SECONDS)
        self._write_seconds = Histogram(IO_SECONDS)  # both observed under self._lock, where the counts are

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        dirs: Sequence[str | os.PathLike[str]],
        job_id: str,
        engine: IOEngine,
        quota_nbytes: int,
        *,
        stripe_nbytes: int = MiB,
        fsync: bool = True,
        auto_commit: bool = True,
    ) -> SwapStore:
        """Open (creating or reopening from its manifest) job ``job_id``'s store, preallocating ``quota_nbytes``.

        ``auto_commit``: whether a write that finds no room may commit to free old versions (see the module
        docstring)."""
        check_job_id(job_id)
        paths = [Path(d) for d in dirs]
        if not paths:
            raise InvalidArgument("a swap store needs at least one directory")
        if stripe_nbytes <= 0 or stripe_nbytes % PAGE_SIZE:
            raise InvalidArgument(f"stripe_nbytes must be a positive multiple of 4KiB, got {stripe_nbytes}")
        files: list[SwapFile] = []
        try:
            for d in paths:
                files.append(SwapFile.open(d, job_id, direct=engine.direct))
            store = cls(
                job_id,
                files,
                engine,
                stripe_nbytes=stripe_nbytes,
                fsync=fsync,
                manifest=paths[0] / f"{job_id}.manifest",
                auto_commit=auto_commit,
            )
            store._load()
            share = align_up(-(-quota_nbytes // len(files)))
            for f in files:
                f.grow(max(share, f.capacity), job_id)
        except BaseException:
            for f in files:
                f.close()
            raise
        return store

    def _load(self) -> None:
        manifest = read_manifest(self._manifest_path)
        if manifest is None:
            return
        names = tuple(f.path.name for f in self._files)
        if manifest.files != names or manifest.stripe_nbytes != self._stripe:
            raise InvalidArgument(
                f"{self._manifest_path} was written for files {list(manifest.files)} with stripe "
                f"{manifest.stripe_nbytes}; opened with {list(names)} and stripe {self._stripe}: use the same "
                "swap directories, in the same order, and stripe size"
            )
        for index, f in enumerate(self._files):
            # a file truncated behind our back still gets its extents claimed; reading them fails and says so
            ends = [e.offset + e.nbytes for r in manifest.records.values() for e in r.extents if e.file == index]
            f.allocator.grow(max([f.capacity, *ends]))
        for key, r in manifest.records.items():
            version = Version(r.version, r.nbytes, r.extents, r.crcs)
            for e in r.extents:
                self._files[e.file].allocator.claim(e.offset, e.nbytes)
            self._records[key] = SwapRecord(key, S.STORED, version, version, r.version + 1)
        self._generation = manifest.generation

    def reserve(self, nbytes: int) -> None:
        """Grow the store's space by ``nbytes`` (preallocated now); ``SwapFullError`` when a disk cannot hold it."""
        share = align_up(-(-nbytes // len(self._files)))
        for f in self._files:
            f.grow(f.capacity + share, self._job)

    # ------------------------------------------------------------------ reads and writes

    def write(self, key: str, memory: Memory) -> Future[int]:
        """Write ``memory`` as the next version of ``key``; resolves with the byte count once written."""
        address, nbytes, keepalive = self._memory(memory, IOOp.WRITE)
        t0 = time.perf_counter()
        started = self._begin_write(key, nbytes)
        if started is None and self._auto_commit:
            self.commit()  # frees versions only the last manifest still named
            started = self._begin_write(key, nbytes)
        if started is None:
            raise self._full_error(nbytes)
        record, number, extents = started
        version = Version(number, nbytes, extents, ())
        outer: Future[int] = Future()
        futures = self._submit(
            IOOp.WRITE, version, address, keepalive, lambda exc: self._write_done(record, version, exc, outer, t0)
        )
        # checksum while the disk writes the same (unchanging) memory; the version becomes readable only in
        # gather's callback, attached once the checksums are set
        try:
            view = _view(address, nbytes)
            version.crcs = tuple(self._checksum(view, key, number, extents, i) for i in range(len(extents)))
        except BaseException as exc:
            failed = exc  # the name ``exc`` is gone once this block ends; the callback runs later
            gather(futures, lambda _err: self._write_done(record, version, failed, outer, t0))
            raise
        gather(futures, lambda err: self._write_done(record, version, err, outer, t0))
        return outer

    def _begin_write(self, key: str, nbytes: int) -> tuple[SwapRecord, int, tuple[Extent, ...]] | None:
        """Allocate extents and move the record to NEW/WRITING; None when there is no room."""
        with self._lock:
            self._check_open()
            record = self._records.get(key)
            if record is not None and record.state in (S.NEW, S.WRITING):
                raise InvalidState(f"swap key {key!r}: a write is already in flight")
            extents = self._allocate(nbytes)
            if extents is None:
                return None
            if record is None:
                record = self._records[key] = SwapRecord(key, S.NEW)
            else:
                record.move(S.WRITING if record.state is S.STORED else S.NEW)
            number = record.next_number
            record.next_number += 1
            self._inflight += 1
            return record, number, extents

    def read(self, key: str, memory: Memory) -> Future[int]:
        """Read ``key``'s current version into ``memory`` (exactly its size) and verify it; see the module docstring."""
        address, nbytes, keepalive = self._memory(memory, IOOp.READ)
        t0 = time.perf_counter()
        with self._lock:
            self._check_open()
            record, version = self._stored(key)
            if nbytes != version.nbytes:
                raise InvalidArgument(f"swap key {key!r} holds {version.nbytes} bytes; read into {nbytes} bytes")
            version.holds += 1
            self._inflight += 1
        outer: Future[int] = Future()
        futures = self._submit(
            IOOp.READ, version, address, keepalive, lambda exc: self._finish_read(record, version, exc, outer, t0)
        )
        gather(futures, lambda err: self._read_done(record, version, address, err, outer, t0))
        return outer

    def delete(self, key: str) -> None:
        """Forget ``key``; its space is reused once a commit no longer names it."""
        with self._lock:
            self._check_open()
            record = self._records.get(key)
            if record is None or record.state is S.DELETED:
                raise UnknownKey(key, f"swap store of job {self._job!r}")
            if record.state is not S.STORED:
                raise InvalidState(f"swap key {key!r}: cannot delete while a write is in flight")
            old, record.current = record.current, None
            record.move(S.DELETED)
            self._dirty.add(key)
            self._release(record, old)
            self._drop_if_gone(record)

    def keys(self) -> list[str]:
        """Keys with a readable version, sorted."""
        with self._lock:
            return sorted(k for k, r in self._records.items() if r.current is not None)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            record = self._records.get(key)
            return record is not None and record.current is not None

    def nbytes(self, key: str) -> int:
        with self._lock:
            return self._stored(key)[1].nbytes

    # ------------------------------------------------------------------ durability

    def commit(self) -> None:
        """Make every write completed so far durable (see the module docstring); ``DataLostError`` on failure."""
        with self._commit_lock:
            with self._lock:
                self._check_open()
                snapshot = {k: r.current for k, r in self._records.items() if r.current is not None}
                deleted = [r for r in self._records.values() if r.state is S.DELETED]
                dirty = set(self._dirty)
                self._dirty.clear()
                for v in snapshot.values():
                    v.holds += 1
                generation = self._generation + 1
            manifest = Manifest(
                job=self._job,
                generation=generation,
                stripe_nbytes=self._stripe,
                files=tuple(f.path.name for f in self._files),
                records={k: ManifestRecord(v.number, v.nbytes, v.extents, v.crcs) for k, v in snapshot.items()},
            )
            try:
                if self._fsync:
                    for f in self._files:
                        os.fdatasync(f.fd)
                write_manifest(self._manifest_path, manifest, fsync=self._fsync)
            except ManifestNotReplaced as exc:
                self._defer(snapshot, dirty)
                raise CommitDeferred(str(self._manifest_path), exc.errno or 0, sorted(dirty), self._generation) from exc
            except OSError as exc:
                lost = self._roll_back(snapshot, dirty)
                raise DataLostError(lost, f"committing swap store of job {self._job!r} failed: {exc}") from exc
            with self._lock:
                self._generation = generation
                self._counts["commits"] += 1
                for key, v in snapshot.items():
                    record = self._records[key]
                    old, record.committed = record.committed, v
                    v.holds -= 1
                    self._release(record, old)
                    self._release(record, v)
                for record in deleted:
                    if record.state is S.DELETED:
                        old, record.committed = record.committed, None
                        self._release(record, old)
                        self._drop_if_gone(record)

    def _defer(self, snapshot: dict[str, Version], dirty: set[str]) -> None:
        """The data is synced and the old manifest stands: every key keeps its current version, uncommitted."""
        with self._lock:
            self._counts["commit_errors"] += 1
            for v in snapshot.values():
                v.holds -= 1
            self._dirty |= dirty

    def _roll_back(self, snapshot: dict[str, Version], dirty: set[str]) -> list[str]:
        with self._lock:
            self._counts["commit_errors"] += 1
            lost = []
            for key, v in snapshot.items():
                record = self._records[key]
                v.holds -= 1
                if key in dirty and v is not record.committed:
                    lost.append(key)
                    if record.current is v:
                        record.current = record.committed
                        if record.current is None and record.state is S.STORED:
                            record.move(S.DELETED)
                    self._release(record, v)
                    self._drop_if_gone(record)
            self._dirty |= {k for k in dirty if k not in lost}
            return sorted(lost)

    def close(self, *, remove: bool = False) -> None:
        """Wait for in-flight reads and writes, close the files; ``remove`` also deletes them and the manifest.

        Close does not commit: call ``commit()`` first to keep what was written since the last one.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._inflight:
                self._idle.wait()
        self._verifier.shutdown(wait=True)
        for f in self._files:
            f.close()
            if remove:
                f.path.unlink(missing_ok=True)
        if remove:
            self._manifest_path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ facts

    @property
    def job_id(self) -> str:
        return self._job

    @property
    def paths(self) -> list[Path]:
        return [f.path for f in self._files]

    @property
    def manifest_path(self) -> Path:
        return self._manifest_path

    @property
    def generation(self) -> int:
        """The generation of the last committed manifest (0: none yet); ``commit()`` writes the next one."""
        with self._lock:
            return self._generation

    @property
    def engine(self) -> IOEngine:
        return self._engine

    def record(self, key: str) -> SwapRecord | None:
        """The record of ``key`` (for inspection; do not modify)."""
        with self._lock:
            return self._records.get(key)

    def stats(self) -> SwapStats:
        with self._lock:
            return SwapStats(
                **self._counts,
                keys=sum(1 for r in self._records.values() if r.current is not None),
                used_nbytes=sum(f.allocator.used_nbytes for f in self._files),
                reserved_nbytes=sum(f.capacity for f in self._files),
                read_seconds=self._read_seconds.snapshot(),
                write_seconds=self._write_seconds.snapshot(),
            )

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidState(f"swap store of job {self._job!r} is closed")

    def _memory(self, memory: Memory, op: IOOp) -> tuple[int, int, Any]:
        if isinstance(memory, tuple):
            address, nbytes = memory
            keepalive = None
        else:
            view = memory if isinstance(memory, memoryview) else memoryview(memory)
            if op is IOOp.READ and view.readonly:
                raise InvalidArgument("a read needs writable memory, got a read-only buffer")
            address, nbytes, keepalive = buffer_address(view), view.nbytes, view
        if nbytes <= 0 or nbytes % PAGE_SIZE:
            raise InvalidArgument(f"swap objects are whole 4KiB pages; got {nbytes} bytes")
        if self._engine.direct and address % PAGE_SIZE:
            raise InvalidArgument(f"O_DIRECT needs 4KiB-aligned memory; got address {address:#x}")
        return address, nbytes, keepalive

    def _allocate(self, nbytes: int) -> tuple[Extent, ...] | None:
        """Extents for a new object (lock held), or None when no rotation of the files has room."""
        shares = stripe_shares(nbytes, len(self._files), self._stripe)
        nfiles = len(self._files)
        for shift in range(nfiles):
            start = (self._next_file + shift) % nfiles
            got: list[Extent] = []
            for i, share in enumerate(shares):
                index = (start + i) % nfiles
                offset = self._files[index].allocator.alloc(share)
                if offset is None:
                    break
                got.append(Extent(index, offset, share))
            if len(got) == len(shares):
                self._next_file = (start + 1) % nfiles
                return tuple(got)
            for e in got:
                self._files[e.file].allocator.free(e.offset, e.nbytes)
        return None

    def _full_error(self, nbytes: int) -> SwapFullError:
        free = sum(f.allocator.free_nbytes for f in self._files)
        largest = max(f.allocator.largest_free for f in self._files)
        return SwapFullError(
            f"swap store of job {self._job!r} is full: a write of {format_size(nbytes)} found "
            f"{format_size(free)} free (largest free extent {format_size(largest)}) of "
            f"{format_size(sum(f.capacity for f in self._files))} reserved; reserve more or commit more often",
            requested=nbytes,
            available=free,
            path=str(self._files[0].path.parent),
        )

    def _stored(self, key: str) -> tuple[SwapRecord, Version]:
        """``key``'s record and readable version (the caller holds the lock); ``UnknownKey`` when it has none."""
        record = self._records.get(key)
        if record is None or record.current is None:
            raise UnknownKey(key, f"swap store of job {self._job!r}")
        return record, record.current

    def _submit(
        self, op: IOOp, version: Version, address: int, keepalive: Any, finish: Callable[[BaseException], None]
    ) -> list[Future[int]]:
        """Start ``version``'s transfers on the engine; one that cannot start is finished (``finish``) and re-raised."""
        try:
            return self._engine.submit(self._requests(op, version, address, keepalive))
        except BaseException as exc:
            finish(exc)
            raise

    def _requests(self, op: IOOp, version: Version, address: int, keepalive: Any) -> list[IORequest]:
        out = []
        for seg in segments(version.nbytes, list(version.extents), self._stripe):
            f = self._files[version.extents[seg.extent].file]
            out.append(
                IORequest(op, f.fd, seg.file_offset, address + seg.memory_offset, seg.nbytes, str(f.path), keepalive)
            )
        return out

    def _checksum(self, view: memoryview, key: str, number: int, extents: tuple[Extent, ...], index: int) -> int:
        crc = 0
        for seg in segments(sum(e.nbytes for e in extents), list(extents), self._stripe):
            if seg.extent == index:
                crc = crc32c.crc32c(view[seg.memory_offset : seg.memory_offset + seg.nbytes], crc)
        return int(crc32c.crc32c(f"\0{key}\0{number}".encode(), crc))

    def _write_done(
        self, record: SwapRecord, version: Version, err: BaseException | None, outer: Future[int], t0: float
    ) -> None:
        with self._transfer_done(self._write_seconds, t0):
            if err is None:
                old, record.current = record.current, version
                record.move(S.STORED)
                self._dirty.add(record.key)
                self._release(record, old)
                self._counts["writes"] += 1
                self._counts["bytes_written"] += version.nbytes
            else:
                self._release(record, version)
                record.move(S.STORED if record.current is not None else S.DELETED)
                self._drop_if_gone(record)
                self._counts["write_errors"] += 1
        _settle(outer, err, version.nbytes)

    def _read_done(
        self,
        record: SwapRecord,
        version: Version,
        address: int,
        err: BaseException | None,
        outer: Future[int],
        t0: float,
    ) -> None:
        if err is not None:
            self._finish_read(record, version, err, outer, t0)
            return
        try:
            self._verifier.submit(self._verify, record, version, address, outer, t0)
        except RuntimeError as exc:  # verifier shut down: cannot happen while a read is in flight
            self._finish_read(record, version, exc, outer, t0)

    def _verify(self, record: SwapRecord, version: Version, address: int, outer: Future[int], t0: float) -> None:
        view = _view(address, version.nbytes)
        error: BaseException | None = None
        for i, e in enumerate(version.extents):
            if self._checksum(view, record.key, version.number, version.extents, i) != version.crcs[i]:
                error = CorruptionError(
                    record.key,
                    str(self._files[e.file].path),
                    e.offset,
                    f"checksum mismatch in version {version.number} ({e.nbytes} bytes)",
                )
                break
        self._finish_read(record, version, error, outer, t0)

    def _finish_read(
        self, record: SwapRecord, version: Version, err: BaseException | None, outer: Future[int], t0: float
    ) -> None:
        with self._transfer_done(self._read_seconds, t0):
            version.holds -= 1
            self._release(record, version)
            if err is None:
                self._counts["reads"] += 1
                self._counts["bytes_read"] += version.nbytes
            else:
                self._counts["corruptions" if isinstance(err, CorruptionError) else "read_errors"] += 1
        _settle(outer, err, version.nbytes)

    @contextmanager
    def _transfer_done(self, seconds: Histogram, t0: float) -> Iterator[None]:
        """Under the lock: one transfer less in flight and its duration observed, then the body's bookkeeping,
        then whoever waits for the store to go idle woken."""
        with self._lock:
            self._inflight -= 1
            seconds.observe(time.perf_counter() - t0)
            yield
            self._idle.notify_all()

    def _release(self, record: SwapRecord, version: Version | None) -> None:
        """Free ``version``'s extents if nothing needs them any more (lock held)."""
        if version is None or version.freed or version.holds > 0:
            return
        if version is record.current or version is record.committed:
            return
        version.freed = True
        for e in version.extents:
            self._files[e.file].allocator.free(e.offset, e.nbytes)

    def _drop_if_gone(self, record: SwapRecord) -> None:
        if record.state is S.DELETED and record.committed is None and self._records.get(record.key) is record:
            del self._records[record.key]
            self._dirty.discard(record.key)


def _settle(outer: Future[int], err: BaseException | None, nbytes: int) -> None:
    """Hand a finished transfer to its caller: ``nbytes`` moved, or the error."""
    if err is None:
        outer.set_result(nbytes)
    else:
        outer.set_exception(err)


def _view(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")

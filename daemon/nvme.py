"""The NVMe placement of a rank's state: chunks paged through a ``TierManager``.

Each state chunk (master | exp_avg | exp_avg_sq of ``chunk_numel`` elements,
see ``state``) is one key of the rank's ``SwapStore`` and one tensor of its
``TierManager``.  The step pipeline acquires chunks in ascending order, so the
manager is given that order once and keeps the next ``PREFETCH_DEPTH`` chunks
in flight: while chunk i is updated, chunk i+1 is read and chunk i-1 written
back as its slot is needed.

The chunk cache (the manager's CPU budget) is ``CACHE_CHUNKS`` chunks, bounded
by the state itself, and is reserved in the node's pool budget at admission;
the swap space is reserved (preallocated by the store) in the swap budget.  A
full disk is therefore an admission error, never a failure mid-training.

``persist()`` (SIGTERM, and every ``jobs.commit_every`` steps) writes every
dirty chunk and commits the manifest, so a restarted daemon reopens the chunks
from the store.  Only ``persist()`` commits (the store is opened with
``auto_commit=False``): a manifest committed in the middle of a step would
name chunks of two different steps.  The swap reserved is therefore two
copies of the state (the committed one and the one being written) plus the
cache.  A rank reopened from a job file (``require_stored``) must find every
chunk in the store; a chunk the manifest does not name is ``DataLostError``,
never zeros.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tiermem.errors import DataLostError, TiermemError
from tiermem.swap.store import SwapStore
from tiermem.tiers import TierManager
from tiermemd.ledger import Resource
from tiermemd.state import ALL_KEYS, ChunkTensors, StateStats, split_chunk

if TYPE_CHECKING:
    from tiermemd.jobs import Job
    from tiermemd.service import Service

__all__ = ["CACHE_CHUNKS", "PREFETCH_DEPTH", "NvmeStateChunks", "make_nvme_state", "remove_store", "store_name"]

log = logging.getLogger(__name__)

CACHE_CHUNKS = 6
"""Chunks resident at once: one being updated, prefetched ones, and ones being written back."""
PREFETCH_DEPTH = 2


def store_name(job_id: str, rank: int, uid: int) -> str:
    """A file-system-safe, collision-free name for the swap files of one rank of uid ``uid``'s job."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job_id).lstrip(".")[:80] or "job"
    digest = hashlib.sha256(f"{uid}/{job_id}".encode()).hexdigest()[:10]
    return f"u{uid}-{safe}-{digest}.r{rank}"


def _key(chunk: int) -> str:
    return f"chunk{chunk}"


class NvmeStateChunks:
    def __init__(
        self,
        pool: object,
        store: SwapStore,
        numel: int,
        chunk_numel: int,
        cache_nbytes: int,
        keys: tuple[str, ...] = ALL_KEYS,
        *,
        require_stored: bool = False,
    ) -> None:
        """``keys`` always include the fp32 master on this placement: it is what a restarted daemon reopens.
        ``require_stored``: the state is reopened, so every chunk must be in the store."""
        self.keys = keys
        self.numel = numel
        self.chunk_numel = chunk_numel
        self.store = store
        if require_stored:
            missing = [_key(c) for c in range(self.nchunks) if _key(c) not in store]
            if missing:
                raise DataLostError(
                    missing,
                    f"the state is reopened from a job file, but the swap manifest {store.manifest_path} "
                    f"(generation {store.generation}) holds no committed copy of {len(missing)} of its "
                    f"{self.nchunks} chunks",
                )
        self.tiers = TierManager(pool, store, cache_nbytes)
        try:
            for c in range(self.nchunks):
                self.tiers.register(_key(c), torch.float32, (len(keys) * self._chunk_len(c),))
            self.tiers.prefetch([_key(c) for c in range(self.nchunks)], PREFETCH_DEPTH)
        except BaseException:
            self.tiers.close()
            raise

    @property
    def max_acquired(self) -> int:
        """Pieces the step pipeline may hold at once (the rest of the cache is for prefetch)."""
        return CACHE_CHUNKS - PREFETCH_DEPTH - 1

    @property
    def nchunks(self) -> int:
        return (self.numel + self.chunk_numel - 1) // self.chunk_numel

    def _chunk_len(self, chunk: int) -> int:
        return min(self.chunk_numel, self.numel - chunk * self.chunk_numel)

    def acquire(self, chunk: int) -> ChunkTensors:
        flat = self.tiers.acquire(_key(chunk))
        return split_chunk(flat, self._chunk_len(chunk), self.keys)

    def release(self, chunk: int, *, dirty: bool) -> None:
        self.tiers.release(_key(chunk), dirty=dirty)

    def persist(self) -> None:
        """Write every modified chunk and commit the manifest (crash-consistent reopen)."""
        self.tiers.flush()

    @property
    def generation(self) -> int:
        """The generation of the store's last committed manifest; ``persist()`` commits the next."""
        return self.store.generation

    def stats(self) -> StateStats:
        tiers, swap = self.tiers.stats(), self.store.stats()
        return StateStats(cpu_nbytes=tiers.cpu_nbytes, nvme_nbytes=swap.used_nbytes, tiers=tiers, swap=swap)

    def close(self, *, remove: bool = True) -> None:
        """Free the cache; ``remove`` also deletes the swap files (the job is gone)."""
        self.tiers.close()
        self.store.close(remove=remove)


def wipe_store_files(swap_dirs: Sequence[Path], name: str) -> list[Path]:
    """Delete whatever files of store ``name`` exist (swap files, manifest, a cut-short manifest write)."""
    paths = [Path(d) / f"{name}.swap" for d in swap_dirs]
    if swap_dirs:
        first = Path(swap_dirs[0])
        paths += [first / f"{name}.manifest", first / f"{name}.manifest.tmp"]
    removed = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    if removed:
        log.warning("removed files of an earlier store %r before a new rank took the name: %s", name, removed)
    return removed


def remove_store(service: Service, job: Job, rank: int) -> None:
    """Delete the swap files of a rank that was never reopened (its job was reclaimed)."""
    try:
        store = SwapStore.open(service.swap_dirs, store_name(job.job_id, rank, job.owner_uid), service.io_engine, 0)
    except TiermemError as exc:
        log.warning("could not remove the swap files of job %r rank %d: %s", job.job_id, rank, exc)
        return
    store.close(remove=True)


def make_nvme_state(
    service: Service,
    job: Job,
    rank: int,
    numel: int,
    keys: tuple[str, ...] = ALL_KEYS,
    *,
    require_stored: bool = False,
) -> NvmeStateChunks:
    """Reserve cache and swap for ``numel`` elements of ``job``'s ``rank`` and open its store."""
    chunk_numel = service.config.adam.chunk_numel
    per_element = 4 * len(keys)
    state_nbytes = numel * per_element
    cache_nbytes = min(state_nbytes, CACHE_CHUNKS * chunk_numel * per_element) + 4096 * CACHE_CHUNKS
    # out-of-place writes keep the committed version until the next commit: room for two copies of the state
    # and the chunks being written
    swap_nbytes = 2 * state_nbytes + cache_nbytes
    service.ledger.reserve(job.key, Resource.POOL, cache_nbytes)
    try:
        service.ledger.reserve(job.key, Resource.SWAP, swap_nbytes)
    except BaseException:
        service.ledger.release(job.key, Resource.POOL, cache_nbytes)
        raise
    if not require_stored:  # a new rank: files of a previous job of this name are not its state
        wipe_store_files(service.swap_dirs, store_name(job.job_id, rank, job.owner_uid))
    try:
        store = SwapStore.open(
            service.swap_dirs,
            store_name(job.job_id, rank, job.owner_uid),
            service.io_engine,
            swap_nbytes,
            fsync=service.config.swap.fsync,
            auto_commit=False,
        )
        try:
            return NvmeStateChunks(
                service.pool, store, numel, chunk_numel, cache_nbytes, keys, require_stored=require_stored
            )
        except BaseException:
            store.close(remove=True)
            raise
    except BaseException:
        service.ledger.release(job.key, Resource.POOL, cache_nbytes)
        service.ledger.release(job.key, Resource.SWAP, swap_nbytes)
        raise

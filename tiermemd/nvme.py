"""The NVMe placement of a rank's state: chunks paged through a ``TierManager``.

Each part of each state chunk (``param``: the master; ``state``: the
moments; ``grad``: the staged grads; see ``state``) is one key of the rank's
``SwapStore`` (``chunk{c}.{part}``) and one tensor of its ``TierManager``, so
a param fetch reads the param's bytes only and a grad push touches only
grads.  The update acquires chunks in ascending order, each chunk's parts
together, so the manager is given that order once and keeps the next chunks
in flight: while chunk i is updated, chunks i+1.. are read and chunk i-1
written back as its slot is needed.  Uses outside the update (fetches, grad
pushes, checkpoints) do not move the prefetch along that order; they page in
on demand.  Grads an update consumed are dropped (``TierManager.release(...,
discard=True)``): never written back, and the next step's first grad landing
in a chunk finds it zeroed without a read.

Sizing is measured, not fixed (``tiermem.engine.tiers.sizing``): the first time a rank
is placed here, ``SwapDevice`` probes the swap device (bandwidth by queue
depth, latency; a fraction of a second) and sets the engine's queue depth;
each rank's plan (prefetch depth, chunks being updated and written back, so
the cache) follows from the probe, its chunk size and the job's room in the
pool budget, and its prefetch is planned again after each pass from the
measured update time.  ``swap.queue_depth``, ``swap.cache_chunks`` and
``swap.prefetch_depth`` fix any of them instead.  Every decision is logged and
is in the tier manager's stats (``TierStats.plan``).

The plan's cache (the manager's guaranteed budget) is reserved in the node's
pool budget at admission; with ``swap.borrow`` the manager also borrows free
pool memory up to all of its state, which the node's ``PoolShares`` takes back
when another allocation needs it.  The swap space is reserved (preallocated by
the store) in the swap budget.  A full disk is therefore an admission error,
never a failure mid-training; a disk filled by something else later fails
only a commit's manifest, which defers the commit (``CommitDeferred``, see
``tiermemd.durability``).

``persist()`` (SIGTERM, and every ``jobs.commit_every`` steps) writes every
dirty chunk and commits the manifest, so a restarted daemon reopens the chunks
from the store.  Only ``persist()`` commits (the store is opened with
``auto_commit=False``): a manifest committed in the middle of a step would
name chunks of two different steps.  The swap reserved is therefore two
copies of the state (the committed one and the one being written) plus the
cache (``tiermem.core.nvme_budget.nvme_reservation``, which ``tiermem
estimate`` counts too).  A rank reopened from a job file (``require_stored``) must find every
chunk in the store; a chunk the manifest does not name is ``DataLostError``,
never zeros.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tiermem.core import dtypes
from tiermem.core.config import MAX_QUEUE_DEPTH, SwapConfig
from tiermem.core.errors import DataLostError, InvalidArgument, TiermemError
from tiermem.core.nvme_budget import chunk_nbytes, nvme_reservation, part_nbytes
from tiermem.core.statekeys import StateFormat
from tiermem.engine.swap.engine import IOEngine
from tiermem.engine.swap.probe import DiskProbe, probe_disk
from tiermem.engine.swap.store import SwapStore
from tiermem.engine.tiers import PoolShares, TierManager
from tiermem.engine.tiers.sizing import CachePlan, choose_queue_depth, plan_cache, with_overrides
from tiermemd.ledger import Resource
from tiermemd.state import ALL_KEYS, UPDATE_KEYS, ChunkTensors, StateStats

if TYPE_CHECKING:
    from tiermemd.jobs import Job
    from tiermemd.service import Service

__all__ = [
    "NvmeStateChunks",
    "SwapDevice",
    "chunk_nbytes",
    "make_nvme_state",
    "plan_rank",
    "remove_store",
    "store_name",
]

log = logging.getLogger(__name__)


class SwapDevice:
    """The node's swap device as measured: one short probe, the first time an NVMe-placed rank is sized.

    No probe where the engine is not libaio (no O_DIRECT: a buffered file measures the page cache) or
    where the configuration fixes every figure it would decide; a failed probe is logged and the plans
    fall back to the unmeasured minimum."""

    def __init__(self, dirs: Sequence[Path], engine: IOEngine, config: SwapConfig) -> None:
        self._dirs = list(dirs)
        self._engine = engine
        self._config = config
        self._lock = threading.Lock()
        self._probed = False
        self._probe: DiskProbe | None = None

    @property
    def queue_depth(self) -> int:
        return int(getattr(self._engine, "queue_depth", self._config.threads))

    def probe(self) -> DiskProbe | None:
        with self._lock:
            if self._probed:
                return self._probe
            self._probed = True
            cfg = self._config
            set_depth = getattr(self._engine, "set_queue_depth", None)
            if not self._engine.direct or set_depth is None or not self._dirs:
                return None
            if cfg.queue_depth and cfg.cache_chunks and cfg.prefetch_depth:
                return None
            try:
                probe = probe_disk(self._dirs[0], block_nbytes=cfg.block_size)
            except (OSError, TiermemError) as exc:
                log.warning(
                    "could not measure the swap device under %s (%s); using unmeasured sizes", self._dirs[0], exc
                )
                return None
            if not cfg.queue_depth:
                set_depth(min(choose_queue_depth(probe), getattr(self._engine, "capacity", MAX_QUEUE_DEPTH)))
            log.info(
                "swap device under %s measured (%s): queue depth %d (%s)",
                self._dirs[0],
                probe.describe(),
                self.queue_depth,
                "configured" if cfg.queue_depth else "measured",
            )
            self._probe = probe
            return probe


def plan_rank(
    service: Service,
    job: Job,
    numel: int,
    chunk_numel: int,
    fmt: StateFormat,
) -> CachePlan:
    """The sizing of one rank's chunk cache: measured, within the job's room in the pool budget (each cached
    chunk counted in whole pages per part, as ``make_nvme_state`` reserves it), overridden by what the
    configuration fixes."""
    cfg = service.config.swap
    nchunks = -(-numel // chunk_numel)
    # parts of different sizes are placed among pinned blocks (those being updated or paged): a cache that
    # would fill the pool to its last byte could find its free room cut in holes smaller than a part, so one
    # part's worth of the pool is left to the allocator
    room = service.ledger.available(Resource.POOL) - max(part_nbytes(chunk_numel, fmt))
    quota = service.ledger.quota(job.key, Resource.POOL)
    if quota is not None:
        room = min(room, quota - service.ledger.held(Resource.POOL, job.key))
    probe = service.swap_device.probe()
    plan = plan_cache(
        probe,
        chunk_nbytes=chunk_nbytes(chunk_numel, fmt),
        nchunks=nchunks,
        memory_nbytes=room,
        queue_depth=service.swap_device.queue_depth,
    )
    return with_overrides(plan, cache_chunks=cfg.cache_chunks, prefetch_depth=cfg.prefetch_depth, nchunks=nchunks)


def store_name(job_id: str, rank: int, uid: int) -> str:
    """A file-system-safe, collision-free name for the swap files of one rank of uid ``uid``'s job."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job_id).lstrip(".")[:80] or "job"
    digest = hashlib.sha256(f"{uid}/{job_id}".encode()).hexdigest()[:10]
    return f"u{uid}-{safe}-{digest}.r{rank}"


def _key(chunk: int, part: str) -> str:
    return f"chunk{chunk}.{part}"


PERSISTED_PARTS = ("param", "state")
"""What a reopened rank must find in its store; grads are transient (consumed by each step)."""


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
        param_dtype: torch.dtype = torch.float32,
        state_dtype: str = "fp32",
        require_stored: bool = False,
        ceiling_nbytes: int | None = None,
        shares: PoolShares | None = None,
        tenant: str = "",
        plan: CachePlan | None = None,
        probe: DiskProbe | None = None,
        replan: bool = True,
    ) -> None:
        """``keys`` always include the fp32 master on this placement: it is what a restarted daemon reopens.
        ``require_stored``: the state is reopened, so every chunk must be in the store.  ``cache_nbytes`` is
        the guaranteed cache; with ``shares`` the manager borrows free pool memory up to ``ceiling_nbytes``
        and gives it back when the node needs it (registered as ``tenant``).  ``plan`` sizes the pipeline
        (default: the unmeasured minimum); with ``replan`` its prefetch is planned again from ``probe`` and
        the measured update time after each pass.  ``chunk_numel`` is rounded up to a whole number of the
        format's blocks (``StateFormat.chunk_numel``)."""
        if "master" not in keys:
            raise InvalidArgument(f"NVMe-placed state keeps the fp32 master, got keys {keys}")
        self.keys = keys
        self.format = StateFormat(keys, dtypes.by_torch(param_dtype).name, state_dtype)
        self._part_keys = self.format.parts
        self.parts = tuple(self._part_keys)
        self.numel = numel
        self.chunk_numel = self.format.chunk_numel(chunk_numel)
        self.store = store
        if require_stored:
            missing = [
                _key(c, part)
                for c in range(self.nchunks)
                for part in self.parts
                if part in PERSISTED_PARTS and _key(c, part) not in store
            ]
            if missing:
                raise DataLostError(
                    missing,
                    f"the state is reopened from a job file, but the swap manifest {store.manifest_path} "
                    f"(generation {store.generation}) holds no committed copy of {len(missing)} of the "
                    f"{self.nchunks} chunks' parts",
                )
        self.tiers = TierManager(pool, store, cache_nbytes, ceiling_nbytes=ceiling_nbytes)
        try:
            for c in range(self.nchunks):
                for part in self.parts:
                    shape = (self.format.part_nbytes(part, self._chunk_len(c)),)
                    self.tiers.register(_key(c, part), torch.uint8, shape)
            self.plan = plan or plan_cache(
                None,
                chunk_nbytes=chunk_nbytes(self.chunk_numel, self.format),
                nchunks=self.nchunks,
                memory_nbytes=cache_nbytes,
            )
            # the update's order; working-dtype params are left out: the update writes them whole, and a
            # prefetch would read what is about to be overwritten
            self._ordered = tuple(part for part in self.parts if self._part_keys[part] != ("param",))
            order = [_key(c, part) for c in range(self.nchunks) for part in self._ordered]
            # where grads land in the cache between two updates (and params are fetched from it), the next
            # update's first chunks are not read ahead at the end of one: they would sit through those uses
            wrap = "grad" not in keys
            self.tiers.prefetch(order, self.plan.prefetch_depth * len(self._ordered), wrap=wrap)
            self.tiers.set_plan(self.plan, tensors_per_chunk=len(self._ordered))
            if shares is not None:
                shares.register(tenant, self.tiers)
        except BaseException:
            self.tiers.close()
            raise
        self._shares, self._tenant = shares, tenant
        self._probe, self._replan = probe, replan
        self._grad_filled: dict[int, int] = {}
        """Per chunk, the grad elements pushes wrote since its grads were last consumed (``release(filled=)``):
        a grad part written in pieces is kept resident until it is whole, instead of going out to disk and
        coming back between two pieces (twice its bytes each way)."""

    @property
    def max_acquired(self) -> int:
        """Pieces the step pipeline may hold at once (the rest of the cache is for prefetch and write-back)."""
        return self.plan.acquired

    @property
    def nchunks(self) -> int:
        return (self.numel + self.chunk_numel - 1) // self.chunk_numel

    def _chunk_len(self, chunk: int) -> int:
        return min(self.chunk_numel, self.numel - chunk * self.chunk_numel)

    def resident(self) -> bool:
        """Every chunk is in the cache now: an update has no page-in to overlap with."""
        return bool(self.tiers.resident())

    def acquire(
        self, chunk: int, keys: Iterable[str] = UPDATE_KEYS, *, advance: bool = True, overwrite: Iterable[str] = ()
    ) -> ChunkTensors:
        parts = self._parts_of(keys)
        whole = set(overwrite)
        read = [_key(chunk, part) for part in parts if not whole.issuperset(self._part_keys[part])]
        if len(read) > 1:
            self.tiers.want(read)  # read together, not one after the other (and never what is overwritten)
        n = self._chunk_len(chunk)
        sections: dict[str, torch.Tensor] = {}
        taken: list[str] = []
        try:
            for part in parts:
                fresh = whole.issuperset(self._part_keys[part])
                raw = self.tiers.acquire(_key(chunk, part), advance=advance, overwrite=fresh)
                taken.append(part)
                sections.update(self.format.split(part, raw, n))
        except BaseException:
            for part in taken:
                self.tiers.release(_key(chunk, part), dirty=False)
            raise
        return ChunkTensors(**sections)

    def release(
        self, chunk: int, keys: Iterable[str] = UPDATE_KEYS, *, dirty: bool, consumed: bool = False, filled: int = 0
    ) -> None:
        parts = self._parts_of(keys)
        keep = False
        if consumed:
            self._grad_filled.pop(chunk, None)
        elif filled:
            total = self._grad_filled.get(chunk, 0) + filled
            keep = total < self._chunk_len(chunk)
            self._grad_filled[chunk] = total
        for part in parts:
            grad = part == "grad"
            self.tiers.release(_key(chunk, part), dirty=dirty, discard=consumed and grad, keep=keep and grad)
        if chunk == self.nchunks - 1 and dirty and "state" in parts and self._replan:
            self._plan_again()  # the end of an update's pass (not a fetch of the last chunk's params)

    def _parts_of(self, keys: Iterable[str]) -> tuple[str, ...]:
        wanted = set(keys)
        return tuple(part for part, held in self._part_keys.items() if wanted.intersection(held))

    def _plan_again(self) -> None:
        """After a pass: the prefetch depth for the update time measured now.  The reserved cache stays as it
        is: a deeper prefetch runs in borrowed memory where there is some, else within the cache (the pager
        never evicts a chunk needed sooner than the one it fetches)."""
        update_s = self.tiers.stats().hold_s
        if update_s <= 0:
            return
        fresh = plan_cache(
            self._probe,
            chunk_nbytes=self.plan.chunk_nbytes,
            nchunks=self.nchunks,
            memory_nbytes=self.nchunks * self.plan.chunk_nbytes,  # bounded by the state; see the docstring
            update_s=update_s,
            queue_depth=self.plan.queue_depth,
        )
        prefetch = max(1, min(fresh.prefetch_depth, self.nchunks - 1))
        if prefetch != self.plan.prefetch_depth or fresh.bound != self.plan.bound:
            self.plan = replace(self.plan, prefetch_depth=prefetch, bound=fresh.bound)
            self.tiers.set_plan(self.plan, tensors_per_chunk=len(self._ordered))
            log.info(
                "%s: update %.1f ms per chunk measured: %s",
                self._tenant or "NVMe state",
                update_s * 1e3,
                self.plan.describe(),
            )

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
        if self._shares is not None:
            self._shares.unregister(self._tenant)
            self._shares = None
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
        name = store_name(job.job_id, rank, job.owner_uid)
        store = SwapStore.open(
            service.swap_dirs, name, service.io_engine, 0, stripe_nbytes=service.config.swap.stripe_size
        )
    except TiermemError as exc:
        log.warning("could not remove the swap files of job %r rank %d: %s", job.job_id, rank, exc)
        return
    store.close(remove=True)


def _ceiling(service: Service, job: Job, resident_nbytes: int, cache_nbytes: int) -> int:
    """The most pool memory a rank's chunk cache may hold, borrowing above ``cache_nbytes``: all of its
    state, within the pool and what the job's pool quota leaves (asked before the cache is reserved)."""
    ceiling = min(resident_nbytes, service.pool.capacity)
    quota = service.ledger.quota(job.key, Resource.POOL)
    if quota is not None:
        ceiling = min(ceiling, quota - service.ledger.held(Resource.POOL, job.key))
    return max(ceiling, cache_nbytes)


def make_nvme_state(
    service: Service,
    job: Job,
    rank: int,
    numel: int,
    fmt: StateFormat,
    *,
    require_stored: bool = False,
) -> NvmeStateChunks:
    """Reserve cache and swap for ``numel`` elements of ``job``'s ``rank`` and open its store (``fmt``: its
    keys, working dtype and state dtype)."""
    chunk_numel = fmt.chunk_numel(service.config.adam.chunk_numel)
    plan = plan_rank(service, job, numel, chunk_numel, fmt)
    log.info(
        "job %r rank %d: NVMe state of %d chunk(s): %s", job.job_id, rank, -(-numel // chunk_numel), plan.describe()
    )
    # out-of-place writes keep the committed version until the next commit: room for two copies of the state
    # and the chunks being written
    reserved = nvme_reservation(numel, chunk_numel, fmt, plan.cache_chunks)
    resident_nbytes, cache_nbytes, swap_nbytes = reserved.state_nbytes, reserved.cache_nbytes, reserved.swap_nbytes
    ceiling_nbytes = cache_nbytes
    if service.config.swap.borrow:
        ceiling_nbytes = _ceiling(service, job, resident_nbytes, cache_nbytes)
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
            stripe_nbytes=service.config.swap.stripe_size,
            fsync=service.config.swap.fsync,
            auto_commit=False,
        )
        try:
            return NvmeStateChunks(
                service.pool,
                store,
                numel,
                chunk_numel,
                cache_nbytes,
                fmt.keys,
                param_dtype=dtypes.by_name(fmt.dtype).torch,
                state_dtype=fmt.state_dtype,
                require_stored=require_stored,
                ceiling_nbytes=ceiling_nbytes,
                shares=service.shares,
                tenant=f"{job.key}/{rank}",
                plan=plan,
                probe=service.swap_device.probe(),
                replan=not service.config.swap.prefetch_depth,
            )
        except BaseException:
            store.close(remove=True)
            raise
    except BaseException:
        service.ledger.release(job.key, Resource.POOL, cache_nbytes)
        service.ledger.release(job.key, Resource.SWAP, swap_nbytes)
        raise

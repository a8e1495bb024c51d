"""The NVMe placement's sizing: ``SwapDevice`` (the probe, once, setting the engine's queue depth) and a
rank's chunk pipeline sized by its plan, planned again from the measured update time."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiermem.core.config import DEFAULT_QUEUE_DEPTH, MAX_QUEUE_DEPTH, SwapConfig
from tiermem.core.units import KiB, MiB
from tiermem.engine.pool import BufferPool
from tiermem.engine.swap.engine_libaio import LibaioEngine
from tiermem.engine.swap.engine_select import open_engine
from tiermem.engine.swap.engine_threads import ThreadEngine
from tiermem.engine.swap.probe import DiskPoint, DiskProbe
from tiermem.engine.swap.store import SwapStore
from tiermem.engine.tiers.sizing import plan_cache
from tiermemd.nvme import NvmeStateChunks, SwapDevice

CHUNK_NUMEL = 16384  # 192 KiB of state per chunk (three fp32 keys)
NCHUNKS = 12


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tiermem-probe-", dir="/var/tmp") as d:
        yield Path(d)


def test_the_plan_sizes_the_pipeline_and_a_slow_update_deepens_the_prefetch(
    pool_and_store: tuple[BufferPool, SwapStore],
) -> None:
    pool, store = pool_and_store
    # a disk whose reads take ~4 ms per chunk and 200 ms of latency: an update slower than 8 ms is compute-bound
    probe = DiskProbe(64 * 1024, (DiskPoint(1, 50e6, 50e6),), latency_s=0.2)
    chunk_nbytes = CHUNK_NUMEL * 12
    plan = plan_cache(probe, chunk_nbytes=chunk_nbytes, nchunks=NCHUNKS, memory_nbytes=10 * chunk_nbytes)
    state = NvmeStateChunks(pool, store, NCHUNKS * CHUNK_NUMEL, CHUNK_NUMEL, plan.cache_nbytes, plan=plan, probe=probe)
    try:
        assert state.max_acquired == plan.acquired
        # the prefetch keeps whole chunks in flight: each is one tier tensor per part (param, state)
        per_chunk = len(state.parts)
        assert (
            state.tiers.stats().plan == plan and state.tiers.stats().prefetch_depth == plan.prefetch_depth * per_chunk
        )
        for _ in range(2):
            for c in range(NCHUNKS):
                tensors = state.acquire(c)
                tensors.exp_avg.add_(1.0)
                time.sleep(0.02)  # the "update": 20 ms per chunk, less than a read plus its latency
                state.release(c, dirty=True)
        replanned = state.tiers.stats().plan
        assert replanned is not None and replanned.bound == "compute"
        assert replanned.prefetch_depth > plan.prefetch_depth  # (4 + 200) ms / ~20 ms: ~10 chunks ahead
        assert (replanned.acquired, replanned.writeback) == (plan.acquired, plan.writeback)
        assert state.tiers.stats().prefetch_depth == replanned.prefetch_depth * per_chunk
        assert float(state.acquire(0).exp_avg[0]) == 2.0
        state.release(0, dirty=False)
    finally:
        state.close(remove=False)


def test_a_measured_depth_is_set_on_the_engine_once_and_logged(
    disk_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = SwapConfig(queue_depth=0, block_size=256 * KiB)
    engine = open_engine(config, disk_dir)
    try:
        assert isinstance(engine, LibaioEngine)
        assert (engine.capacity, engine.queue_depth) == (MAX_QUEUE_DEPTH, DEFAULT_QUEUE_DEPTH)
        device = SwapDevice([disk_dir], engine, config)
        with caplog.at_level(logging.INFO, logger="tiermemd.nvme"):
            probe = device.probe()
        assert probe is not None and device.probe() is probe  # measured once
        assert engine.queue_depth in {
            min(2 * p.queue_depth, max(q.queue_depth for q in probe.points)) for p in probe.points
        }
        assert "measured" in caplog.text and f"queue depth {engine.queue_depth}" in caplog.text
    finally:
        engine.close()


def test_nothing_is_probed_when_the_configuration_fixes_every_size_or_io_is_buffered(disk_dir: Path) -> None:
    fixed = SwapConfig(queue_depth=8, cache_chunks=6, prefetch_depth=2)
    engine = open_engine(fixed, disk_dir)
    try:
        assert SwapDevice([disk_dir], engine, fixed).probe() is None
        assert engine.queue_depth == 8  # type: ignore[attr-defined]
    finally:
        engine.close()
    threads = ThreadEngine(block_size=MiB, threads=2)
    try:
        assert SwapDevice([disk_dir], threads, SwapConfig()).probe() is None
    finally:
        threads.close()


def test_a_pool_of_a_whole_number_of_chunks_admits_a_rank_that_pages_through_it() -> None:
    """The cache plan counts each cached chunk as its parts' blocks take the pool, and leaves one part's room to
    the allocator (parts of two sizes among pinned blocks): a pool that holds exactly four chunks of the rank's
    state admits a rank of eight, which then trains through it, steps after steps."""
    import torch

    from tiermem.client.link import connect
    from tiermem.client.offload import OffloadAdam

    chunk_numel = 65536
    pool = 4 * chunk_numel * 12  # master, exp_avg, exp_avg_sq: 12 bytes an element
    client = connect(pool_size=pool, settings={"adam.chunk_numel": chunk_numel, "pool.arena_size": pool})
    p = torch.nn.Parameter(torch.randn(8 * chunk_numel))
    opt = OffloadAdam([p], offload="nvme", client=client)
    try:
        for _ in range(6):
            p.grad = torch.randn_like(p)
            opt.step()
        stats = opt.stats()
        assert stats.rank.last_step == 6
        assert stats.rank.cpu_state_nbytes <= pool
        assert stats.rank.nvme is not None and stats.rank.nvme.page_outs > 0  # the state did not fit: it paged
    finally:
        opt.close()
        client.close()

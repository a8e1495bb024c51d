"""PoolShares over one real pool shared by several TierManagers (libaio, O_DIRECT on this disk)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiermem.core.errors import PoolExhausted
from tiermem.engine.pool import BufferPool
from tiermem.engine.swap.engine_libaio import LibaioEngine
from tiermem.engine.swap.store import SwapStore
from tiermem.engine.tiers import PoolShares, TierManager

TENSOR_NUMEL = 64 * 1024  # 256 KiB of fp32
TENSOR_NBYTES = TENSOR_NUMEL * 4
NTENSORS = 8  # 2 MiB of state per job
FLOOR = 2 * TENSOR_NBYTES
POOL_NBYTES = 2 * NTENSORS * TENSOR_NBYTES  # exactly what two jobs hold when all their state is resident


class Job:
    """One tier manager, its store, and what each tensor must hold (the reference)."""

    def __init__(self, name: str, pool: BufferPool, shares: PoolShares, engine: LibaioEngine, d: Path) -> None:
        self.name = name
        self.store = SwapStore.open([d], name, engine, 4 * NTENSORS * TENSOR_NBYTES)
        self.tiers = TierManager(pool, self.store, FLOOR, ceiling_nbytes=NTENSORS * TENSOR_NBYTES)
        self.keys = [f"{name}.{i}" for i in range(NTENSORS)]
        for key in self.keys:
            self.tiers.register(key, torch.float32, (TENSOR_NUMEL,))
        self.tiers.prefetch(self.keys, 1)
        shares.register(name, self.tiers)
        self.expected = dict.fromkeys(self.keys, 0.0)

    def step(self, seed: float) -> None:
        """One pass: every tensor must hold its reference, then takes a new value."""
        for i, key in enumerate(self.keys):
            t = self.tiers.acquire(key)
            try:
                assert torch.equal(t, torch.full_like(t, self.expected[key])), f"{key} lost its contents"
                value = seed + i
                t.fill_(value)
                self.expected[key] = value
            finally:
                self.tiers.release(key, dirty=True)

    def close(self) -> None:
        self.tiers.close()
        self.store.close(remove=True)


@pytest.mark.timeout(120)
def test_two_jobs_borrow_the_whole_pool_and_give_it_back_to_a_third(libaio: LibaioEngine, swap_dir: Path) -> None:
    shares = PoolShares()
    pool = BufferPool.create(POOL_NBYTES, arena_size=POOL_NBYTES, mlock=False, evict=shares.evict)
    a, b = Job("a", pool, shares, libaio, swap_dir), Job("b", pool, shares, libaio, swap_dir)
    try:
        for step in range(1, 3):
            a.step(10.0 * step)
            b.step(100.0 * step)
        # both borrowed far above their floors: the pool is full
        assert a.tiers.stats().cpu_nbytes > FLOOR and b.tiers.stats().cpu_nbytes > FLOOR
        assert pool.free_bytes < 2 * TENSOR_NBYTES

        # a third job's unpaged state (a CPU-placed job) is admitted: the two give memory back
        third = pool.alloc(4 * TENSOR_NBYTES, owner="cpu-job")
        with pool.pinned(third) as view:
            torch.frombuffer(view, dtype=torch.float32).fill_(7.0)
        sa, sb = a.tiers.stats(), b.tiers.stats()
        assert sa.given_back + sb.given_back >= 4
        assert sa.cpu_nbytes >= FLOOR and sb.cpu_nbytes >= FLOOR
        assert shares.stats().given_back_nbytes >= 4 * TENSOR_NBYTES

        # everyone keeps training within what is left, and every byte is what its reference says
        for step in range(3, 6):
            a.step(10.0 * step)
            b.step(100.0 * step)
            assert a.tiers.stats().cpu_nbytes >= FLOOR and b.tiers.stats().cpu_nbytes >= FLOOR
        with pool.pinned(third) as view:
            assert torch.equal(torch.frombuffer(view, dtype=torch.float32), torch.full((4 * TENSOR_NUMEL,), 7.0))

        # the floors are guarantees: an allocation that would need them fails instead
        idle = POOL_NBYTES - 4 * TENSOR_NBYTES - 2 * FLOOR
        with pytest.raises(PoolExhausted):
            pool.alloc(idle + TENSOR_NBYTES, owner="too-big")
        assert a.tiers.stats().cpu_nbytes >= FLOOR and b.tiers.stats().cpu_nbytes >= FLOOR
        a.step(1000.0)
        b.step(2000.0)
        pool.free(third)
    finally:
        a.close()
        b.close()
        pool.close()


@pytest.mark.timeout(120)
def test_a_third_paged_job_is_admitted_into_a_full_pool_and_all_three_keep_their_contents(
    libaio: LibaioEngine, swap_dir: Path
) -> None:
    shares = PoolShares()
    pool = BufferPool.create(POOL_NBYTES, arena_size=POOL_NBYTES, mlock=False, evict=shares.evict)
    jobs = [Job("a", pool, shares, libaio, swap_dir), Job("b", pool, shares, libaio, swap_dir)]
    try:
        for step in range(1, 3):
            for n, job in enumerate(jobs):
                job.step(10.0 * step + n)
        assert pool.free_bytes < 2 * TENSOR_NBYTES
        jobs.append(Job("c", pool, shares, libaio, swap_dir))
        for step in range(3, 7):
            for n, job in enumerate(jobs):
                job.step(10.0 * step + n)
        stats = [job.tiers.stats() for job in jobs]
        assert all(s.cpu_nbytes >= FLOOR for s in stats)
        assert stats[0].given_back + stats[1].given_back > 0  # c's floor came from a's and b's borrowing
        assert stats[2].page_outs > 0  # and c is paged within what it could get
        assert sum(s.cpu_nbytes for s in stats) <= POOL_NBYTES
    finally:
        for job in jobs:
            job.close()
        pool.close()

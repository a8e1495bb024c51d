"""The NVMe tier's sizing rules (pure): queue depth from a probe, prefetch and cache from chunk size and memory."""

from __future__ import annotations

import pytest

from tiermem.core.errors import InvalidArgument
from tiermem.core.units import GiB, KiB, MiB
from tiermem.engine.swap.probe import DiskPoint, DiskProbe
from tiermem.engine.tiers.sizing import choose_queue_depth, plan_cache, with_overrides

GB = 1e9


def probe(*points: tuple[int, float, float], latency_s: float = 1e-3, block: int = MiB) -> DiskProbe:
    return DiskProbe(block, tuple(DiskPoint(qd, r * GB, w * GB) for qd, r, w in points), latency_s)


# a disk that saturates at QD 16: reads 2 GB/s, writes 1.5 GB/s
NVME = probe((1, 0.4, 0.3), (4, 1.2, 1.0), (16, 1.95, 1.5), (64, 2.0, 1.5))


def test_queue_depth_is_twice_the_smallest_that_reaches_nine_tenths_of_the_best() -> None:
    assert choose_queue_depth(NVME) == 32
    assert choose_queue_depth(probe((1, 1.0, 1.0), (8, 1.0, 1.0))) == 2  # flat: depth 1 is enough
    # both directions must qualify: writes only saturate at 64
    assert choose_queue_depth(probe((1, 0.5, 0.2), (16, 2.0, 0.5), (64, 2.0, 1.5))) == 64


def test_large_chunks_need_two_prefetched_one_writing_back() -> None:
    plan = plan_cache(NVME, chunk_nbytes=48 * MiB, nchunks=100, memory_nbytes=64 * GiB)
    assert (plan.queue_depth, plan.prefetch_depth, plan.writeback, plan.acquired) == (32, 2, 1, 2)
    assert plan.cache_chunks == 5 and plan.cache_nbytes == 5 * 48 * MiB
    assert plan.bound == "unmeasured"
    assert "prefetch 2" in plan.describe()


def test_small_chunks_prefetch_enough_to_fill_the_queue() -> None:
    plan = plan_cache(NVME, chunk_nbytes=4 * MiB, nchunks=1000, memory_nbytes=64 * GiB)
    # 32 requests of 1 MiB in flight need 8 chunks of 4 MiB each way
    assert (plan.prefetch_depth, plan.writeback) == (8, 8)


def test_a_configured_queue_depth_is_used_as_is() -> None:
    plan = plan_cache(NVME, chunk_nbytes=4 * MiB, nchunks=1000, memory_nbytes=64 * GiB, queue_depth=8)
    assert plan.queue_depth == 8 and plan.prefetch_depth == 2 and plan.writeback == 2


def test_a_compute_bound_update_prefetches_enough_to_cover_a_read_and_its_latency() -> None:
    slow = probe((1, 0.05, 0.05), latency_s=0.2)  # 50 MB/s at depth 1, 200 ms latency
    chunk = 4 * MiB  # read ~84 ms + 200 ms latency
    io_bound = plan_cache(slow, chunk_nbytes=chunk, nchunks=100, memory_nbytes=GiB, update_s=0.01)
    assert io_bound.bound == "io" and io_bound.prefetch_depth == 2  # deeper cannot beat the disk
    compute = plan_cache(slow, chunk_nbytes=chunk, nchunks=100, memory_nbytes=GiB, update_s=0.2)
    assert compute.bound == "compute" and compute.prefetch_depth == 2  # (84 + 200) ms / 200 ms -> 2
    faster = probe((1, 0.05, 0.05), latency_s=0.9)
    compute = plan_cache(faster, chunk_nbytes=chunk, nchunks=100, memory_nbytes=GiB, update_s=0.2)
    assert compute.prefetch_depth == 5  # (84 + 900) ms / 200 ms -> 5


def test_memory_and_state_bound_the_cache_down_to_three_chunks() -> None:
    small = plan_cache(NVME, chunk_nbytes=4 * MiB, nchunks=1000, memory_nbytes=24 * MiB)
    assert small.cache_chunks == 6 and small.prefetch_depth == 2 and small.writeback == 2
    tiny = plan_cache(NVME, chunk_nbytes=4 * MiB, nchunks=1000, memory_nbytes=4 * MiB)
    assert (tiny.acquired, tiny.prefetch_depth, tiny.writeback) == (1, 1, 1)
    whole = plan_cache(NVME, chunk_nbytes=24 * KiB, nchunks=11, memory_nbytes=GiB)
    assert whole.cache_chunks == 11  # a state smaller than the queue: all of it cached


def test_bad_input_is_named() -> None:
    with pytest.raises(InvalidArgument, match="chunk_nbytes"):
        plan_cache(NVME, chunk_nbytes=0, nchunks=1, memory_nbytes=GiB)
    with pytest.raises(InvalidArgument, match="update_s"):
        plan_cache(NVME, chunk_nbytes=MiB, nchunks=1, memory_nbytes=GiB, update_s=-1.0)
    with pytest.raises(InvalidArgument, match="at least one"):
        DiskProbe(MiB, (), 0.0)


def test_without_a_probe_the_plan_is_the_unmeasured_minimum() -> None:
    plan = plan_cache(None, chunk_nbytes=48 * MiB, nchunks=100, memory_nbytes=GiB, update_s=0.5, queue_depth=4)
    assert (plan.queue_depth, plan.prefetch_depth, plan.writeback, plan.acquired) == (4, 2, 1, 2)
    assert plan.bound == "unmeasured"


def test_configured_cache_and_prefetch_override_the_measured_plan() -> None:
    measured = plan_cache(NVME, chunk_nbytes=4 * MiB, nchunks=1000, memory_nbytes=64 * GiB)
    fixed = with_overrides(measured, cache_chunks=6, prefetch_depth=2, nchunks=1000)
    # the layout the NVMe tier used before it measured anything: 6 chunks, 2 prefetched, 3 for the update
    assert (fixed.cache_chunks, fixed.prefetch_depth, fixed.acquired, fixed.writeback) == (6, 2, 3, 1)
    assert fixed.bound == "configured" and fixed.queue_depth == measured.queue_depth
    assert with_overrides(measured, prefetch_depth=3, nchunks=1000).prefetch_depth == 3
    assert with_overrides(measured, nchunks=1000) == measured
    assert with_overrides(measured, cache_chunks=6, nchunks=4).cache_chunks == 4

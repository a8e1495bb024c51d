"""TierManager over a real BufferPool (memfd arenas) and a real SwapStore (libaio, O_DIRECT on this disk)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tiermem.core.errors import CorruptionError, InvalidState, PoolExhausted
from tiermem.core.units import MiB
from tiermem.engine.pool import BufferPool
from tiermem.engine.swap.engine_libaio import LibaioEngine
from tiermem.engine.swap.store import SwapStore
from tiermem.engine.tiers import TensorState, TierManager

SHAPES = [(4096 * (1 + i % 5),) for i in range(16)]  # 16..80 KiB of fp32 each
KEYS = [f"t{i}" for i in range(len(SHAPES))]
STATE_NBYTES = sum(s[0] * 4 for s in SHAPES)


@contextlib.contextmanager
def tiered(
    engine: LibaioEngine, d: Path, budget: int, pool_nbytes: int, *, remove: bool = True
) -> Iterator[tuple[SwapStore, TierManager]]:
    """A swap store in ``d`` and a tier manager over it and a pool, every tensor of ``SHAPES`` registered;
    all three closed on exit, the store's files removed unless ``remove`` is false."""
    holder: list[TierManager] = []
    pool = BufferPool.create(pool_nbytes, arena_size=pool_nbytes, mlock=False, evict=lambda n: holder[0].evict(n))  # noqa: PLW0108
    store = SwapStore.open([d], "job", engine, 4 * STATE_NBYTES)
    manager = TierManager(pool, store, budget)
    holder.append(manager)
    for key, shape in zip(KEYS, SHAPES, strict=True):
        manager.register(key, torch.float32, shape)
    try:
        yield store, manager
    finally:
        manager.close()
        store.close(remove=remove)
        pool.close()


def one_pass(manager: TierManager, step: int, budget: int) -> None:
    """Check every tensor holds ``step - 1`` + its index, then set it to ``step`` + index."""
    for i, key in enumerate(KEYS):
        t = manager.acquire(key)
        assert manager.stats().cpu_nbytes <= budget
        expected = 0.0 if step == 1 else float(step - 1 + i)
        assert torch.equal(t, torch.full_like(t, expected)), f"{key} at step {step}"
        t.fill_(float(step + i))
        manager.release(key, dirty=True)


@pytest.mark.timeout(60)  # a pager livelock (prefetch and demand evicting each other) shows as a hang here
def test_full_passes_with_a_quarter_of_the_state_in_memory_keep_contents(libaio: LibaioEngine, swap_dir: Path) -> None:
    budget = STATE_NBYTES // 4
    with tiered(libaio, swap_dir, budget, 2 * MiB) as (_, manager):
        one_pass(manager, 1, budget)
        one_pass(manager, 2, budget)  # the first pass recorded the order: eviction now knows next uses
        manager.prefetch(KEYS, depth=3)
        for step in range(3, 13):
            one_pass(manager, step, budget)
        s = manager.stats()
        assert s.page_ins > 0 and s.page_outs > 0 and s.bytes_out > 0
        assert s.acquires == 12 * len(KEYS) and s.wait_s >= 0.0 and s.io_errors == 0
        assert s.page_ins <= 2 * 12 * len(KEYS)  # no thrashing: about one page-in per tensor and pass
        assert s.cpu_nbytes <= budget


def test_pool_eviction_callback_pages_tensors_out_when_the_pool_is_full(libaio: LibaioEngine, swap_dir: Path) -> None:
    # the budget would allow everything in memory, but the pool holds only about a third of it
    with tiered(libaio, swap_dir, 4 * STATE_NBYTES, 400 * 1024) as (_, manager):
        one_pass(manager, 1, 4 * STATE_NBYTES)
        one_pass(manager, 2, 4 * STATE_NBYTES)
        assert manager.stats().evictions > 0


def test_corrupt_swap_copy_is_raised_by_acquire_and_other_tensors_still_work(
    libaio: LibaioEngine, swap_dir: Path
) -> None:
    budget = STATE_NBYTES // 4
    with tiered(libaio, swap_dir, budget, 2 * MiB) as (store, manager):
        one_pass(manager, 1, budget)
        victim = next(k for k in KEYS if manager.record(k).state is TensorState.NVME)
        rec = store.record(victim)
        assert rec is not None and rec.current is not None
        with open(store.paths[0], "r+b") as f:
            f.seek(rec.current.extents[0].offset + 100)
            f.write(b"\xff\xfe")
        with pytest.raises(CorruptionError) as info:
            manager.acquire(victim)
        assert info.value.key == victim
        other = next(k for k in KEYS if k != victim)
        t = manager.acquire(other)
        assert torch.equal(t, torch.full_like(t, float(1 + KEYS.index(other))))
        manager.release(other)


def test_flush_then_reopen_restores_every_tensor(libaio: LibaioEngine, swap_dir: Path) -> None:
    budget = STATE_NBYTES // 2
    with tiered(libaio, swap_dir, budget, 2 * MiB, remove=False) as (_, manager):
        one_pass(manager, 1, budget)
        manager.flush()
    with tiered(libaio, swap_dir, budget, 2 * MiB) as (_, manager):
        assert all(manager.record(k).state is TensorState.NVME for k in KEYS)
        one_pass(manager, 2, budget)


def test_acquiring_more_than_the_budget_at_once_is_refused(libaio: LibaioEngine, swap_dir: Path) -> None:
    budget = SHAPES[0][0] * 4 * 2
    with tiered(libaio, swap_dir, budget, 2 * MiB) as (_, manager):
        try:
            manager.acquire("t0")
            manager.acquire("t1")  # 16 + 32 KiB > 32 KiB? t0 is 16 KiB, t1 32 KiB: not both
        except PoolExhausted as exc:
            assert "tier CPU budget" in str(exc)
        else:
            pytest.fail("acquire did not refuse a tensor that cannot fit next to the ones in use")
        finally:
            manager.release("t0")


@pytest.mark.timeout(60)
def test_a_pager_thread_that_dies_fails_its_waiters_instead_of_hanging_them(
    libaio: LibaioEngine, swap_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = STATE_NBYTES // 4
    with tiered(libaio, swap_dir, budget, 2 * MiB) as (_, manager):
        one_pass(manager, 1, budget)
        one_pass(manager, 2, budget)
        paged = [k for k in KEYS if manager.record(k).state is TensorState.NVME]
        assert paged, "nothing was paged out"

        def broken_plan() -> None:
            raise RuntimeError("a bug in the pager")

        monkeypatch.setattr(manager, "_plan", broken_plan)
        with pytest.raises(InvalidState, match=r"pager thread failed .*a bug in the pager"):
            manager.acquire(paged[0])
        with pytest.raises(InvalidState, match="pager thread failed"):  # and every later wait, at once
            manager.acquire(paged[-1])


def test_resident_says_whether_every_tensor_is_in_the_pool(libaio: LibaioEngine, swap_dir: Path) -> None:
    with tiered(libaio, swap_dir, 2 * STATE_NBYTES, 2 * MiB) as (_, manager):
        assert not manager.resident()  # registered, never paged in
        one_pass(manager, 1, 2 * STATE_NBYTES)
        assert manager.resident()  # the budget holds the whole state
        manager.acquire(KEYS[0])
        assert manager.resident()  # in use counts as resident
        manager.release(KEYS[0], dirty=False)
        assert manager.page_out([KEYS[1]])
        assert not manager.resident()


def test_an_overwriting_acquire_pages_in_without_reading_and_the_new_values_are_kept(
    libaio: LibaioEngine, swap_dir: Path
) -> None:
    key = KEYS[0]
    with tiered(libaio, swap_dir, 2 * STATE_NBYTES, 2 * MiB) as (_, manager):
        one_pass(manager, 1, 2 * STATE_NBYTES)  # every tensor holds 1 + its index, dirty
        assert manager.page_out([key])
        read_before = manager.stats().bytes_in
        t = manager.acquire(key, overwrite=True)
        assert manager.stats().bytes_in == read_before  # nothing read from NVMe
        assert not t.any()  # a zeroed block, never another tensor's bytes
        t.fill_(42.0)
        manager.release(key, dirty=True)
        assert manager.page_out([key])  # written: the stored copy is now the overwritten one
        again = manager.acquire(key)
        assert manager.stats().bytes_in > read_before  # a plain acquire reads
        assert torch.equal(again, torch.full_like(again, 42.0))
        manager.release(key, dirty=False)


def test_a_discarded_tensor_is_dropped_without_a_write_and_comes_back_zeroed_without_a_read(
    libaio: LibaioEngine, swap_dir: Path
) -> None:
    key = KEYS[0]
    with tiered(libaio, swap_dir, 2 * STATE_NBYTES, 2 * MiB) as (store, manager):
        one_pass(manager, 1, 2 * STATE_NBYTES)
        manager.flush()  # every tensor has a stored copy
        assert key in store
        t = manager.acquire(key)
        t.fill_(7.0)
        before = manager.stats()
        manager.release(key, dirty=True, discard=True)
        after = manager.stats()
        assert manager.record(key).state is TensorState.EMPTY and key not in store  # the stale copy is gone too
        assert after.cpu_nbytes == before.cpu_nbytes - manager.record(key).padded_nbytes  # its block is freed
        assert (after.bytes_out, after.discards) == (before.bytes_out, before.discards + 1)  # nothing written
        again = manager.acquire(key)
        assert manager.stats().bytes_in == after.bytes_in  # nothing read
        assert not again.any()
        manager.release(key, dirty=False)
        other = manager.acquire(KEYS[1])  # the other tensors keep their values
        assert torch.equal(other, torch.full_like(other, 2.0))
        manager.release(KEYS[1], dirty=False)


def test_a_discard_waits_for_the_last_user(libaio: LibaioEngine, swap_dir: Path) -> None:
    key = KEYS[0]
    with tiered(libaio, swap_dir, 2 * STATE_NBYTES, 2 * MiB) as (_, manager):
        first = manager.acquire(key)
        manager.acquire(key)
        first.fill_(3.0)
        manager.release(key, dirty=True, discard=True)  # another user holds it: kept
        assert manager.record(key).state is TensorState.IN_USE
        manager.release(key, dirty=True)
        assert manager.record(key).state is TensorState.CPU
        assert float(manager.acquire(key)[0]) == 3.0
        manager.release(key, dirty=False)


def test_acquires_outside_the_order_do_not_move_the_prefetch(libaio: LibaioEngine, swap_dir: Path) -> None:
    """A use that is not a step of the order (a param fetch between two updates) pages in on demand only: the
    pager does not read ahead of it along the order."""
    budget = 2 * STATE_NBYTES
    with tiered(libaio, swap_dir, budget, 2 * MiB) as (_, manager):
        one_pass(manager, 1, budget)
        manager.flush()
        assert manager.page_out(KEYS)  # nothing resident
        manager.prefetch(KEYS, 4)
        # the pager prefetches the start of the order now; wait for it, then count
        first = manager.acquire(KEYS[0])
        manager.release(KEYS[0], dirty=False)
        deadline = time.monotonic() + 10
        while sum(manager.record(k).resident for k in KEYS[1:5]) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first is not None and all(manager.record(k).resident for k in KEYS[1:5])
        read = manager.stats().page_ins
        t = manager.acquire(KEYS[9], advance=False)
        manager.release(KEYS[9], dirty=False)
        time.sleep(0.2)  # room for a prefetch, were one started
        assert manager.stats().page_ins == read + 1  # KEYS[9] only: nothing read ahead of it
        assert not any(manager.record(k).resident for k in KEYS[10:14])
        assert torch.equal(t, torch.full_like(t, 10.0))
        manager.acquire(KEYS[9])  # a step of the order: the prefetch moves on past it
        manager.release(KEYS[9], dirty=False)
        deadline = time.monotonic() + 10
        while not manager.record(KEYS[10]).resident and time.monotonic() < deadline:
            time.sleep(0.01)
        assert manager.record(KEYS[10]).resident


def test_a_kept_tensor_stays_resident_while_others_make_room_and_goes_as_a_last_resort(
    libaio: LibaioEngine, swap_dir: Path
) -> None:
    """``release(keep=True)`` (a grad part more pushes will fill): evictions take every other tensor first;
    an acquire that finds nothing else to evict takes it; a release without ``keep`` makes it ordinary."""
    budget = STATE_NBYTES // 4
    kept = KEYS[0]
    with tiered(libaio, swap_dir, budget, 2 * MiB) as (_, manager):
        one_pass(manager, 1, budget)
        manager.acquire(kept).fill_(5.0)
        manager.release(kept, dirty=True, keep=True)
        for key in KEYS[1:]:  # more than the budget holds: every page-in needs victims
            manager.acquire(key)
            manager.release(key, dirty=True)
            assert manager.record(kept).state is TensorState.CPU, key
        writes = manager.stats().bytes_out
        # the budget's room taken by tensors in use: the kept one is the only victim left
        held = []
        for key in sorted(KEYS[1:], key=lambda k: -manager.record(k).padded_nbytes):
            if sum(manager.record(k).padded_nbytes for k in [*held, key, kept]) > budget:
                break
            manager.acquire(key)
            held.append(key)
        free = budget - manager.stats().cpu_nbytes
        room = free + manager.record(kept).padded_nbytes
        big = next(  # a page-in only the kept tensor's room makes possible
            k
            for k in KEYS[1:]
            if manager.record(k).state is TensorState.NVME and free < manager.record(k).padded_nbytes <= room
        )
        manager.acquire(big)  # would wait forever (or be refused) if a kept tensor were never a victim
        assert manager.record(kept).state is not TensorState.CPU and manager.stats().bytes_out > writes
        for key in [*held, big]:
            manager.release(key, dirty=False)
        again = manager.acquire(kept)  # its value went to NVMe and came back
        assert torch.equal(again, torch.full_like(again, 5.0))
        manager.release(kept, dirty=False)  # no keep: ordinary again
        assert not manager.record(kept).kept

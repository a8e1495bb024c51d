"""BufferPool over real arenas: random sequences, pins, compaction with real memmove, threads, config."""

from __future__ import annotations

import threading

import psutil
import pytest
import torch
from helpers_pool import check_layout
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiermem.core.config import PoolConfig
from tiermem.core.errors import BoundsError, InvalidState, PoolExhausted
from tiermem.core.units import GiB, KiB, MiB
from tiermem.engine.pool import Block, BufferPool, NullPinner, PinStatus, arena_sizes, auto_pool_size

PAGE = 4096
ARENA = 32 * PAGE


class PoolMachine(RuleBasedStateMachine):
    """Two real arenas; every block carries a pattern written through the pool's views."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BufferPool.create(2 * ARENA, arena_size=ARENA, mlock=False)
        self.live: list[tuple[Block, bytes]] = []
        self.serial = 0

    def teardown(self) -> None:
        self.pool.close()

    def pinned_places(self) -> dict[int, tuple[int, int]]:
        return {id(b): (b.arena, b.offset) for b, _ in self.live if b.pinned}

    @rule(pages=st.integers(1, 12), extra=st.integers(0, PAGE - 1))
    def alloc(self, pages: int, extra: int) -> None:
        nbytes = (pages - 1) * PAGE + extra + 1
        free_per_arena = [a.free_bytes for a in self.pool.allocators]
        pinned = self.pinned_places()
        block = self.pool.try_alloc(nbytes, owner="prop")
        assert self.pinned_places() == pinned
        if block is None:
            assert max(free_per_arena) < pages * PAGE or pinned
            return
        self.serial += 1
        pattern = bytes((self.serial * 31 + i) % 256 for i in range(block.nbytes))
        self.pool.view(block)[:] = pattern
        self.live.append((block, pattern))

    @precondition(lambda self: any(not b.pinned for b, _ in self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from([e for e in self.live if not e[0].pinned]))
        self.pool.free(entry[0])
        self.live.remove(entry)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        self.pool.pin(data.draw(st.sampled_from(self.live))[0])

    @precondition(lambda self: any(b.pinned for b, _ in self.live))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        self.pool.unpin(data.draw(st.sampled_from([e for e in self.live if e[0].pinned]))[0])

    @rule()
    def compact(self) -> None:
        pinned = self.pinned_places()
        self.pool.compact()
        assert self.pinned_places() == pinned

    @invariant()
    def layout_and_contents_hold(self) -> None:
        for allocator in self.pool.allocators:
            check_layout(allocator)
        assert self.pool.used + self.pool.free_bytes == self.pool.capacity
        for block, pattern in self.live:
            assert bytes(self.pool.view(block)) == pattern


PoolMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase


@pytest.fixture
def pool() -> BufferPool:
    with BufferPool.create(1 * MiB, arena_size=512 * KiB, mlock=False) as pool:
        yield pool


def test_blocks_never_span_arenas(pool: BufferPool) -> None:
    with pytest.raises(PoolExhausted) as info:
        pool.alloc(600 * KiB)
    assert info.value.largest_free == 512 * KiB and info.value.free == 1 * MiB
    first, second = pool.alloc(512 * KiB), pool.alloc(512 * KiB)
    assert {first.arena, second.arena} == {0, 1}
    assert pool.try_alloc(1) is None


def test_pinned_context_yields_a_view_and_releases_the_pin(pool: BufferPool) -> None:
    block = pool.alloc(8 * KiB)
    with pool.pinned(block) as view:
        assert block.pinned and len(view) == 8 * KiB
        view[:4] = b"pin!"
    assert not block.pinned
    assert bytes(pool.view(block)[:4]) == b"pin!"


def test_tensor_shares_the_block_memory_and_follows_compaction(pool: BufferPool) -> None:
    filler = pool.alloc(64 * KiB)
    block = pool.alloc(16 * KiB)
    t = pool.tensor(block, torch.float32, (4, 1024))
    t.fill_(1.5)
    pool.free(filler)
    pool.compact()
    assert block.offset == 0
    moved = pool.tensor(block, torch.float32, (4, 1024))
    assert torch.equal(moved, torch.full((4, 1024), 1.5))
    with pytest.raises(BoundsError):
        pool.tensor(block, torch.float64, (4, 1024))


def test_view_of_a_freed_block_is_refused(pool: BufferPool) -> None:
    block = pool.alloc(4 * KiB)
    pool.free(block)
    with pytest.raises(InvalidState):
        pool.view(block)
    with pytest.raises(InvalidState):
        pool.free(block)


def test_eviction_callback_may_free_from_inside_alloc() -> None:
    victims: list[Block] = []
    asked: list[int] = []

    def evict(nbytes: int) -> bool:
        asked.append(nbytes)
        pool.free(victims.pop())
        return True

    with BufferPool.create(1 * MiB, arena_size=512 * KiB, mlock=False, evict=evict) as pool:
        victims.extend(pool.alloc(256 * KiB) for _ in range(4))
        block = pool.alloc(200 * KiB)
        assert asked == [200 * KiB] and block.nbytes == 200 * KiB and len(victims) == 3


def test_concurrent_alloc_and_free_keep_the_layout_consistent(pool: BufferPool) -> None:
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        held: list[Block] = []
        try:
            for i in range(300):
                block = pool.try_alloc(((seed * 7 + i) % 9 + 1) * 4 * KiB)
                if block is not None:
                    held.append(block)
                if len(held) > 6 or (block is None and held):
                    pool.free(held.pop(i % len(held)))
            for block in held:
                pool.free(block)
        except BaseException as exc:  # collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for allocator in pool.allocators:
        check_layout(allocator)
    assert pool.used == 0 and pool.blocks == 0


def test_closed_pool_refuses_work() -> None:
    pool = BufferPool.create(64 * KiB, mlock=False)
    block = pool.alloc(4 * KiB)
    pool.close()
    with pytest.raises(InvalidState):
        pool.alloc(4 * KiB)
    with pytest.raises(InvalidState):
        pool.view(block)


def test_from_config_builds_arenas_of_at_most_arena_size() -> None:
    config = PoolConfig(size=5 * MiB, arena_size=2 * MiB, mlock=False)
    with BufferPool.from_config(config) as pool:
        assert [a.nbytes for a in pool.arenas] == [2 * MiB, 2 * MiB, 1 * MiB]
        assert pool.capacity == 5 * MiB and pool.fragmentation == pytest.approx(0.6)


def test_size_zero_means_half_of_available_memory() -> None:
    size = auto_pool_size()
    assert size % PAGE == 0
    assert abs(size - psutil.virtual_memory().available // 2) < 512 * MiB
    sizes = arena_sizes(size, GiB)
    assert sum(sizes) == size and max(sizes) <= GiB


def test_pinner_results_are_recorded_and_nothing_raises_without_cuda() -> None:
    with BufferPool.create(64 * KiB, mlock=False, pinner=NullPinner()) as pool:
        (result,) = pool.pin_results
        assert result.status is PinStatus.SKIPPED and not result.registered
        assert result.nbytes == 64 * KiB and "CUDA unavailable" in str(result)

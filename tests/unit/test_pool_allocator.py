"""The pure allocator and compaction planner: best fit, coalescing, compaction, eviction, errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from tiermem.core.errors import InvalidArgument, InvalidState, PoolExhausted
from tiermem.engine.pool import Allocator, Block, BlockState, Move, plan_compaction, plan_evacuation, plan_local_slide

A = 4096


def test_sizes_are_rounded_up_and_offsets_aligned() -> None:
    alloc = Allocator(16 * A)
    first = alloc.alloc(1)
    second = alloc.alloc(A + 1)
    assert (first.offset, first.nbytes, first.requested) == (0, A, 1)
    assert (second.offset, second.nbytes) == (A, 2 * A)
    assert alloc.used == 3 * A and alloc.free_bytes == 13 * A


def test_best_fit_picks_the_smallest_free_block_that_holds_the_request() -> None:
    alloc = Allocator(16 * A)
    blocks = [alloc.alloc(n * A) for n in (3, 1, 1, 1, 2, 1)]  # holes of 3 and 2 once freed
    alloc.free(blocks[0])
    alloc.free(blocks[4])
    got = alloc.alloc(2 * A)
    assert got.offset == blocks[4].offset


def test_free_coalesces_with_both_neighbors() -> None:
    alloc = Allocator(8 * A)
    left, middle, right, tail = (alloc.alloc(A) for _ in range(4))
    alloc.free(left)
    alloc.free(right)
    assert alloc.free_extents() == [(0, A), (2 * A, A), (4 * A, 4 * A)]
    alloc.free(middle)
    assert alloc.free_extents() == [(0, 3 * A), (4 * A, 4 * A)]
    alloc.free(tail)
    assert alloc.free_extents() == [(0, 8 * A)]
    assert alloc.largest_free == 8 * A and alloc.blocks == 0


def full_pages(pages: int, *, free: Sequence[int] = (), **options: Any) -> tuple[Allocator, list[Block]]:
    """An allocator of ``pages`` pages, each holding a one-page block, then the blocks at ``free`` freed."""
    alloc = Allocator(pages * A, **options)
    blocks = [alloc.alloc(A) for _ in range(pages)]
    for i in free:
        alloc.free(blocks[i])
    return alloc, blocks


def one_block() -> tuple[Allocator, Block]:
    """An allocator of four blocks' room holding one live block."""
    alloc = Allocator(4 * A)
    return alloc, alloc.alloc(A)


def test_double_free_raises_invalid_state() -> None:
    alloc, block = one_block()
    alloc.free(block)
    assert block.state is BlockState.FREED
    with pytest.raises(InvalidState, match="double free"):
        alloc.free(block)


def test_freeing_a_block_from_another_allocator_raises() -> None:
    one, two = Allocator(4 * A), Allocator(4 * A)
    block = one.alloc(A)
    two.alloc(A)
    with pytest.raises(InvalidState):
        two.free(block)


def test_freed_block_cannot_be_pinned() -> None:
    alloc, block = one_block()
    alloc.free(block)
    with pytest.raises(InvalidState):
        alloc.pin(block)


def test_pinned_block_cannot_be_freed_and_unpin_below_zero_raises() -> None:
    alloc, block = one_block()
    alloc.pin(block)
    with pytest.raises(InvalidState, match="pin"):
        alloc.free(block)
    alloc.unpin(block)
    with pytest.raises(InvalidState):
        alloc.unpin(block)
    alloc.free(block)


def test_block_state_transition_rejects_illegal_moves() -> None:
    block = Block(0, A, A)
    block.transition(BlockState.FREED)
    with pytest.raises(InvalidState):
        block.transition(BlockState.LIVE)


@pytest.mark.parametrize("nbytes", [0, -1, 2.0, True])
def test_alloc_rejects_sizes_that_are_not_positive_integers(nbytes: object) -> None:
    with pytest.raises(InvalidArgument):
        Allocator(4 * A).alloc(nbytes)  # type: ignore[arg-type]


@pytest.mark.parametrize(("capacity", "alignment"), [(0, A), (A - 1, A), (8 * A, 3000)])
def test_allocator_rejects_bad_capacity_or_alignment(capacity: int, alignment: int) -> None:
    with pytest.raises(InvalidArgument):
        Allocator(capacity, alignment=alignment)


def test_exhausted_pool_reports_requested_free_and_largest_free() -> None:
    alloc, blocks = full_pages(8, free=(2, 5))
    alloc.pin(blocks[3])
    alloc.pin(blocks[4])
    with pytest.raises(PoolExhausted) as info:
        alloc.alloc(3 * A)
    err = info.value
    assert (err.requested, err.free, err.largest_free) == (3 * A, 2 * A, A)
    assert alloc.try_alloc(3 * A) is None


def test_request_larger_than_capacity_fails_without_compacting() -> None:
    alloc = Allocator(4 * A)
    assert alloc.try_alloc(5 * A) is None
    assert alloc.compactions == 0


def test_compaction_makes_room_when_total_free_space_suffices() -> None:
    moved: list[Move] = []
    alloc, blocks = full_pages(8, free=range(0, 8, 2), mover=moved.extend)
    assert alloc.largest_free == A and alloc.fragmentation == pytest.approx(0.75)
    big = alloc.alloc(4 * A)
    assert alloc.compactions == 1 and alloc.bytes_moved == sum(m.nbytes for m in moved) > 0
    assert alloc.bytes_moved == 2 * A  # any 4-page stretch holds two live pages: the cheapest plan moves two
    assert all(b.end <= big.offset or b.offset >= big.end for b in blocks[1::2])


def test_compaction_moves_only_what_the_request_needs() -> None:
    alloc, _ = full_pages(16, free=(0, 2, 15))
    alloc.alloc(2 * A)
    assert alloc.bytes_moved == A  # sliding blocks[1] down opens the two-page hole


def test_compaction_never_moves_pinned_blocks() -> None:
    alloc, blocks = full_pages(8, free=(0, 2, 4, 6))
    alloc.pin(blocks[3])
    alloc.compact()
    assert blocks[3].offset == 3 * A
    assert sorted(b.offset for b in (blocks[1], blocks[5], blocks[7])) == [0, A, 2 * A]
    assert alloc.free_extents() == [(4 * A, 4 * A)]


def test_eviction_callback_is_asked_before_failing_and_its_frees_count() -> None:
    asked: list[int] = []
    held: list[Block] = []

    def evict(nbytes: int) -> bool:
        asked.append(nbytes)
        while held and alloc.free_bytes < nbytes:
            alloc.free(held.pop(0))
        return True

    alloc = Allocator(4 * A, evict=evict)
    held.extend(alloc.alloc(A) for _ in range(4))
    block = alloc.alloc(2 * A)
    assert asked == [2 * A]
    assert block.nbytes == 2 * A and alloc.blocks == 3


def test_eviction_that_frees_nothing_ends_in_pool_exhausted() -> None:
    calls: list[int] = []

    def evict(nbytes: int) -> bool:
        calls.append(nbytes)
        return True  # claims success but frees nothing

    alloc = Allocator(2 * A, evict=evict)
    alloc.alloc(2 * A)
    with pytest.raises(PoolExhausted):
        alloc.alloc(A)
    assert calls == [A]


# ---------------------------------------------------------------- planner


def execute(memory: bytearray, moves: Sequence[Move]) -> None:
    for m in moves:
        memory[m.dst : m.dst + m.nbytes] = memory[m.src : m.src + m.nbytes]


def test_plan_slides_blocks_down_in_order_with_overlapping_moves() -> None:
    moves = plan_compaction([(10, 20, False), (40, 5, False)], 64)
    assert moves == [Move(10, 0, 20), Move(40, 20, 5)]
    assert moves[0].src < moves[0].dst + moves[0].nbytes  # source and destination overlap


def test_plan_fills_the_hole_before_a_pinned_block_with_a_later_block() -> None:
    layout = [(0, 4, False), (8, 4, True), (16, 4, False), (24, 2, False)]
    moves = plan_compaction(layout, 32)
    assert Move(16, 4, 4) in moves  # hole [4, 8) before the pinned block takes the 4-byte block
    assert all(m.src != 8 for m in moves)


def test_plan_preserves_contents_when_executed_in_order() -> None:
    layout = [(3, 5, False), (9, 2, True), (12, 6, False), (20, 3, False), (25, 7, False)]
    memory = bytearray(32)
    for index, (offset, nbytes, _) in enumerate(layout):
        memory[offset : offset + nbytes] = bytes([index + 1]) * nbytes
    moves = plan_compaction(layout, 32)
    execute(memory, moves)
    new = {m.src: m.dst for m in moves}
    for index, (offset, nbytes, _) in enumerate(layout):
        start = new.get(offset, offset)
        assert memory[start : start + nbytes] == bytes([index + 1]) * nbytes


def test_plan_with_need_stops_once_the_hole_is_big_enough() -> None:
    layout = [(4, 4, False), (12, 4, False), (20, 4, False)]
    assert plan_compaction(layout, 32, need=8) == [Move(4, 0, 4)]
    assert len(plan_compaction(layout, 32)) == 3


def test_plan_of_a_packed_layout_is_empty() -> None:
    assert plan_compaction([(0, 8, False), (8, 8, True)], 32) == []


def test_evacuation_empties_the_stretch_with_the_fewest_live_bytes() -> None:
    # Free [4, 8) and [10, 16) around a 2-byte block; [16, 30) packed; free tail [30, 32).
    layout = [(0, 4, False), (8, 2, False), (16, 8, False), (24, 6, False)]
    moves = plan_evacuation(layout, 32, need=8)
    assert moves == [Move(8, 30, 2)]  # moving 2 bytes to the tail opens [4, 16); sliding would move 16


def test_evacuation_never_moves_pinned_blocks_and_gives_up_without_room() -> None:
    layout = [(0, 4, True), (6, 4, True), (12, 4, True)]
    assert plan_evacuation(layout, 16, need=4) is None


def test_allocator_picks_the_cheaper_plan() -> None:
    alloc, _ = full_pages(16, free=(0, 9, 11, 13, 15))
    alloc.alloc(2 * A)  # sliding would move 9 blocks; evacuating [9A, 11A) moves one
    assert alloc.bytes_moved == A


def test_local_slide_moves_only_the_stretch_that_gathers_enough_free_space() -> None:
    # Free [10, 12) and [14, 16) around a 2-byte block; everything else packed; need 4 free bytes.
    layout = [(0, 10, False), (12, 2, False), (16, 16, False)]
    assert plan_local_slide(layout, 32, need=4) == [Move(12, 10, 2)]


def test_local_slide_cannot_cross_a_pinned_block() -> None:
    layout = [(2, 2, False), (4, 4, True), (10, 2, False)]
    assert plan_local_slide(layout, 12, need=4) is None

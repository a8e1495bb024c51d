"""Random alloc/free/pin/unpin/compact sequences on the pure allocator keep its invariants.

Memory is a bytearray that the allocator's mover rearranges, so a block's
pattern surviving compaction checks the plan's move order as well.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from integration.helpers_pool import check_layout

from tiermem.core.errors import InvalidState
from tiermem.engine.pool import Allocator, Block, Move

ALIGN = 64
CAPACITY = 64 * ALIGN


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.memory = bytearray(CAPACITY)
        self.allocator = Allocator(CAPACITY, alignment=ALIGN, mover=self.move)
        self.live: list[tuple[Block, int]] = []  # (block, pattern byte)
        self.serial = 0

    def move(self, moves: Sequence[Move]) -> None:
        for m in moves:
            self.memory[m.dst : m.dst + m.nbytes] = self.memory[m.src : m.src + m.nbytes]

    def pinned_offsets(self) -> dict[int, int]:
        return {id(b): b.offset for b, _ in self.live if b.pinned}

    @rule(nbytes=st.integers(1, CAPACITY // 4))
    def alloc(self, nbytes: int) -> None:
        rounded = -(-nbytes // ALIGN) * ALIGN
        free_before = self.allocator.free_bytes
        pinned = self.pinned_offsets()
        block = self.allocator.try_alloc(nbytes)
        assert self.pinned_offsets() == pinned
        if block is None:
            # Without pins, compaction always opens a hole as big as the free space.
            assert rounded > free_before or pinned
            return
        assert block.nbytes == rounded and block.requested == nbytes
        self.serial += 1
        pattern = self.serial % 255 + 1
        self.memory[block.offset : block.end] = bytes([pattern]) * block.nbytes
        self.live.append((block, pattern))

    @precondition(lambda self: any(not b.pinned for b, _ in self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        choices = [entry for entry in self.live if not entry[0].pinned]
        entry = data.draw(st.sampled_from(choices))
        self.allocator.free(entry[0])
        self.live.remove(entry)
        try:
            self.allocator.free(entry[0])
        except InvalidState:
            pass
        else:
            raise AssertionError("double free was accepted")

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        block, _ = data.draw(st.sampled_from(self.live))
        self.allocator.pin(block)

    @precondition(lambda self: any(b.pinned for b, _ in self.live))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        block, _ = data.draw(st.sampled_from([e for e in self.live if e[0].pinned]))
        self.allocator.unpin(block)

    @rule()
    def compact(self) -> None:
        pinned = self.pinned_offsets()
        self.allocator.compact()
        assert self.pinned_offsets() == pinned
        if not pinned:
            assert len(self.allocator.free_extents()) <= 1

    @invariant()
    def layout_holds(self) -> None:
        check_layout(self.allocator)
        assert {id(b) for b, _ in self.live} == {id(b) for b in self.allocator.live_blocks()}

    @invariant()
    def contents_survive(self) -> None:
        for block, pattern in self.live:
            assert self.memory[block.offset : block.end] == bytes([pattern]) * block.nbytes


AllocatorMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase

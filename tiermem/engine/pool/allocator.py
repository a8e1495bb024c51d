"""A best-fit, coalescing, compacting allocator over ``[0, capacity)`` (pure logic).

Owns the layout of one address range: which extents are live (one ``Block``
record each) and which are free.  It touches no memory and makes no system
call; a ``mover`` callback, when given, copies the bytes of a compaction
(``BufferPool`` passes one that ``memmove``s inside its arena).

Callers hold ``Block`` handles, never raw offsets: when compaction moves a
block, the allocator updates ``block.offset``.  A block with pins (I/O in
flight, mapped by a client) never moves.

Invariants (checked by the property tests):
- live blocks never overlap; every offset and size is a multiple of
  ``alignment`` (a power of two);
- free extents never touch: freeing merges a block with both free neighbours;
- ``used + free == capacity``.

Free extents are indexed three ways so that alloc and free are O(log n):
``_by_size`` (a sorted list of ``(nbytes, offset)`` for best fit, ties broken
by the lowest offset), ``_by_start`` (offset -> nbytes) and ``_by_end``
(end -> offset) for finding neighbours.

Allocation ladder (``allocate``): best fit; else, where an allocator's total
free space would hold the request, compact it just enough and retry; else ask
the ``evict`` callback to free something and start again; else give up.
"""

from __future__ import annotations

import abc
import bisect
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Generic, TypeVar, overload

from tiermem.core.errors import InvalidArgument, InvalidState, PoolExhausted
from tiermem.core.figures import Family, counter, gauge
from tiermem.core.units import PAGE_SIZE, align_up, format_size
from tiermem.engine.pool.compaction import Move, plan_compaction, plan_for

__all__ = [
    "Allocator",
    "Block",
    "BlockState",
    "EvictFn",
    "MoverFn",
    "PoolFigures",
    "PoolStats",
    "allocate",
    "fragmentation",
]

EvictFn = Callable[[int], bool]
"""``evict(nbytes_needed) -> bool``: free some blocks; True when something was freed."""
MoverFn = Callable[[Sequence[Move]], None]
"""Executes a compaction plan on real memory, moves in the order given."""


class BlockState(enum.Enum):
    LIVE = "live"
    FREED = "freed"


_ALLOWED = {BlockState.LIVE: frozenset({BlockState.FREED}), BlockState.FREED: frozenset()}


@dataclass(eq=False, slots=True)
class Block:
    """One allocation: where it is now, how big, who owns it, how many pins hold it in place."""

    offset: int
    """Current offset inside its arena; updated by compaction."""
    nbytes: int
    """Reserved bytes (the request rounded up to the alignment)."""
    requested: int
    """Bytes the caller asked for."""
    owner: str = ""
    arena: int = 0
    """Index of the allocator (arena) the block lives in."""
    state: BlockState = BlockState.LIVE
    pins: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def pinned(self) -> bool:
        return self.pins > 0

    def transition(self, to: BlockState) -> None:
        """Move to state ``to``; raises ``InvalidState`` for an illegal move (e.g. a double free)."""
        if to not in _ALLOWED[self.state]:
            what = "double free" if to is BlockState.FREED else "illegal transition"
            raise InvalidState(
                f"{what}: block of {format_size(self.nbytes)} (owner {self.owner!r}, arena {self.arena}) "
                f"is {self.state.value}, cannot become {to.value}"
            )
        self.state = to


def fragmentation(free: int, largest_free: int) -> float:
    """Share of free space outside the largest free extent: 0 when all of it is in one piece."""
    return 0.0 if free == 0 else 1.0 - largest_free / free


POOL_CAPACITY = Family("tiermem_pool_capacity_bytes", "Bytes of the daemon's host-memory pool.")
POOL_BYTES = Family("tiermem_pool_bytes", "Pool bytes in live blocks (used) and not (free).", label="state")
POOL_LARGEST_FREE = Family("tiermem_pool_largest_free_block_bytes", "The largest free extent of the pool.")
POOL_BLOCKS = Family("tiermem_pool_blocks", "Live blocks in the pool.")
POOL_COMPACTIONS = Family("tiermem_pool_compactions", "Compactions of the pool.")
POOL_MOVED = Family("tiermem_pool_compaction_moved_bytes", "Bytes moved by compactions.")
POOL_LOCKED = Family("tiermem_pool_locked_bytes", "Pool bytes locked in RAM (mlock).")


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of an allocator's (or a whole pool's) counters, in bytes unless named otherwise."""

    capacity: Annotated[int, gauge(POOL_CAPACITY, wire="capacity_nbytes")]
    used: Annotated[int, gauge(POOL_BYTES.at("used"), wire="used_nbytes")]
    free: Annotated[int, gauge(POOL_BYTES.at("free"), wire="free_nbytes")]
    largest_free: Annotated[int, gauge(POOL_LARGEST_FREE, wire="largest_free_nbytes")]
    blocks: Annotated[int, gauge(POOL_BLOCKS)]
    compactions: Annotated[int, counter(POOL_COMPACTIONS)]
    bytes_moved: Annotated[int, counter(POOL_MOVED, wire="moved_nbytes")]
    locked: Annotated[int, gauge(POOL_LOCKED, wire="locked_nbytes")] = 0
    """Bytes of arenas locked in RAM (filled in by ``BufferPool.stats``; an allocator alone knows none)."""

    @property
    def fragmentation(self) -> float:
        return fragmentation(self.free, self.largest_free)

    @classmethod
    def combine(cls, parts: Sequence[PoolStats]) -> PoolStats:
        """Totals over several arenas (``largest_free`` is the largest of any)."""
        return cls(
            capacity=sum(p.capacity for p in parts),
            used=sum(p.used for p in parts),
            free=sum(p.free for p in parts),
            largest_free=max((p.largest_free for p in parts), default=0),
            blocks=sum(p.blocks for p in parts),
            compactions=sum(p.compactions for p in parts),
            bytes_moved=sum(p.bytes_moved for p in parts),
        )


_T = TypeVar("_T")


class _Figure(Generic[_T]):
    """A read-only attribute of a ``PoolFigures``: one figure of a fresh ``stats()`` snapshot."""

    def __init__(self, read: Callable[[PoolStats], _T], doc: str | None = None) -> None:
        self._read = read
        self.__doc__ = doc

    @overload
    def __get__(self, obj: None, owner: type) -> _Figure[_T]: ...
    @overload
    def __get__(self, obj: PoolFigures, owner: type) -> _T: ...
    def __get__(self, obj: PoolFigures | None, owner: type) -> _Figure[_T] | _T:
        return self if obj is None else self._read(obj.stats())


class PoolFigures(abc.ABC):
    """The figures of ``stats()`` as read-only attributes, an allocator's or a whole pool's; each is read from
    a fresh snapshot, so read ``stats()`` once for several that must agree.  (``capacity`` is each owner's own
    property: the allocation path reads it.)"""

    @abc.abstractmethod
    def stats(self) -> PoolStats: ...

    used = _Figure(lambda s: s.used)
    free_bytes = _Figure(lambda s: s.free, "Bytes not in any live block (``free`` is the method that returns a block).")
    largest_free = _Figure(lambda s: s.largest_free)
    fragmentation = _Figure(lambda s: s.fragmentation)
    blocks = _Figure(lambda s: s.blocks)
    compactions = _Figure(lambda s: s.compactions)
    bytes_moved = _Figure(lambda s: s.bytes_moved)


class Allocator(PoolFigures):
    """Best-fit allocation over ``capacity`` bytes with coalescing, compaction and eviction."""

    def __init__(
        self,
        capacity: int,
        *,
        alignment: int = PAGE_SIZE,
        evict: EvictFn | None = None,
        mover: MoverFn | None = None,
        index: int = 0,
    ) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidArgument(f"alignment must be a power of two, got {alignment}")
        capacity -= capacity % alignment
        if capacity <= 0:
            raise InvalidArgument(f"capacity must hold at least one {alignment}-byte block, got {capacity}")
        self._capacity = capacity
        self._alignment = alignment
        self._evict = evict
        self._mover = mover
        self._index = index
        self._live: dict[int, Block] = {}
        self._by_size: list[tuple[int, int]] = []
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._add_free(0, capacity)
        self._used = 0
        self._compactions = 0
        self._bytes_moved = 0

    # ------------------------------------------------------------------ stats

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def index(self) -> int:
        return self._index

    def stats(self) -> PoolStats:
        return PoolStats(
            capacity=self._capacity,
            used=self._used,
            free=self._capacity - self._used,
            largest_free=self._by_size[-1][0] if self._by_size else 0,
            blocks=len(self._live),
            compactions=self._compactions,
            bytes_moved=self._bytes_moved,
        )

    def live_blocks(self) -> list[Block]:
        """Live blocks in offset order."""
        return [self._live[offset] for offset in sorted(self._live)]

    def free_extents(self) -> list[tuple[int, int]]:
        """Free ``(offset, nbytes)`` extents in offset order."""
        return sorted(self._by_start.items())

    # ------------------------------------------------------------------ allocation

    def round(self, nbytes: int) -> int:
        """``nbytes`` rounded up to the alignment; rejects sizes that are not positive integers."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument(f"allocation size must be a positive number of bytes, got {nbytes!r}")
        return align_up(nbytes, self._alignment)

    def best_fit(self, nbytes: int) -> int | None:
        """Size of the smallest free extent that holds ``nbytes`` (already rounded), or None."""
        i = bisect.bisect_left(self._by_size, (nbytes, -1))
        return self._by_size[i][0] if i < len(self._by_size) else None

    def fit(self, nbytes: int, *, owner: str = "") -> Block | None:
        """Best fit only: no compaction, no eviction.  None when no free extent is big enough."""
        size = self.round(nbytes)
        i = bisect.bisect_left(self._by_size, (size, -1))
        if i == len(self._by_size):
            return None
        extent, offset = self._by_size[i]
        self._remove_free(offset, extent)
        if extent > size:
            self._add_free(offset + size, extent - size)
        block = Block(offset, size, nbytes, owner, self._index)
        self._live[offset] = block
        self._used += size
        return block

    def try_alloc(self, nbytes: int, *, owner: str = "") -> Block | None:
        """A block of at least ``nbytes`` after compaction and eviction if needed, or None."""
        return allocate([self], nbytes, owner, self._evict)

    def alloc(self, nbytes: int, *, owner: str = "") -> Block:
        """Like ``try_alloc`` but raises ``PoolExhausted(requested, free, largest_free)``."""
        block = self.try_alloc(nbytes, owner=owner)
        if block is None:
            stats = self.stats()
            raise PoolExhausted(nbytes, stats.free, stats.largest_free, what="allocator")
        return block

    def free(self, block: Block) -> None:
        """Return ``block``; merges it with free neighbours.  Double free raises ``InvalidState``."""
        if block.state is BlockState.LIVE:  # a double free is rejected by the transition itself
            self.check_live(block)
            if block.pins:
                raise InvalidState(f"block at offset {block.offset} has {block.pins} pin(s); unpin it before freeing")
        block.transition(BlockState.FREED)
        del self._live[block.offset]
        self._used -= block.nbytes
        start, size = block.offset, block.nbytes
        before = self._by_end.get(start)
        if before is not None:
            self._remove_free(before, start - before)
            size += start - before
            start = before
        after = self._by_start.get(block.end)
        if after is not None:
            self._remove_free(block.end, after)
            size += after
        self._add_free(start, size)

    def pin(self, block: Block) -> None:
        """Hold ``block`` in place: compaction packs around it until ``unpin``."""
        self.check_live(block)
        block.pins += 1

    def unpin(self, block: Block) -> None:
        self.check_live(block)
        if block.pins == 0:
            raise InvalidState(f"block at offset {block.offset} is not pinned")
        block.pins -= 1

    # ------------------------------------------------------------------ compaction

    def compact(self, need: int | None = None) -> int:
        """Make room by moving unpinned blocks; returns bytes moved.

        Without ``need``, packs everything toward offset 0.  With ``need``, runs
        the cheaper of sliding (until a free run of ``need`` exists) and
        evacuating the cheapest stretch of ``need`` bytes.
        """
        extents = [(b.offset, b.nbytes, b.pins > 0) for b in self._live.values()]
        moves = plan_compaction(extents, self._capacity) if need is None else plan_for(extents, self._capacity, need)
        if not moves:
            return 0
        if self._mover is not None:
            self._mover(moves)
        moved = [self._live.pop(m.src) for m in moves]
        for move, block in zip(moves, moved, strict=True):
            block.offset = move.dst
            self._live[move.dst] = block
        self._rebuild_free()
        nbytes = sum(m.nbytes for m in moves)
        self._compactions += 1
        self._bytes_moved += nbytes
        return nbytes

    # ------------------------------------------------------------------ internals

    def check_live(self, block: Block) -> None:
        """Raise ``InvalidState`` unless ``block`` is live and was allocated here."""
        if block.state is not BlockState.LIVE:
            raise InvalidState(f"block of {format_size(block.nbytes)} (owner {block.owner!r}) is {block.state.value}")
        if self._live.get(block.offset) is not block:
            raise InvalidState(f"block at offset {block.offset} (arena {block.arena}) was not allocated here")

    def _add_free(self, offset: int, nbytes: int) -> None:
        bisect.insort(self._by_size, (nbytes, offset))
        self._by_start[offset] = nbytes
        self._by_end[offset + nbytes] = offset

    def _remove_free(self, offset: int, nbytes: int) -> None:
        i = bisect.bisect_left(self._by_size, (nbytes, offset))
        del self._by_size[i]
        del self._by_start[offset]
        del self._by_end[offset + nbytes]

    def _rebuild_free(self) -> None:
        self._by_size.clear()
        self._by_start.clear()
        self._by_end.clear()
        cursor = 0
        for offset in sorted(self._live):
            if offset > cursor:
                self._add_free(cursor, offset - cursor)
            cursor = offset + self._live[offset].nbytes
        if cursor < self._capacity:
            self._add_free(cursor, self._capacity - cursor)


def allocate(allocators: Sequence[Allocator], nbytes: int, owner: str, evict: EvictFn | None) -> Block | None:
    """The allocation ladder over one or more allocators (arenas); a block never spans two.

    1. best fit across all allocators (the smallest free extent that holds it);
    2. else compact, one by one, those whose total free space would hold it;
    3. else ``evict(size)`` and start again, as long as eviction frees something;
    4. else None.
    """
    size = allocators[0].round(nbytes)
    if size > max(a.capacity for a in allocators):
        return None
    while True:
        best: Allocator | None = None
        best_size = 0
        for a in allocators:
            fit = a.best_fit(size)
            if fit is not None and (best is None or fit < best_size):
                best, best_size = a, fit
        if best is not None:
            return best.fit(nbytes, owner=owner)
        for a in sorted(allocators, key=lambda a: a.free_bytes, reverse=True):
            if a.free_bytes < size:
                break
            a.compact(need=size)
            block = a.fit(nbytes, owner=owner)
            if block is not None:
                return block
        if evict is None:
            return None
        free_before = sum(a.free_bytes for a in allocators)
        if not evict(size) or sum(a.free_bytes for a in allocators) <= free_before:
            return None

"""Extents: where a stored object's bytes live in the swap files.  Pure logic, no I/O.

``ExtentAllocator`` hands out 4 KiB-aligned byte ranges of one file of a given
capacity: first fit over a sorted free list, coalescing on free.  Invariants:
free ranges are sorted, never overlap, never touch (adjacent ranges are merged)
and lie inside [0, capacity); every offset and size is a multiple of
``alignment``; ``free_nbytes + used_nbytes == capacity``.

Striping: an object of ``nbytes`` is cut into ``stripe_nbytes`` stripes dealt
round-robin over its extents (one extent per file used, listed in dealing
order).  Stripe ``j`` lies in ``extents[j % k]`` at ``offset + (j // k) *
stripe_nbytes``, so each extent holds its stripes back to back.  With a single
extent the whole object is one contiguous range.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

from tiermem.core.errors import InvalidArgument
from tiermem.core.units import PAGE_SIZE

__all__ = ["Extent", "ExtentAllocator", "Segment", "segments", "stripe_shares"]


@dataclass(frozen=True, slots=True)
class Extent:
    """``nbytes`` at ``offset`` in swap file number ``file``."""

    file: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous piece of an object: ``nbytes`` at ``memory_offset`` <-> extent ``extent`` at ``file_offset``."""

    memory_offset: int
    extent: int
    file_offset: int
    nbytes: int


class ExtentAllocator:
    """First-fit allocator of aligned ranges in one file; see the module docstring."""

    def __init__(self, capacity: int = 0, alignment: int = PAGE_SIZE) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidArgument(f"alignment must be a power of two, got {alignment}")
        self._alignment = alignment
        self._capacity = 0
        self._starts: list[int] = []  # sorted offsets of free ranges
        self._sizes: list[int] = []  # their sizes, same order
        self._free = 0
        self.grow(capacity)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def free_nbytes(self) -> int:
        return self._free

    @property
    def used_nbytes(self) -> int:
        return self._capacity - self._free

    @property
    def largest_free(self) -> int:
        return max(self._sizes, default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of every free range, in file order."""
        return list(zip(self._starts, self._sizes, strict=True))

    def grow(self, capacity: int) -> None:
        """Extend the file's capacity to ``capacity`` bytes (never shrinks)."""
        self._check_aligned("capacity", capacity)
        if capacity > self._capacity:
            old = self._capacity
            self._capacity = capacity
            self._insert(old, capacity - old)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a fresh range of ``nbytes`` (first fit), or None when no free range is large enough."""
        self._check_size(nbytes)
        for i, size in enumerate(self._sizes):
            if size >= nbytes:
                offset = self._starts[i]
                if size == nbytes:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += nbytes
                    self._sizes[i] -= nbytes
                self._free -= nbytes
                return offset
        return None

    def claim(self, offset: int, nbytes: int) -> None:
        """Mark the exact range [offset, offset+nbytes) used (rebuilding state from a manifest)."""
        self._check_size(nbytes)
        self._check_aligned("offset", offset)
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset + nbytes > self._starts[i] + self._sizes[i]:
            raise InvalidArgument(f"range [{offset}, {offset + nbytes}) is not free; cannot claim it")
        start, size = self._starts[i], self._sizes[i]
        del self._starts[i], self._sizes[i]
        self._free -= size
        if offset > start:
            self._insert(start, offset - start)
        if offset + nbytes < start + size:
            self._insert(offset + nbytes, start + size - offset - nbytes)

    def free(self, offset: int, nbytes: int) -> None:
        """Return a used range; raises ``InvalidArgument`` if any byte of it is already free or out of bounds."""
        self._check_size(nbytes)
        self._check_aligned("offset", offset)
        if offset + nbytes > self._capacity:
            raise InvalidArgument(f"range [{offset}, {offset + nbytes}) exceeds capacity {self._capacity}")
        i = bisect.bisect_right(self._starts, offset)
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] > offset:
            raise InvalidArgument(f"double free: range at {offset} overlaps free range at {self._starts[i - 1]}")
        if i < len(self._starts) and self._starts[i] < offset + nbytes:
            raise InvalidArgument(f"double free: range at {offset} overlaps free range at {self._starts[i]}")
        self._insert(offset, nbytes)

    def _insert(self, offset: int, nbytes: int) -> None:
        """Add a free range known not to overlap any other, merging with touching neighbours."""
        i = bisect.bisect_right(self._starts, offset)
        self._free += nbytes
        if i < len(self._starts) and self._starts[i] == offset + nbytes:
            nbytes += self._sizes[i]
            del self._starts[i], self._sizes[i]
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == offset:
            self._sizes[i - 1] += nbytes
        else:
            self._starts.insert(i, offset)
            self._sizes.insert(i, nbytes)

    def _check_size(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise InvalidArgument(f"extent size must be > 0, got {nbytes}")
        self._check_aligned("size", nbytes)

    def _check_aligned(self, what: str, value: int) -> None:
        if value < 0 or value % self._alignment:
            raise InvalidArgument(f"extent {what} must be a non-negative multiple of {self._alignment}, got {value}")


def stripe_shares(nbytes: int, nfiles: int, stripe_nbytes: int) -> list[int]:
    """Bytes each of up to ``nfiles`` extents holds when ``nbytes`` are dealt in stripes (no empty shares)."""
    if nbytes <= 0 or nfiles <= 0 or stripe_nbytes <= 0:
        raise InvalidArgument(f"need positive sizes, got nbytes={nbytes} nfiles={nfiles} stripe={stripe_nbytes}")
    nstripes = -(-nbytes // stripe_nbytes)
    k = min(nfiles, nstripes)
    shares = [0] * k
    for j in range(nstripes):
        shares[j % k] += min(stripe_nbytes, nbytes - j * stripe_nbytes)
    return shares


def segments(nbytes: int, extents: list[Extent], stripe_nbytes: int) -> Iterator[Segment]:
    """The pieces of an ``nbytes`` object laid out over ``extents`` (see the module docstring), in memory order."""
    k = len(extents)
    if k == 1:
        yield Segment(0, 0, extents[0].offset, nbytes)
        return
    for j, start in enumerate(range(0, nbytes, stripe_nbytes)):
        e = j % k
        yield Segment(start, e, extents[e].offset + (j // k) * stripe_nbytes, min(stripe_nbytes, nbytes - start))

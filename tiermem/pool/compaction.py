"""The compaction planner: which live blocks to move where (pure logic).

Owns nothing; ``plan_compaction`` is a pure function from a layout to a list of
moves.  The allocator applies the plan to its block records, and a binding
layer (``BufferPool``) copies the bytes.

Input: the live extents of one address range ``[0, capacity)`` as
``(offset, nbytes, pinned)``, non-overlapping.  Pinned extents never move, so
they cut the range into *windows*.  Movable extents are taken in offset order
and each goes to the lowest window that still has room for it, at that
window's fill cursor; inside its own window an extent can always stay at or
below where it is, so every extent moves toward lower offsets (or not at all).

Invariants of the plan, relied on by whoever executes it:
- moves are listed in execution order; executed one after the other, a move's
  destination never holds bytes a later move still needs to read;
- a move's source and destination may overlap (an extent sliding down by less
  than its own length), so each move must be done as ``memmove``, not a
  forward ``memcpy`` of possibly overlapping ranges;
- ``src`` values are unique: each live extent moves at most once.

With ``need``, planning stops as soon as a contiguous free run of at least
``need`` bytes exists, so a compaction moves only what it has to.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["Move", "plan_compaction"]


class Move(NamedTuple):
    """Copy ``nbytes`` from ``src`` to ``dst`` (offsets in the same range; may overlap)."""

    src: int
    dst: int
    nbytes: int


def plan_compaction(extents: Iterable[tuple[int, int, bool]], capacity: int, need: int | None = None) -> list[Move]:
    """Moves that pack the movable extents toward offset 0, around the pinned ones.

    ``extents`` are ``(offset, nbytes, pinned)`` of the live blocks (any order).
    Returns the moves in the order they must be executed.  When ``need`` is
    given, stops once a free run of ``need`` bytes has opened up.
    """
    layout = sorted(extents)
    # Each window is [cursor, end): the free tail of a stretch between pinned extents.
    windows: list[list[int]] = []
    start = 0
    for offset, nbytes, pinned in layout:
        if pinned:
            windows.append([start, offset])
            start = offset + nbytes
    windows.append([start, capacity])

    moves: list[Move] = []
    current = 0  # index of the window that holds the extent being placed
    for i, (offset, nbytes, pinned) in enumerate(layout):
        if pinned:
            current += 1
            continue
        target = current
        for j in range(current):
            if windows[j][1] - windows[j][0] >= nbytes:
                target = j
                break
        dst = windows[target][0]
        windows[target][0] = dst + nbytes
        if dst != offset:
            moves.append(Move(offset, dst, nbytes))
        if need is not None:
            following = layout[i + 1][0] if i + 1 < len(layout) else capacity
            if following - windows[current][0] >= need:
                break
    return moves

"""The compaction planners: which live blocks to move where (pure logic).

Owns nothing; each planner is a pure function from a layout to a list of
moves.  The allocator applies a plan to its block records, and a binding
layer (``BufferPool``) copies the bytes.

Input: the live extents of one address range ``[0, capacity)`` as
``(offset, nbytes, pinned)``, non-overlapping.  Pinned extents never move.

- ``plan_compaction`` packs everything toward offset 0.  Pinned extents cut
  the range into windows; movable extents, in offset order, go to the lowest
  window with room, at its fill cursor, so each moves down or not at all.
  With ``need`` it stops once a free run of ``need`` bytes exists.
- ``plan_local_slide`` slides down only the extents of the cheapest unpinned
  stretch that holds ``need`` free bytes; they gather at the stretch's end.
- ``plan_evacuation`` empties the cheapest stretch of ``need`` bytes whose
  extents all fit (best fit, largest first) into free extents outside it.
- ``plan_for`` returns whichever of the three moves the fewest bytes.

Invariants of a plan, relied on by whoever executes it:
- moves are listed in execution order; executed one after the other, a move's
  destination never holds bytes a later move still needs to read;
- a move's source and destination may overlap (an extent sliding down by less
  than its own length), so each move must be done as ``memmove``;
- ``src`` values are unique: each live extent moves at most once.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Sequence
from typing import NamedTuple

__all__ = ["Move", "plan_compaction", "plan_evacuation", "plan_for", "plan_local_slide"]

_CANDIDATES = 16
"""Stretches ``plan_evacuation`` tries, cheapest first, before giving up."""


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


Segment = tuple[int, int, bool, bool]
"""``(start, nbytes, live, pinned)``: a piece of the range; free pieces have live False."""


def _segments(extents: Iterable[tuple[int, int, bool]], capacity: int) -> list[Segment]:
    segments: list[Segment] = []
    cursor = 0
    for offset, nbytes, pinned in sorted(extents):
        if offset > cursor:
            segments.append((cursor, offset - cursor, False, False))
        segments.append((offset, nbytes, True, pinned))
        cursor = offset + nbytes
    if cursor < capacity:
        segments.append((cursor, capacity - cursor, False, False))
    return segments


def _windows(segments: list[Segment], need: int, by_free: bool) -> list[tuple[int, int, int]]:
    """``(live bytes, first, last)`` of the shortest unpinned stretches ending at each segment that hold
    ``need`` bytes in all (``by_free`` False) or ``need`` free bytes (``by_free`` True)."""
    windows: list[tuple[int, int, int]] = []
    first, length, live = 0, 0, 0
    for last, (_, nbytes, is_live, pinned) in enumerate(segments):
        if pinned:
            first, length, live = last + 1, 0, 0
            continue
        length += nbytes
        live += nbytes if is_live else 0
        while first < last:
            drop = segments[first][1]
            dropped_live = drop if segments[first][2] else 0
            if (length - live - (drop - dropped_live) if by_free else length - drop) < need:
                break
            length -= drop
            live -= dropped_live
            first += 1
        if (length - live if by_free else length) >= need:
            windows.append((live, first, last))
    return windows


def plan_local_slide(extents: Iterable[tuple[int, int, bool]], capacity: int, need: int) -> list[Move] | None:
    """Slide down the live extents of the cheapest unpinned stretch holding ``need`` free bytes.

    The stretch's free bytes gather at its end; only the extents inside it move.
    None when no stretch without pinned extents holds that much free space.
    """
    segments = _segments(extents, capacity)
    windows = _windows(segments, need, by_free=True)
    if not windows:
        return None
    _, lo, hi = min(windows)
    moves: list[Move] = []
    cursor = segments[lo][0]
    for start, nbytes, is_live, _ in segments[lo : hi + 1]:
        if is_live:
            if start != cursor:
                moves.append(Move(start, cursor, nbytes))
            cursor += nbytes
    return moves


def plan_evacuation(extents: Iterable[tuple[int, int, bool]], capacity: int, need: int) -> list[Move] | None:
    """Moves that empty the cheapest stretch of ``need`` bytes into free space elsewhere; None if none can."""
    segments = _segments(extents, capacity)
    windows = _windows(segments, need, by_free=False)
    for _, lo, hi in heapq.nsmallest(_CANDIDATES, windows):
        moves = _evacuate(segments, lo, hi)
        if moves is not None:
            return moves
    return None


def _evacuate(segments: list[Segment], lo: int, hi: int) -> list[Move] | None:
    """Best-fit the live segments lo..hi (largest first) into free segments outside them."""
    holes = sorted((n, start) for i, (start, n, is_live, _) in enumerate(segments) if not is_live and not lo <= i <= hi)
    movers = sorted((s for s in segments[lo : hi + 1] if s[2]), key=lambda s: -s[1])
    moves: list[Move] = []
    for start, nbytes, _, _ in movers:
        i = bisect.bisect_left(holes, (nbytes, -1))
        if i == len(holes):
            return None
        size, dst = holes.pop(i)
        if size > nbytes:
            bisect.insort(holes, (size - nbytes, dst + nbytes))
        moves.append(Move(start, dst, nbytes))
    return moves


def plan_for(extents: Sequence[tuple[int, int, bool]], capacity: int, need: int) -> list[Move]:
    """The plan that moves the fewest bytes to open a free run of ``need``: evacuation, local or global slide."""
    plans = [
        plan_evacuation(extents, capacity, need),
        plan_local_slide(extents, capacity, need),
        plan_compaction(extents, capacity, need),
    ]
    return min((p for p in plans if p is not None), key=lambda p: sum(m.nbytes for m in p))

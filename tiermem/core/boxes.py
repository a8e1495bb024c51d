"""A stretch of a flattened tensor as boxes of the tensor's own shape.  Pure: numbers in, boxes out.

The sharded optimizers hold stretches of params: elements ``[lo, hi)`` of a
param's row-major flattening.  A checkpoint that other tools read by the
param's own shape (``torch.distributed.checkpoint``: a chunk is an N-d box,
``offsets`` and ``sizes`` per dimension) needs each stretch as boxes.  A
stretch of a ``d``-dimensional tensor is at most ``2d - 1`` of them: a partial
run at each level going in, whole blocks in the middle, a partial run at each
level coming out.  Each box's elements are contiguous in the flattening, so a
box is a view of the stretch's flat values (``[Box.start, Box.stop)`` of them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tiermem.core.errors import InvalidArgument

__all__ = ["Box", "flat_boxes"]


@dataclass(frozen=True, slots=True)
class Box:
    """Elements ``[start, stop)`` of the flattening, which are the box at ``offsets`` of ``sizes``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int
    stop: int


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """Elements ``[lo, hi)`` of a row-major tensor of ``shape`` as boxes in flat order (none for an empty
    stretch).  An empty tensor's one stretch, ``[0, 0)``, is one empty box of its shape, so that a holder of
    it can still name it."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not 0 <= lo <= hi <= numel:
        raise InvalidArgument(f"stretch [{lo}, {hi}) lies outside a tensor of shape {list(shape)} ({numel} elements)")
    if numel == 0:
        return [Box((0,) * len(shape), shape, 0, 0)]
    return _boxes(shape, lo, hi)


def _boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    if lo >= hi:
        return []
    if not shape:  # a 0-d tensor: one element
        return [Box((), (), 0, 1)]
    rest = shape[1:]
    inner = math.prod(rest)
    first, first_at = divmod(lo, inner)
    last, last_at = divmod(hi, inner)

    def within(row: int, a: int, b: int) -> list[Box]:
        """Elements ``[a, b)`` of sub-tensor ``row``."""
        at = row * inner
        return [Box((row, *s.offsets), (1, *s.sizes), at + s.start, at + s.stop) for s in _boxes(rest, a, b)]

    if first == last:
        return within(first, first_at, last_at)
    out: list[Box] = []
    if first_at:
        out += within(first, first_at, inner)
        first += 1
    if last > first:
        out.append(Box((first, *(0,) * len(rest)), (last - first, *rest), first * inner, last * inner))
    if last_at:
        out += within(last, 0, last_at)
    return out

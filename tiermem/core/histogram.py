"""A fixed-bucket histogram of durations, cheap enough for the I/O and update paths.

Owns ``Histogram`` (mutable, one writer or the caller's lock) and its frozen
snapshot ``HistogramSnapshot``.  ``observe`` is a bisect over a tuple of upper
bounds and two additions: no allocation, no lock of its own.  Callers that
observe from several threads do so under a lock they already hold (the swap
store's), or from one thread (a rank's update runner).

Counts are per bucket (not cumulative); ``cumulative()`` gives the Prometheus
form, whose last bucket is ``+Inf`` and equals ``count``.  Pure: no I/O.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["IO_SECONDS", "UPDATE_SECONDS", "Histogram", "HistogramSnapshot"]

IO_SECONDS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
"""Upper bounds for one swap read or write (100 us .. 2.5 s; slower ones land in +Inf)."""
UPDATE_SECONDS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
"""Upper bounds for one Adam update of a rank (1 ms .. 30 s)."""


def _check_bounds(bounds: Sequence[float]) -> tuple[float, ...]:
    out = tuple(float(b) for b in bounds)
    if not out:
        raise ValueError("a histogram needs at least one bucket bound")
    if any(b <= a for a, b in itertools.pairwise(out)):
        raise ValueError(f"histogram bounds must increase strictly, got {list(out)}")
    return out


@dataclass(frozen=True)
class HistogramSnapshot:
    """Bucket counts at one moment: ``counts[i]`` observations <= ``bounds[i]`` (and above the previous bound);
    ``counts[-1]`` those above every bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs, the Prometheus bucket series, ending with ``("+Inf", count)``."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out

    @classmethod
    def empty(cls, bounds: Sequence[float]) -> HistogramSnapshot:
        b = _check_bounds(bounds)
        return cls(b, (0,) * (len(b) + 1), 0.0)

    @classmethod
    def merge(cls, bounds: Sequence[float], parts: Iterable[HistogramSnapshot]) -> HistogramSnapshot:
        """The sum of histograms with the same bounds (``ValueError`` for other bounds)."""
        total = cls.empty(bounds)
        counts, acc = list(total.counts), 0.0
        for part in parts:
            if part.bounds != total.bounds:
                raise ValueError(f"cannot merge histograms with bounds {part.bounds} into {total.bounds}")
            for i, n in enumerate(part.counts):
                counts[i] += n
            acc += part.sum
        return cls(total.bounds, tuple(counts), acc)


class Histogram:
    """Counts of observed values per bucket; see the module docstring."""

    __slots__ = ("_counts", "_sum", "bounds")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = _check_bounds(bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self._counts), self._sum)

"""The fixed-bucket histogram: bucket placement, the Prometheus form, merging, bad bounds."""

from __future__ import annotations

import pytest

from tiermem.core.histogram import IO_SECONDS, Histogram, HistogramSnapshot


def test_values_land_in_the_first_bucket_whose_bound_holds_them() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap.counts == (2, 2, 1)  # <= 0.1: 0.05 and 0.1; <= 1: 0.5 and 1.0; above: 7
    assert snap.count == 5 and snap.sum == pytest.approx(8.65)
    assert snap.cumulative() == [("0.1", 2), ("1.0", 4), ("+Inf", 5)]


def test_snapshots_do_not_change_when_the_histogram_does() -> None:
    h = Histogram(IO_SECONDS)
    before = h.snapshot()
    h.observe(0.003)
    assert before.count == 0 and h.snapshot().count == 1


def test_merge_adds_bucket_by_bucket_and_refuses_other_bounds() -> None:
    a, b = Histogram((1.0, 2.0)), Histogram((1.0, 2.0))
    a.observe(0.5)
    b.observe(1.5)
    b.observe(3.0)
    merged = HistogramSnapshot.merge((1.0, 2.0), [a.snapshot(), b.snapshot()])
    assert merged.counts == (1, 1, 1) and merged.sum == pytest.approx(5.0)
    with pytest.raises(ValueError, match="cannot merge histograms with bounds"):
        HistogramSnapshot.merge((1.0,), [a.snapshot()])


@pytest.mark.parametrize("bounds", [(), (1.0, 1.0), (2.0, 1.0)])
def test_bounds_must_increase(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match=r"bucket bound|increase strictly"):
        Histogram(bounds)

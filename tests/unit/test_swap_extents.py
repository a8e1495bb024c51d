"""Pure parts of the swap store: extent allocator, striping, manifest codec, record states."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiermem.core.errors import CorruptionError, InvalidArgument, InvalidState
from tiermem.engine.swap.extents import Extent, ExtentAllocator, segments, stripe_shares
from tiermem.engine.swap.manifest import Manifest, ManifestRecord, decode, encode
from tiermem.engine.swap.records import RecordState, SwapRecord

P = 4096


def test_alloc_is_first_fit_and_free_coalesces_with_both_neighbors() -> None:
    a = ExtentAllocator(10 * P)
    offs = [a.alloc(2 * P) for _ in range(5)]
    assert offs == [0, 2 * P, 4 * P, 6 * P, 8 * P]
    assert a.alloc(P) is None and a.free_nbytes == 0
    a.free(2 * P, 2 * P)
    a.free(6 * P, 2 * P)
    assert a.free_ranges() == [(2 * P, 2 * P), (6 * P, 2 * P)]
    a.free(4 * P, 2 * P)
    assert a.free_ranges() == [(2 * P, 6 * P)] and a.largest_free == 6 * P
    assert a.alloc(5 * P) == 2 * P


def test_double_free_and_misaligned_ranges_are_rejected() -> None:
    a = ExtentAllocator(4 * P)
    off = a.alloc(2 * P)
    assert off == 0
    a.free(0, 2 * P)
    with pytest.raises(InvalidArgument, match="double free"):
        a.free(0, P)
    with pytest.raises(InvalidArgument):
        a.alloc(100)
    with pytest.raises(InvalidArgument):
        a.free(8 * P, P)


def test_claim_marks_an_exact_range_used_and_grow_adds_space() -> None:
    a = ExtentAllocator(4 * P)
    a.claim(P, 2 * P)
    assert a.free_ranges() == [(0, P), (3 * P, P)]
    with pytest.raises(InvalidArgument, match="not free"):
        a.claim(2 * P, P)
    a.grow(6 * P)
    assert a.free_ranges() == [(0, P), (3 * P, 3 * P)] and a.capacity == 6 * P


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6), st.integers(0, 50)), max_size=60))
def test_allocator_matches_a_page_bitmap_model(ops: list[tuple[bool, int, int]]) -> None:
    pages = 32
    a = ExtentAllocator(pages * P)
    used = [False] * pages
    live: list[tuple[int, int]] = []
    for is_alloc, npages, pick in ops:
        if is_alloc or not live:
            off = a.alloc(npages * P)
            # first fit in the model
            first = next(
                (i for i in range(pages - npages + 1) if not any(used[i : i + npages])),
                None,
            )
            assert (off // P if off is not None else None) == first
            if off is not None:
                used[first : first + npages] = [True] * npages  # type: ignore[index,operator]
                live.append((off, npages * P))
        else:
            off, nbytes = live.pop(pick % len(live))
            a.free(off, nbytes)
            used[off // P : (off + nbytes) // P] = [False] * (nbytes // P)
        assert a.free_nbytes == used.count(False) * P
        ranges = a.free_ranges()
        assert all(r1[0] + r1[1] < r2[0] for r1, r2 in itertools.pairwise(ranges))  # merged, sorted


@given(st.integers(1, 64), st.integers(1, 4), st.sampled_from([1, 2, 4]))
def test_stripes_cover_every_byte_once_and_fill_each_extent(npages: int, nfiles: int, stripe_pages: int) -> None:
    nbytes, stripe = npages * P, stripe_pages * P
    shares = stripe_shares(nbytes, nfiles, stripe)
    assert sum(shares) == nbytes and all(s > 0 for s in shares) and len(shares) <= nfiles
    extents = []
    base = 0
    for i, share in enumerate(shares):
        extents.append(Extent(i, base + 1000 * P, share))
        base += share
    segs = list(segments(nbytes, extents, stripe))
    assert [s.memory_offset for s in segs] == sorted(s.memory_offset for s in segs)
    covered = 0
    used_in = [0] * len(extents)
    for s in segs:
        assert s.memory_offset == covered
        covered += s.nbytes
        e = extents[s.extent]
        assert e.offset <= s.file_offset and s.file_offset + s.nbytes <= e.offset + e.nbytes
        used_in[s.extent] += s.nbytes
    assert covered == nbytes and used_in == shares


def _manifest() -> Manifest:
    rec = ManifestRecord(3, 2 * P, (Extent(0, 0, P), Extent(1, P, P)), (123, 456))
    return Manifest(job="j", generation=7, stripe_nbytes=P, files=("j.swap", "j.swap"), records={"k": rec})


def test_manifest_round_trips() -> None:
    m = _manifest()
    assert decode(encode(m)) == m


def test_manifest_with_a_changed_byte_is_reported_corrupt() -> None:
    data = bytearray(encode(_manifest()))
    i = data.index(b"456")
    data[i] = ord("9")
    with pytest.raises(CorruptionError, match="manifest checksum"):
        decode(bytes(data))
    with pytest.raises(CorruptionError, match="malformed"):
        decode(b"{not json")


def test_record_transitions_reject_illegal_moves() -> None:
    r = SwapRecord("k", RecordState.NEW)
    with pytest.raises(InvalidState):
        r.move(RecordState.WRITING)
    r.move(RecordState.STORED)
    r.move(RecordState.WRITING)
    with pytest.raises(InvalidState):
        r.move(RecordState.NEW)
    r.move(RecordState.STORED)
    r.move(RecordState.DELETED)
    r.move(RecordState.NEW)

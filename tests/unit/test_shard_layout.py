"""The ZeRO-2 shard plan: buckets by group and size, each rank's slices, and the pieces of params in them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.core.errors import InvalidArgument
from tiermem.core.shard_plan import plan_shards


def test_buckets_hold_consecutive_params_of_one_group_up_to_the_size():
    layout = plan_shards([4, 4, 4, 10, 3], groups=[0, 0, 0, 0, 1], world_size=2, bucket_numel=8)
    assert [b.params for b in layout.buckets] == [(0, 1), (2,), (3,), (4,)]
    assert [b.offsets for b in layout.buckets] == [(0, 4), (0,), (0,), (0,)]
    assert [b.group for b in layout.buckets] == [0, 0, 0, 1]
    assert [(b.numel, b.slice_numel) for b in layout.buckets] == [(8, 4), (4, 2), (10, 5), (3, 2)]


def test_a_rank_owns_one_slice_of_each_bucket_cut_into_pieces_of_params():
    layout = plan_shards([3, 5], groups=[0, 0], world_size=3, bucket_numel=100)
    # one bucket of 8 elements, slices of 3: [0,3) [3,6) [6,8)+1 padding
    assert [(p.param, p.lo, p.hi, p.at) for p in layout.pieces(0)] == [(0, 0, 3, 0)]
    assert [(p.param, p.lo, p.hi, p.at) for p in layout.pieces(1)] == [(1, 0, 3, 0)]
    assert [(p.param, p.lo, p.hi, p.at) for p in layout.pieces(2)] == [(1, 3, 5, 0)]
    assert layout.padded_numel(layout.buckets[0]) == 9


def test_more_ranks_than_elements_leave_some_ranks_without_pieces():
    layout = plan_shards([2], groups=[0], world_size=4, bucket_numel=100)
    assert [len(layout.pieces(r)) for r in range(4)] == [1, 1, 0, 0]


def test_bad_plans_are_refused_by_name():
    with pytest.raises(InvalidArgument, match="world_size"):
        plan_shards([1], [0], world_size=0, bucket_numel=4)
    with pytest.raises(InvalidArgument, match="2 param sizes but 1 group"):
        plan_shards([1, 2], [0], world_size=1, bucket_numel=4)
    with pytest.raises(InvalidArgument, match="rank 2"):
        plan_shards([1], [0], world_size=2, bucket_numel=4).pieces(2)


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    world=st.integers(1, 6),
    bucket=st.integers(1, 64),
    data=st.data(),
)
def test_the_ranks_pieces_cover_every_element_exactly_once(numels, world, bucket, data):
    groups = sorted(data.draw(st.lists(st.integers(0, 2), min_size=len(numels), max_size=len(numels))))
    layout = plan_shards(numels, groups, world_size=world, bucket_numel=bucket)
    owner: dict[tuple[int, int], int] = {}
    for r in range(world):
        slots: set[tuple[int, int]] = set()
        for piece in layout.pieces(r):
            bucket_ = layout.buckets[piece.bucket]
            assert groups[piece.param] == bucket_.group
            assert piece.at >= 0 and piece.at + piece.numel <= bucket_.slice_numel
            for k in range(piece.numel):
                key = (piece.param, piece.lo + k)
                assert key not in owner, f"element {key} owned twice"
                owner[key] = r
                slot = (piece.bucket, piece.at + k)
                assert slot not in slots
                slots.add(slot)
                # the element's place in the bucket is the rank's slice start plus its offset in the slice
                start = bucket_.offsets[bucket_.params.index(piece.param)]
                assert start + piece.lo + k == r * bucket_.slice_numel + piece.at + k
    assert len(owner) == sum(numels)

"""The step planner: pieces of an update, cut at chunk boundaries, merged into the fewest kernel calls."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiermem.core.errors import InvalidArgument
from tiermem.core.layout import TensorSpec as LayoutSpec
from tiermem.core.layout import plan_layout
from tiermem.core.protocol import ParamGroup, TensorSpec
from tiermemd.rank.planner import Piece, check_ids, plan_pieces
from tiermemd.rank.records import TensorRecord

GROUPS = (
    ParamGroup(lr=1e-3),
    ParamGroup(lr=2e-3, weight_decay=0.1),
    ParamGroup(lr=3e-3, adamw=False),
    ParamGroup(lr=1e-3),  # another group with the first one's hyper-parameters (a group per param)
)


def make_records(shapes: list[tuple[int, ...]], groups: list[int], steps: list[int]) -> list[TensorRecord]:
    """Records as the rank builds them at REGISTER: one per tensor, from the layout's slots."""
    specs = [
        TensorSpec(f"t{i}", shape, "bfloat16", group=g) for i, (shape, g) in enumerate(zip(shapes, groups, strict=True))
    ]
    layout = plan_layout(
        [LayoutSpec(s.name, s.shape, s.dtype, s.group) for s in specs], bucket_nbytes=1 << 62, grad_buffers=1
    )
    records = [TensorRecord(slot.index, spec, slot) for slot, spec in zip(layout.slots, specs, strict=True)]
    for rec, step in zip(records, steps, strict=True):
        rec.step = step
    return records


@st.composite
def updates(draw: st.DrawFn) -> tuple[list[TensorRecord], list[int], int]:
    """Records (zero-size tensors included), a sorted unique subset of their ids, and a chunk size."""
    n = draw(st.integers(1, 12))
    shapes = draw(st.lists(st.lists(st.integers(0, 6), max_size=3).map(tuple), min_size=n, max_size=n))
    groups = draw(st.lists(st.integers(0, len(GROUPS) - 1), min_size=n, max_size=n))
    steps = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    ids = sorted(draw(st.sets(st.integers(0, n - 1))))
    chunk_numel = draw(st.integers(1, 64))
    return make_records(shapes, groups, steps), ids, chunk_numel


def element_labels(records: list[TensorRecord], ids: list[int]) -> dict[int, tuple[ParamGroup, int]]:
    """Each flat element the update touches, with the (group, next step) its tensor gives it."""
    labels = {}
    for tid in ids:
        rec = records[tid]
        for e in range(rec.start, rec.stop):
            labels[e] = (GROUPS[rec.spec.group], rec.step + 1)
    return labels


@given(updates())
def test_pieces_stay_inside_one_chunk(update: tuple[list[TensorRecord], list[int], int]) -> None:
    records, ids, chunk_numel = update
    for piece in plan_pieces(records, ids, GROUPS, chunk_numel):
        assert piece.lo < piece.hi
        assert piece.chunk * chunk_numel <= piece.lo
        assert piece.hi <= (piece.chunk + 1) * chunk_numel


@given(updates())
def test_pieces_cover_exactly_the_updated_tensors_once(update: tuple[list[TensorRecord], list[int], int]) -> None:
    records, ids, chunk_numel = update
    covered = [e for piece in plan_pieces(records, ids, GROUPS, chunk_numel) for e in range(piece.lo, piece.hi)]
    assert len(covered) == len(set(covered))  # no overlap
    assert set(covered) == set(element_labels(records, ids))  # no gap, nothing else


@given(updates())
def test_each_piece_carries_its_tensors_group_and_next_step(update: tuple[list[TensorRecord], list[int], int]) -> None:
    records, ids, chunk_numel = update
    labels = element_labels(records, ids)
    for piece in plan_pieces(records, ids, GROUPS, chunk_numel):
        assert {labels[e] for e in range(piece.lo, piece.hi)} == {(piece.group, piece.step)}


@given(updates())
def test_pieces_are_the_fewest_possible(update: tuple[list[TensorRecord], list[int], int]) -> None:
    """A piece is one kernel call: only a chunk boundary or a change of (group, step) or a hole may cut one."""
    records, ids, chunk_numel = update
    labels = element_labels(records, ids)
    fewest = 0
    for e in sorted(labels):
        starts_run = e - 1 not in labels or labels[e - 1] != labels[e] or e % chunk_numel == 0
        fewest += starts_run
    assert len(plan_pieces(records, ids, GROUPS, chunk_numel)) == fewest


def test_consecutive_tensors_of_one_group_and_step_make_one_piece() -> None:
    records = make_records([(3,), (4,), (2,)], groups=[1, 1, 1], steps=[2, 2, 2])
    assert plan_pieces(records, [0, 1, 2], GROUPS, chunk_numel=100) == [Piece(0, 0, 9, GROUPS[1], 3)]


def test_a_different_step_or_group_starts_a_new_piece() -> None:
    records = make_records([(3,), (4,), (2,), (5,)], groups=[0, 0, 1, 1], steps=[0, 1, 1, 1])
    assert plan_pieces(records, [0, 1, 2, 3], GROUPS, chunk_numel=100) == [
        Piece(0, 0, 3, GROUPS[0], 1),
        Piece(0, 3, 7, GROUPS[0], 2),
        Piece(0, 7, 14, GROUPS[1], 2),
    ]


def test_groups_with_equal_hyper_parameters_share_a_piece() -> None:
    """A group per param, all with one lr: one kernel call, not one per group (4,000 groups took 0.35 s)."""
    records = make_records([(3,), (4,), (2,), (5,)], groups=[0, 3, 0, 1], steps=[0, 0, 0, 0])
    assert plan_pieces(records, [0, 1, 2, 3], GROUPS, chunk_numel=100) == [
        Piece(0, 0, 9, GROUPS[0], 1),
        Piece(0, 9, 14, GROUPS[1], 1),
    ]


def test_a_run_is_cut_at_each_chunk_boundary() -> None:
    records = make_records([(5,), (6,)], groups=[0, 0], steps=[0, 0])
    assert plan_pieces(records, [0, 1], GROUPS, chunk_numel=4) == [
        Piece(0, 0, 4, GROUPS[0], 1),
        Piece(1, 4, 8, GROUPS[0], 1),
        Piece(2, 8, 11, GROUPS[0], 1),
    ]


def test_tensors_not_updated_leave_a_hole_between_pieces() -> None:
    records = make_records([(3,), (4,), (2,)], groups=[0, 0, 0], steps=[0, 0, 0])
    assert plan_pieces(records, [0, 2], GROUPS, chunk_numel=100) == [
        Piece(0, 0, 3, GROUPS[0], 1),
        Piece(0, 7, 9, GROUPS[0], 1),
    ]


def test_zero_size_tensors_make_no_piece() -> None:
    records = make_records([(0,), (2, 0), ()], groups=[0, 1, 2], steps=[0, 0, 0])
    assert plan_pieces(records, [0, 1], GROUPS, chunk_numel=4) == []
    assert plan_pieces(records, [0, 1, 2], GROUPS, chunk_numel=4) == [Piece(0, 0, 1, GROUPS[2], 1)]


def test_a_zero_size_tensor_does_not_split_its_neighbours_run() -> None:
    records = make_records([(3,), (0,), (2,)], groups=[0, 2, 0], steps=[0, 5, 0])
    assert plan_pieces(records, [0, 1, 2], GROUPS, chunk_numel=100) == [Piece(0, 0, 5, GROUPS[0], 1)]


def test_pieces_name_the_group_objects_given_for_this_update() -> None:
    records = make_records([(3,)], groups=[1], steps=[0])
    changed = (GROUPS[0], ParamGroup(lr=0.5), GROUPS[2])
    (piece,) = plan_pieces(records, [0], changed, chunk_numel=100)
    assert piece.group == ParamGroup(lr=0.5)


def test_planning_leaves_the_step_counts_alone() -> None:
    records = make_records([(3,), (4,)], groups=[0, 0], steps=[1, 2])
    plan_pieces(records, [0, 1], GROUPS, chunk_numel=2)
    assert [rec.step for rec in records] == [1, 2]


# ----------------------------------------------------------------- check_ids


def test_check_ids_of_nothing_means_every_tensor() -> None:
    assert check_ids([], 4) == [0, 1, 2, 3]


@given(st.integers(1, 20).flatmap(lambda n: st.tuples(st.just(n), st.lists(st.integers(0, n - 1), min_size=1))))
def test_check_ids_sorts_and_deduplicates(case: tuple[int, list[int]]) -> None:
    count, ids = case
    assert check_ids(ids, count) == sorted(set(ids))


@given(
    st.integers(1, 20).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(st.integers(0, n - 1)),
            st.one_of(st.integers(max_value=-1), st.integers(min_value=n)),
            st.lists(st.integers(0, n - 1)),
        )
    )
)
def test_check_ids_refuses_an_unknown_id_by_name(case: tuple[int, list[int], int, list[int]]) -> None:
    count, before, bad, after = case
    with pytest.raises(InvalidArgument, match=rf"tensor id {bad} is not registered"):
        check_ids([*before, bad, *after], count)


def test_check_ids_names_the_registered_range() -> None:
    with pytest.raises(InvalidArgument) as info:
        check_ids([0, 3], 3)
    assert "tensor id 3" in str(info.value)
    assert "0..2" in str(info.value)


def test_pieces_of_checked_ids_cover_all_tensors() -> None:
    records = make_records([(2,), (3,), (1,)], groups=[0, 1, 0], steps=[0, 0, 0])
    pieces = plan_pieces(records, check_ids([], len(records)), GROUPS, chunk_numel=4)
    assert [(p.lo, p.hi) for p in pieces] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert all(a.hi == b.lo for a, b in itertools.pairwise(pieces))

"""The tier manager's pure parts: access order, victim choice, tensor state transitions."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiermem.core.errors import InvalidArgument, InvalidState
from tiermem.engine.tiers.policy import AccessOrder, Candidate, NodeCandidate, choose_node_victims, choose_victims
from tiermem.engine.tiers.records import TensorRecord, TensorState


def test_distance_counts_uses_until_next_use_wrapping_into_the_next_pass() -> None:
    order = AccessOrder(["a", "b", "c", "d"])
    assert order.distance("b", 0) == 1
    assert order.distance("a", 0) == 4  # just used: needed again a full pass later
    assert order.distance("a", 2) == 2
    assert order.distance("zz", 0) == math.inf
    assert order.window(2, 3) == ["d", "a", "b"]
    assert order.window(0, 10) == ["b", "c", "d", "a"]
    with pytest.raises(InvalidArgument):
        AccessOrder([])


def cand(key: str, nbytes: int = 10, last_use: int = 0, clean: bool = False) -> Candidate:
    return Candidate(key, nbytes, last_use, clean)


def test_with_an_order_the_furthest_next_use_is_evicted_first() -> None:
    order = AccessOrder(["a", "b", "c", "d", "e"])
    got = choose_victims([cand("b"), cand("e"), cand("c")], 15, order, position=0)
    assert [v.key for v in got] == ["e", "c"]


def test_without_an_order_the_least_recently_used_is_evicted_first() -> None:
    got = choose_victims([cand("x", last_use=5), cand("y", last_use=1), cand("z", last_use=3)], 10)
    assert [v.key for v in got] == ["y"]


def test_clean_tensors_go_first_among_equally_distant_ones() -> None:
    got = choose_victims([cand("p", clean=False), cand("q", clean=True)], 10, AccessOrder(["a"]), 0)
    assert [v.key for v in got] == ["q"]


def test_prefetch_never_evicts_what_is_needed_before_the_fetched_tensor() -> None:
    order = AccessOrder(["a", "b", "c", "d"])
    got = choose_victims([cand("b"), cand("d")], 20, order, position=0, sooner_than=2)
    assert [v.key for v in got] == ["d"]


@given(
    st.lists(st.tuples(st.integers(1, 50), st.integers(0, 100), st.booleans()), min_size=0, max_size=12),
    st.integers(0, 300),
    st.booleans(),
)
def test_victims_are_distinct_candidates_and_stop_once_enough_bytes(
    specs: list[tuple[int, int, bool]], need: int, with_order: bool
) -> None:
    cands = [Candidate(f"k{i}", n, last, clean) for i, (n, last, clean) in enumerate(specs)]
    order = AccessOrder([c.key for c in reversed(cands)] or ["none"]) if with_order else None
    got = choose_victims(cands, need, order, position=0)
    keys = [v.key for v in got]
    assert len(set(keys)) == len(keys) and set(keys) <= {c.key for c in cands}
    total = sum(v.nbytes for v in got)
    if total < need:
        assert len(got) == len(cands)  # fell short only because every candidate was taken
    else:
        assert total - got[-1].nbytes < need if got else need <= 0  # no extra victim


def test_tensor_states_reject_illegal_moves() -> None:
    r = TensorRecord("k", None, (4,), 16, 4096)
    with pytest.raises(InvalidState):
        r.move(TensorState.CPU)
    r.move(TensorState.PAGING_IN)
    r.move(TensorState.CPU)
    r.move(TensorState.IN_USE)
    with pytest.raises(InvalidState):
        r.move(TensorState.PAGING_OUT)  # never evicted while in use
    r.move(TensorState.CPU)
    r.move(TensorState.PAGING_OUT)
    r.move(TensorState.NVME)


def node(tenant: str, key: str, next_use_s: float, nbytes: int = 10, clean: bool = False) -> NodeCandidate:
    return NodeCandidate(tenant, key, nbytes, next_use_s, clean)


def test_node_victims_are_the_furthest_next_use_across_tenants() -> None:
    offered = [node("a", "a1", 1.0), node("a", "a2", 9.0), node("b", "b1", 5.0), node("b", "b2", 0.5)]
    got = choose_node_victims(offered, 20, {"a": 100, "b": 100})
    assert [(v.tenant, v.key) for v in got] == [("a", "a2"), ("b", "b1")]


def test_node_victims_never_take_a_tenant_below_its_floor() -> None:
    offered = [node("a", "a1", 9.0), node("a", "a2", 8.0), node("b", "b1", 1.0), node("c", "c1", 99.0)]
    # a holds 10 bytes above its floor: one tensor; c holds nothing above its floor (absent from spare)
    got = choose_node_victims(offered, 30, {"a": 10, "b": 10})
    assert [v.key for v in got] == ["a1", "b1"]
    assert choose_node_victims(offered, 30, {}) == []


def test_node_victims_prefer_clean_tensors_among_equal_next_uses() -> None:
    offered = [node("a", "dirty", 3.0), node("b", "clean", 3.0, clean=True)]
    assert [v.key for v in choose_node_victims(offered, 10, {"a": 10, "b": 10})] == ["clean"]

"""``pack_spans``: how a transfer's tensors are packed into staging slots, one request per slot filled."""

from __future__ import annotations

import pytest

from tiermem.client.offload.transfer import Span, pack_spans
from tiermem.core.errors import InvalidArgument


def check_cover(numels: list[int], batches: list[list[Span]], slot: int, max_spans: int) -> None:
    """Every element of every item is in exactly one span, in order; each batch fits its slot, back to back."""
    seen = {i: 0 for i in range(len(numels))}
    for batch in batches:
        assert 0 < len(batch) <= max_spans
        at = 0
        for span in batch:
            assert span.at == at and span.start == seen[span.item]
            at += span.numel
            seen[span.item] += span.numel
        assert at <= slot
    assert seen == dict(enumerate(numels))
    items = [span.item for batch in batches for span in batch]
    assert items == sorted(items) and set(items) == set(range(len(numels)))  # each item reaches the daemon


@pytest.mark.parametrize("slot", [1, 7, 512, 4096])
def test_items_share_slots_and_large_ones_continue_in_the_next(slot: int) -> None:
    numels = [0, 1, 511, 512, 513, 1024, 3000, 7, 0]
    batches = list(pack_spans(numels, slot))
    check_cover(numels, batches, slot, 1024)
    assert len(batches) == -(-sum(numels) // slot)  # full slots: one request per slot's worth of elements


def test_many_small_tensors_are_one_request_up_to_the_span_limit() -> None:
    numels = [3] * 2000  # biases and norms: 6000 elements, far less than the slot
    assert len(list(pack_spans(numels, 1 << 20, max_spans=4096))) == 1
    batches = list(pack_spans(numels, 1 << 20, max_spans=1024))
    check_cover(numels, batches, 1 << 20, 1024)
    assert [len(b) for b in batches] == [1024, 976]


def test_empty_items_alone_are_one_request() -> None:
    batches = list(pack_spans([0, 0], 512))
    assert batches == [[Span(0, 0, 0, 0), Span(1, 0, 0, 0)]]
    assert list(pack_spans([], 512)) == []


def test_a_slot_without_room_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="room for an element"):
        list(pack_spans([1], 0))


@pytest.mark.parametrize("slot", [256, 300, 512, 1000])
def test_an_aligned_item_is_cut_only_on_its_blocks(slot: int) -> None:
    """A moment continued in the next slot is cut at a multiple of its block from its start, wherever in a
    slot it began: the daemon then quantizes every block from one request."""
    numels = [3, 1000, 37, 777, 256, 5, 0, 513]
    aligns = [256, 256, 1, 256, 256, 256, 256, 256]
    batches = list(pack_spans(numels, slot, aligns=aligns))
    check_cover(numels, batches, slot, 1024)
    for span in (span for batch in batches for span in batch):
        if aligns[span.item] > 1:
            assert span.start % 256 == 0, span
            assert (span.start + span.numel) % 256 == 0 or span.start + span.numel == numels[span.item], span
    # the unaligned item still fills what is left of a slot
    unaligned = [span for batch in batches for span in batch if span.item == 2]
    assert sum(span.numel for span in unaligned) == 37


def test_aligns_are_checked_against_the_items_and_the_slot() -> None:
    with pytest.raises(InvalidArgument, match="2 aligns for 1 items"):
        list(pack_spans([10], 512, aligns=[1, 1]))
    with pytest.raises(InvalidArgument, match="item 0 is cut at multiples of 256 elements; a slot holds 100"):
        list(pack_spans([1000], 100, aligns=[256]))


@pytest.mark.parametrize("slot", [64, 100, 2048])
def test_items_of_different_sizes_share_a_slot_each_at_a_multiple_of_its_size(slot: int) -> None:
    """A bf16 item (2 bytes an element) of odd length, then fp32 ones: each span starts on its own element
    size, within the slot's bytes, and every element is staged once."""
    numels = [7, 5, 0, 33, 100, 1]
    sizes = [2, 4, 4, 2, 4, 2]
    batches = list(pack_spans(numels, slot, itemsizes=sizes))
    seen = dict.fromkeys(range(len(numels)), 0)
    for batch in batches:
        end = 0
        for span in batch:
            size = sizes[span.item]
            assert span.at % size == 0 and span.at >= end, span
            assert span.start == seen[span.item]
            end = span.at + span.numel * size
            seen[span.item] += span.numel
        assert end <= slot
    assert seen == dict(enumerate(numels))
    # uniform 4-byte items pack in bytes as 1-byte items in elements: the same cuts
    fp32 = list(pack_spans(numels, slot, itemsizes=[4] * len(numels)))
    elements = list(pack_spans(numels, slot // 4))
    assert [[(s.item, s.start, s.numel, s.at // 4) for s in b] for b in fp32] == [
        [(s.item, s.start, s.numel, s.at) for s in b] for b in elements
    ]


def test_itemsizes_are_checked_against_the_items_and_the_slot() -> None:
    with pytest.raises(InvalidArgument, match="2 itemsizes for 1 items"):
        list(pack_spans([10], 512, itemsizes=[2, 4]))
    with pytest.raises(InvalidArgument, match="item 0 is cut at multiples of 1 elements; a slot holds 0"):
        list(pack_spans([10], 3, itemsizes=[4]))

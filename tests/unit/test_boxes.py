"""``tiermem.core.boxes``: a stretch of a flattened tensor as boxes of its shape; and ``Stretches``, the state
tensor of a sharded optimizer's rank built on them (``tiermem.client.distributed.stretches``)."""

from __future__ import annotations

import copy
import io
import itertools
import math
import random

import pytest
import torch

from tiermem.client.distributed.reshard import ParamInfo, Piece
from tiermem.client.distributed.stretches import Stretches, flat_range, held_state
from tiermem.core.boxes import flat_boxes
from tiermem.core.errors import InvalidArgument, InvalidState

SHAPES = [(), (1,), (7,), (3, 5), (4, 1, 6), (2, 3, 4), (3, 2, 2, 5), (1, 1, 9), (6, 1)]


def _stretches(shape: tuple[int, ...], rng: random.Random) -> list[tuple[int, int]]:
    numel = math.prod(shape)
    cuts = sorted({0, numel, *(rng.randrange(numel + 1) for _ in range(3))})
    return list(itertools.pairwise(cuts))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_boxes_tile_the_stretch_in_flat_order_each_a_contiguous_view(shape):
    """Every stretch of every cut: the boxes, read from the tensor by offsets and sizes, are its elements in
    order; each begins at its ``start``; there are at most 2d - 1 of them."""
    rng = random.Random(str(shape))
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    for _ in range(20):
        for lo, hi in _stretches(shape, rng):
            boxes = flat_boxes(shape, lo, hi)
            read = []
            for box in boxes:
                index = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))
                values = full[index].reshape(-1)
                assert values.tolist() == list(range(box.start, box.stop)), (lo, hi, box)
                read.append(values)
            got = torch.cat(read).tolist() if read else []
            assert got == list(range(lo, hi)), (shape, lo, hi, boxes)
            assert len(boxes) <= max(1, 2 * len(shape) - 1), (shape, lo, hi, boxes)


def test_a_whole_tensor_is_one_box_and_an_empty_one_has_one_empty_box():
    assert [(b.offsets, b.sizes) for b in flat_boxes((3, 5), 0, 15)] == [((0, 0), (3, 5))]
    assert [(b.offsets, b.sizes) for b in flat_boxes((0, 4), 0, 0)] == [((0, 0), (0, 4))]
    assert flat_boxes((3, 5), 6, 6) == []


def test_a_stretch_outside_the_tensor_is_refused():
    with pytest.raises(InvalidArgument, match=r"stretch \[10, 16\) lies outside a tensor of shape \[3, 5\]"):
        flat_boxes((3, 5), 10, 16)


def _held(full: torch.Tensor, lo: int, hi: int) -> Stretches:
    return Stretches.of_flat(full.shape, [(lo, full.reshape(-1)[lo:hi].clone())])


def test_stretches_give_back_what_they_hold_and_refuse_what_they_do_not():
    full = torch.randn(4, 6)
    held = _held(full, 5, 19)
    assert held.shape == (4, 6) and held.held_numel == 14
    assert torch.equal(held.flat(7, 19), full.reshape(-1)[7:19])
    assert torch.equal(flat_range(held, 5, 9), full.reshape(-1)[5:9])
    assert torch.equal(flat_range(full, 5, 9), full.reshape(-1)[5:9])
    with pytest.raises(InvalidArgument, match=r"elements \[4, 9\) of a \[4, 6\] state tensor are not all among"):
        held.flat(4, 9)


def test_any_other_operation_says_what_the_tensor_is_and_where_the_whole_one_is():
    held = _held(torch.randn(3, 5), 0, 7)
    with pytest.raises(InvalidState, match=r"this rank holds only its own stretches: opt.full_state_dict\(\) gathers"):
        held + 1
    with pytest.raises(InvalidState, match="full_state_dict"):
        held.sum()
    assert "holds 7 of 15 elements in 2 box(es)" in repr(held)


def test_to_moves_every_box_as_accelerate_and_lightning_move_optimizer_state():
    full = torch.randn(3, 5)
    held = _held(full, 2, 11)
    assert held.to("cpu") is held
    wider = held.to(torch.float64)
    assert isinstance(wider, Stretches) and torch.equal(wider.flat(2, 11), full.reshape(-1)[2:11].double())
    moved = held.to("meta")
    assert moved.device.type == "meta" and all(values.device.type == "meta" for _, values in moved._boxes)
    # accelerate's device for a CPU process of a distributed run is "cpu:0", where a tensor lands on "cpu"
    indexed = held.to(torch.device("cpu:0"))
    assert isinstance(indexed, Stretches) and indexed.device == torch.device("cpu")
    assert torch.equal(indexed.flat(2, 11), full.reshape(-1)[2:11])


def test_a_copy_is_a_copy_and_torch_save_writes_a_plain_dict():
    full = torch.randn(3, 5)
    held = _held(full, 3, 12)
    copied = copy.deepcopy(held)
    assert isinstance(copied, Stretches) and torch.equal(copied.flat(3, 12), full.reshape(-1)[3:12])
    buffer = io.BytesIO()
    torch.save({"exp_avg": held}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["exp_avg"]
    assert loaded["shape"] == [3, 5] and loaded["dtype"] == "float32"
    assert [offsets for offsets, _ in loaded["boxes"]] == [[0, 3], [1, 0], [2, 0]]
    assert torch.equal(torch.cat([v.reshape(-1) for _, v in loaded["boxes"]]), full.reshape(-1)[3:12])


def test_held_state_has_an_entry_per_param_that_requires_grad_or_that_this_rank_holds_state_of():
    """Positions 0-3 of the optimizer are params 3, 0, 1, 2: param 1 is frozen and never stepped (no entry),
    param 2 is frozen with state held here, param 3 is bf16 (its fp32 value is ``master``), param 0 is empty
    and held by no piece (ZeRO-2 gives it none): every rank with state holds its step, at the applied steps."""
    params = [
        ParamInfo(("empty",), (0, 4), "float32"),
        ParamInfo(("frozen",), (3,), "float32"),
        ParamInfo(("was_trained",), (2, 2), "float32"),
        ParamInfo(("half",), (2, 3), "bfloat16"),
    ]
    pieces = [
        Piece(2, 1, 4, 5, {"value": torch.ones(3), "exp_avg": torch.full((3,), 2.0), "exp_avg_sq": torch.ones(3)}),
        Piece(3, 0, 4, 5, {"value": torch.arange(4.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}),
        Piece(1, 0, 3, 0, {"value": torch.ones(3)}),
    ]
    state = held_state(params, [3, 0, 1, 2], pieces, [True, True, False, False], steps=5)
    assert sorted(state) == [0, 1, 3]
    assert sorted(state[0]) == ["exp_avg", "exp_avg_sq", "master", "step"]
    assert torch.equal(state[0]["master"].flat(0, 4), torch.arange(4.0)) and state[0]["master"].shape == (2, 3)
    assert float(state[3]["step"].flat(0, 1)[0]) == 5.0
    assert torch.equal(state[3]["exp_avg"].flat(1, 4), torch.full((3,), 2.0))
    assert float(state[1]["step"].flat(0, 1)[0]) == 5.0 and state[1]["exp_avg"].shape == (0, 4)
    alone = held_state(params, [3, 0, 1, 2], [], [True, True, False, False], steps=None)  # a rank with no state
    assert sorted(alone) == [0, 1] and alone[1]["step"].held_numel == 0 and alone[0]["exp_avg"].held_numel == 0

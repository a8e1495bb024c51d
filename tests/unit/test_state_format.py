"""How a rank's chunks hold compressed moments (``StateFormat``), the layout that starts each tensor on a
quantization block, and the planner's runs over the gaps between them."""

from __future__ import annotations

import pytest
import torch

from tiermem.core.errors import InvalidArgument
from tiermem.core.layout import TensorSpec, plan_layout
from tiermem.core.lowbit import BLOCK
from tiermem.core.protocol import ParamGroup
from tiermem.core.statekeys import ALL_KEYS, MOMENTS, PAGED_KEYS, StateFormat
from tiermemd.rank.planner import plan_pieces
from tiermemd.rank.records import TensorRecord


@pytest.mark.parametrize(("state_dtype", "per_param"), [("fp32", 12.0), ("bf16", 8.0), ("int8", 6 + 8 / BLOCK)])
def test_state_bytes_per_param_with_the_master(state_dtype: str, per_param: float) -> None:
    fmt = StateFormat(ALL_KEYS, "bfloat16", state_dtype)
    n = 1 << 16
    assert fmt.chunk_nbytes(n) == per_param * n
    assert fmt.nbytes(3 * n + 100, n) == 3 * fmt.chunk_nbytes(n) + fmt.chunk_nbytes(100)


def test_fp32_parts_are_the_keys_in_order_each_n_elements() -> None:
    """The layout every earlier swap store was written in."""
    fmt = StateFormat(PAGED_KEYS, "float16")
    assert [(s.name, off, count) for s, off, count in fmt.layout("state", 10)] == [
        ("master", 0, 10),
        ("exp_avg", 40, 10),
        ("exp_avg_sq", 80, 10),
    ]
    assert fmt.part_nbytes("param", 10) == 20


@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000, 4096])
def test_int8_sections_are_packed_densely_and_naturally_aligned(n: int) -> None:
    fmt = StateFormat(PAGED_KEYS, "bfloat16", "int8")
    raw = torch.zeros(fmt.part_nbytes("state", n), dtype=torch.uint8)
    views = fmt.split("state", raw, n)
    assert {k: (v.dtype, v.numel()) for k, v in views.items()} == {
        "master": (torch.float32, n),
        "exp_avg_scale": (torch.float32, -(-n // BLOCK)),
        "exp_avg_sq_scale": (torch.float32, -(-n // BLOCK)),
        "exp_avg": (torch.int8, n),
        "exp_avg_sq": (torch.uint8, n),
    }
    end = 0
    for section, offset, count in fmt.layout("state", n):
        assert offset == end and offset % section.dtype.itemsize == 0
        end = offset + count * section.dtype.itemsize
    assert end == raw.numel()
    for i, view in enumerate(views.values()):  # disjoint: each section's writes land in its own bytes
        view.fill_(i + 1)
    assert all(bool((v == i + 1).all()) for i, v in enumerate(views.values()))


def test_split_gives_only_the_wanted_keys_with_their_scales() -> None:
    fmt = StateFormat(ALL_KEYS, "float32", "int8")
    raw = torch.zeros(fmt.part_nbytes("state", 300), dtype=torch.uint8)
    assert set(fmt.split("state", raw, 300, {"exp_avg_sq"})) == {"exp_avg_sq", "exp_avg_sq_scale"}


def test_chunks_of_an_int8_rank_are_whole_blocks() -> None:
    assert StateFormat(MOMENTS, state_dtype="int8").chunk_numel(1000) == 1024
    assert StateFormat(MOMENTS, state_dtype="bf16").chunk_numel(1000) == 1000


def test_an_unknown_state_dtype_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="state_dtype must be one of"):
        StateFormat(ALL_KEYS, state_dtype="int4")


def test_the_layout_starts_each_tensor_on_a_block_when_asked() -> None:
    specs = [TensorSpec(str(i), shape, "float16") for i, shape in enumerate([(3, 100), (7,), (256,), (1,)])]
    dense = plan_layout(specs, bucket_nbytes=1 << 20)
    aligned = plan_layout(specs, bucket_nbytes=1 << 20, element_align=BLOCK)
    assert [s.start for s in dense.slots] == [0, 300, 307, 563]
    assert [s.start for s in aligned.slots] == [0, 512, 768, 1024]
    assert [s.slot_offset for s in aligned.slots] == [0, 1024, 1536, 2048]
    assert aligned.numel == 1025


def test_a_run_steps_over_the_gaps_but_not_over_another_steps_tensor() -> None:
    specs = [TensorSpec(str(i), (n,), "float32") for i, n in enumerate([300, 10, 256, 5])]
    layout = plan_layout(specs, bucket_nbytes=1 << 20, element_align=BLOCK)
    records = [TensorRecord(slot.index, spec, slot) for slot, spec in zip(layout.slots, specs, strict=True)]
    groups = [ParamGroup(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)]
    pieces = plan_pieces(records, [0, 1, 2, 3], groups, 1 << 20, align=BLOCK)
    assert [(p.lo, p.hi) for p in pieces] == [(0, 1029)]
    records[2].step = 4  # stepped apart from the others: its own run
    pieces = plan_pieces(records, [0, 1, 2, 3], groups, 1 << 20, align=BLOCK)
    assert [(p.lo, p.hi) for p in pieces] == [(0, 522), (768, 1024), (1024, 1029)]
    assert all(p.lo % BLOCK == 0 for p in pieces)

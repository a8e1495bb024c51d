from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiermem.core.errors import DTypeError, InvalidArgument
from tiermem.core.layout import DTYPE_NBYTES, TensorSpec, plan_layout


def specs_strategy() -> st.SearchStrategy[list[TensorSpec]]:
    shape = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
    return st.lists(st.tuples(shape, st.integers(0, 2)), min_size=1, max_size=20).flatmap(
        lambda items: st.sampled_from(sorted(DTYPE_NBYTES)).map(
            lambda dtype: [TensorSpec(f"t{i}", s, dtype, g) for i, (s, g) in enumerate(items)]
        )
    )


@given(specs_strategy(), st.integers(1, 5000), st.sampled_from([1, 2]))
def test_layout_invariants(specs: list[TensorSpec], bucket_nbytes: int, buffers: int) -> None:
    layout = plan_layout(specs, bucket_nbytes=bucket_nbytes, grad_buffers=buffers)
    # flat ranges tile [0, numel) in registration order
    pos = 0
    for slot in layout.slots:
        assert slot.start == pos
        pos = slot.stop
        assert slot.slot_offset == slot.start * DTYPE_NBYTES[slot.spec.dtype]
        assert slot.slot_offset + slot.nbytes <= layout.region_nbytes
    assert pos == layout.numel
    # slots do not overlap inside a region
    spans = sorted((s.slot_offset, s.slot_offset + s.nbytes) for s in layout.slots if s.nbytes)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    # buckets partition the tensors, are contiguous, and fill from the last tensor
    members = sorted(i for b in layout.buckets for i in b.tensors)
    assert members == list(range(len(specs)))
    assert max(layout.buckets[0].tensors) == len(specs) - 1
    for bucket in layout.buckets:
        assert list(bucket.tensors) == list(range(bucket.tensors[0], bucket.tensors[-1] + 1))
        assert bucket.start == layout.slots[bucket.tensors[0]].start
        assert bucket.stop == layout.slots[bucket.tensors[-1]].stop
        assert all(layout.slots[i].bucket == bucket.index for i in bucket.tensors)
    # regions do not overlap and fit the window
    assert layout.param_offset == 0
    assert len(layout.grad_offsets) == buffers
    assert layout.grad_offsets[0] >= layout.region_nbytes
    assert layout.grad_offsets[-1] + layout.region_nbytes == layout.nbytes


def test_buckets_close_at_the_requested_size_in_backward_order() -> None:
    specs = [TensorSpec(f"w{i}", (256,), "float16") for i in range(6)]  # 512 B each
    layout = plan_layout(specs, bucket_nbytes=1024)
    assert [b.tensors for b in layout.buckets] == [(4, 5), (2, 3), (0, 1)]


def test_mixed_working_dtypes_are_refused() -> None:
    with pytest.raises(DTypeError, match="share a working dtype"):
        plan_layout([TensorSpec("a", (2,), "float16"), TensorSpec("b", (2,), "float32")], bucket_nbytes=64)


def test_unknown_dtype_and_duplicate_names_are_refused() -> None:
    with pytest.raises(DTypeError, match="float64"):
        plan_layout([TensorSpec("a", (2,), "float64")], bucket_nbytes=64)
    with pytest.raises(InvalidArgument, match="'a' is registered twice"):
        plan_layout([TensorSpec("a", (2,), "float32"), TensorSpec("a", (3,), "float32")], bucket_nbytes=64)
    with pytest.raises(InvalidArgument, match="at least one"):
        plan_layout([], bucket_nbytes=64)

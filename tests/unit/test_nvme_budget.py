"""What an NVMe-tier rank reserves at admission (``nvme_reservation``), and the estimator counting the same."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiermem.core.errors import InvalidArgument
from tiermem.core.estimate import RunShape, estimate
from tiermem.core.nvme_budget import SWAP_STATE_COPIES, chunk_nbytes, nvme_reservation, part_nbytes, state_nbytes
from tiermem.core.statekeys import PAGED_KEYS, STAGED_KEYS, StateFormat
from tiermem.core.units import PAGE_SIZE

FORMATS = [
    StateFormat(PAGED_KEYS, "float16", "fp32"),
    StateFormat(PAGED_KEYS, "bfloat16", "int8"),
    StateFormat(STAGED_KEYS, "float32", "bf16"),
]


def test_each_part_of_a_chunk_takes_whole_pages() -> None:
    fmt = StateFormat(PAGED_KEYS, "float16", "fp32")  # parts: param 2 B, state 12 B, grad 4 B an element
    assert part_nbytes(1000, fmt) == [PAGE_SIZE, 3 * PAGE_SIZE, PAGE_SIZE]
    assert chunk_nbytes(1 << 20, fmt) == 18 << 20
    assert state_nbytes(2 * (1 << 20) + 1000, 1 << 20, fmt) == 2 * (18 << 20) + 5 * PAGE_SIZE


@given(
    numel=st.integers(1, 10**9),
    chunk_blocks=st.integers(1, 1 << 14),
    cache_chunks=st.integers(3, 64),
    fmt=st.sampled_from(FORMATS),
)
def test_the_swap_holds_two_copies_of_the_state_and_the_cache(
    numel: int, chunk_blocks: int, cache_chunks: int, fmt: StateFormat
) -> None:
    chunk_numel = chunk_blocks * 256
    reserved = nvme_reservation(numel, chunk_numel, fmt, cache_chunks)
    assert reserved.state_nbytes == state_nbytes(numel, chunk_numel, fmt) >= fmt.nbytes(numel, chunk_numel)
    assert reserved.cache_nbytes == min(reserved.state_nbytes, cache_chunks * chunk_nbytes(chunk_numel, fmt))
    assert reserved.swap_nbytes == SWAP_STATE_COPIES * reserved.state_nbytes + reserved.cache_nbytes
    assert SWAP_STATE_COPIES == 2


def test_a_bad_chunking_is_refused() -> None:
    fmt = FORMATS[0]
    with pytest.raises(InvalidArgument, match="chunk_numel > 0"):
        nvme_reservation(1000, 0, fmt, 6)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("params", [1000, 123_456_789, 7_000_000_000])
def test_the_estimate_counts_what_admission_reserves(params: int, state_dtype: str) -> None:
    """One home for the figure: the estimate's NVMe bytes and pool share are ``nvme_reservation``'s for a rank
    of mixed-precision training (fp16 params kept apart from the master), not 18 B a param once."""
    shape = RunShape(params=params, gpus=1, state_dtype=state_dtype, cache_chunks=5)
    fmt = StateFormat(PAGED_KEYS, "float16", state_dtype)
    reserved = nvme_reservation(params, fmt.chunk_numel(shape.chunk_numel), fmt, 5)
    est = estimate(shape, 0, "nvme")
    assert est.nvme_nbytes == reserved.swap_nbytes
    assert est.host_nbytes == reserved.cache_nbytes + shape.window_nbytes
    assert est.nvme_nbytes >= 2 * fmt.nbytes(params, shape.chunk_numel)

"""The CPU placement's chunk tensors, made once per block position, and the shared feed's bound check."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tiermem.client.offload.shared import TensorEntry
from tiermem.core.units import MiB
from tiermem.engine.pool import BufferPool
from tiermemd.state import ALL_KEYS, CpuStateChunks


@pytest.fixture
def pool() -> Iterator[BufferPool]:
    with BufferPool.create(1 * MiB, arena_size=1 * MiB, mlock=False, name="state-views-test") as pool:
        yield pool


def test_chunk_tensors_follow_a_block_that_compaction_moved(pool: BufferPool) -> None:
    before = pool.alloc(64 * 1024, owner="other")  # frees room in front of the state's blocks
    state = CpuStateChunks(pool, 3000, 1000, owner="job/0", keys=ALL_KEYS)
    try:
        for chunk in range(state.nchunks):
            t = state.acquire(chunk, ALL_KEYS)
            t.master.copy_(torch.arange(1000, dtype=torch.float32) + 1000 * chunk)
            state.release(chunk, ALL_KEYS, dirty=True)
        first = state.acquire(0, ALL_KEYS).master.data_ptr()
        state.release(0, ALL_KEYS, dirty=False)
        pool.free(before)
        assert pool.compact() > 0
        for chunk in range(state.nchunks):
            t = state.acquire(chunk, ALL_KEYS)
            try:
                expected = torch.arange(1000, dtype=torch.float32) + 1000 * chunk
                assert torch.equal(t.master, expected)
                if chunk == 0:
                    assert t.master.data_ptr() != first  # the block moved, and the tensor with it
                    assert t.master.data_ptr() == pool.address(state._blocks[0])
            finally:
                state.release(chunk, ALL_KEYS, dirty=False)
    finally:
        state.close()


def test_entry_bound_until_the_param_leaves_its_view() -> None:
    storage = torch.zeros(12)
    view, grad = storage[:6].view(2, 3), storage[6:].view(2, 3)
    param = torch.nn.Parameter(torch.empty(0))
    param.data = view
    entry = TensorEntry(0, param, view, (grad,), bucket=0)
    assert entry.bound()
    param.data = view.view(6)  # same address, other shape
    assert not entry.bound()
    param.requires_grad_(False)  # torch lets only such a param hold integers
    param.data = view.view(torch.int32)  # same address and shape, other dtype
    assert not entry.bound()
    param.data = view
    param.requires_grad_(True)
    param.data = view.clone()  # other address
    assert not entry.bound()
    param.data = view
    assert entry.bound()
    assert entry.grad_ptrs == (grad.data_ptr(),)

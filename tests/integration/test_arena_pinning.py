"""Registering an arena with CUDA (needs a GPU; skipped without one)."""

from __future__ import annotations

import pytest
import torch

from tiermem.core.units import MiB
from tiermem.engine.pool import BufferPool, CudaPinner, PinStatus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_registered_arena_copies_to_the_gpu_and_unregisters() -> None:
    pinner = CudaPinner()
    pool = BufferPool.create(16 * MiB, arena_size=8 * MiB, pinner=pinner)
    try:
        assert [r.status for r in pool.pin_results] == [PinStatus.REGISTERED] * 2
        block = pool.alloc(4 * MiB)
        with pool.pinned(block):
            host = pool.tensor(block, torch.float32, (MiB,))
            host.copy_(torch.arange(MiB, dtype=torch.float32))
            device = host.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(device.cpu(), host)
            del host
    finally:
        pool.close()
    again = pinner.unregister(pool.arenas[0].address)
    assert again.status is PinStatus.FAILED  # close() already unregistered it

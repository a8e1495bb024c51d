"""The pinner API: without CUDA every call says it did nothing, and nothing raises."""

from __future__ import annotations

import pytest
import torch

from tiermem.engine.pool import CudaPinner, NullPinner, Pinner, PinStatus, default_pinner

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


@no_cuda
def test_default_pinner_without_cuda_reports_not_registered() -> None:
    pinner = default_pinner()
    assert isinstance(pinner, Pinner)
    result = pinner.register(0x1000, 4096)
    assert result.status is PinStatus.SKIPPED and not result.registered
    assert str(result).startswith("not registered: CUDA unavailable")
    assert pinner.unregister(0x1000).status is PinStatus.SKIPPED


@no_cuda
def test_cuda_pinner_without_cuda_skips_instead_of_raising() -> None:
    pinner = CudaPinner()
    assert pinner.register(0x1000, 4096).reason == "CUDA unavailable"
    assert pinner.unregister(0x1000).status is PinStatus.SKIPPED


def test_null_pinner_carries_its_reason() -> None:
    result = NullPinner("disabled by config").register(0x2000, 8192)
    assert (result.status, result.address, result.nbytes) == (PinStatus.SKIPPED, 0x2000, 8192)
    assert "disabled by config" in str(result)

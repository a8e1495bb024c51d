"""The grad path's one copy (``SharedFeed._copy_in``): exact for every layout it meets, one thread for plain ones."""

from __future__ import annotations

import pytest
import torch

from tiermem.client.offload.shared import SharedFeed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_plain_grad_is_copied_exactly(dtype: torch.dtype) -> None:
    grad = torch.randn(257, 33).to(dtype)
    target = torch.full((257, 33), 7.0, dtype=dtype)
    SharedFeed._copy_in(target, grad, accumulate=False)
    assert torch.equal(target, grad)


def test_a_non_contiguous_grad_is_copied_by_value_not_by_memory() -> None:
    base = torch.randn(40, 24)
    grad = base.t()  # same numel, other strides: a raw memory copy would transpose it
    target = torch.zeros(24, 40)
    SharedFeed._copy_in(target, grad, accumulate=False)
    assert torch.equal(target, grad)


def test_an_expanded_grad_is_copied_by_value() -> None:
    grad = torch.randn(1, 16).expand(8, 16)
    target = torch.zeros(8, 16)
    SharedFeed._copy_in(target, grad, accumulate=False)
    assert torch.equal(target, grad)


def test_accumulating_adds_and_a_graph_grad_records_nothing() -> None:
    target = torch.ones(5)
    w = torch.randn(5, requires_grad=True)
    grad = w * 2  # a grad of a graph (backward with create_graph=True)
    SharedFeed._copy_in(target, grad, accumulate=True)
    assert torch.equal(target, 1 + w.detach() * 2)
    assert not target.requires_grad
    SharedFeed._copy_in(target, grad, accumulate=False)
    assert torch.equal(target, w.detach() * 2)


def test_a_plain_copy_runs_no_torch_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain case must not open an OpenMP region (see ``_copy_in``): it never reaches ``Tensor.copy_``."""
    calls = []
    real = torch.Tensor.copy_

    def spy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        calls.append(src.shape)
        return real(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    SharedFeed._copy_in(torch.zeros(1 << 16), torch.randn(1 << 16), accumulate=False)
    assert calls == []
    SharedFeed._copy_in(torch.zeros(4, 4), torch.randn(4, 4).t(), accumulate=False)
    assert calls == [torch.Size([4, 4])]

"""A sharded step reads its grad statistics back to the host once (``RankGroup.read_back``), not once per
submodule or bucket: the reduced grads' sums of squares stay on their device until the step's one read of
the all-reduced figures.  One rank of a gloo group, a real daemon, clipping on (the case that takes them)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tiermem.client.distributed import LayerShardedAdam, ShardedOffloadAdam, ShardedPagedAdam
from tiermem.client.distributed.group import RankGroup
from tiermem.client.link import connect

STEPS = 3


def model() -> torch.nn.Module:
    torch.manual_seed(2)
    layers: list[torch.nn.Module] = []
    for _ in range(4):  # four submodules with params: four reduced grads a step
        layers += [torch.nn.Linear(8, 8), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def make(kind: str, m: torch.nn.Module, socket_path: str) -> Any:
    client = connect(socket_path)
    if kind == "zero2":
        return ShardedOffloadAdam(m.parameters(), lr=0.01, max_grad_norm=0.5, bucket_nbytes=256, client=client)
    if kind == "zero3-layers":
        return LayerShardedAdam(m, lr=0.01, paged=True, max_grad_norm=0.5, client=client)
    return ShardedPagedAdam(m, lr=0.01, max_grad_norm=0.5, device_budget="1MiB", offload="cpu", client=client)


@pytest.mark.parametrize("kind", ["zero2", "zero3-layers", "zero3-paged"])
def test_a_step_reads_its_grad_statistics_back_once(daemon, one_rank_group, monkeypatch, kind: str) -> None:
    reads: list[int] = []
    real = RankGroup.read_back

    def counted(t: torch.Tensor) -> list[float]:
        reads.append(t.numel())
        return real(t)

    monkeypatch.setattr(RankGroup, "read_back", staticmethod(counted))
    m = model()
    opt = make(kind, m, daemon.socket_path)
    try:
        for step in range(STEPS):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert len(reads) == STEPS, reads
        assert opt.last_grad_norm is not None and opt.steps == STEPS
    finally:
        opt.close()

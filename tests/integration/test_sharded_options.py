"""One ``OffloadOptions`` record per rank: each sharded optimizer builds its rank's inner ``OffloadAdam`` from
it, and sizes its node's private daemon by it (one rank of a gloo group, no node daemon: the rank starts a
private one, as a node without the service does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tiermem.client.distributed import LayerShardedAdam, ShardedOffloadAdam, ShardedPagedAdam
from tiermem.core.modes import Exchange, Placement


def make(kind: str, m: torch.nn.Module) -> Any:
    if kind == "zero2":
        return ShardedOffloadAdam(m.parameters(), lr=1e-2, offload="cpu", state_dtype="bf16")
    if kind == "zero3-layers":
        return LayerShardedAdam(m, lr=1e-2, paged=True, offload="nvme")
    return ShardedPagedAdam(m, lr=1e-2, device_budget="1MiB", offload="cpu", state_dtype="int8")


@pytest.mark.parametrize("kind", ["zero2", "zero3-layers", "zero3-paged"])
def test_the_rank_record_builds_the_inner_optimizer_and_sizes_the_node_daemon(
    kind: str, one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERMEM_SOCKET_PATH", str(tmp_path / "no-node-daemon.sock"))
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = make(kind, m)
    try:
        record, inner = opt.options, opt.inner
        assert record.exchange is not Exchange.AUTO and record.offload is not Placement.AUTO
        job = {"job_id": opt.job_id, "token": opt.token, "create_job": True, "rank": 0, "world_size": 1}
        assert inner.options == record.replace(**job)
        numels = [p.numel() for g in inner.param_groups for p in g["params"]]
        plan = record.pool_plan(numels, dtype="float32")
        assert inner.client.stats().node.pool.capacity_nbytes == plan.nbytes
    finally:
        opt.close()

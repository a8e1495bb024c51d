"""Bytes across the host/device boundary: params and grads cross the staging window in the model's dtype.

The copy layer (``StateTransfer``) counts what its copies move between the
trainer's tensors and the window (``Crossings``): on a GPU those copies are
the PCIe transfers.  A bf16 or fp16 model's params and grads cross as 2
bytes an element, a fp32 model's as 4; the daemon widens a grad to fp32
where the update reads it and rounds the master to the working dtype where it
is.  Here on CPU params with the staged exchange (the path a GPU's params
take), for ``OffloadAdam`` on the CPU tier, its released grads in the shared
exchange, and ``offload_params``' paging; the values stay bitwise those of
fp32 staging (the parity tests pin them against ``CPUAdam`` and the
unpaged runs).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from offload_helpers import OffloadDaemon, train
from small_models import BATCH, corpus, mlp, mlp_batches, mlp_loss
from torch import nn

import tiermem
from tiermem.client.demo.model import GPT, GPTConfig
from tiermem.core.errors import BoundsError
from tiermem.core.protocol import MemRef, StateReadMany
from tiermem.core.protocol.step import StateSpan

HYPER: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]
OFFLOAD_DAEMON: dict[str, Any] = {"settings": {"jobs.max_jobs": 64}}


def numel_of(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_offload_adam_staged_params_and_grads_cross_in_the_working_dtype(
    offload: OffloadDaemon, dtype: torch.dtype
) -> None:
    """Per step each param crosses once each way (its grad to the host, its updated value back), at the
    working dtype's size; the registration wrote each param once as its master, also at that size."""
    model = mlp().to(dtype)
    numel = numel_of(model)
    opt = offload.make(model.parameters(), offload="cpu", exchange="staged", window_nbytes=8192, **HYPER)
    steps = 3
    train(model, opt, mlp_batches(steps, fixed=False), mlp_loss)
    stats = opt.stats()
    size = dtype.itemsize
    assert stats.crossed_numel == {
        "to_host.master": numel,
        "to_host.grad": steps * numel,
        "to_device.param": steps * numel,
    }
    for name in ("to_host.master", "to_host.grad", "to_device.param"):
        assert stats.crossed_bytes_per_element(name) == size, name
    assert stats.crossed_nbytes["to_host.grad"] == steps * numel * size  # 2 B a bf16 param and step, not 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_released_grads_of_shared_params_cross_in_the_working_dtype(offload: OffloadDaemon, dtype: torch.dtype) -> None:
    """The CPU tier's shared exchange: params never leave the shared storage; released grads go to the daemon's
    ``grad`` key through the window, in their own dtype."""
    model = mlp().to(dtype)
    numel = numel_of(model)
    opt = offload.make(model.parameters(), offload="cpu", release_grads=True, **HYPER)
    train(model, opt, mlp_batches(2, fixed=False), mlp_loss)
    stats = opt.stats()
    assert stats.crossed_numel == {"to_host.grad": 2 * numel}
    assert stats.crossed_nbytes == {"to_host.grad": 2 * numel * dtype.itemsize}
    kept = offload.make(mlp().to(dtype).parameters(), offload="cpu", **HYPER)  # grads stay in the shared buffer
    assert kept.stats().crossed_nbytes == {}


PAGED_GPT = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_params_and_grads_cross_in_the_working_dtype(offload: OffloadDaemon, dtype: torch.dtype) -> None:
    """``offload_params``: a step fetches each param at least once (forward; backward again where it saved
    it) and pushes each grad once, at the working dtype's size."""
    torch.manual_seed(0)
    model = GPT(PAGED_GPT).to(dtype)
    numel = numel_of(model)
    opt = offload.make(model.parameters(), offload="cpu", exchange="staged", window_nbytes=1 << 20, **HYPER)
    pager = tiermem.offload_params(model, opt, device_budget=numel * dtype.itemsize // 2)
    g = torch.Generator().manual_seed(1)
    data = [corpus().batch(BATCH, PAGED_GPT.block_size, g) for _ in range(2)]
    for i, (x, y) in enumerate(data):
        if i == 1:
            pager.reset_stats()  # the second step alone
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    got = pager.stats()
    assert got["crossed_numel.to_host.grad"] == numel
    assert got["crossed_nbytes.to_host.grad"] == numel * dtype.itemsize
    fetched = got["crossed_numel.to_device.param"]
    assert numel <= fetched <= 3 * numel
    assert got["crossed_nbytes.to_device.param"] == fetched * dtype.itemsize
    assert got["crossed_nbytes.to_device.param"] == got["fetched_nbytes"]  # the copy layer's bytes are the pager's


def test_a_bf16_read_is_the_master_rounded_and_a_misaligned_area_is_refused(offload: OffloadDaemon) -> None:
    """The daemon narrows in its copy exactly as the client's copy of fp32 values would (nearest-even), and
    checks a 2-byte staging area's alignment."""
    model = mlp()
    opt = offload.make(model.parameters(), offload="cpu", exchange="staged", window_nbytes=8192, **HYPER)
    transfer = opt.transfer
    master = torch.randn(model[0].weight.numel()) * 1e-3 + 1.0  # values with bits below bf16's precision
    transfer.push(0, "master", master, step=0)
    low = torch.empty(master.numel(), dtype=torch.bfloat16)
    transfer.pull_into(0, "master", low)
    assert torch.equal(low, master.to(torch.bfloat16))
    assert torch.equal(transfer.pull(0, "master", master.numel())[0], master)
    info = opt.client.info
    with pytest.raises(BoundsError, match="bfloat16 staging area at offset 1, length 4 is not 2-byte aligned"):
        opt.client.conn.request(
            StateReadMany(spans=(StateSpan(0, "master", 0, MemRef(info.window_id, 1, 4), "bfloat16"),))
        )

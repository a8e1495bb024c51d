"""Request counts of the state transfer and the param pager, against a real private tiermemd.

``StateTransfer.requests`` counts every request it sends: one per
staging-window slot filled, so a tensor larger than a slot costs several and
tensors that share a slot share a request.  ``ParamPager.stats()["requests"]``
is that count since the last ``reset_stats``: a step's fetches, prefetches and
grad pushes; a submodule's params are fetched together, and grads that land
while the pager's I/O thread is busy are pushed together.  With a 4 KiB
window the ring has two slots of 2 KiB (512 fp32 elements).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from offload_helpers import OffloadDaemon
from torch import nn

import tiermem
from tiermem.client.offload import OffloadAdam

WINDOW = 4096
SLOT_NUMEL = WINDOW // 2 // 4
"""Elements of one of the ring's two slots."""
OFFLOAD_DAEMON: dict[str, Any] = {"settings": {"jobs.max_jobs": 32}}


def make_opt(offload: OffloadDaemon, model: nn.Module) -> OffloadAdam:
    opt = offload.make(model.parameters(), offload="cpu", exchange="staged", window_nbytes=WINDOW, lr=1e-2)
    assert opt.client.window.numel() == WINDOW  # the slot size the counts below assume
    return opt


def test_transfer_counts_one_request_per_window_slot_filled(offload: OffloadDaemon) -> None:
    model = nn.Linear(50, 20)  # a 1000-element weight (two slots' worth) and a 20-element bias
    opt = make_opt(offload, model)
    transfer = opt.transfer
    before = transfer.requests
    transfer.push(0, "master", model.weight.detach(), step=0)
    assert transfer.requests - before == math.ceil(1000 / SLOT_NUMEL) == 2
    out = torch.empty(1000)
    transfer.pull_into(0, "master", out)
    assert transfer.requests - before == 4
    torch.testing.assert_close(out, model.weight.detach().reshape(-1))
    transfer.step_of(1)  # a zero-length read: one request
    assert transfer.requests - before == 5
    sent = transfer.push_many([(0, "grad", torch.ones(1000), 0, False), (1, "grad", torch.ones(20), 0, False)])
    assert sent == math.ceil(1020 / SLOT_NUMEL) == 2  # the bias shares the weight's last slot
    assert transfer.requests - before == 7


def seed_net() -> nn.Sequential:
    """Four scalar layers: every param fits one slot, so each fetch, prefetch or grad push is one request."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 1), nn.ReLU(), nn.Linear(1, 1), nn.ReLU(), nn.Linear(1, 1))


def wide_net() -> nn.Sequential:
    """Params of 1, 2 and 3 slots and a partial one: each transfer costs ceil(numel / slot) requests."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 8))


def pager_step(model: nn.Module, opt: OffloadAdam, x: torch.Tensor) -> None:
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def test_pager_stats_count_each_steps_fetches_prefetches_and_pushes(offload: OffloadDaemon) -> None:
    for model, x in ((seed_net(), torch.tensor([[1.5]])), (wide_net(), torch.randn(2, 32))):
        opt = make_opt(offload, model)
        pager = tiermem.offload_params(model, opt, device_budget=1 << 20, prefetch=1)
        numel = {e.name: e.shape.numel() for e in pager.entries}
        for step in range(3):  # the first step records the trace, the later ones prefetch
            pager.reset_stats()
            assert pager.stats()["requests"] == 0
            before = opt.transfer.requests
            pager_step(model, opt, x)
            moved = [name for event, name in pager.events if event in ("fetch", "prefetch", "grad")]
            one_by_one = sum(math.ceil(numel[name] / SLOT_NUMEL) for name in moved)  # a request per param
            fetched = sum(numel[name] for event, name in pager.events if event in ("fetch", "prefetch"))
            got = pager.stats()["requests"]
            assert got == opt.transfer.requests - before, step
            # a submodule's weight and bias share their requests: fewer than one per param and slot, never
            # fewer than the fetched elements need slots
            assert math.ceil(fetched / SLOT_NUMEL) < got < one_by_one, step

"""``OffloadAdam`` trains like torch: the CPU and NVMe tiers, param groups, fp16/bf16 working copies.

One private tiermemd for the module (``offload_helpers.offload_daemon``) with
2048-element state chunks, so the NVMe tier pages the tiny GPT's state (about
10 chunks) through its 6-chunk cache.

Two references (see ``offload_helpers``):
- ``CPUAdam`` with the daemon's engine settings runs the same arithmetic in
  process: trajectories must be bitwise equal (elementwise updates do not
  depend on how the state is cut into chunks).
- ``torch.optim.AdamW``: a transformer's trajectory amplifies one-ulp
  differences (about 7e-9 after one step, 1.3e-6 after two, 1.4e-5 after 30,
  measured between the engine and torch on this model), so over 100 steps the
  params are compared with ``atol=1e-3, rtol=0`` (two orders of magnitude
  above that growth and far below a real error: lr 2e-3 moves a param by about
  lr per step, so a wrong group lr, a missing weight decay or a skipped step
  shows up as >= 1e-2 within 100 steps).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from offload_helpers import OffloadDaemon, assert_params_close, assert_params_equal, cpu_adam, train
from small_models import gpt_batches, gpt_loss, mlp, mlp_batches, mlp_loss, replicas, tiny_gpt
from torch import nn

STEPS = 100
GPT_VS_TORCH = {"atol": 1e-3, "rtol": 0.0}
"""Transformer trajectories vs torch.optim.AdamW over 100 steps: see the module docstring."""


def gpt_groups(model: nn.Module, *, weight_decay: bool) -> list[dict[str, Any]]:
    """Three groups: matrices, embeddings, biases and norms, each with its own lr and weight decay."""
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("wte", "wpe"))]
    embeddings = [p for n, p in model.named_parameters() if n.startswith(("wte", "wpe"))]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    wd = 0.1 if weight_decay else 0.0
    return [
        {"params": matrices, "lr": 2e-3, "weight_decay": wd},
        {"params": embeddings, "lr": 5e-4, "weight_decay": wd / 2},
        {"params": vectors, "lr": 1e-3, "weight_decay": 0.0},
    ]


@pytest.mark.parametrize(("tier", "weight_decay"), [("cpu", True), ("nvme", False)], ids=["cpu-wd", "nvme-no-wd"])
def test_gpt_trains_like_cpu_adam_and_torch(offload: OffloadDaemon, tier: str, weight_decay: bool) -> None:
    """100 steps, three param groups with their own lr and weight decay (the biases and norms never decay)."""
    base = tiny_gpt()
    m_off, m_eng, m_torch = replicas(base, 3)
    opt = offload.make(gpt_groups(m_off, weight_decay=weight_decay), offload=tier, betas=(0.9, 0.95))
    eng = cpu_adam(gpt_groups(m_eng, weight_decay=weight_decay), betas=(0.9, 0.95))
    ref = torch.optim.AdamW(gpt_groups(m_torch, weight_decay=weight_decay), betas=(0.9, 0.95))
    batches = gpt_batches(STEPS)
    losses = train(m_off, opt, batches, gpt_loss)
    train(m_eng, eng, batches, gpt_loss)
    train(m_torch, ref, batches, gpt_loss)
    assert losses[-1] < losses[0] - 1.0, "the model did not learn"
    assert_params_equal(m_off, m_eng)
    assert_params_close(m_off, m_torch, **GPT_VS_TORCH)
    stats = opt.stats()
    assert stats.rank.last_step == STEPS
    assert stats.steps == STEPS
    if tier == "nvme":
        # the state (~10 chunks) is larger than the chunk cache (6): every step pages chunks out and in
        assert stats.rank.nvme is not None
        assert stats.rank.nvme.page_outs > 0
        assert stats.rank.nvme.page_ins > 0
    else:
        assert stats.rank.nvme is None


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_mlp_matches_torch_adamw_within_default_tolerance(offload: OffloadDaemon, tier: str) -> None:
    """On an MLP with fixed data, 100 steps stay within assert_close's default fp32 tolerances of torch."""
    base = mlp()
    m_off, m_torch = replicas(base, 2)
    opt = offload.make(m_off.parameters(), lr=3e-3, weight_decay=0.05, offload=tier)
    ref = torch.optim.AdamW(m_torch.parameters(), lr=3e-3, weight_decay=0.05)
    batches = mlp_batches(STEPS)
    train(m_off, opt, batches, mlp_loss)
    train(m_torch, ref, batches, mlp_loss)
    assert_params_close(m_off, m_torch)
    # torch's Adam (decoupled_weight_decay=False: L2 added to the grad) as well
    m_adam, m_tadam = replicas(base, 2)
    opt2 = offload.make(m_adam.parameters(), lr=3e-3, weight_decay=0.05, adamw=False, offload=tier)
    ref2 = torch.optim.Adam(m_tadam.parameters(), lr=3e-3, weight_decay=0.05)
    train(m_adam, opt2, batches, mlp_loss)
    train(m_tadam, ref2, batches, mlp_loss)
    assert_params_close(m_adam, m_tadam)
    # maximize=True ascends (on the negated loss it follows the same path as torch's)
    m_max, m_tmax = replicas(base, 2)
    opt3 = offload.make(m_max.parameters(), lr=3e-3, weight_decay=0.05, maximize=True, offload=tier)
    ref3 = torch.optim.AdamW(m_tmax.parameters(), lr=3e-3, weight_decay=0.05, maximize=True)
    batches = batches[:30]
    train(m_max, opt3, batches, lambda m, b: -mlp_loss(m, b))
    train(m_tmax, ref3, batches, lambda m, b: -mlp_loss(m, b))
    assert_params_close(m_max, m_tmax)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_working_copy_is_the_master_cast_down(offload: OffloadDaemon, dtype: torch.dtype) -> None:
    base = mlp()
    m_off = replicas(base, 1)[0].to(dtype)
    m_eng = replicas(base, 1)[0].to(dtype)
    opt = offload.make(m_off.parameters(), lr=1e-2, weight_decay=0.1)
    eng = cpu_adam(m_eng.parameters(), lr=1e-2, weight_decay=0.1)
    batches = mlp_batches(30, fixed=False)

    def check(i: int) -> None:
        if i % 10 != 9:
            return
        state = opt.state_dict()["state"]
        for tid, p in enumerate(m_off.parameters()):
            master = state[tid]["master"]
            assert master.dtype == torch.float32
            # exactly the fp32 master rounded to the working dtype
            torch.testing.assert_close(p, master.to(dtype), rtol=0, atol=0)
            # and the master itself carries more than the working copy (it is not just p widened)
            assert not torch.equal(master, p.float()) or p.numel() == 0

    train(m_off, opt, batches, mlp_loss, after_step=check)
    train(m_eng, eng, batches, mlp_loss)
    assert_params_equal(m_off, m_eng)
    sd, sd_eng = opt.state_dict(), eng.state_dict()
    for tid in sd_eng["state"]:
        for name in ("master", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sd["state"][tid][name], sd_eng["state"][tid][name], rtol=0, atol=0)


def test_bf16_gpt_working_copy(offload: OffloadDaemon) -> None:
    """The transformer in bf16 on the CPU: working params are the master cast down and equal CPUAdam's."""
    base = tiny_gpt()
    m_off = replicas(base, 1)[0].bfloat16()
    m_eng = replicas(base, 1)[0].bfloat16()
    opt = offload.make(m_off.parameters(), lr=2e-3, weight_decay=0.1)
    eng = cpu_adam(m_eng.parameters(), lr=2e-3, weight_decay=0.1)
    batches = gpt_batches(20)
    train(m_off, opt, batches, gpt_loss)
    train(m_eng, eng, batches, gpt_loss)
    assert_params_equal(m_off, m_eng)
    state = opt.state_dict()["state"]
    for tid, p in enumerate(m_off.parameters()):
        torch.testing.assert_close(p, state[tid]["master"].to(torch.bfloat16), rtol=0, atol=0)

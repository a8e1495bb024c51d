"""Compressed optimizer state (``state_dtype`` bf16 and int8) through a real daemon: training, checkpoints in
AdamW's format, and the bytes the daemon holds.

One private tiermemd for the module (``offload_helpers``: 2048-element chunks, the eager engine, so the
moments go through the plain-torch reference ``lowbit_update``, which the fused kernel equals bit for bit in
its moments: ``tests/unit/test_lowbit_kernel.py``); one test starts a daemon with the kernel built and checks
it trains as the reference does.

Tolerances against ``torch.optim.AdamW``: compressed moments are not AdamW's, so params are not compared
element by element.  After 100 steps of the tiny GPT the final loss is within the issue's goal (measured
here: bf16 +0.04%, int8 -0.16% of AdamW's).  The moments are compared as a sanity bound only: the two
trajectories part, so their moments do too (relative L2 distance measured: bf16 at most 0.05 for
``exp_avg`` and 0.07 for ``exp_avg_sq``, int8 0.33 and 0.51); zeroed, mis-scaled or sign-flipped moments
are at 1 or more.  The quantization itself is held to its error bound where nothing else moves: a
checkpoint loaded and read back.  The swap's bytes: ``test_nvme_parts``.

Resuming is exact in every format: a run saved (``torch.save`` of ``state_dict()``), loaded into a new
optimizer and continued ends on the uninterrupted run's bits, on both tiers, also through the smallest
window, whose slots cut the 300-wide MLP's int8 blocks unless the transfer cuts on blocks.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from offload_helpers import OffloadDaemon, max_param_diff, offload_daemon, train
from small_models import gpt_batches, gpt_loss, mlp, mlp_batches, mlp_loss, replicas, tiny_gpt
from torch import nn

from tiermem import OffloadAdam
from tiermem.core.errors import InvalidArgument

OFFLOAD_DAEMON: dict[str, Any] = {"settings": {"jobs.max_jobs": 64}, "pool_size": 192 << 20}
STEPS = 100
LOSS_RTOL = {"bf16": 0.01, "int8": 0.02}
"""The issue's goal for the final loss against exact AdamW."""
MOMENT_RTOL = {"bf16": 0.2, "int8": 0.9}
"""Relative L2 distance of a moment from AdamW's after training (see the module docstring)."""


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def gpt_runs(offload: OffloadDaemon, state_dtype: str, tier: str) -> tuple[list[float], list[float], Any, Any]:
    base = tiny_gpt()
    m_off, m_ref = replicas(base, 2)
    opt = offload.make(m_off.parameters(), lr=2e-3, offload=tier, state_dtype=state_dtype)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=2e-3)
    batches = gpt_batches(STEPS)
    return train(m_off, opt, batches, gpt_loss), train(m_ref, ref, batches, gpt_loss), opt, ref


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_compressed_moments_train_like_adamw(offload: OffloadDaemon, state_dtype: str, tier: str) -> None:
    losses, ref_losses, opt, ref = gpt_runs(offload, state_dtype, tier)
    assert losses[-1] < losses[0] - 1.0, "the model did not learn"
    assert abs(losses[-1] - ref_losses[-1]) <= LOSS_RTOL[state_dtype] * ref_losses[-1], (losses[-1], ref_losses[-1])
    saved, reference = opt.state_dict(), ref.state_dict()
    assert sorted(saved["state"]) == sorted(reference["state"])
    for key, theirs in reference["state"].items():
        mine = saved["state"][key]
        assert float(mine["step"]) == float(theirs["step"]) == STEPS
        for name in ("exp_avg", "exp_avg_sq"):
            assert mine[name].dtype == torch.float32 and mine[name].shape == theirs[name].shape
            assert rel_l2(mine[name], theirs[name]) < MOMENT_RTOL[state_dtype], (key, name)
    if tier == "nvme":
        stats = opt.stats()
        assert stats.rank.nvme is not None and stats.rank.nvme.page_ins > 0


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_a_checkpoint_is_adamws_both_ways(offload: OffloadDaemon, state_dtype: str) -> None:
    """AdamW's state loads into a compressed optimizer (quantized: within the format's error, the zeros of a
    sparse second moment kept apart from its small values), and its state dict loads into AdamW."""
    base = mlp(width=300)  # 300-wide rows: blocks of 256 that cut across rows and tensors' ends
    m_ref, m_off, m_back = replicas(base, 3)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2)
    train(m_ref, ref, mlp_batches(5, fixed=False), mlp_loss)
    reference = ref.state_dict()
    first = next(iter(reference["state"].values()))
    first["exp_avg_sq"][0, :7] = torch.tensor([0.0, 1e-30, 1e-20, 1e-12, 1e-9, 1e-6, 1e-3])

    opt = offload.make(m_off.parameters(), lr=1e-2, state_dtype=state_dtype)
    opt.load_state_dict(reference)
    loaded = opt.state_dict()
    for key, theirs in reference["state"].items():
        mine = loaded["state"][key]
        assert float(mine["step"]) == float(theirs["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            bound = 2.0**-7 if state_dtype == "bf16" else 2.0**-3  # stochastic rounding: up to one step of the format
            scale = theirs[name].abs().amax()
            err = (mine[name] - theirs[name]).abs()
            assert bool((err <= bound * theirs[name].abs() + 2.0**-15 * scale).all()), (key, name)
    got = loaded["state"][next(iter(reference["state"]))]["exp_avg_sq"][0, :7]
    assert float(got[0]) == 0.0, "an exact zero must stay zero"
    assert bool((got[3:] > 0).all()), f"small second moments rounded to zero: {got.tolist()}"

    opt.load_state_dict(loaded)  # values the format holds exactly come back exactly
    again = opt.state_dict()
    for key, mine in loaded["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(again["state"][key][name], mine[name]), (key, name)

    # AdamW takes the state over: the next step of each starts from the same params and moments, and an
    # update reads its moments before rounding them, so the two steps agree to fp32 rounding
    back = torch.optim.AdamW(m_back.parameters(), lr=1e-2)
    back.load_state_dict(again)
    batches = mlp_batches(1, seed=3, fixed=False)
    train(m_off, opt, batches, mlp_loss)
    train(m_back, back, batches, mlp_loss)
    for p, q in zip(m_off.parameters(), m_back.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def pool_bytes(offload: OffloadDaemon, state_dtype: str) -> int:
    model = tiny_gpt().to(torch.bfloat16)
    opt = offload.make(model.parameters(), offload="cpu", state_dtype=state_dtype)
    try:
        rank = opt.stats().rank
        assert rank.state_dtype == state_dtype
        return rank.cpu_state_nbytes
    finally:
        opt.close()


def test_the_pool_holds_the_compressed_bytes(offload: OffloadDaemon) -> None:
    """A bf16 model on the CPU tier: the fp32 master plus the moments, 12, 8 and 6.03 bytes a param (int8's
    gaps that start each tensor on a block are counted: a few hundred elements a tensor)."""
    numel = sum(p.numel() for p in tiny_gpt().parameters())
    tensors = len(list(tiny_gpt().parameters()))
    fp32, bf16, int8 = (pool_bytes(offload, d) for d in ("fp32", "bf16", "int8"))
    assert fp32 == 12 * numel
    assert bf16 == 8 * numel
    assert 6 * numel < int8 <= (4 + 2 + 8 / 256) * (numel + 255 * tensors) + 8 * tensors


def test_an_unknown_state_dtype_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgument, match=r"state_dtype must be one of 'fp32', 'bf16', 'int8', got 'fp8'"):
        OffloadAdam(nn.Linear(2, 2).parameters(), state_dtype="fp8")


def test_the_fused_kernel_trains_as_the_reference_does(offload: OffloadDaemon) -> None:
    """A daemon that builds the fused kernel (``adam.compile``) against this module's reference path: the same
    int8 training, the params within what the kernel's two-ulp master difference grows to in 30 steps."""
    base = tiny_gpt()
    m_kernel, m_ref = replicas(base, 2)
    batches = gpt_batches(30)
    with offload_daemon({"adam.compile": True}) as compiled:
        opt = compiled.make(m_kernel.parameters(), lr=2e-3, state_dtype="int8")
        losses = train(m_kernel, opt, batches, gpt_loss)
        assert opt.stats().node is not None
    ref_losses = train(m_ref, offload.make(m_ref.parameters(), lr=2e-3, state_dtype="int8"), batches, gpt_loss)
    assert losses[-1] < losses[0] - 0.5
    assert abs(losses[-1] - ref_losses[-1]) < 1e-3 * ref_losses[-1], (losses[-1], ref_losses[-1])


SMALL_WINDOW = 4096
"""The smallest staging window (a page): two slots of 512 elements, so a moment that starts inside a slot
(most of the 300-wide MLP's do) would have a block cut by the slot's end."""
RESUME_AT, RESUME_STEPS = 4, 7


def through_bytes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` as a checkpoint file gives it back: ``torch.save``, then ``torch.load``."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer)
    return loaded


def changed_elements(a: dict[str, Any], b: dict[str, Any]) -> int:
    """Moment elements that differ between two state dicts of the same params (NaN equal to NaN)."""
    assert sorted(a["state"]) == sorted(b["state"])
    return sum(
        int((a["state"][k][name] != b["state"][k][name]).sum())
        - int((a["state"][k][name].isnan() & b["state"][k][name].isnan()).sum())
        for k in a["state"]
        for name in ("exp_avg", "exp_avg_sq")
    )


@pytest.mark.parametrize("window_nbytes", [None, SMALL_WINDOW])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_a_resumed_run_ends_on_the_uninterrupted_runs_bits(
    offload: OffloadDaemon, state_dtype: str, tier: str, window_nbytes: int | None
) -> None:
    base = mlp(width=300)
    m_full, m_resumed = replicas(base, 2)
    batches = mlp_batches(RESUME_STEPS, fixed=False)
    options: dict[str, Any] = {"lr": 1e-2, "offload": tier, "state_dtype": state_dtype, "window_nbytes": window_nbytes}
    full = offload.make(m_full.parameters(), **options)
    train(m_full, full, batches, mlp_loss)

    first = offload.make(m_resumed.parameters(), **options)
    train(m_resumed, first, batches[:RESUME_AT], mlp_loss)
    checkpoint = through_bytes(first.state_dict())
    first.close()
    resumed = offload.make(m_resumed.parameters(), **options)
    resumed.load_state_dict(checkpoint)
    train(m_resumed, resumed, batches[RESUME_AT:], mlp_loss)

    assert max_param_diff(m_resumed, m_full) == 0.0
    for p, q in zip(m_resumed.parameters(), m_full.parameters(), strict=True):
        assert torch.equal(p, q)
    assert changed_elements(resumed.state_dict(), full.state_dict()) == 0
    for opt in (full, resumed):  # the daemon admits 32 jobs a uid; this test runs 12 times
        opt.close()


def test_a_block_across_two_window_slots_is_quantized_once(offload: OffloadDaemon) -> None:
    """Through the smallest window, every int8 block is still quantized once, from all of its values: a
    checkpoint loads back unchanged, and AdamW's state (values the format does not hold) loads as it does
    through a window that takes each tensor whole."""
    base = mlp(width=300)
    m_trained, m_small, m_large, m_ref = replicas(base, 4)
    batches = mlp_batches(RESUME_AT, fixed=False)
    trained = offload.make(m_trained.parameters(), lr=1e-2, state_dtype="int8")
    train(m_trained, trained, batches, mlp_loss)
    saved = trained.state_dict()
    small = offload.make(m_small.parameters(), lr=1e-2, state_dtype="int8", window_nbytes=SMALL_WINDOW)
    small.load_state_dict(saved)
    assert changed_elements(small.state_dict(), saved) == 0

    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2)
    train(m_ref, ref, batches, mlp_loss)
    large = offload.make(m_large.parameters(), lr=1e-2, state_dtype="int8")
    small.load_state_dict(ref.state_dict())
    large.load_state_dict(ref.state_dict())
    assert changed_elements(small.state_dict(), large.state_dict()) == 0
    for opt in (trained, small, large):
        opt.close()

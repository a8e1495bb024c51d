"""The staged exchange (params on a device: CUDA), run here on CPU params with ``exchange="staged"``.

The params stay where they are (not in shared storage); grads go in and
params come out through the bounded staging window, and the daemon keeps the
master and the grads as state keys.  These tests hold it to the same results
as ``torch.optim.AdamW`` (default fp32 tolerance, as the other MLP parity
tests) and ``CPUAdam`` (bitwise, bf16), on both tiers, with a window far
smaller than the model; the CUDA specifics (pinned window, device copies)
are in ``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from offload_helpers import (
    OffloadDaemon,
    assert_bf16_trains_like_cpu_adam,
    assert_params_close,
    assert_params_equal,
    assert_state_close,
    offload_and_adamw,
    scaled_step,
    train,
)
from small_models import mlp, mlp_batches, mlp_loss, replicas
from torch import nn
from torch.nn import functional as F

from tiermem.core.errors import InvalidArgument, InvalidState

HYPER: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
WINDOW = 8192
"""Far below the MLP's params (about 22 KiB of fp32 per large layer): every transfer takes several pieces."""


OFFLOAD_DAEMON: dict[str, Any] = {"settings": {"jobs.max_jobs": 128}}


def staged(offload: OffloadDaemon, params: Any, tier: str, **kwargs: Any) -> Any:
    return offload.make(params, offload=tier, exchange="staged", window_nbytes=WINDOW, **kwargs)


def staged_and_adamw(
    offload: OffloadDaemon, base: nn.Module, tier: str, **staged_only: Any
) -> tuple[nn.Module, Any, nn.Module, torch.optim.AdamW]:
    """``offload_and_adamw`` with the staged exchange (and ``staged_only``) on the ``OffloadAdam`` side."""
    exchange = {"exchange": "staged", "window_nbytes": WINDOW, **staged_only}
    return offload_and_adamw(offload, base, tier, offload_only=exchange, **HYPER)


def test_staged_training_equals_adamw_and_keeps_no_storage(offload: OffloadDaemon, tier: str) -> None:
    m_off, opt, m_ref, ref = staged_and_adamw(offload, mlp(), tier)
    batches = mlp_batches(8, fixed=False)
    train(m_off, opt, batches, mlp_loss)
    train(m_ref, ref, batches, mlp_loss)
    assert_params_close(m_off, m_ref)
    assert_state_close(opt.state_dict(), ref.state_dict())
    stats = opt.stats()
    assert stats.rank.storage_nbytes == 0
    assert stats.rank.window_nbytes == WINDOW
    assert opt.state_keys == ("master", "exp_avg", "exp_avg_sq", "grad")


def test_staged_honours_param_and_grad_edits(offload: OffloadDaemon, tier: str) -> None:
    """``.data`` edits of params (clamp, rebinding) and of grads are seen, as with AdamW."""
    m_off, opt, m_ref, ref = staged_and_adamw(offload, mlp(), tier)
    batches = mlp_batches(6, fixed=False)
    for i, batch in enumerate(batches):
        for model, o in ((m_off, opt), (m_ref, ref)):
            mlp_loss(model, batch).backward()
            for p in model.parameters():
                p.grad.data.clamp_(-5e-3, 5e-3)  # type: ignore[union-attr]
            o.step()
            o.zero_grad()
            if i == 1:
                for p in model.parameters():
                    p.data.clamp_(-0.05, 0.05)
            if i == 3:
                first = next(model.parameters())
                first.data = torch.full_like(first, 0.01)
    assert_params_close(m_off, m_ref)


def test_staged_checkpoint_resumes_in_either_load_order(offload: OffloadDaemon, tier: str) -> None:
    base = mlp()
    batches = mlp_batches(6, fixed=False)
    m_ref = replicas(base, 1)[0]
    ref = torch.optim.AdamW(m_ref.parameters(), **HYPER)
    train(m_ref, ref, batches[:3], mlp_loss)
    ckpt = (copy.deepcopy(m_ref.state_dict()), copy.deepcopy(ref.state_dict()))
    train(m_ref, ref, batches[3:], mlp_loss)
    for order in ("optimizer-first", "model-first"):
        model = replicas(base, 1)[0]
        opt = staged(offload, model.parameters(), tier, **HYPER)
        if order == "optimizer-first":
            opt.load_state_dict(ckpt[1])
            model.load_state_dict(ckpt[0])
        else:
            model.load_state_dict(ckpt[0])
            opt.load_state_dict(ckpt[1])
        train(model, opt, batches[3:], mlp_loss)
        assert_params_close(model, m_ref)


def test_staged_clipping_and_grad_scaler_match_torch(offload: OffloadDaemon, tier: str) -> None:
    m_off, opt, m_ref, ref = staged_and_adamw(offload, mlp(), tier, max_grad_norm=0.05)
    norms = []
    for batch in mlp_batches(5, fixed=False):
        mlp_loss(m_off, batch).backward()
        opt.step()
        opt.zero_grad()
        mlp_loss(m_ref, batch).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m_ref.parameters(), 0.05)))
        ref.step()
        ref.zero_grad()
        assert opt.last_grad_norm == pytest.approx(norms[-1], rel=1e-5)
    assert_params_close(m_off, m_ref)
    scaler_off, scaler_ref = (
        torch.amp.GradScaler("cpu", init_scale=2.0**10),
        torch.amp.GradScaler("cpu", init_scale=2.0**10),
    )
    m_off, opt, m_ref, ref = staged_and_adamw(offload, mlp(), tier)
    for batch in mlp_batches(4, fixed=False):
        for model, o, scaler in ((m_off, opt, scaler_off), (m_ref, ref, scaler_ref)):
            scaler.scale(mlp_loss(model, batch)).backward()
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    assert_params_close(m_off, m_ref)


def test_staged_delayed_update_matches_the_synchronous_engine_one_step_late(offload: OffloadDaemon, tier: str) -> None:
    """With no warm-up, step t's update is applied at step t+1: after a flush the params equal a synchronous
    run whose grads were taken one update behind (checked against the shared exchange's delayed mode)."""
    base = mlp()
    batches = mlp_batches(6, fixed=False)
    m_staged, m_shared = replicas(base, 2)
    a = staged(offload, m_staged.parameters(), tier, delayed_update=True, warmup_steps=1, **HYPER)
    b = offload.make(m_shared.parameters(), offload=tier, delayed_update=True, warmup_steps=1, **HYPER)
    train(m_staged, a, batches, mlp_loss)
    train(m_shared, b, batches, mlp_loss)
    a.flush()
    b.flush()
    assert_params_equal(m_staged, m_shared)


def test_staged_bf16_equals_cpu_adam(offload: OffloadDaemon, tier: str) -> None:
    assert_bf16_trains_like_cpu_adam(lambda params: staged(offload, params, tier, **HYPER), **HYPER)


def test_staged_overlapped_update_trains_like_adamw(offload: OffloadDaemon, tier: str) -> None:
    """Grads go in as their buckets land (a pusher thread), the daemon updates each bucket during backward."""
    m_off, opt, m_ref, ref = staged_and_adamw(offload, mlp(), tier, overlap_update=True, bucket_nbytes=4096)
    batches = mlp_batches(6, fixed=False)
    train(m_off, opt, batches, mlp_loss)
    train(m_ref, ref, batches, mlp_loss)
    assert_params_close(m_off, m_ref)
    assert_state_close(opt.state_dict(), ref.state_dict())
    # the first step verifies the loop (synchronous); every later one updated all six tensors early
    assert opt.stats().rank.overlapped_tensors == 5 * 6


def test_staged_released_grads_are_none_after_backward_and_train_like_adamw(offload: OffloadDaemon, tier: str) -> None:
    m_off, opt, m_ref, ref = staged_and_adamw(offload, mlp(), tier, release_grads=True, max_grad_norm=0.05)
    batches = mlp_batches(6, fixed=False)
    grads_seen: list[bool] = []

    def after_backward(_: int) -> None:
        grads_seen.append(any(p.grad is not None for p in m_off.parameters()))

    train(m_off, opt, batches, mlp_loss, after_backward=after_backward)
    train(
        m_ref,
        ref,
        batches,
        mlp_loss,
        after_backward=lambda _: torch.nn.utils.clip_grad_norm_(m_ref.parameters(), 0.05),
    )
    assert grads_seen == [False] * 6
    assert_params_close(m_off, m_ref)
    assert opt.last_grad_norm is not None


def test_staged_released_grads_accumulate_over_micro_batches(offload: OffloadDaemon) -> None:
    m_off, m_ref = replicas(mlp(), 2)
    opt = staged(offload, m_off.parameters(), "cpu", release_grads=True, **HYPER)
    ref = torch.optim.AdamW(m_ref.parameters(), **HYPER)
    batches = mlp_batches(6, fixed=False)
    for model, o in ((m_off, opt), (m_ref, ref)):
        for i in range(0, 6, 2):
            for batch in batches[i : i + 2]:
                mlp_loss(model, batch).backward()
            o.step()
            o.zero_grad()
    assert_params_close(m_off, m_ref)


def test_staged_released_grads_with_the_overlapped_update(offload: OffloadDaemon) -> None:
    m_off, m_ref = replicas(mlp(), 2)
    kwargs = {"release_grads": True, "overlap_update": True, "bucket_nbytes": 4096}
    opt = staged(offload, m_off.parameters(), "nvme", **kwargs, **HYPER)
    ref = torch.optim.AdamW(m_ref.parameters(), **HYPER)
    batches = mlp_batches(5, fixed=False)
    train(m_off, opt, batches, mlp_loss)
    train(m_ref, ref, batches, mlp_loss)
    assert_params_close(m_off, m_ref)
    assert opt.stats().rank.overlapped_tensors == 4 * 6


def test_staged_overlap_refuses_a_clipping_loop_before_anything_is_applied(offload: OffloadDaemon) -> None:
    model = mlp()
    opt = staged(offload, model.parameters(), "cpu", overlap_update=True, bucket_nbytes=4096, **HYPER)
    before = [p.detach().clone() for p in model.parameters()]
    mlp_loss(model, mlp_batches(1)[0]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(InvalidState, match="grads changed after backward"):
        opt.step()
    for p, q in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert opt.stats().rank.overlapped_tensors == 0


def test_shared_exchange_refuses_params_off_the_cpu(offload: OffloadDaemon) -> None:
    meta = nn.Linear(4, 4, device="meta")
    with pytest.raises(InvalidArgument, match="needs every param on the CPU"):
        offload.make(meta.parameters(), exchange="shared")


def test_staged_sparse_grads_are_refused_naming_sparse(offload: OffloadDaemon) -> None:
    emb = nn.Embedding(10, 4, sparse=True)
    opt = staged(offload, emb.parameters(), "cpu")
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(InvalidArgument, match="sparse"):
        opt.step()
    F.mse_loss(torch.zeros(1), torch.zeros(1))  # the process goes on


# ----------------------------------------------------------------------------- step rules: the two exchanges agree


def _run_with_an_inf_grad(opt: Any, model: nn.Module, scaler: Any = None) -> list[tuple[Any, ...]]:
    """Five steps, an inf in one grad at step 3; per step: (found inf, skipped, norm, params)."""
    out = []
    for step, (x, y) in enumerate(mlp_batches(5), start=1):
        loss = mlp_loss(model, (x, y))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if step == 3:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaled_step(opt, scaler)
        opt.zero_grad()
        params = [p.detach().clone() for p in model.parameters()]
        out.append((opt.last_found_inf, opt.last_skipped, opt.last_grad_norm, params))
    return out


def _assert_same_steps(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> None:
    for step, (x, y) in enumerate(zip(a, b, strict=True), start=1):
        assert x[:2] == y[:2], f"step {step}: found inf / skipped {x[:2]} (shared) against {y[:2]} (staged)"
        assert (x[2] is None) == (y[2] is None), step
        if x[2] is not None:
            assert x[2] == y[2] or (x[2] != x[2] and y[2] != y[2]), (step, x[2], y[2])  # NaN: both NaN
        for p, q in zip(x[3], y[3], strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True, msg=f"step {step}")


def test_shared_and_staged_exchanges_agree_step_by_step_when_clipping_an_inf_grad(offload: OffloadDaemon) -> None:
    """``clip_grad_norm_`` over an inf norm multiplies every grad by 0 (the inf one becomes NaN) and torch
    applies it: so do both exchanges, and the staged one hands the model the params the daemon made."""
    m_shared, m_staged, m_ref = replicas(mlp(), 3)
    shared = offload.make(m_shared.parameters(), offload="cpu", exchange="shared", max_grad_norm=1.0, **HYPER)
    stage = staged(offload, m_staged.parameters(), "cpu", max_grad_norm=1.0, **HYPER)
    a = _run_with_an_inf_grad(shared, m_shared)
    b = _run_with_an_inf_grad(stage, m_staged)
    _assert_same_steps(a, b)
    assert [s[:2] for s in a] == [(False, False), (False, False), (True, False), (True, False), (True, False)]
    # torch: clip_grad_norm_ then AdamW gives the same params (NaN where the inf grad went)
    ref = torch.optim.AdamW(m_ref.parameters(), **HYPER)
    for step, batch in enumerate(mlp_batches(5), start=1):
        mlp_loss(m_ref, batch).backward()
        if step == 3:
            next(m_ref.parameters()).grad.view(-1)[0] = float("inf")
        torch.nn.utils.clip_grad_norm_(m_ref.parameters(), 1.0)
        ref.step()
        ref.zero_grad()
    for p, q in zip(m_ref.parameters(), m_staged.parameters(), strict=True):
        torch.testing.assert_close(q, p, equal_nan=True)
    shared.close()
    stage.close()


def test_shared_and_staged_exchanges_agree_step_by_step_on_a_grad_scaler_overflow(offload: OffloadDaemon) -> None:
    """A ``GradScaler`` overflow skips the step in the daemon (its skip count) and nowhere else changes."""
    m_shared, m_staged = replicas(mlp(), 2)
    shared = offload.make(m_shared.parameters(), offload="cpu", exchange="shared", **HYPER)
    stage = staged(offload, m_staged.parameters(), "cpu", **HYPER)
    runs = []
    for opt, model in ((shared, m_shared), (stage, m_staged)):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        runs.append(_run_with_an_inf_grad(opt, model, scaler))
    _assert_same_steps(*runs)
    assert [s[:2] for s in runs[0]] == [(False, False), (False, False), (True, True), (False, False), (False, False)]
    for opt in (shared, stage):
        assert (opt.steps, opt.skipped_steps) == (4, 1)
        assert opt.stats().rank.skipped_steps == 1
        opt.close()

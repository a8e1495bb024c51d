"""``OffloadAdam`` in real training loops: state dicts, LR schedulers, GradScaler, clipping,
gradient accumulation, params without grads, and its errors.

One private tiermemd for the module.  The models are MLPs on random data,
where ``OffloadAdam`` and ``torch.optim.AdamW`` stay within ``assert_close``'s
default fp32 tolerances over these runs; the only differences are one-ulp
roundings (the global grad norm is summed per tensor in another order than
``clip_grad_norm_``'s), which an MLP does not amplify the way a transformer
does.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from offload_helpers import OffloadDaemon, assert_params_close, assert_params_equal, assert_state_close, train
from small_models import Batch, TwoBranches, gpt_batches, gpt_loss, mlp, mlp_batches, mlp_loss, replicas, tiny_gpt
from torch import nn

from tiermem.client.offload import OffloadAdam
from tiermem.core.errors import DTypeError, InvalidArgument

STEPS = 40


def two_groups(model: nn.Module) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() == 2], "lr": 3e-3, "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "lr": 1e-3, "weight_decay": 0.0},
    ]


# ----------------------------------------------------------------------------- state dicts


def test_state_dict_moves_between_offload_and_torch(offload: OffloadDaemon) -> None:
    base = mlp()
    batches = mlp_batches(STEPS, fixed=False)
    half = STEPS // 2
    m_ref = replicas(base, 1)[0]
    train(m_ref, torch.optim.AdamW(two_groups(m_ref)), batches, mlp_loss)

    # OffloadAdam for the first half, torch.optim.AdamW (loaded from its state dict) for the second
    m1 = replicas(base, 1)[0]
    opt1 = offload.make(two_groups(m1))
    train(m1, opt1, batches[:half], mlp_loss)
    saved = opt1.state_dict()
    m_mid = replicas(base, 1)[0]
    ref_mid = torch.optim.AdamW(two_groups(m_mid))
    train(m_mid, ref_mid, batches[:half], mlp_loss)
    assert_state_close(saved, ref_mid.state_dict())
    torch_opt = torch.optim.AdamW(two_groups(m1), lr=0.5, weight_decay=0.5)  # overwritten by the load
    torch_opt.load_state_dict(copy.deepcopy(saved))
    assert [g["lr"] for g in torch_opt.param_groups] == [3e-3, 1e-3]
    train(m1, torch_opt, batches[half:], mlp_loss)
    assert_params_close(m1, m_ref)

    # torch for the first half, OffloadAdam for the second
    m2 = replicas(base, 1)[0]
    torch_opt2 = torch.optim.AdamW(two_groups(m2))
    train(m2, torch_opt2, batches[:half], mlp_loss)
    saved2 = torch_opt2.state_dict()
    opt2 = offload.make(two_groups(m2), lr=0.5, weight_decay=0.5)
    opt2.load_state_dict(copy.deepcopy(saved2))
    assert [g["lr"] for g in opt2.param_groups] == [3e-3, 1e-3]
    assert_state_close(opt2.state_dict(), saved2, rtol=0, atol=0)  # the round trip is exact
    train(m2, opt2, batches[half:], mlp_loss)
    assert_params_close(m2, m_ref)


def test_state_dict_resume_is_exact_on_a_transformer(offload: OffloadDaemon) -> None:
    """Stop at step 10, resume in a new OffloadAdam (new job) from the state dict: bitwise the same run."""
    base = tiny_gpt()
    batches = gpt_batches(20)
    m_ref = replicas(base, 1)[0]
    train(m_ref, offload.make(m_ref.parameters(), lr=2e-3, weight_decay=0.1), batches, gpt_loss)

    m1 = replicas(base, 1)[0]
    opt1 = offload.make(m1.parameters(), lr=2e-3, weight_decay=0.1)
    train(m1, opt1, batches[:10], gpt_loss)
    saved = copy.deepcopy(opt1.state_dict())
    model_saved = copy.deepcopy(m1.state_dict())
    m2 = tiny_gpt(seed=7)  # other values: the checkpoint must bring everything back
    m2.load_state_dict(model_saved)
    opt2 = offload.make(m2.parameters(), lr=1.0)
    opt2.load_state_dict(saved)
    train(m2, opt2, batches[10:], gpt_loss)
    assert_params_equal(m2, m_ref)


def test_state_dict_between_backward_and_step_keeps_the_grads(offload: OffloadDaemon) -> None:
    """A checkpoint taken after backward (grads already handed over by the hooks) must not change the step."""
    base = mlp()
    batches = mlp_batches(6, fixed=False)
    m_off, m_ref = replicas(base, 2)
    opt = offload.make(m_off.parameters(), lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.1)
    train(m_off, opt, batches, mlp_loss, after_backward=lambda i: opt.state_dict())
    train(m_ref, ref, batches, mlp_loss)
    assert_params_close(m_off, m_ref)


# ----------------------------------------------------------------------------- schedulers


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.2 * s)),
    # OneCycleLR also cycles betas[0] (cycle_momentum): the daemon must follow both
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[1e-2, 5e-3], total_steps=STEPS),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_scheduler(offload: OffloadDaemon, name: str) -> None:
    base = mlp()
    batches = mlp_batches(STEPS, fixed=False)
    runs = []
    for make in (offload.make, torch.optim.AdamW):
        model = replicas(base, 1)[0]
        opt = make(two_groups(model))
        sched = SCHEDULERS[name](opt)
        seen: list[tuple[float, float]] = []

        def after(i: int, opt: torch.optim.Optimizer = opt, sched: Any = sched, seen: list[Any] = seen) -> None:
            sched.step()
            seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0]))

        train(model, opt, batches, mlp_loss, after_step=after)
        runs.append((model, seen))
    (m_off, seen_off), (m_ref, seen_ref) = runs
    assert seen_off == seen_ref
    assert len({lr for lr, _ in seen_ref}) > 3, "the schedule did not change the lr"
    assert_params_close(m_off, m_ref)


# ----------------------------------------------------------------------------- GradScaler and clipping


def _scaled_run(
    model: nn.Module, opt: torch.optim.Optimizer, batches: list[Batch], *, clip: float | None = None
) -> list[float]:
    """A GradScaler loop (CPU, fp32) whose large scale overflows every few steps; returns the scale after each step.

    The loss is scaled up 256x and the scale starts at 2**124 and grows every 2 steps, so the scaled grads
    overflow fp32 again and again: steps are skipped and the scale backs off, as in fp16 training."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**124, growth_interval=2)
    scales = []
    for batch in batches:
        loss = mlp_loss(model, batch) * 256
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("clip", [None, 1.0], ids=["scale", "unscale-clip"])
def test_grad_scaler_skips_the_same_steps_as_torch(offload: OffloadDaemon, clip: float | None) -> None:
    base = mlp()
    batches = mlp_batches(STEPS, fixed=False)
    m_off, m_ref = replicas(base, 2)
    opt = offload.make(m_off.parameters(), lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.1)
    scales = _scaled_run(m_off, opt, batches, clip=clip)
    ref_scales = _scaled_run(m_ref, ref, batches, clip=clip)
    assert scales == ref_scales
    skipped = sum(1 for a, b in zip([2.0**124, *scales], scales, strict=False) if b < a)
    assert 3 <= skipped <= STEPS - 3, f"the test should skip some steps and take others ({skipped} skipped)"
    assert_params_close(m_off, m_ref)
    stats = opt.stats()
    assert stats.client_skipped_steps == skipped
    assert stats.rank.last_step == STEPS - skipped
    assert int(opt.state_dict()["state"][0]["step"]) == int(ref.state_dict()["state"][0]["step"]) == STEPS - skipped


def test_max_grad_norm_clips_like_clip_grad_norm(offload: OffloadDaemon) -> None:
    base = mlp()
    batches = mlp_batches(STEPS, fixed=False)
    m_off, m_ref = replicas(base, 2)
    opt = offload.make(m_off.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.1)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.1)
    norms: list[float] = []
    train(m_off, opt, batches, mlp_loss)
    train(
        m_ref,
        ref,
        batches,
        mlp_loss,
        after_backward=lambda i: norms.append(float(torch.nn.utils.clip_grad_norm_(m_ref.parameters(), 0.1))),
    )
    assert sum(n > 0.1 for n in norms) > STEPS // 4, "clipping should be active in part of the run"
    assert_params_close(m_off, m_ref)


def test_user_clipping_after_the_hooks_is_seen(offload: OffloadDaemon) -> None:
    """clip_grad_norm_ changes the grads after the hooks copied them: step() copies them again."""
    base = tiny_gpt()
    batches = gpt_batches(8)
    m_off, m_ref = replicas(base, 2)
    opt = offload.make(m_off.parameters(), lr=2e-3, weight_decay=0.1)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=2e-3, weight_decay=0.1)
    # a threshold below the grad norm on every step, so every grad is scaled
    train(
        m_off, opt, batches, gpt_loss, after_backward=lambda i: torch.nn.utils.clip_grad_norm_(m_off.parameters(), 0.05)
    )
    train(
        m_ref, ref, batches, gpt_loss, after_backward=lambda i: torch.nn.utils.clip_grad_norm_(m_ref.parameters(), 0.05)
    )
    # 8 steps of a transformer: per-step rounding growth stays below ~1e-6 (module docstring of test_offload_parity)
    assert_params_close(m_off, m_ref, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- accumulation, missing grads


def _accumulating_run(model: nn.Module, opt: torch.optim.Optimizer, batches: list[Batch], clip: float | None) -> None:
    for i in range(0, len(batches), 2):
        for batch in batches[i : i + 2]:
            (mlp_loss(model, batch) / 2).backward()
            time.sleep(0.02)  # lets the daemon finish the statistics of the first micro-batch's buckets
        if clip is not None and isinstance(opt, torch.optim.AdamW):
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


def test_gradient_accumulation(offload: OffloadDaemon) -> None:
    base = mlp()
    batches = mlp_batches(STEPS, fixed=False)
    m_off, m_ref = replicas(base, 2)
    _accumulating_run(m_off, offload.make(m_off.parameters(), lr=1e-2, weight_decay=0.1), batches, None)
    _accumulating_run(m_ref, torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.1), batches, None)
    assert_params_close(m_off, m_ref)


def test_gradient_accumulation_with_clipping(offload: OffloadDaemon) -> None:
    base = mlp()
    batches = mlp_batches(STEPS, fixed=False)
    m_off, m_ref = replicas(base, 2)
    _accumulating_run(
        m_off, offload.make(m_off.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.2), batches, 0.2
    )
    _accumulating_run(m_ref, torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.1), batches, 0.2)
    assert_params_close(m_off, m_ref)


def test_params_without_grads_are_skipped_like_torch(offload: OffloadDaemon) -> None:
    base = TwoBranches()
    batches = mlp_batches(STEPS // 2, fixed=False)
    m_off, m_ref = replicas(base, 2)
    opt = offload.make(m_off.parameters(), lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.1)
    for model, o in ((m_off, opt), (m_ref, ref)):
        for i, (x, y) in enumerate(batches):
            model.heads = "b" if i % 2 == 0 and i < 12 else "a"  # branch_a first steps at i=1; branch_b stops at i=12
            torch.nn.functional.mse_loss(model(x), y).backward()
            o.step()
            o.zero_grad(set_to_none=True)
    # weight decay would move a param updated without a grad: equality shows they were skipped
    assert_params_close(m_off, m_ref)
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert_state_close(sd, ref_sd)
    steps = [int(sd["state"][k]["step"]) for k in sorted(sd["state"])]
    assert steps == [20, 20, 14, 14, 6, 6]  # trunk, branch_a, branch_b (weight, bias each)


def test_zero_size_params(offload: OffloadDaemon) -> None:
    """Params with no elements (an empty bias, a 0-row matrix) next to real ones train like torch."""
    torch.manual_seed(0)
    real = nn.Parameter(torch.randn(8, 4))
    empty = nn.Parameter(torch.zeros(0))
    empty2 = nn.Parameter(torch.zeros(0, 4))
    tail = nn.Parameter(torch.randn(4))
    params = [real, empty, empty2, tail]
    ref_params = [nn.Parameter(p.detach().clone()) for p in params]
    opt = offload.make(params, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1)
    x = torch.randn(3, 8)
    for ps, o in ((params, opt), (ref_params, ref)):
        for _ in range(5):
            out = x @ ps[0] + ps[3] + ps[1].sum() + ps[2].sum()
            out.square().mean().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q)
    assert_state_close(opt.state_dict(), ref.state_dict())


# ----------------------------------------------------------------------------- errors


def test_mixed_dtypes_raise_dtype_error_at_construction(offload: OffloadDaemon) -> None:
    a = nn.Parameter(torch.randn(4))
    b = nn.Parameter(torch.randn(4, dtype=torch.float16))
    with pytest.raises(DTypeError, match="one working dtype"):
        offload.make([a, b], lr=1e-3)
    c = nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    with pytest.raises(DTypeError, match="one working dtype"):
        offload.make([{"params": [a]}, {"params": [c], "lr": 1e-4}], lr=1e-3)


def test_unsupported_param_dtype(offload: OffloadDaemon) -> None:
    with pytest.raises(DTypeError):
        offload.make([torch.zeros(3, dtype=torch.float64, requires_grad=True)])


def test_param_groups_are_given_at_construction(offload: OffloadDaemon) -> None:
    first = nn.Linear(4, 4)
    second = nn.Linear(4, 4)
    late = nn.Linear(4, 4)
    opt = offload.make(
        [{"params": list(first.parameters())}, {"params": list(second.parameters()), "lr": 0.0}], lr=1e-2
    )
    x = torch.randn(2, 4)
    before = [p.detach().clone() for p in second.parameters()]
    second(first(x)).sum().backward()
    opt.step()
    for p, q in zip(second.parameters(), before, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # its lr=0 was honoured
    opt.add_param_group({"params": list(late.parameters()), "lr": 0.5})
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 0.0, 0.5]
    with pytest.raises(ValueError, match="more than one parameter group"):  # torch's check and message
        opt.add_param_group({"params": list(first.parameters())})
    assert len(opt.param_groups) == 3


@pytest.mark.parametrize(("tier", "exchange"), [("cpu", "shared"), ("nvme", "shared"), ("cpu", "staged")])
def test_progressive_unfreezing_with_add_param_group_matches_adamw(
    offload: OffloadDaemon, tier: str, exchange: str
) -> None:
    """Train the head, then add the body as a second group with its own lr (torch's add_param_group):
    the head keeps its moments and step counts across the regrouping, the body starts afresh, and every
    step equals torch.optim.AdamW doing the same."""
    torch.manual_seed(5)
    body, head = nn.Linear(8, 16), nn.Linear(16, 4)
    ref_body, ref_head = copy.deepcopy(body), copy.deepcopy(head)
    opt = offload.make(list(head.parameters()), offload=tier, exchange=exchange, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(list(ref_head.parameters()), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(9)
    for step in range(6):
        if step == 3:
            opt.add_param_group({"params": list(body.parameters()), "lr": 3e-3})
            ref.add_param_group({"params": list(ref_body.parameters()), "lr": 3e-3})
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
        for b, h, o in ((body, head, opt), (ref_body, ref_head, ref)):
            torch.nn.functional.mse_loss(h(torch.tanh(b(x))), y).backward()
            o.step()
            o.zero_grad()
    ours_params, ref_params = [*body.parameters(), *head.parameters()], [*ref_body.parameters(), *ref_head.parameters()]
    for p, q in zip(ours_params, ref_params, strict=True):
        torch.testing.assert_close(p, q)
    ours, theirs = opt.state_dict(), ref.state_dict()
    assert [len(g["params"]) for g in ours["param_groups"]] == [len(g["params"]) for g in theirs["param_groups"]]
    assert {k: int(v["step"]) for k, v in ours["state"].items()} == {
        k: int(v["step"]) for k, v in theirs["state"].items()
    }
    assert opt.steps == 6


@pytest.mark.parametrize(
    "kwargs",
    [{"offload": "gpu"}, {"warmup_steps": -1}, {"max_grad_norm": 0.0}, {"max_grad_norm": -1.0}],
    ids=["offload", "warmup", "clip0", "clip-neg"],
)
def test_bad_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        OffloadAdam([nn.Parameter(torch.zeros(2))], **kwargs)


def test_load_state_dict_checks_shapes(offload: OffloadDaemon) -> None:
    model = mlp()
    opt = offload.make(model.parameters())
    other = torch.optim.AdamW(nn.Linear(3, 3).parameters())
    with pytest.raises(InvalidArgument):
        opt.load_state_dict(other.state_dict())
    assert math.isfinite(float(next(model.parameters()).sum()))


def test_an_amsgrad_checkpoint_is_refused_and_changes_nothing(offload: OffloadDaemon) -> None:
    """``torch.optim.AdamW(amsgrad=True)``'s state dict loaded into OffloadAdam went on silently as plain AdamW,
    its ``max_exp_avg_sq`` dropped; ``CPUAdam`` refuses it, and so does the constructor ``amsgrad=True``."""
    model, ref_model = replicas(mlp(), 2)
    ref = torch.optim.AdamW(ref_model.parameters(), amsgrad=True)
    train(ref_model, ref, mlp_batches(2, fixed=False), mlp_loss)
    opt = offload.make(model.parameters())
    train(model, opt, mlp_batches(1, fixed=False), mlp_loss)
    before = opt.state_dict()
    with pytest.raises(InvalidArgument, match=r"param_groups\[0\] has amsgrad=True.*torch.optim.AdamW\(amsgrad=True\)"):
        opt.load_state_dict(ref.state_dict())
    assert_state_close(opt.state_dict(), before, rtol=0, atol=0)
    assert opt.param_groups[0]["amsgrad"] is False
    saved = ref.state_dict()
    for entry in saved["state"].values():
        del entry["max_exp_avg_sq"]
    with pytest.raises(InvalidArgument, match=r"param_groups\[0\] has amsgrad=True"):
        opt.load_state_dict(saved)
    saved["param_groups"][0]["amsgrad"] = False  # going on without amsgrad, on purpose
    opt.load_state_dict(saved)
    assert_state_close(opt.state_dict(), ref.state_dict())


def test_a_group_may_name_the_weight_decay_switch_either_way_and_must_not_ask_for_amsgrad(
    offload: OffloadDaemon,
) -> None:
    """A group with torch's ``decoupled_weight_decay=False`` (Adam's L2 decay) trains as torch.optim.AdamW does
    with that group (it was stepped as AdamW); a group asking for AMSGrad is refused where it is added."""
    model, ref_model = replicas(mlp(), 2)
    (first, *rest), (ref_first, *ref_rest) = list(model.parameters()), list(ref_model.parameters())
    opt = offload.make([{"params": [first], "decoupled_weight_decay": False}, {"params": rest}], weight_decay=0.1)
    ref = torch.optim.AdamW(
        [{"params": [ref_first], "decoupled_weight_decay": False}, {"params": ref_rest}], weight_decay=0.1
    )
    assert [g["decoupled_weight_decay"] for g in opt.param_groups] == [False, True]
    assert not any("adamw" in g for g in opt.param_groups)  # torch's key alone, as AdamW's groups
    batches = mlp_batches(3, fixed=False)
    train(model, opt, batches, mlp_loss)
    train(ref_model, ref, batches, mlp_loss)
    assert_params_close(model, ref_model)
    with pytest.raises(InvalidArgument, match=r"param_groups\[2\]\['amsgrad'\] is True"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "amsgrad": True})
    assert len(opt.param_groups) == 2

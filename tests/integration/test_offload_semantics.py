"""``OffloadAdam`` gives ``torch.optim.AdamW``'s results where a training loop does more than the happy path.

Each test runs a loop twice with the same seeds, once with ``OffloadAdam`` and
once with ``torch.optim.AdamW`` (``torch.optim.Adam`` for ``adamw=False``),
and compares the params (and the Adam state where the case is about state):
default hyper-parameters, params and grads edited between steps, checkpoints
loaded in either order or into a used optimizer, the overlapped update's
contract, and bf16 models whose working params are edited.  Every test runs
on the CPU tier and on the NVMe tier (one private tiermemd for the module with
2048-element chunks: an MLP's state pages through the NVMe tier's chunk cache).

Tolerance: the models are MLPs, where ``OffloadAdam`` and ``torch.optim.AdamW``
stay within ``assert_close``'s default fp32 tolerances (the same tolerance as
``test_offload_parity``'s and ``test_offload_training``'s MLP comparisons with
torch: the only differences are one-ulp roundings, which an MLP does not
amplify over a few steps); every error these tests look for moves a param by
1e-3 or more.  The bf16 tests compare with ``CPUAdam`` (the daemon's own
arithmetic, fp32 master) and ask for bitwise equality, as ``test_offload_parity``
does.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from offload_helpers import (
    OffloadDaemon,
    assert_bf16_trains_like_cpu_adam,
    assert_params_close,
    assert_params_equal,
    assert_state_close,
    assert_trains_like,
    cpu_adam,
    max_param_diff,
    offload_and_adamw,
    train,
)
from small_models import TwoBranches, mlp, mlp_batches, mlp_loss, replicas
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn import functional as F

from tiermem import OffloadAdam
from tiermem.core.errors import GradsAfterRelease, InvalidState

HYPER: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
"""Explicit hyper-parameters for every test but the defaults' own (so a wrong default cannot mask another error)."""


OFFLOAD_DAEMON: dict[str, Any] = {"settings": {"jobs.max_jobs": 256}}


# ----------------------------------------------------------------------------- defaults


def test_no_hyper_parameters_trains_like_torch_adamw_defaults(offload: OffloadDaemon, tier: str) -> None:
    """Swapping the class and nothing else keeps AdamW's weight decay of 0.01."""
    base = mlp()
    with torch.no_grad():  # large weights, so that a missing 0.01 weight decay moves them well beyond the tolerance
        for p in base.parameters():
            p.mul_(8.0)
    m_off, m_ref = replicas(base, 2)
    opt = offload.make(m_off.parameters(), offload=tier)
    ref = torch.optim.AdamW(m_ref.parameters())
    for name in ("lr", "betas", "eps", "weight_decay", "maximize"):
        assert opt.param_groups[0][name] == ref.param_groups[0][name], name
    assert_trains_like(m_off, opt, m_ref, ref, mlp_batches(8, fixed=False), mlp_loss)


def test_adamw_false_with_no_hyper_parameters_trains_like_torch_adam_defaults(
    offload: OffloadDaemon, tier: str
) -> None:
    base = mlp()
    m_off, m_ref = replicas(base, 2)
    opt = offload.make(m_off.parameters(), offload=tier, adamw=False)
    ref = torch.optim.Adam(m_ref.parameters())
    assert opt.param_groups[0]["weight_decay"] == ref.param_groups[0]["weight_decay"] == 0
    assert_trains_like(m_off, opt, m_ref, ref, mlp_batches(8, fixed=False), mlp_loss)


# ----------------------------------------------------------------------------- params and grads edited by the loop


def _assert_trains_like_adamw_with_an_edit(
    offload: OffloadDaemon, tier: str, point: str, edit: Callable[[nn.Module, int], None]
) -> None:
    """Six steps of ``OffloadAdam`` and of ``torch.optim.AdamW``, each loop calling ``edit(model, step)`` at
    ``point`` of ``train`` (``after_step`` or ``after_backward``), end with the same params and Adam state."""
    m_off, opt, m_ref, ref = offload_and_adamw(offload, mlp(), tier, **HYPER)
    batches = mlp_batches(6, fixed=False)
    for model, o in ((m_off, opt), (m_ref, ref)):
        train(model, o, batches, mlp_loss, **{point: functools.partial(edit, model)})
    assert_params_close(m_off, m_ref)
    assert_state_close(opt.state_dict(), ref.state_dict())


def _clamp_every_step(model: nn.Module, i: int) -> None:
    for p in model.parameters():
        p.data.clamp_(-0.1, 0.1)  # WGAN's weight clipping


def _zero_one_param(model: nn.Module, i: int) -> None:
    if i == 1:
        next(iter(model.parameters())).data.zero_()


def _load_other_weights(model: nn.Module, i: int) -> None:
    if i == 1:
        model.load_state_dict(mlp(seed=5).state_dict())


def _halve_under_no_grad(model: nn.Module, i: int) -> None:
    if i == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)


def _rebind_data(model: nn.Module, i: int) -> None:
    if i == 1:
        g = torch.Generator().manual_seed(5)
        for p in model.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.1  # new storage behind the same Parameter


PARAM_EDITS: dict[str, Callable[[nn.Module, int], None]] = {
    "clamp-every-step": _clamp_every_step,
    "zero-one-param": _zero_one_param,
    "load-state-dict": _load_other_weights,
    "no-grad-mul": _halve_under_no_grad,
    "rebind-data": _rebind_data,
}


@pytest.mark.parametrize("edit", list(PARAM_EDITS))
def test_param_edits_between_steps_are_honoured(offload: OffloadDaemon, tier: str, edit: str) -> None:
    """The next step starts from the edited values, as AdamW's does (the edit is never reverted)."""
    _assert_trains_like_adamw_with_an_edit(offload, tier, "after_step", PARAM_EDITS[edit])


def _clamp_grad_data(model: nn.Module, i: int) -> None:
    for p in model.parameters():
        assert p.grad is not None
        p.grad.data.clamp_(-1e-3, 1e-3)  # the DQN tutorial's idiom; a .data edit leaves the version counter alone


def _zero_grad_data(model: nn.Module, i: int) -> None:
    if i in (2, 3):
        for p in model.parameters():
            assert p.grad is not None
            p.grad.data.mul_(0.0)


GRAD_EDITS: dict[str, Callable[[nn.Module, int], None]] = {
    "clamp-data": _clamp_grad_data,
    "zero-data": _zero_grad_data,
}


@pytest.mark.parametrize("edit", list(GRAD_EDITS))
def test_grad_edits_through_data_after_backward_are_honoured(offload: OffloadDaemon, tier: str, edit: str) -> None:
    _assert_trains_like_adamw_with_an_edit(offload, tier, "after_backward", GRAD_EDITS[edit])


# ----------------------------------------------------------------------------- checkpoints


def _load(
    model: nn.Module, opt: torch.optim.Optimizer, ckpt: tuple[dict[str, Any], dict[str, Any]], order: str
) -> None:
    model_sd, opt_sd = copy.deepcopy(ckpt)
    if order == "optimizer-first":
        opt.load_state_dict(opt_sd)
        model.load_state_dict(model_sd)
    else:
        model.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)


ORDERS = ["optimizer-first", "model-first"]


def _trained(
    offload: OffloadDaemon, tier: str, source: str, batches: list[Any]
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP trained on ``batches`` by ``OffloadAdam`` (``source`` "offload") or ``torch.optim.AdamW``."""
    model = mlp()
    opt: torch.optim.Optimizer = (
        offload.make(model.parameters(), offload=tier, **HYPER)
        if source == "offload"
        else torch.optim.AdamW(model.parameters(), **HYPER)
    )
    train(model, opt, batches, mlp_loss)
    return model, opt


@pytest.mark.parametrize("source", ["offload", "adamw"], ids=["saved-by-offload", "saved-by-adamw"])
@pytest.mark.parametrize("order", ORDERS)
def test_resume_continues_from_the_checkpoint_in_either_load_order(
    offload: OffloadDaemon, tier: str, order: str, source: str
) -> None:
    """A new optimizer on a model with other values resumes from the checkpoint, as AdamW resumed the same way."""
    batches = mlp_batches(6, fixed=False)
    m_src, src = _trained(offload, tier, source, batches[:3])
    ckpt = (copy.deepcopy(m_src.state_dict()), copy.deepcopy(src.state_dict()))

    m_off, m_ref = mlp(seed=7), mlp(seed=7)  # other values: the checkpoint must bring everything back
    opt = offload.make(m_off.parameters(), offload=tier, lr=0.5, weight_decay=0.5)  # overwritten by the load
    ref = torch.optim.AdamW(m_ref.parameters(), lr=0.5, weight_decay=0.5)
    _load(m_off, opt, ckpt, order)
    _load(m_ref, ref, ckpt, order)
    assert_params_equal(m_off, m_ref)
    train(m_off, opt, batches[3:], mlp_loss)
    train(m_ref, ref, batches[3:], mlp_loss)
    assert_params_close(m_off, m_ref)
    assert_state_close(opt.state_dict(), ref.state_dict())


@pytest.mark.parametrize("source", ["offload", "adamw"], ids=["saved-by-offload", "saved-by-adamw"])
def test_a_torch_distributed_checkpoint_resumes_in_either_optimizer(
    offload: OffloadDaemon, tier: str, source: str, tmp_path: Path
) -> None:
    """``get_state_dict`` and ``dcp.save`` (torch's checkpoint by param name, as FSDP2's users save), then a new
    model and optimizer of other values: ``get_state_dict`` of them as the template, ``dcp.load``,
    ``set_state_dict``.  Either optimizer's checkpoint resumes in either, as AdamW resumes it."""
    batches = mlp_batches(6, fixed=False)
    m_src, src = _trained(offload, tier, source, batches[:3])
    model_state, optim_state = get_state_dict(m_src, src)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp_path, no_dist=True)
    m_off, m_ref = mlp(seed=7), mlp(seed=7)
    opt = offload.make(m_off.parameters(), offload=tier, lr=0.5, weight_decay=0.5)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=0.5, weight_decay=0.5)
    for model, optimizer in ((m_off, opt), (m_ref, ref)):
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert_params_equal(m_off, m_ref)
    assert_state_close(opt.state_dict(), ref.state_dict())
    train(m_off, opt, batches[3:], mlp_loss)
    train(m_ref, ref, batches[3:], mlp_loss)
    assert_params_close(m_off, m_ref)


def test_state_dict_is_taken_when_called_and_later_steps_leave_it_alone(offload: OffloadDaemon, tier: str) -> None:
    """AdamW's ``state_dict()`` hands out its live tensors, so a checkpoint kept in memory moves with later
    steps; OffloadAdam's state lives in the daemon and its ``state_dict()`` is a copy taken when called."""
    batches = mlp_batches(5, fixed=False)
    model = mlp()
    opt = offload.make(model.parameters(), offload=tier, **HYPER)
    train(model, opt, batches[:2], mlp_loss)
    kept = opt.state_dict()
    frozen = copy.deepcopy(kept)
    train(model, opt, batches[2:], mlp_loss)
    assert sorted(kept["state"]) == sorted(frozen["state"])
    for index, state in kept["state"].items():
        for key, value in state.items():
            assert torch.equal(value, frozen["state"][index][key]), f"param {index} {key} changed after the call"
    assert int(opt.state_dict()["state"][0]["step"]) == 5 and int(kept["state"][0]["step"]) == 2


def _branch_steps(model: TwoBranches, opt: torch.optim.Optimizer, batches: list[Any], *, use_b: bool) -> None:
    model.heads = "a+b" if use_b else "a"
    for x, y in batches:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("order", ORDERS)
def test_loading_an_older_checkpoint_into_a_used_optimizer_restores_it_exactly(
    offload: OffloadDaemon, tier: str, order: str
) -> None:
    """Checkpoint at step 2 (branch_b never stepped), train on with branch_b, load the checkpoint back:
    the model holds the checkpoint's weights, branch_b has no state (it starts again from step 0, as with
    AdamW), the others have the checkpoint's, and training goes on as AdamW's does."""
    base = TwoBranches()
    batches = mlp_batches(8, fixed=False)
    m_off, m_ref = replicas(base, 2)
    opt = offload.make(m_off.parameters(), offload=tier, **HYPER)
    ref = torch.optim.AdamW(m_ref.parameters(), **HYPER)
    loaded = []
    for model, o in ((m_off, opt), (m_ref, ref)):
        _branch_steps(model, o, batches[:2], use_b=False)
        ckpt = (copy.deepcopy(model.state_dict()), copy.deepcopy(o.state_dict()))
        _branch_steps(model, o, batches[2:5], use_b=True)
        _load(model, o, ckpt, order)
        for name, p in model.named_parameters():  # never overwritten by the optimizer's load
            torch.testing.assert_close(p, ckpt[0][name], rtol=0, atol=0, msg=lambda m, n=name: f"param {n}: {m}")
        loaded.append(copy.deepcopy(o.state_dict()))  # AdamW hands out its live tensors
        _branch_steps(model, o, batches[5:], use_b=True)
    assert sorted(loaded[1]["state"]) == [0, 1, 2, 3]  # trunk and branch_a only
    assert_state_close(loaded[0], loaded[1])
    assert_params_close(m_off, m_ref)
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert_state_close(sd, ref_sd)
    assert [int(sd["state"][k]["step"]) for k in sorted(sd["state"])] == [5, 5, 5, 5, 3, 3]


# ----------------------------------------------------------------------------- overlap_update is a contract


@pytest.mark.parametrize("kwargs", [{"max_grad_norm": 1.0}, {"delayed_update": True}], ids=["clip", "delayed"])
def test_overlap_update_with_clipping_or_delayed_update_is_refused_at_construction(
    no_daemon: None, tier: str, kwargs: dict[str, Any]
) -> None:
    (name,) = kwargs
    with pytest.raises(ValueError, match=name):
        OffloadAdam(mlp().parameters(), offload=tier, overlap_update=True, **kwargs)


def _state_and_params(opt: torch.optim.Optimizer, model: nn.Module) -> tuple[dict[str, Any], list[torch.Tensor]]:
    return copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()]


def _assert_nothing_applied(
    opt: torch.optim.Optimizer, model: nn.Module, before: tuple[dict[str, Any], list[torch.Tensor]]
) -> None:
    state, params = before
    assert_state_close(opt.state_dict(), state, rtol=0, atol=0)  # step counts and moments unchanged
    for p, q in zip(model.parameters(), params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def _overlap_refusal(offload: OffloadDaemon, tier: str, refused_step: Callable[[nn.Module, OffloadAdam], None]) -> None:
    """The first step of an overlap run is synchronous and shows what the loop does: a first step that
    ``refused_step`` makes raises InvalidState before applying anything; then plain steps train as AdamW.

    (A loop that starts plain and only later scales or accumulates cannot be refused before its early
    updates: ``test_overlap_update_reports_a_loop_that_changes_later`` covers that.)"""
    (x1, y1), (x3, y3) = mlp_batches(2, fixed=False)
    m_off, opt, m_ref, ref = offload_and_adamw(offload, mlp(), tier, offload_only={"overlap_update": True}, **HYPER)
    before = _state_and_params(opt, m_off)
    with pytest.raises(InvalidState):
        refused_step(m_off, opt)
    _assert_nothing_applied(opt, m_off, before)
    for x, y in ((x1, y1), (x3, y3)):
        opt.zero_grad()
        F.mse_loss(m_off(x), y).backward()
        opt.step()  # the optimizer is still usable
    opt.zero_grad()
    for x, y in ((x1, y1), (x3, y3)):
        F.mse_loss(m_ref(x), y).backward()
        ref.step()
        ref.zero_grad()
    assert_params_close(m_off, m_ref)
    assert_state_close(opt.state_dict(), ref.state_dict())


def test_overlap_update_reports_a_loop_that_changes_later(offload: OffloadDaemon, tier: str) -> None:
    """Plain steps, then one that accumulates: its first backward was already applied bucket by bucket, so
    the step is refused naming how many tensors keep that update, and the state says exactly that."""
    model = mlp()
    opt = offload.make(model.parameters(), offload=tier, overlap_update=True, bucket_nbytes=4096, **HYPER)
    batches = mlp_batches(4, fixed=False)
    for x, y in batches[:2]:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for x, y in batches[2:]:
        F.mse_loss(model(x), y).backward()
    with pytest.raises(InvalidState, match=r"\d+ tensor\(s\) were already updated"):
        opt.step()
    steps = [int(opt.state[p]["step"]) for p in model.parameters()]
    assert set(steps) <= {2, 3} and 3 in steps, steps
    opt.zero_grad()
    F.mse_loss(model(batches[0][0]), batches[0][1]).backward()
    opt.step()  # still usable


def test_overlap_update_refuses_a_grad_scaler_step_before_applying_anything(offload: OffloadDaemon, tier: str) -> None:
    x, y = mlp_batches(1, seed=9)[0]

    def scaled_step(model: nn.Module, opt: OffloadAdam) -> None:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        scaler.scale(F.mse_loss(model(x), y)).backward()
        try:
            scaler.step(opt)
        finally:
            # GradScaler.step removes the grad_scale and found_inf it set on the optimizer only when
            # opt.step() returns; the plain step after the refusal must not see them
            for name in ("grad_scale", "found_inf"):
                opt.__dict__.pop(name, None)

    _overlap_refusal(offload, tier, scaled_step)


def test_overlap_update_refuses_gradient_accumulation_before_applying_anything(
    offload: OffloadDaemon, tier: str
) -> None:
    micro = mlp_batches(2, seed=9, fixed=False)

    def accumulated_step(model: nn.Module, opt: OffloadAdam) -> None:
        for x, y in micro:  # two backward passes before step()
            (F.mse_loss(model(x), y) / 2).backward()
        opt.step()

    _overlap_refusal(offload, tier, accumulated_step)


def test_overlap_update_plain_loop_trains_like_adamw(offload: OffloadDaemon, tier: str) -> None:
    m_off, opt, m_ref, ref = offload_and_adamw(offload, mlp(), tier, offload_only={"overlap_update": True}, **HYPER)
    batches = mlp_batches(6, fixed=False)
    train(m_off, opt, batches, mlp_loss)
    train(m_ref, ref, batches, mlp_loss)
    assert_params_close(m_off, m_ref)
    assert_state_close(opt.state_dict(), ref.state_dict())


# ----------------------------------------------------------------------------- bf16 models


def test_bf16_model_trains_like_cpu_adam(offload: OffloadDaemon, tier: str) -> None:
    assert_bf16_trains_like_cpu_adam(lambda params: offload.make(params, offload=tier, **HYPER), **HYPER)


def test_a_bf16_state_dict_reloaded_changes_nothing_with_staged_params(offload: OffloadDaemon, tier: str) -> None:
    """``model.load_state_dict(model.state_dict())`` between steps, as a resume through
    ``torch.distributed.checkpoint`` does (it loads the optimizer, then the model): the staged exchange (the
    GPU path) wrote every edited param whole as its master, dropping the fp32 bits below bf16 of all its
    elements.  A master element that rounds to the loaded value is kept now, as the shared exchange keeps it."""
    base = mlp()
    batches = mlp_batches(5, fixed=False)
    runs = []
    for reload in (False, True):
        model = replicas(base, 1)[0].to(torch.bfloat16)
        opt = offload.make(model.parameters(), offload=tier, exchange="staged", **HYPER)

        def after(i: int, model: nn.Module = model, reload: bool = reload) -> None:
            if reload and i == 2:
                model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})

        train(model, opt, batches, mlp_loss, after_step=after)
        runs.append(model)
    assert_params_equal(*runs)


BF16_CLAMP = 0.01
"""WGAN's clip value: most weights sit on the bound, so each clamp changes some elements of every tensor."""


def test_bf16_param_edits_are_adopted_by_the_fp32_master(offload: OffloadDaemon, tier: str) -> None:
    """``p.data.clamp_`` on bf16 params after every step: the next step starts from the clamped values.

    Reference: ``CPUAdam`` with the same clamps, whose fp32 master then adopts them.  Two adoptions are
    both faithful to the edit and differ only in the low bits of the elements the clamp left alone: the
    edited tensor's master becomes the edited param widened to fp32, or only the changed elements of the
    master take the new values.  The run must equal one of them bitwise (reverting the clamp is ~1e-2 off).
    """
    base = mlp()
    m_off = replicas(base, 1)[0].to(torch.bfloat16)
    opt = offload.make(m_off.parameters(), offload=tier, **HYPER)
    batches = mlp_batches(5, fixed=False)

    def clamp(model: nn.Module) -> list[torch.Tensor]:
        before = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.data.clamp_(-BF16_CLAMP, BF16_CLAMP)
        return before

    train(m_off, opt, batches, mlp_loss, after_step=lambda i: clamp(m_off))

    references = {}
    for adoption in ("whole-tensor", "changed-elements"):
        m_eng = replicas(base, 1)[0].to(torch.bfloat16)
        eng = cpu_adam(m_eng.parameters(), **HYPER)

        def adopt(i: int, m_eng: nn.Module = m_eng, eng: torch.optim.Optimizer = eng, adoption: str = adoption) -> None:
            before = clamp(m_eng)
            for p, old in zip(m_eng.parameters(), before, strict=True):
                changed = p != old
                assert changed.any(), "the test's clamp should change every tensor (else the adoptions differ more)"
                master = eng.state[p]["master"]
                if adoption == "whole-tensor":
                    master.copy_(p.float())
                else:
                    master.copy_(torch.where(changed, p.float(), master))

        train(m_eng, eng, batches, mlp_loss, after_step=adopt)
        references[adoption] = m_eng
    diffs = {name: max_param_diff(m_off, m) for name, m in references.items()}
    assert min(diffs.values()) == 0.0, f"max abs param difference to each reference: {diffs}"


# ----------------------------------------------------------------------------- released grads


def test_released_grads_accumulate_in_the_daemon_like_adamw(offload: OffloadDaemon, tier: str) -> None:
    """``release_grads=True``: grads go to the daemon's ``grad`` state key as they land (p.grad is None after
    backward); two backward passes per step add up there: the same params as AdamW with the same loop.  A
    GradScaler, which must see the grads to check them, is refused with a clear error."""
    m_off, opt, m_ref, ref = offload_and_adamw(offload, mlp(), tier, offload_only={"release_grads": True}, **HYPER)
    assert "grad" in opt.state_keys
    micro = mlp_batches(6, fixed=False)
    for i in range(0, 6, 2):
        for model, o in ((m_off, opt), (m_ref, ref)):
            for batch in micro[i : i + 2]:
                (mlp_loss(model, batch) / 2).backward()
            if o is opt:
                assert all(p.grad is None for p in model.parameters())
            o.step()
            o.zero_grad()
    assert_params_close(m_off, m_ref)
    assert_state_close(opt.state_dict(), ref.state_dict())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scaler.scale(mlp_loss(m_off, micro[0])).backward()
    with pytest.raises(InvalidState, match="GradScaler"):
        scaler.step(opt)
    for name in ("grad_scale", "found_inf"):
        opt.__dict__.pop(name, None)


@pytest.mark.parametrize("exchange", ["shared", "staged"])
def test_a_grad_written_after_its_release_is_refused_at_step_and_nothing_is_applied(
    offload: OffloadDaemon, tier: str, exchange: str
) -> None:
    """DDP all-reduces the grads after the hooks released them and writes the averages into ``p.grad`` when
    backward ends; the step added them to the released local grads (0.07 off AdamW after 4 steps at 2 ranks).
    A grad written after its release (by DDP, or by hand) is now refused at ``step()``, naming the param, with
    nothing of that step applied; the next step starts afresh."""
    kwargs = {"release_grads": True, "exchange": exchange}
    m_off, opt, m_ref, ref = offload_and_adamw(offload, mlp(), tier, offload_only=kwargs, **HYPER)
    batches = mlp_batches(4, fixed=False)
    train(m_off, opt, batches[:1], mlp_loss)
    train(m_ref, ref, batches[:1], mlp_loss)
    before = [p.detach().clone() for p in m_off.parameters()]
    mlp_loss(m_off, batches[1]).backward()
    late = m_off[2].weight
    late.grad = torch.ones_like(late)  # what DDP's reducer does with the averaged bucket
    with pytest.raises(GradsAfterRelease, match=r"param 2 \(shape \(64, 64\).*written after.*DDP.*release_grads=False"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(m_off.parameters(), before, strict=True))
    assert opt.steps == 1
    opt.zero_grad()
    train(m_off, opt, batches[2:], mlp_loss)
    train(m_ref, ref, batches[2:], mlp_loss)
    assert_params_close(m_off, m_ref)


def test_released_grads_with_the_overlapped_update_train_like_adamw(offload: OffloadDaemon, tier: str) -> None:
    kwargs = {"release_grads": True, "overlap_update": True, "bucket_nbytes": 4096}
    m_off, opt, m_ref, ref = offload_and_adamw(offload, mlp(), tier, offload_only=kwargs, **HYPER)
    batches = mlp_batches(5, fixed=False)
    train(m_off, opt, batches, mlp_loss)
    train(m_ref, ref, batches, mlp_loss)
    assert_params_close(m_off, m_ref)
    assert opt.stats().rank.overlapped_tensors > 0


# ----------------------------------------------------------------------------- storages torch moves


def _share_memory(model: nn.Module, i: int) -> None:
    if i in (1, 3):
        model.share_memory()  # Hogwild's idiom: every param's (and grad's) storage into a segment of torch's


SHARED_OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "bf16": {},
    "delayed": {"delayed_update": True, "warmup_steps": 1},
    "overlap": {"overlap_update": True, "bucket_nbytes": 1024},
    "released": {"release_grads": True},
}


@pytest.mark.parametrize("point", ["after_step", "after_backward"])
@pytest.mark.parametrize("case", list(SHARED_OPTIONS))
def test_model_share_memory_is_undone_for_the_params_and_training_is_unchanged(
    offload: OffloadDaemon, tier: str, case: str, point: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``share_memory_()`` swaps a storage's memory for a new segment in place, so a param and the shared
    storage's view it lives in moved together, out of the daemon's reach: the daemon went on updating the
    old bytes, the model trained on a stale copy (0.048 off AdamW after 5 steps) and nothing was said.
    Now the params and their grads are put back, with a warning, and the run equals one without the move,
    bitwise, after the grads (``after_backward``: the grads moved too) or between steps."""
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    quiet_model, moved_model = (m.to(dtype) for m in replicas(mlp(), 2))
    batches = [tuple(t.to(dtype) for t in batch) for batch in mlp_batches(6, fixed=False)]
    options = {**HYPER, **SHARED_OPTIONS[case], "offload": tier}
    quiet, moved = offload.make(quiet_model.parameters(), **options), offload.make(moved_model.parameters(), **options)
    train(quiet_model, quiet, batches, mlp_loss)
    with caplog.at_level("WARNING", logger="tiermem.client.offload.shared"):
        train(moved_model, moved, batches, mlp_loss, **{point: functools.partial(_share_memory, moved_model)})
    quiet.flush()
    moved.flush()
    assert_params_equal(moved_model, quiet_model)
    assert moved.shared_feed is not None and moved.shared_feed.rehomed == 2 * len(list(moved_model.parameters()))
    assert not any(p.is_shared() for p in moved_model.parameters())  # back in the daemon's storage
    warnings = [r for r in caplog.records if "moved out of tiermemd's shared storage" in r.getMessage()]
    assert len(warnings) == 2  # one a step that found moved params, not one a param


def _sum_in_child(inbox: Any, outbox: Any) -> None:
    state = inbox.get()
    outbox.put(float(sum(t.double().sum() for t in state.values())))


def test_a_state_dict_sent_to_another_process_leaves_training_unchanged(offload: OffloadDaemon, tier: str) -> None:
    """A ``torch.multiprocessing`` queue moves each CPU tensor it sends into shared memory of torch's, in place
    (an evaluation or checkpoint-writing process fed the model's ``state_dict()``): the child gets the values,
    and the parent's training goes on exactly as without the send."""
    quiet_model, sent_model = replicas(mlp(), 2)
    batches = mlp_batches(6, fixed=False)
    quiet, sent = (offload.make(m.parameters(), **HYPER, offload=tier) for m in (quiet_model, sent_model))
    ctx = torch.multiprocessing.get_context("fork")
    inbox, outbox = ctx.SimpleQueue(), ctx.SimpleQueue()
    child = ctx.Process(target=_sum_in_child, args=(inbox, outbox))
    child.start()
    try:
        train(quiet_model, quiet, batches[:3], mlp_loss)
        train(sent_model, sent, batches[:3], mlp_loss)
        expected = float(sum(t.double().sum() for t in sent_model.state_dict().values()))
        inbox.put(sent_model.state_dict())
        assert outbox.get() == expected
    finally:
        child.join(30)
    assert child.exitcode == 0
    train(quiet_model, quiet, batches[3:], mlp_loss)
    train(sent_model, sent, batches[3:], mlp_loss)
    assert_params_equal(sent_model, quiet_model)

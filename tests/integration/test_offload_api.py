"""``OffloadAdam`` behaves as a ``torch.optim`` optimizer where users lean on the API.

Construction (torch's validation and messages, torch's harmless kwargs),
Ctrl-C in the middle of a step or a backward, ``torch.compile(opt.step)``,
clear errors at the point of misuse (dtype change, sparse grads, deepcopy and
pickle), ``opt.state`` and the last step's grad norm and overflow flag,
``release_grads``, and a model 100x larger than a bounded window.  Every
training test compares with ``torch.optim.AdamW`` under the same seeds, on
the CPU tier and on the NVMe tier (one private tiermemd for the module, as in
``test_offload_semantics``).

Tolerance: MLPs, compared with ``assert_close``'s default fp32 tolerances, as
in ``test_offload_parity``'s and ``test_offload_training``'s MLP comparisons
with torch (one-ulp roundings, which an MLP does not amplify over a few
steps; a wrong update is off by 1e-3 or more).
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import re
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from offload_helpers import (
    OffloadDaemon,
    assert_params_close,
    assert_state_close,
    offload_and_adamw,
    record_state_dict_hooks,
    train,
)
from small_models import TwoBranches, mlp, mlp_batches, mlp_loss
from torch import nn
from torch.nn import functional as F

from tiermem import OffloadAdam
from tiermem.core.errors import DTypeError, InvalidArgument, InvalidType

HYPER: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}


# the bounded-window test's model holds ~25 MiB of Adam state
OFFLOAD_DAEMON: dict[str, Any] = {"settings": {"jobs.max_jobs": 256}, "pool_size": 256 << 20}


# ----------------------------------------------------------------------------- construction


INVALID = {
    "lr": {"lr": -1e-3},
    "eps": {"eps": -1e-8},
    "beta1-one": {"betas": (1.0, 0.999)},
    "beta2-one": {"betas": (0.9, 1.0)},
    "beta1-negative": {"betas": (-0.1, 0.999)},
    "weight-decay": {"weight_decay": -1e-2},
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_hyper_parameter_raises_torchs_value_error_before_any_daemon(
    no_daemon: None, tier: str, case: str
) -> None:
    params = list(mlp().parameters())
    with pytest.raises(ValueError) as torch_error:
        torch.optim.AdamW(params, **INVALID[case])
    with pytest.raises(ValueError) as error:
        OffloadAdam(params, offload=tier, **INVALID[case])
    assert str(error.value) == str(torch_error.value)


HARMLESS = {
    "amsgrad-false": {"amsgrad": False},
    "foreach-none": {"foreach": None},
    "foreach-true": {"foreach": True},
    "foreach-false": {"foreach": False},
    "fused-none": {"fused": None},
    "fused-true": {"fused": True},
    "fused-false": {"fused": False},
    "capturable-false": {"capturable": False},
    "differentiable-false": {"differentiable": False},
}


@pytest.mark.parametrize("case", list(HARMLESS))
def test_harmless_torch_kwargs_are_accepted_and_train_like_adamw(offload: OffloadDaemon, tier: str, case: str) -> None:
    base = mlp()
    m_off, opt, m_ref, ref = offload_and_adamw(offload, base, tier, **HYPER, **HARMLESS[case])
    batches = mlp_batches(3, fixed=False)
    train(m_off, opt, batches, mlp_loss)
    train(m_ref, ref, batches, mlp_loss)
    assert_params_close(m_off, m_ref)


def test_a_param_listed_twice_is_refused_before_any_daemon(no_daemon: None, tier: str) -> None:
    """torch.optim warns and updates it twice a step (and means to refuse it); one registered tensor cannot."""
    m = mlp()
    params = list(m.parameters())
    with pytest.raises(InvalidArgument, match=r"lists one param twice \(positions 0 and 6.*OffloadAdam takes each"):
        OffloadAdam([*params, params[0]], offload=tier)


def test_more_param_groups_than_the_daemon_takes_are_refused_before_any_daemon(no_daemon: None, tier: str) -> None:
    """The wire carries at most 4,096 groups; past it the error says so in the optimizer's words, not as a
    malformed REGISTER field."""
    groups = [{"params": [nn.Parameter(torch.zeros(1))]} for _ in range(4097)]
    with pytest.raises(InvalidArgument, match=r"at most 4096 param groups .* share lr, betas, eps and weight_decay"):
        OffloadAdam(groups, offload=tier)


@pytest.mark.parametrize("name", ["amsgrad", "capturable", "differentiable"])
def test_unsupported_torch_kwargs_are_refused_by_name(no_daemon: None, tier: str, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        OffloadAdam(mlp().parameters(), offload=tier, **{name: True})


def test_unknown_keyword_is_a_type_error(no_daemon: None, tier: str) -> None:
    with pytest.raises(TypeError):
        OffloadAdam(mlp().parameters(), offload=tier, momentum=0.9)


NUMPY_HYPER: dict[str, Any] = {"lr": np.float32(1e-2), "eps": np.float32(1e-8), "weight_decay": np.float64(0.1)}


def test_numpy_scalar_hyper_parameters_train_like_adamw_with_them(offload: OffloadDaemon, tier: str) -> None:
    """``lr=np.float32(1e-2)`` as torch takes it (it was refused with a message about tensors)."""
    m_off, opt, m_ref, ref = offload_and_adamw(offload, mlp(), tier, **NUMPY_HYPER)
    assert opt.defaults["lr"] == float(np.float32(1e-2))
    batches = mlp_batches(3, fixed=False)
    train(m_off, opt, batches, mlp_loss)
    train(m_ref, ref, batches, mlp_loss)
    assert_params_close(m_off, m_ref)


def test_a_string_written_into_a_group_fails_the_step_naming_it_and_training_goes_on_once_fixed(
    offload: OffloadDaemon, tier: str
) -> None:
    """torch's step fails on ``param_groups[0]["lr"] = "0.1"`` with a TypeError, and so does this one, naming
    the group, the key and the value (the string was float()-converted and trained with); with the lr set
    right, the same grads step as AdamW's do."""
    batches = mlp_batches(3, fixed=False)
    probe_model = mlp()
    probe = torch.optim.AdamW(probe_model.parameters())
    mlp_loss(probe_model, batches[0]).backward()
    probe.param_groups[0]["lr"] = "0.1"
    with pytest.raises(TypeError):
        probe.step()
    m_off, opt, m_ref, ref = offload_and_adamw(offload, mlp(), tier, **HYPER)
    train(m_off, opt, batches[:1], mlp_loss)
    train(m_ref, ref, batches[:1], mlp_loss)
    mlp_loss(m_off, batches[1]).backward()
    opt.param_groups[0]["lr"] = "0.1"
    with pytest.raises(InvalidType) as info:
        opt.step()
    assert str(info.value).startswith("param_groups[0]['lr'] is '0.1' of type str, not a number")
    opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = 0.1
    opt.step()
    opt.zero_grad()
    train(m_ref, ref, batches[1:2], mlp_loss)
    train(m_off, opt, batches[2:], mlp_loss)
    train(m_ref, ref, batches[2:], mlp_loss)
    assert_params_close(m_off, m_ref)


# ----------------------------------------------------------------------------- Ctrl-C


@contextlib.contextmanager
def interrupt_timer() -> Iterator[None]:
    """While open, SIGALRM raises KeyboardInterrupt; pytest-timeout's handler and timer are put back after."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    pending_s, _ = signal.getitimer(signal.ITIMER_REAL)
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if pending_s > 0:
            signal.setitimer(signal.ITIMER_REAL, max(pending_s - (time.monotonic() - started), 1e-3))


def interrupted(call: Callable[[], object], delay_s: float) -> bool:
    """Run ``call`` with a KeyboardInterrupt due after ``delay_s``; True if it came (during the call or just
    after it returned, before the timer was cancelled)."""
    try:
        signal.setitimer(signal.ITIMER_REAL, delay_s)
        try:
            call()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except KeyboardInterrupt:
        return True
    return False


INTERRUPT_DELAYS_S = [1e-5 * 1.3**k for k in range(24)]
"""10 us to 4 ms: the first ones land inside the first step's registration, the last ones after a step."""


@pytest.mark.parametrize("phase", ["step", "backward"])
def test_keyboard_interrupt_leaves_the_optimizer_usable_and_every_step_whole(
    offload: OffloadDaemon, tier: str, phase: str
) -> None:
    """Ctrl-C at swept moments of step() (or backward()): state_dict() works after each, training goes on,
    and every step was applied to every param or to none.  The data is one fixed batch, so the params
    depend only on how many steps were applied: they must equal AdamW's after that many steps."""
    batch = mlp_batches(1)[0]
    model = mlp()
    opt = offload.make(model.parameters(), offload=tier, **HYPER)
    hits = 0
    with interrupt_timer(), torch.enable_grad():
        for delay_s in INTERRUPT_DELAYS_S:
            if phase == "step":
                mlp_loss(model, batch).backward()
                hit = interrupted(opt.step, delay_s)
            else:
                loss = mlp_loss(model, batch)
                hit = interrupted(loss.backward, delay_s)
                if not hit:
                    opt.step()
            if hit:
                hits += 1
                # an interrupt inside torch's own no_grad() (entering or leaving it) can leave grad mode off,
                # whatever the optimizer; the loop's own handler puts it back
                torch.set_grad_enabled(True)
                steps = {int(s["step"]) for s in opt.state_dict()["state"].values()}
                assert len(steps) <= 1, f"a step was applied to some params only: step counts {steps}"
            opt.zero_grad()
    assert hits >= 3, "the sweep should interrupt some calls"
    train(model, opt, [batch] * 3, mlp_loss)  # and training goes on
    saved = opt.state_dict()
    steps = {int(s["step"]) for s in saved["state"].values()}
    assert len(saved["state"]) == len(list(model.parameters()))
    assert len(steps) == 1, f"a step was applied to some params only: step counts {steps}"
    (applied,) = steps
    assert applied >= 3
    m_ref = mlp()
    ref = torch.optim.AdamW(m_ref.parameters(), **HYPER)
    train(m_ref, ref, [batch] * applied, mlp_loss)
    assert_params_close(model, m_ref)
    assert_state_close(saved, ref.state_dict())


def twice_interrupted(calls: list[Callable[[], object]], first_s: float, second_s: float) -> int:
    """Run ``calls`` one after another with a KeyboardInterrupt due after ``first_s`` and a second one
    ``second_s`` after the first (an impatient Ctrl-C, Ctrl-C); an interrupt ends the call it lands in and the
    next one runs; one that comes between the calls is dropped.  Waits for both; returns how many landed in
    a call."""
    fired: list[float] = []
    landed = 0

    def interrupt(signum: int, frame: Any) -> None:
        fired.append(time.monotonic())
        if len(fired) == 1:
            signal.setitimer(signal.ITIMER_REAL, second_s)
        if frame is not None and frame.f_code.co_filename == __file__:
            return  # it came between the calls, in this harness (its own except clause included): dropped
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, first_s)
        pending = list(calls)
        while True:
            try:
                while pending:
                    pending.pop(0)()
                deadline = time.monotonic() + first_s + second_s + 0.05
                while len(fired) < 2 and time.monotonic() < deadline:
                    time.sleep(1e-4)
                break
            except KeyboardInterrupt:
                landed += 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return landed


def adamw_trajectory(batch: Any, steps: int, width: int = 64) -> list[list[torch.Tensor]]:
    """AdamW's params after 0, 1, ..., ``steps`` steps on one fixed batch."""
    model = mlp(width=width)
    ref = torch.optim.AdamW(model.parameters(), **HYPER)
    out = [[p.detach().clone() for p in model.parameters()]]
    for _ in range(steps):
        train(model, ref, [batch], mlp_loss)
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def test_a_second_interrupt_while_step_waits_for_the_first_ones_outcome_leaves_the_optimizer_usable(
    offload: OffloadDaemon, tier: str
) -> None:
    """Ctrl-C twice (the second 0-2 ms after the first, so it lands in the handler that records the step, in
    the wait for its outcome, or in the next call, ``zero_grad()``, while that reads the outcome): whatever
    each hit, training goes on, each step is applied whole, and the params end as AdamW's after as many steps
    as the daemon counts."""
    batch = mlp_batches(1)[0]
    width = 1024  # 1M params: a step long enough that the second interrupt can land in the wait for it
    model = mlp(width=width)
    opt = offload.make(model.parameters(), offload=tier, **HYPER)
    hits = 0
    with interrupt_timer(), torch.enable_grad():
        for k, delay_s in enumerate(INTERRUPT_DELAYS_S[8:]):
            mlp_loss(model, batch).backward()
            hits += twice_interrupted([opt.step, opt.zero_grad], delay_s, 1e-6 if k % 2 else 1e-3 * (k % 3))
            torch.set_grad_enabled(True)  # an interrupt inside torch's no_grad() can leave grad mode off
            opt.zero_grad()
    assert hits >= 3, "the sweep should interrupt some steps"
    train(model, opt, [batch] * 2, mlp_loss)  # before the fix: "step N was already applied" for good
    saved = opt.state_dict()
    steps = {int(s["step"]) for s in saved["state"].values()}
    assert steps == {opt.steps}, (steps, opt.steps)
    expected = adamw_trajectory(batch, opt.steps, width)[-1]
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.detach(), want)


def test_the_interrupt_handler_finds_the_params_of_one_whole_step_that_steps_counts(
    offload: OffloadDaemon, tier: str
) -> None:
    """A trainer that saves on Ctrl-C: in its handler the model holds AdamW's params after exactly
    ``opt.steps`` steps, and nothing changes them after it (the daemon wrote them before the interrupt came
    out of step())."""
    batch = mlp_batches(1)[0]
    model = mlp()
    opt = offload.make(model.parameters(), offload=tier, **HYPER)
    trajectory = adamw_trajectory(batch, len(INTERRUPT_DELAYS_S) + 1)
    hits = 0
    with interrupt_timer(), torch.enable_grad():
        for delay_s in INTERRUPT_DELAYS_S:
            mlp_loss(model, batch).backward()
            if interrupted(opt.step, delay_s):
                hits += 1
                seen = [p.detach().clone() for p in model.parameters()]
                steps = opt.steps
                time.sleep(0.02)
                for p, was, want in zip(model.parameters(), seen, trajectory[steps], strict=True):
                    assert torch.equal(p.detach(), was), "the params changed after the interrupt came out"
                    torch.testing.assert_close(was, want)
                torch.set_grad_enabled(True)
            opt.zero_grad()
    assert hits >= 3, "the sweep should interrupt some steps"


# ----------------------------------------------------------------------------- torch.compile


def test_compiled_step_trains_like_adamw(offload: OffloadDaemon, tier: str) -> None:
    base = mlp()
    m_off, opt, m_ref, ref = offload_and_adamw(offload, base, tier, **HYPER)
    batches = mlp_batches(4, fixed=False)
    compiled_step = torch.compile(opt.step)
    try:
        for batch in batches:
            mlp_loss(m_off, batch).backward()
            compiled_step()
            opt.zero_grad()
    finally:
        torch._dynamo.reset()
    train(m_ref, ref, batches, mlp_loss)
    assert_params_close(m_off, m_ref)
    assert_state_close(opt.state_dict(), ref.state_dict())


# ----------------------------------------------------------------------------- errors at the point of misuse


def test_casting_the_model_to_bf16_after_some_steps_raises_dtype_error(offload: OffloadDaemon, tier: str) -> None:
    model = mlp()
    opt = offload.make(model.parameters(), offload=tier, **HYPER)
    batches = mlp_batches(3, fixed=False)
    train(model, opt, batches[:2], mlp_loss)
    model.to(torch.bfloat16)
    with pytest.raises(DTypeError) as error:
        mlp_loss(model, batches[2]).backward()
        opt.step()
    message = str(error.value)
    assert "float32" in message and "bfloat16" in message, message
    numbers = [int(n) for n in re.findall(r"\d+", re.sub(r"\w*float\d+", "", message))]
    assert any(n < len(list(model.parameters())) for n in numbers), f"no param index in: {message}"


class SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(20, 8, sparse=True)
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids))


def test_sparse_grads_raise_invalid_argument_naming_sparse(offload: OffloadDaemon, tier: str) -> None:
    model = SparseEmbedding()
    opt = offload.make(model.parameters(), offload=tier, **HYPER)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(InvalidArgument, match=r"(?i)sparse"):
        model(ids).square().mean().backward()
        opt.step()


def test_deepcopy_and_pickle_raise_type_error_pointing_to_state_dict(offload: OffloadDaemon, tier: str) -> None:
    fresh = offload.make(mlp().parameters(), offload=tier, **HYPER)
    model = mlp()
    trained = offload.make(model.parameters(), offload=tier, **HYPER)
    train(model, trained, mlp_batches(1), mlp_loss)
    for opt in (fresh, trained):
        with pytest.raises(TypeError, match="state_dict"):
            copy.deepcopy(opt)
        with pytest.raises(TypeError, match="state_dict"):
            pickle.dumps(opt)


# ----------------------------------------------------------------------------- what the optimizer answers


def test_torchs_state_dict_hooks_run_as_they_do_on_adamw(offload: OffloadDaemon, tier: str) -> None:
    """``register_state_dict_pre_hook`` and its three siblings (torch.optim's, used by libraries that save their
    own state with the optimizer's) were silently never called: ``state_dict`` and ``load_state_dict`` are
    ours.  They run as on AdamW: the post hook's dict is what is saved, the pre hook's what is loaded."""
    m_off, opt, m_ref, ref = offload_and_adamw(offload, mlp(), tier, **HYPER)
    ours: list[str] = []
    torchs: list[str] = []
    record_state_dict_hooks(opt, ours)
    record_state_dict_hooks(ref, torchs)
    batches = mlp_batches(2, fixed=False)
    train(m_off, opt, batches, mlp_loss)
    train(m_ref, ref, batches, mlp_loss)
    saved, ref_saved = opt.state_dict(), ref.state_dict()
    assert saved["extra"] == ref_saved["extra"] == {"ema_decay": 0.999}
    opt.load_state_dict(saved)
    ref.load_state_dict(ref_saved)
    assert ours == torchs == ["save pre", "save post", "load pre {'ema_decay': 0.999}", "load post"]
    assert_state_close(opt.state_dict(), ref.state_dict())


def test_state_mapping_answers_like_adamw(offload: OffloadDaemon, tier: str) -> None:
    base = TwoBranches(heads="a")  # branch_b never takes part: its params get no grad and no state
    m_off, opt, m_ref, ref = offload_and_adamw(offload, base, tier, **HYPER)
    batches = mlp_batches(3, fixed=False)
    train(m_off, opt, batches, lambda m, b: F.mse_loss(m(b[0]), b[1]))
    train(m_ref, ref, batches, lambda m, b: F.mse_loss(m(b[0]), b[1]))
    assert len(opt.state) == len(ref.state) == 4  # trunk and branch_a
    for (name, p), q in zip(m_off.named_parameters(), m_ref.parameters(), strict=True):
        if q not in ref.state:
            assert p not in opt.state, name
            continue
        mine, theirs = opt.state[p], ref.state[q]
        assert isinstance(mine["step"], torch.Tensor) and mine["step"].dim() == 0, name
        assert float(mine["step"]) == float(theirs["step"]) == 3.0, name
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(mine[key], theirs[key], msg=lambda m, n=name, k=key: f"{n} {k}: {m}")
    stepped = {id(p) for p, q in zip(m_off.parameters(), m_ref.parameters(), strict=True) if q in ref.state}
    assert {id(p) for p, entry in opt.state.items() if "exp_avg" in entry} == stepped


def _shadow_grad_norm(model: nn.Module, max_norm: float) -> float:
    """What ``clip_grad_norm_`` returns on copies of ``model``'s grads (the grads themselves are left alone)."""
    shadows = []
    for p in model.parameters():
        if p.grad is not None:
            shadow = torch.zeros_like(p)
            shadow.grad = p.grad.detach().clone()
            shadows.append(shadow)
    return float(torch.nn.utils.clip_grad_norm_(shadows, max_norm))


def test_last_grad_norm_is_what_clip_grad_norm_returns(offload: OffloadDaemon, tier: str) -> None:
    base = mlp()
    m_off, opt, m_ref, ref = offload_and_adamw(offload, base, tier, offload_only={"max_grad_norm": 0.5}, **HYPER)
    assert opt.last_grad_norm is None  # no step yet
    norms = []
    for batch in mlp_batches(4, fixed=False):
        mlp_loss(m_off, batch).backward()
        expected = _shadow_grad_norm(m_off, 0.5)
        opt.step()
        opt.zero_grad()
        # the daemon sums the squares per chunk, clip_grad_norm_ per tensor: the order differs in the last bits
        assert opt.last_grad_norm == pytest.approx(expected, rel=1e-5)
        assert opt.last_found_inf is False
        mlp_loss(m_ref, batch).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m_ref.parameters(), 0.5)))
        ref.step()
        ref.zero_grad()
    assert any(n > 0.5 for n in norms), "clipping should be active"
    assert_params_close(m_off, m_ref)


def test_last_found_inf_reports_the_grad_scaler_overflow(offload: OffloadDaemon, tier: str) -> None:
    """A scale of 2**124 overflows the scaled fp32 grads until it has backed off: those steps are skipped."""
    base = mlp()
    m_off, opt, m_ref, ref = offload_and_adamw(offload, base, tier, **HYPER)
    batches = mlp_batches(8, fixed=False)
    flags = []
    for model, o in ((m_off, opt), (m_ref, ref)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**124, backoff_factor=2.0**-4)
        for batch in batches:
            scaler.scale(mlp_loss(model, batch) * 256).backward()
            scale = scaler.get_scale()
            scaler.step(o)
            scaler.update()
            o.zero_grad()
            if o is opt:
                overflow = scaler.get_scale() < scale
                flags.append(overflow)
                assert opt.last_found_inf is overflow
    assert True in flags and False in flags, f"the run should skip some steps and take others: {flags}"
    assert_params_close(m_off, m_ref)


def test_release_grads_leaves_no_grad_and_clips_like_torch(offload: OffloadDaemon, tier: str) -> None:
    base = mlp()
    m_off, opt, m_ref, ref = offload_and_adamw(
        offload, base, tier, offload_only={"release_grads": True, "max_grad_norm": 1.0}, **HYPER
    )
    batches = mlp_batches(5, fixed=False)

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        return mlp_loss(model, batch) * 20  # grad norms above 1: the clipping is active

    released: list[bool] = []
    norms: list[float] = []
    train(
        m_off,
        opt,
        batches,
        loss,
        after_backward=lambda i: released.append(all(p.grad is None for p in m_off.parameters())),
    )
    train(
        m_ref,
        ref,
        batches,
        loss,
        after_backward=lambda i: norms.append(float(torch.nn.utils.clip_grad_norm_(m_ref.parameters(), 1.0))),
    )
    assert all(released), f"p.grad after backward was None in steps {released}"
    assert all(n > 1.0 for n in norms), norms
    assert_params_close(m_off, m_ref)


# ----------------------------------------------------------------------------- a bounded window

WINDOW_NBYTES = 64 * 1024


def wide_mlp() -> nn.Module:
    """About 2.1M fp32 params (8 MiB): 128x the window."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024))


def test_a_model_100x_the_window_trains_like_adamw(offload: OffloadDaemon, tier: str) -> None:
    base = wide_mlp()
    assert sum(p.numel() * p.element_size() for p in base.parameters()) >= 100 * WINDOW_NBYTES
    m_off, opt, m_ref, ref = offload_and_adamw(
        offload, base, tier, offload_only={"window_nbytes": WINDOW_NBYTES}, **HYPER
    )
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 1024, generator=g), torch.randn(8, 1024, generator=g)) for _ in range(3)]

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        return F.mse_loss(model(batch[0]), batch[1])

    train(m_off, opt, batches, loss)
    train(m_ref, ref, batches, loss)
    assert_params_close(m_off, m_ref)
    assert opt.stats().rank.window_nbytes <= WINDOW_NBYTES


def test_state_dict_reads_only_the_state_of_params_that_stepped(offload: OffloadDaemon, tier: str) -> None:
    """As in torch, a param that never stepped has no state; its state is not read either (a model's
    ``state_dict()`` before the first step, or with frozen layers, costs a step count per param, not 12
    B/param of reads and memory): with a 4 KiB window a 16K-element param would take 48 requests."""
    big, small = nn.Linear(128, 128, bias=False), nn.Linear(4, 1, bias=False)
    opt = offload.make(
        [*big.parameters(), *small.parameters()], offload=tier, exchange="staged", window_nbytes=4096, lr=1e-2
    )
    before = opt.transfer.requests
    assert opt.state_dict()["state"] == {}
    assert opt.transfer.requests - before == 1  # the step counts, one request for both params
    small(torch.ones(1, 4)).sum().backward()  # only the small param has a grad
    opt.step()
    before = opt.transfer.requests
    state = opt.state_dict()["state"]
    assert list(state) == [1] and float(state[1]["step"]) == 1.0
    assert opt.transfer.requests - before <= 2
    opt.close()


def test_a_model_of_more_tensors_than_one_frame_registers_in_parts_and_trains_like_adamw(
    offload: OffloadDaemon,
) -> None:
    """A mixture of experts with a module per expert has tens of thousands of tensors; 15,000 make a REGISTER
    of about 1.1 MB, past the daemon's 1 MiB frame (and past the 415 KiB a process without CAP_NET_ADMIN may
    send in one packet on a default kernel): it goes in parts.  The tier does not change the registration."""
    torch.manual_seed(0)
    base = nn.ParameterList(nn.Parameter(torch.randn(2)) for _ in range(15_000))
    ref_model = copy.deepcopy(base)
    opt = offload.make(base.parameters(), offload="cpu", **HYPER)
    ref = torch.optim.AdamW(ref_model.parameters(), **HYPER)
    for step in range(2):
        for model, o in ((base, opt), (ref_model, ref)):
            for i, p in enumerate(model):
                p.grad = torch.full_like(p, (i % 7 - 3) * (step + 1))
            o.step()
            o.zero_grad()
    flat = lambda tensors: torch.cat([t.detach().float().reshape(-1) for t in tensors])  # noqa: E731
    torch.testing.assert_close(flat(base), flat(ref_model))  # one comparison, not 15,000
    mine, theirs = opt.state_dict()["state"], ref.state_dict()["state"]
    assert sorted(mine) == sorted(theirs) == list(range(15_000))
    for key in ("step", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(flat(mine[i][key] for i in mine), flat(theirs[i][key] for i in mine))

"""The pure Adam arithmetic against torch.optim, alone (no engine, no threads, no compiler)."""

from __future__ import annotations

import math

import pytest
import torch

from tiermem.core.adam_math import AdamHyper, adam_update, step_scalars
from tiermem.core.errors import InvalidArgument

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


CASES = [
    pytest.param(True, 0.0, False, id="adamw-nodecay"),
    pytest.param(True, 0.1, False, id="adamw-decay"),
    pytest.param(False, 0.1, False, id="adam-l2"),
    pytest.param(False, 0.0, True, id="adam-maximize"),
    pytest.param(True, 0.05, True, id="adamw-decay-maximize"),
]


@pytest.mark.parametrize(("adamw", "weight_decay", "maximize"), CASES)
def test_eager_update_is_bit_identical_to_torch_single_tensor_path(
    adamw: bool, weight_decay: float, maximize: bool
) -> None:
    torch.manual_seed(0)
    p = torch.randn(4099)
    ref = torch.nn.Parameter(p.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay, maximize=maximize, foreach=False)
    hyper = AdamHyper(
        lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=weight_decay, adamw=adamw, maximize=maximize
    )
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t in range(1, 31):
        g = torch.randn(4099)
        ref.grad = g.clone()
        opt.step()
        p, m, v = adam_update(p, g, m, v, step_scalars(hyper, t))
    state = opt.state[ref]
    torch.testing.assert_close(p, ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(m, state["exp_avg"], rtol=0, atol=0)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=0, atol=0)


def test_update_with_tensor_scalars_matches_float_scalars() -> None:
    torch.manual_seed(1)
    hyper = AdamHyper(lr=3e-3, weight_decay=0.02, adamw=False, maximize=True)
    p, g, m, v = torch.randn(1000), torch.randn(1000), torch.randn(1000) * 0.1, torch.rand(1000) * 0.01
    scalars = step_scalars(hyper, 7, grad_scale=0.25)
    as_tensors = type(scalars)(*(torch.tensor(x, dtype=torch.float32) for x in scalars))
    for a, b in zip(adam_update(p, g, m, v, scalars), adam_update(p, g, m, v, as_tensors), strict=True):
        torch.testing.assert_close(a, b)


def test_update_does_not_modify_its_inputs() -> None:
    p, g, m, v = torch.randn(64), torch.randn(64).half(), torch.randn(64), torch.rand(64)
    before = [t.clone() for t in (p, g, m, v)]
    adam_update(p, g, m, v, step_scalars(AdamHyper(weight_decay=0.1), 3))
    for t, b in zip((p, g, m, v), before, strict=True):
        assert torch.equal(t, b)


def test_low_precision_grad_is_upcast_exactly() -> None:
    torch.manual_seed(2)
    p, m, v = torch.randn(512), torch.zeros(512), torch.zeros(512)
    g16 = torch.randn(512).to(torch.bfloat16)
    s = step_scalars(AdamHyper(), 1)
    for a, b in zip(adam_update(p, g16, m, v, s), adam_update(p, g16.float(), m, v, s), strict=True):
        assert torch.equal(a, b)


def test_grad_scale_folds_maximize_and_unscaling() -> None:
    s = step_scalars(AdamHyper(maximize=True), 1, grad_scale=0.5)
    assert s.grad_scale == -0.5
    assert step_scalars(AdamHyper(adamw=False, weight_decay=0.1), 1).l2 == 0.1
    assert step_scalars(AdamHyper(adamw=True, weight_decay=0.1, lr=0.01), 1).decay == 1 - 0.01 * 0.1


@pytest.mark.parametrize(
    "kwargs",
    [{"lr": -1.0}, {"beta1": 1.0}, {"beta2": -0.1}, {"eps": math.nan}, {"weight_decay": -1e-3}, {"lr": "0.1"}],
)
def test_hyper_rejects_out_of_range_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument, match="Adam"):
        AdamHyper(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [0, -1, 1.5, True])
def test_step_must_be_a_positive_integer(step: object) -> None:
    with pytest.raises(InvalidArgument, match="step count"):
        step_scalars(AdamHyper(), step)  # type: ignore[arg-type]


def test_hyper_reads_torch_param_groups() -> None:
    group = {"lr": 0.5, "betas": (0.5, 0.6), "eps": 1e-3, "weight_decay": 0.1, "decoupled_weight_decay": False}
    assert AdamHyper.of(group) == AdamHyper(lr=0.5, beta1=0.5, beta2=0.6, eps=1e-3, weight_decay=0.1, adamw=False)
    assert AdamHyper.of({"lr": 0.1, "adamw": True}).adamw

"""The engine's native fp32 path (torch's fused CPU kernel) against its eager path and torch.optim.

The native path serves fp32 updates with no output and no grad scale; everything else keeps the compiled
kernel (or the eager one).  These tests pin which path runs and that both give torch's results.
"""

from __future__ import annotations

import pytest
import torch

from tiermem.core.adam_math import AdamHyper
from tiermem.engine.optim import AdamEngine

N = 5000
STEPS = 4


def operands(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p, m = torch.randn(N, generator=gen), torch.zeros(N)
    return [p, m, torch.zeros(N)]


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("maximize", [False, True])
def test_native_updates_equal_torch_adam(adamw: bool, maximize: bool) -> None:
    hyper = AdamHyper(lr=1e-2, weight_decay=0.1, adamw=adamw, maximize=maximize)
    p, m, v = operands()
    ref = torch.nn.Parameter(p.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=1e-2, weight_decay=0.1, maximize=maximize)
    gen = torch.Generator().manual_seed(1)
    with AdamEngine(threads=1, compile=False) as engine:
        assert engine.native
        for step in range(1, STEPS + 1):
            g = torch.randn(N, generator=gen)
            before = g.clone()
            engine.update(p, m, v, g, group=hyper, step=step)
            assert torch.equal(g, before), "the native path must not write the grad"
            ref.grad = g.clone()
            opt.step()
    torch.testing.assert_close(p, ref.detach())
    torch.testing.assert_close(m, opt.state[ref]["exp_avg"])
    torch.testing.assert_close(v, opt.state[ref]["exp_avg_sq"])


def test_a_grad_scale_takes_the_other_path_and_leaves_the_grad_alone() -> None:
    hyper = AdamHyper(lr=1e-2, weight_decay=0.1)
    native_ops, other_ops = operands(), operands()
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(N, generator=gen)
    with AdamEngine(threads=1, compile=False) as native, AdamEngine(threads=1, compile=False, native=False) as eager:
        # scaled: both engines run the eager kernel, bit for bit, and the grad is not unscaled in place
        before = g.clone()
        native.update(*native_ops[:3], g, group=hyper, step=1, grad_scale=0.5)
        eager.update(*other_ops[:3], g, group=hyper, step=1, grad_scale=0.5)
        assert torch.equal(g, before)
        for a, b in zip(native_ops, other_ops, strict=True):
            assert torch.equal(a, b)
        # unscaled: the native kernel and the eager one agree to rounding (not bitwise: different op order)
        native.update(*native_ops[:3], g, group=hyper, step=2)
        eager.update(*other_ops[:3], g, group=hyper, step=2)
        for a, b in zip(native_ops, other_ops, strict=True):
            torch.testing.assert_close(a, b)


def test_a_range_updates_only_its_elements() -> None:
    hyper = AdamHyper(lr=1e-2)
    p, m, v = operands()
    before = p.clone()
    g = torch.ones(N)
    with AdamEngine(threads=1, compile=False) as engine:
        engine.update(p, m, v, g, group=hyper, step=1, start=100, stop=200)
        engine.update(p, m, v, g, group=hyper, step=1, start=300, stop=300)  # empty: nothing
    assert torch.equal(p[:100], before[:100]) and torch.equal(p[200:], before[200:])
    assert bool((p[100:200] != before[100:200]).all())

"""The engine's native fp32 path (torch's fused CPU kernel) against its eager path and torch.optim.

The native path serves fp32 updates with no output, scaled or not; everything else keeps the compiled
kernel (or the eager one).  These tests pin which path runs and that both give torch's results.
"""

from __future__ import annotations

import pytest
import torch

from tiermem.core.adam_math import AdamHyper
from tiermem.engine.optim import AdamEngine
from tiermem.engine.optim.engine import NATIVE_SCALE_BLOCK_NUMEL

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


@pytest.mark.parametrize("adamw", [True, False])
def test_a_grad_scale_stays_native_block_by_block_and_leaves_the_grad_alone(adamw: bool) -> None:
    """Loss scaling and clipping scale the grad: the native path multiplies each block into a scratch block
    (so torch's fused kernel sees exactly ``g * grad_scale``) and compiles nothing, across several blocks."""
    n = NATIVE_SCALE_BLOCK_NUMEL * 2 + 777
    hyper = AdamHyper(lr=1e-2, weight_decay=0.1, adamw=adamw)
    gen = torch.Generator().manual_seed(2)
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    ref = torch.nn.Parameter(p.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=1e-2, weight_decay=0.1, fused=True)
    with AdamEngine(threads=1, compile=True, warmup=()) as engine:
        for step, scale in enumerate((0.5, 1.0, 3.0e-3), start=1):
            g = torch.randn(n, generator=gen)
            before = g.clone()
            engine.update(p, m, v, g, group=hyper, step=step, grad_scale=scale)
            assert torch.equal(g, before), "a scaled update must not write the grad (it may be the trainer's)"
            ref.grad = g * scale
            opt.step()
        assert engine.kernels() == [], "an fp32 update compiled a kernel"
    assert torch.equal(p, ref.detach())
    assert torch.equal(m, opt.state[ref]["exp_avg"])
    assert torch.equal(v, opt.state[ref]["exp_avg_sq"])


def test_a_scaled_fp32_update_runs_the_compiled_kernel_only_where_warm_up_built_it() -> None:
    """The path depends on the configuration, never on timing: an fp32 kernel built at warm-up serves scaled
    updates (the same results as the other paths, to rounding); unscaled ones stay native."""
    hyper = AdamHyper(lr=1e-2, weight_decay=0.1)
    warm_ops, cold_ops = operands(), operands()
    g = torch.randn(N, generator=torch.Generator().manual_seed(3))
    with (
        AdamEngine(threads=1, warmup=[(torch.float32, None)]) as warm,
        AdamEngine(threads=1, compile=False) as cold,
    ):
        (record,) = warm.kernels()
        assert record.state.value == "compiled"
        calls: list[int] = []
        fn = record.fn
        record.fn = lambda *a: (calls.append(1), fn(*a))[1]  # counts the compiled kernel's calls
        warm.update(*warm_ops, g, group=hyper, step=1, grad_scale=0.5)
        cold.update(*cold_ops, g, group=hyper, step=1, grad_scale=0.5)
        assert calls, "a scaled update did not run the kernel built at warm-up"
        calls.clear()
        warm.update(*warm_ops, g, group=hyper, step=2)
        cold.update(*cold_ops, g, group=hyper, step=2)
        assert not calls, "an unscaled fp32 update left the native path"
    for a, b in zip(warm_ops, cold_ops, strict=True):
        torch.testing.assert_close(a, b)


def test_a_scaled_native_update_agrees_with_the_eager_kernel() -> None:
    hyper = AdamHyper(lr=1e-2, weight_decay=0.1)
    native_ops, other_ops = operands(), operands()
    g = torch.randn(N, generator=torch.Generator().manual_seed(2))
    with AdamEngine(threads=1, compile=False) as native, AdamEngine(threads=1, compile=False, native=False) as eager:
        for step in (1, 2):
            native.update(*native_ops, g, group=hyper, step=step, grad_scale=0.5)
            eager.update(*other_ops, g, group=hyper, step=step, grad_scale=0.5)
        for a, b in zip(native_ops, other_ops, strict=True):
            torch.testing.assert_close(a, b)  # to rounding: a different order of operations


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

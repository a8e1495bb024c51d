"""The step rules against torch: ``clip_grad_norm_`` and ``GradScaler`` decide the same skip, norm and scale.

A table of gradient sets (finite, one inf, one NaN, inf and NaN, all zero, no grads) is put through torch
(``clip_grad_norm_``, and a real ``GradScaler`` stepping an optimizer) and through ``decide``, at world size
1 and as N ranks would (each rank's statistics over its shards, summed as an all-reduce sums them).
"""

from __future__ import annotations

import math

import pytest
import torch

from tiermem.core.errors import InvalidArgument
from tiermem.core.step_rules import GradStats, clip_coefficient, combine_grad_stats, decide, grad_stats


def _grads(kind: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(300, generator=gen) * 3, torch.randn(7, 5, generator=gen), torch.randn(1, generator=gen)]
    if kind == "zero":
        return [torch.zeros_like(g) for g in grads]
    if kind == "none":
        return []
    if kind in ("inf", "inf+nan"):
        grads[1][2, 3] = math.inf
    if kind in ("nan", "inf+nan"):
        grads[0][17] = math.nan
    return grads


KINDS = ["finite", "inf", "nan", "inf+nan", "zero", "none"]


def _stats(grads: list[torch.Tensor], world_size: int, inv_scale: float = 1.0) -> GradStats:
    """The global statistics as ``world_size`` ranks get them: each its shards, then an all-reduce."""
    flat = torch.cat([g.flatten() for g in grads]) if grads else torch.zeros(0)
    per_rank = [
        combine_grad_stats(grad_stats(shard, inv_scale) for shard in [piece]) for piece in flat.chunk(world_size)
    ]
    sq = sum(s.sq_norm for s in per_rank)
    flags = sum(float(s.found_inf) for s in per_rank)
    return GradStats.of(sq, flags)


def _same(a: float | None, b: float) -> bool:
    if a is None:
        return False
    if math.isnan(b) or math.isinf(b):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return a == pytest.approx(b, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_norm", [0.5, 1e4])
def test_clipping_matches_clip_grad_norm(kind: str, world_size: int, max_norm: float) -> None:
    grads = _grads(kind)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    total = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    decision = decide(_stats(grads, world_size), max_grad_norm=max_norm)
    assert not decision.skip  # clip_grad_norm_ never skips: what it makes of the grads is applied
    assert decision.nonfinite == (kind in ("inf", "nan", "inf+nan"))
    assert _same(decision.grad_norm, total), (decision.grad_norm, total)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(g * decision.grad_scale, p.grad, equal_nan=True, rtol=2e-7, atol=0)


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_overflow_skip_matches_grad_scaler(kind: str, world_size: int) -> None:
    scale = 256.0
    grads = [g * scale for g in _grads(kind)]
    params = [torch.nn.Parameter(torch.ones_like(g)) for g in grads]
    idle = torch.nn.Parameter(torch.ones(3))  # a param without a grad (the only one for "none")
    sgd = torch.optim.SGD([*params, idle], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))  # what scaler.scale(loss) sets up
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    scaler.unscale_(sgd)
    by_stats = decide(_stats(grads, world_size, 1 / scale), inv_scale=1 / scale, skip_nonfinite=True)
    if not grads:
        with pytest.raises(AssertionError, match="No inf checks"):  # torch refuses a step without grads
            scaler.step(sgd)
        assert not by_stats.skip and by_stats.grad_norm == 0.0
        return
    found = sum(float(t) for t in scaler._per_optimizer_states[id(sgd)]["found_inf_per_device"].values()) > 0
    scaler.step(sgd)
    scaler.update()
    assert (scaler.get_scale() < scale) == found  # the scaler skipped and backed off
    # the scaler's own verdict handed over, and the same rule applied to our statistics, agree with torch
    by_scaler = decide(None, inv_scale=1 / scale, scaler_found_inf=found)
    assert by_scaler.skip == by_stats.skip == found == (kind in ("inf", "nan", "inf+nan"))
    if not found:
        for p, g in zip(params, grads, strict=True):
            torch.testing.assert_close(g * by_stats.grad_scale, p.grad, rtol=0, atol=0)


def test_a_skip_keeps_the_norm_it_saw_and_scales_nothing() -> None:
    d = decide(GradStats(math.inf, True), inv_scale=0.5, max_grad_norm=1.0, skip_nonfinite=True)
    assert (d.skip, d.nonfinite, d.grad_norm, d.grad_scale) == (True, True, math.inf, 0.0)


def test_no_statistics_means_no_norm_and_the_unscale_only() -> None:
    d = decide(None, inv_scale=0.25)
    assert (d.skip, d.nonfinite, d.grad_norm, d.grad_scale) == (False, False, None, 0.25)


def test_clipping_without_statistics_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="statistics"):
        decide(None, max_grad_norm=1.0)
    with pytest.raises(InvalidArgument, match="inv_scale"):
        decide(None, inv_scale=math.inf)


def test_grad_stats_match_clip_grad_norm_and_find_inf() -> None:
    torch.manual_seed(3)
    grads = [torch.randn(300) * 100, torch.randn(77) * 100]
    inv_scale = 1 / 64
    stats = combine_grad_stats(grad_stats(g.half(), inv_scale) for g in grads)
    ref = [g.half().float() * inv_scale for g in grads]
    total = torch.nn.utils.get_total_norm(ref)
    assert not stats.found_inf
    assert stats.norm == pytest.approx(float(total), rel=1e-6)
    bad = grads[1].clone()
    bad[5] = math.nan
    assert grad_stats(bad).found_inf
    assert combine_grad_stats([grad_stats(grads[0]), grad_stats(bad)]).found_inf


def test_grad_stats_of_finite_values_beyond_fp32_range_is_not_an_overflow() -> None:
    g = torch.full((4,), 3e38, dtype=torch.float32)
    stats = grad_stats(g, inv_scale=1e-30)
    assert not stats.found_inf
    assert stats.norm == pytest.approx(2 * 3e38 * 1e-30, rel=1e-6)


def test_clip_coefficient_follows_clip_grad_norm() -> None:
    assert clip_coefficient(10.0, None) == 1.0
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, 1.0) == pytest.approx(1.0 / (4.0 + 1e-6))
    assert clip_coefficient(math.inf, 1.0) == 0.0
    assert math.isnan(clip_coefficient(math.nan, 1.0))
    with pytest.raises(InvalidArgument):
        clip_coefficient(1.0, 0.0)

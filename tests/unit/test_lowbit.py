"""The compressed moments' formats (``tiermem.core.lowbit``): hash, rounding, round trips, error bounds, and
the reference update against exact AdamW."""

from __future__ import annotations

import math

import pytest
import torch

from tiermem.core.adam_math import AdamHyper, adam_update, step_scalars
from tiermem.core.errors import InvalidArgument
from tiermem.core.lowbit import (
    BLOCK,
    PER_OCTAVE,
    LowbitMoments,
    dequantize_signed,
    dequantize_unsigned,
    hash32,
    lowbit_update,
    moment_nbytes,
    quantize_signed,
    quantize_unsigned,
    random_halves,
    round_bf16,
)


def _u(n: int, seed: int) -> torch.Tensor:
    return random_halves(torch.arange(n, dtype=torch.int64), seed)[0]


def test_hash_is_uniform_deterministic_and_independent_of_the_cut() -> None:
    index = torch.arange(200_000, dtype=torch.int64)
    h = hash32(index, 3)
    assert int(h.min()) >= 0 and int(h.max()) < 2**32
    u = h.double() / 2**32
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert abs(float(u.var()) - 1 / 12) < 0.002
    assert torch.equal(h, hash32(index, 3))
    assert torch.equal(h[1000:5000], hash32(index[1000:5000], 3))  # a chunk sees the same numbers
    assert float((h == hash32(index, 4)).float().mean()) < 0.001  # another step, other numbers
    # neighbouring indices are not correlated, nor are the two halves
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01
    low, high = random_halves(index, 3)
    assert int(low.max()) < 2**16 and int(high.max()) < 2**16
    assert abs(float(torch.corrcoef(torch.stack([low.double(), high.double()]))[0, 1])) < 0.01


def test_bf16_rounding_picks_a_neighbour_and_is_unbiased() -> None:
    x = torch.tensor([1.0 + 3 * 2**-10, -(2.0**-20) * 1.3, 12345.678], dtype=torch.float32)
    trials = 20_000
    xs = x.repeat(trials)
    out = round_bf16(xs, random_halves(torch.arange(xs.numel(), dtype=torch.int64), 1)[0]).float().view(trials, 3)
    down = x.to(torch.bfloat16).float()  # round to nearest: one of the two neighbours
    for j in range(3):
        values = set(out[:, j].unique().tolist())
        assert len(values) == 2 and float(down[j]) in values
        assert math.isclose(float(out[:, j].mean()), float(x[j]), rel_tol=2e-4)
    exact = torch.tensor([0.0, -0.0, 1.5, -(2.0**-30), float("inf"), float("-inf")])
    assert torch.equal(round_bf16(exact, torch.randint(0, 2**16, (6,))).float(), exact)
    assert bool(torch.isnan(round_bf16(torch.tensor([float("nan")]), torch.tensor([65535]))).all())


@pytest.mark.parametrize("signed", [True, False])
def test_int8_round_trip_error_bounds(signed: bool) -> None:
    g = torch.Generator().manual_seed(0)
    n = 5 * BLOCK + 17  # a short last block
    # magnitudes across many octaves within each block, as second moments have
    x = torch.exp2(torch.rand(n, generator=g) * -40) * torch.rand(n, generator=g)
    if signed:
        x = x * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x[3] = 0.0
    quantize, dequantize = (quantize_signed, dequantize_signed) if signed else (quantize_unsigned, dequantize_unsigned)
    codes, scale = quantize(x, _u(n, 1))
    assert codes.dtype == (torch.int8 if signed else torch.uint8) and codes.numel() == n
    assert scale.numel() == -(-n // BLOCK)
    back = dequantize(codes, scale)
    blocks = torch.nn.functional.pad(x.abs(), (0, scale.numel() * BLOCK - n)).view(-1, BLOCK)
    assert torch.equal(scale, blocks.amax(dim=1))
    one = torch.ones(1, dtype=torch.int8 if signed else torch.uint8)
    smallest = float(dequantize(one, torch.ones(1)))  # code 1: 1.25 * 2**-16 (exp_avg), 2**-32 (exp_avg_sq)
    assert smallest == 1.25 * 2.0 ** (-16 if signed else -32)
    floor = torch.repeat_interleave(scale, BLOCK)[:n] * smallest
    err = (back - x).abs()
    step = 1 / PER_OCTAVE  # the largest gap between neighbouring codes, relative to the lower one
    assert bool((err <= torch.maximum(step * x.abs(), floor) * (1 + 1e-5)).all())
    assert bool((torch.sign(back) * torch.sign(x) >= 0).all())  # never the other sign
    assert float(back[3]) == 0.0
    biggest = torch.argmax(x.abs()[:BLOCK])
    assert float(back[biggest]) == float(x[biggest])  # a block's largest is exact
    # small values keep their relative precision: 2**-14 below the block's largest is still within 12.5%
    y = torch.full((BLOCK,), 2.0**-14)
    y[0] = 1.0
    codes, scale = quantize(y, _u(BLOCK, 2))
    assert bool(((dequantize(codes, scale)[1:] - y[1:]).abs() <= step * y[1:]).all())


@pytest.mark.parametrize("signed", [True, False])
def test_int8_rounding_is_unbiased(signed: bool) -> None:
    trials = 4000
    base = torch.linspace(0.01, 1.0, BLOCK)
    base[-1] = 1.0
    if signed:
        base = base * torch.where(torch.arange(BLOCK) % 2 == 0, -1.0, 1.0)
    quantize, dequantize = (quantize_signed, dequantize_signed) if signed else (quantize_unsigned, dequantize_unsigned)
    x = base.repeat(trials)
    codes, scale = quantize(x, _u(x.numel(), 3))
    mean = dequantize(codes, scale).view(trials, BLOCK).mean(dim=0)
    assert torch.allclose(mean, base, rtol=0.006, atol=0)


def test_state_bytes_per_param() -> None:
    assert moment_nbytes("fp32") == 4 and moment_nbytes("bf16") == 2
    assert 4 + 2 * moment_nbytes("int8") <= 6.2  # the master and both moments, scales included
    n = 10 * BLOCK
    assert LowbitMoments.zeros(n, "int8").nbytes == n * 2 + 2 * 10 * 4
    assert LowbitMoments.zeros(n, "bf16").nbytes == n * 4
    with pytest.raises(InvalidArgument, match="state_dtype"):
        LowbitMoments.zeros(n, "int4")


def test_fp32_moments_give_adamws_bits() -> None:
    g = torch.Generator().manual_seed(4)
    n = 3000
    p, ref = torch.randn(n, generator=g), None
    ref = p.clone()
    moments = LowbitMoments.zeros(n, "fp32")
    m, v = torch.zeros(n), torch.zeros(n)
    hyper = AdamHyper(lr=1e-2, weight_decay=0.1)
    for step in range(1, 6):
        grad = torch.randn(n, generator=g)
        s = step_scalars(hyper, step)
        lowbit_update(p, grad, moments, s, step=step)
        ref, m, v = adam_update(ref, grad, m, v, s)
    assert torch.equal(p, ref)
    assert torch.equal(moments.exp_avg, m) and torch.equal(moments.exp_avg_sq, v)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_the_second_moment_keeps_moving(state_dtype: str) -> None:
    """With beta2 = 0.999 each step moves v by 0.1%, below either format's step: rounded to the nearest it
    would freeze; rounded stochastically its mean follows the exact EMA."""
    n = 8 * BLOCK
    moments = LowbitMoments.zeros(n, state_dtype)
    p = torch.zeros(n)
    grad = torch.exp2(-6.0 * (torch.arange(n) % 97) / 97)  # six octaves in every block: most are not its largest
    hyper = AdamHyper(lr=0.0)
    for step in range(1, 1501):
        lowbit_update(p, grad, moments, step_scalars(hyper, step), step=step)
    _, v = moments.dequantize()
    exact = (1 - 0.999**1500) * grad * grad
    assert math.isclose(float(v.sum()), float(exact.sum()), rel_tol=0.01)
    # and it decays when the grads stop
    for step in range(1501, 2501):
        lowbit_update(p, torch.zeros(n), moments, step_scalars(hyper, step), step=step)
    _, v = moments.dequantize()
    assert math.isclose(float(v.sum()), float(exact.sum()) * 0.999**1000, rel_tol=0.02)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_a_regression_trains_like_exact_adamw(state_dtype: str) -> None:
    g = torch.Generator().manual_seed(5)
    features, targets = torch.randn(512, 64, generator=g), torch.randn(512, 8, generator=g)
    losses = {}
    for kind in ("fp32", state_dtype):
        w = torch.zeros(64 * 8)
        moments = LowbitMoments.zeros(w.numel(), kind)
        hyper = AdamHyper(lr=3e-3, weight_decay=0.01)
        for step in range(1, 401):
            wt = w.view(64, 8).requires_grad_(True)
            loss = ((features @ wt - targets) ** 2).mean()
            (grad,) = torch.autograd.grad(loss, wt)
            lowbit_update(w, grad.reshape(-1), moments, step_scalars(hyper, step), step=step)
        losses[kind] = float(((features @ w.view(64, 8) - targets) ** 2).mean())
    assert math.isfinite(losses[state_dtype])
    assert abs(losses[state_dtype] - losses["fp32"]) / losses["fp32"] < (0.01 if state_dtype == "bf16" else 0.02)


def test_a_zero_v_moves_the_element_by_weight_decay_only() -> None:
    n = BLOCK
    moments = LowbitMoments.zeros(n, "int8")
    m = torch.zeros(n)
    v = torch.zeros(n)
    m[5], v[0] = 1e-9, 1.0  # v[5] far below the block's range: it rounds to zero, m[5] does not
    moments.store(m, v, step=1)
    assert int(moments.exp_avg_sq[5]) == 0 and int(moments.exp_avg[5]) != 0
    p = torch.ones(n)
    hyper = AdamHyper(lr=1e-3, weight_decay=0.1)
    lowbit_update(p, torch.zeros(n), moments, step_scalars(hyper, 2), step=2)
    assert float(p[5]) == pytest.approx(1 - 1e-3 * 0.1)


def test_store_refuses_other_sizes() -> None:
    moments = LowbitMoments.zeros(10, "bf16")
    with pytest.raises(InvalidArgument, match="10"):
        moments.store(torch.zeros(9), torch.zeros(9), step=1)


def _every_code(signed: bool, blocks: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes covering every value (each block's first its largest, as a quantized block's is) and block
    scales over the fp32 range whose dequantized values stay normal numbers."""
    levels = 127 if signed else 255
    codes = torch.randint(-levels if signed else 0, levels + 1, (blocks, BLOCK), generator=gen)
    codes[:, 0] = levels
    codes[: blocks // 2, 1] = -levels if signed else levels  # ties with the largest (and its other sign)
    top = 80.0 if signed else 60.0  # the smallest code is 2**-15.7 (2**-31.7) of the scale: keep it normal
    scale = torch.exp2(torch.rand(blocks, generator=gen) * 2 * top - top)
    return codes.reshape(-1).to(torch.int8 if signed else torch.uint8), scale


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("numbers", ["lowest", "highest", "hashed"])
def test_int8_quantizes_its_own_values_back_to_the_same_codes_and_scales(signed: bool, numbers: str) -> None:
    """What a checkpoint does: codes dequantized to fp32, then quantized again, with any random numbers (the
    extremes of the 16-bit range included), give back every code and scale unchanged."""
    gen = torch.Generator().manual_seed(8)
    codes, scale = _every_code(signed, 4000, gen)
    n = codes.numel()
    r16 = {
        "lowest": torch.zeros(n, dtype=torch.int64),
        "highest": torch.full((n,), 0xFFFF, dtype=torch.int64),
        "hashed": _u(n, 9),
    }[numbers]
    quantize, dequantize = (quantize_signed, dequantize_signed) if signed else (quantize_unsigned, dequantize_unsigned)
    again, again_scale = quantize(dequantize(codes, scale), r16)
    assert torch.equal(again_scale, scale)
    assert int((again != codes).sum()) == 0


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_moments_stored_from_their_own_values_keep_their_bits(state_dtype: str) -> None:
    """``LowbitMoments.store`` of what ``dequantize`` gave, at any step: the same bytes (a resume is exact)."""
    gen = torch.Generator().manual_seed(10)
    n = 40 * BLOCK + 19
    moments = LowbitMoments.zeros(n, state_dtype, start=3 * BLOCK)
    p = torch.randn(n, generator=gen)
    hyper = AdamHyper(lr=1e-3, weight_decay=0.01)
    for step in range(1, 8):
        grad = torch.randn(n, generator=gen) * torch.exp2(torch.randn(n, generator=gen) * 4)
        lowbit_update(p, grad, moments, step_scalars(hyper, step), step=step)
    for step in (7, 8, 1000):
        loaded = LowbitMoments.zeros(n, state_dtype, start=3 * BLOCK)
        loaded.store(*moments.dequantize(), step=step)
        for mine, theirs in zip(
            (loaded.exp_avg, loaded.exp_avg_sq, loaded.exp_avg_scale, loaded.exp_avg_sq_scale),
            (moments.exp_avg, moments.exp_avg_sq, moments.exp_avg_scale, moments.exp_avg_sq_scale),
            strict=True,
        ):
            assert torch.equal(mine, theirs), step

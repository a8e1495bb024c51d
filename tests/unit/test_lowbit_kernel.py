"""The fused compressed-moment Adam kernel (``lowbit_native``) against its plain-torch reference
(``lowbit.lowbit_update``), through the engine's pieces and threads, plus its build's cache and fallback."""

from __future__ import annotations

import os
import pathlib
import tempfile

import pytest
import torch

from tiermem.core.adam_math import AdamHyper, step_scalars
from tiermem.core.errors import DTypeError, InvalidArgument
from tiermem.core.lowbit import BLOCK, LowbitMoments, lowbit_update
from tiermem.engine.optim import AdamEngine
from tiermem.engine.optim.lowbit_native import LowbitKernel, build_library

HYPER = AdamHyper(lr=1e-3, weight_decay=0.01)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("kernel-cache"))


@pytest.fixture(scope="module")
def engine(cache: str) -> AdamEngine:
    # two threads and small pieces: every update is cut, so the pieces' block alignment is exercised
    eng = AdamEngine(threads=2, warmup=[], cache_dir=cache, min_piece_numel=BLOCK * 3)
    if not eng.lowbit_kernel().native:
        pytest.skip(f"no C compiler here: {eng.lowbit_kernel().error}")
    yield eng
    eng.close()


def _grad(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    # magnitudes over six decades, so that codes of every octave and the below-smallest path are hit
    return (torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 6 - 6)).to(dtype)


def _assert_moments_equal(a: LowbitMoments, b: LowbitMoments) -> None:
    assert torch.equal(a.exp_avg, b.exp_avg)
    assert torch.equal(a.exp_avg_sq, b.exp_avg_sq)
    for x, y in ((a.exp_avg_scale, b.exp_avg_scale), (a.exp_avg_sq_scale, b.exp_avg_sq_scale)):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.float16, torch.bfloat16])
def test_the_kernel_keeps_the_references_moments_bit_for_bit(
    engine: AdamEngine, state_dtype: str, grad_dtype: torch.dtype, out_dtype: torch.dtype | None
) -> None:
    n = 5 * BLOCK + 77  # a partial last block
    gen = torch.Generator().manual_seed(7)
    p = torch.randn(n, generator=gen)
    p_ref = p.clone()
    ours = LowbitMoments.zeros(n, state_dtype, start=1000)
    ref = LowbitMoments.zeros(n, state_dtype, start=1000)
    for step in range(1, 6):
        g = _grad(n, grad_dtype, gen)
        out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
        engine.update_lowbit(p, ours, g, out, group=HYPER, step=step, grad_scale=0.5)
        lowbit_update(p_ref, g, ref, step_scalars(HYPER, step, 0.5), step=step)
        _assert_moments_equal(ours, ref)
        # the master: torch's vectorised sqrt is not correctly rounded, the kernel's is
        torch.testing.assert_close(p, p_ref, rtol=3e-7, atol=1e-9)
        if out is not None:
            assert torch.equal(out, p.to(out_dtype))
    if state_dtype == "int8":  # the codes spread over the range
        assert int(ours.exp_avg_sq.to(torch.int32).unique().numel()) > 100


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_adam_with_l2_and_maximize_follow_the_reference(engine: AdamEngine, state_dtype: str) -> None:
    hyper = AdamHyper(lr=1e-3, weight_decay=0.1, adamw=False, maximize=True, beta1=0.6)
    n = 3 * BLOCK
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(n, generator=gen)
    p_ref = p.clone()
    ours, ref = LowbitMoments.zeros(n, state_dtype), LowbitMoments.zeros(n, state_dtype)
    for step in range(1, 4):
        g = _grad(n, torch.float32, gen)
        engine.update_lowbit(p, ours, g, group=hyper, step=step)
        lowbit_update(p_ref, g, ref, step_scalars(hyper, step), step=step)
    # the L2 term reads the master, so an ulp there may move a moment's rounding: compare the values
    torch.testing.assert_close(p, p_ref, rtol=1e-6, atol=1e-8)
    for a, b in zip(ours.dequantize(), ref.dequantize(), strict=True):
        torch.testing.assert_close(a, b, rtol=0.15, atol=1e-12)


def test_a_piece_by_piece_update_equals_one_update(engine: AdamEngine) -> None:
    n = 9 * BLOCK + 5
    gen = torch.Generator().manual_seed(11)
    p = torch.randn(n, generator=gen)
    q = p.clone()
    whole, parts = LowbitMoments.zeros(n, "int8"), LowbitMoments.zeros(n, "int8")
    for step in (1, 2):
        g = _grad(n, torch.float16, gen)
        engine.update_lowbit(p, whole, g, group=HYPER, step=step)
        engine.update_lowbit(q, parts, g, group=HYPER, step=step, start=0, stop=4 * BLOCK)
        engine.update_lowbit(q, parts, g, group=HYPER, step=step, start=4 * BLOCK, stop=n)
    assert torch.equal(p, q)
    _assert_moments_equal(whole, parts)


def test_values_a_few_units_below_a_code_round_as_in_the_reference(engine: AdamEngine) -> None:
    """Normalised moments 4 units of their fp32 bits below a code: only the half step added before the bits
    are cut (``lowbit._HALF_STEP``) rounds them up for the hash's zeros, one element in 2**16, so 2**20 of
    them tell a kernel without it from the reference (beta1 = 0: the new ``exp_avg`` is the grad itself)."""
    n = 1 << 20
    gen = torch.Generator().manual_seed(13)
    top = torch.randint((127 << 3) - 126, (127 << 3) + 1, (n,), generator=gen, dtype=torch.int32)  # exp_avg's codes
    g = ((top << 20) - 4).view(torch.float32)
    g[::BLOCK] = 1.0  # each block's largest: its scale is 1, so the normalised value is the grad
    hyper = AdamHyper(lr=1e-3, beta1=0.0)
    p, p_ref = torch.zeros(n), torch.zeros(n)
    ours, ref = LowbitMoments.zeros(n, "int8"), LowbitMoments.zeros(n, "int8")
    engine.update_lowbit(p, ours, g, group=hyper, step=1)
    lowbit_update(p_ref, g, ref, step_scalars(hyper, 1), step=1)
    _assert_moments_equal(ours, ref)


def test_a_non_finite_grad_poisons_its_block_as_in_the_reference(engine: AdamEngine) -> None:
    n = 3 * BLOCK
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, generator=gen)
    p_ref = p.clone()
    ours, ref = LowbitMoments.zeros(n, "int8"), LowbitMoments.zeros(n, "int8")
    g = _grad(n, torch.float32, gen)
    g[BLOCK + 9] = float("nan")
    engine.update_lowbit(p, ours, g, group=HYPER, step=1)
    lowbit_update(p_ref, g, ref, step_scalars(HYPER, 1), step=1)
    _assert_moments_equal(ours, ref)
    m, v = ours.dequantize()
    for t in (m, v):
        assert bool(t[BLOCK : 2 * BLOCK].isnan().all())
        assert bool(t[:BLOCK].isfinite().all()) and bool(t[2 * BLOCK :].isfinite().all())


def test_the_engine_refuses_what_the_kernel_cannot_take(engine: AdamEngine) -> None:
    n = 2 * BLOCK
    p, g = torch.zeros(n), torch.zeros(n)
    moments = LowbitMoments.zeros(n, "int8")
    with pytest.raises(InvalidArgument, match="start on a block"):
        engine.update_lowbit(p, moments, g, group=HYPER, step=1, start=10)
    with pytest.raises(InvalidArgument, match="fp32 moments: use update"):
        engine.update_lowbit(p, LowbitMoments.zeros(n, "fp32"), g, group=HYPER, step=1)
    with pytest.raises(InvalidArgument, match="exp_avg has 100 elements"):
        engine.update_lowbit(p, LowbitMoments.zeros(100, "bf16"), g, group=HYPER, step=1)
    with pytest.raises(DTypeError, match=r"grad has dtype torch\.int32"):
        engine.update_lowbit(p, moments, torch.zeros(n, dtype=torch.int32), group=HYPER, step=1)
    short = LowbitMoments("int8", moments.exp_avg, moments.exp_avg_sq, torch.zeros(1), torch.zeros(2))
    with pytest.raises(InvalidArgument, match="exp_avg_scale has 1 block scales; 512 elements need 2"):
        engine.update_lowbit(p, short, g, group=HYPER, step=1)


def test_without_the_native_kernel_the_reference_runs_with_the_same_bits() -> None:
    kernel = LowbitKernel.load(build=False)
    assert not kernel.native and "turned off" in kernel.error
    n = 2 * BLOCK + 3
    gen = torch.Generator().manual_seed(2)
    p = torch.randn(n, generator=gen)
    p_ref = p.clone()
    ours, ref = LowbitMoments.zeros(n, "int8"), LowbitMoments.zeros(n, "int8")
    g = _grad(n, torch.float16, gen)
    out = torch.empty(n, dtype=torch.bfloat16)
    s = step_scalars(HYPER, 1)
    kernel.update(p, g, ours, out, s, torch.tensor(s), step=1, start=0, stop=n)
    lowbit_update(p_ref, g, ref, s, step=1)
    assert torch.equal(p, p_ref) and torch.equal(out, p_ref.to(torch.bfloat16))
    _assert_moments_equal(ours, ref)


def test_a_missing_compiler_is_named_and_the_reference_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setenv("CC", "no-such-cc")
    kernel = LowbitKernel._build(str(tmp_path))
    assert not kernel.native
    assert "no C compiler 'no-such-cc'" in kernel.error


def test_the_build_is_cached_and_a_directory_others_may_write_is_not_used(
    cache: str, tmp_path: pathlib.Path, engine: AdamEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the build goes instead
    (tmp_path / "tmp").mkdir()
    source = tmp_path / "probe.c"  # the cache's rules, not the kernel: a source that compiles at once
    source.write_text("int tiermem_probe(void) { return 1; }\n")
    path = build_library(source, "probe", cache)
    assert os.path.dirname(path) == cache
    before = os.stat(path).st_mtime_ns
    assert build_library(source, "probe", cache) == path and os.stat(path).st_mtime_ns == before
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    elsewhere = build_library(source, "probe", str(shared))
    assert os.path.dirname(elsewhere) != str(shared) and not list(shared.iterdir())

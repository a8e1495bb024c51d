"""CPUAdam and the Adam engine against torch.optim.Adam/AdamW, GradScaler and clip_grad_norm_.

The optimizer tests share one eager engine (bit-identical to torch's
single-tensor path); one module-scoped compiled engine covers the compiled
kernel (its first compile costs seconds, paid once here).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from tiermem.core.errors import DTypeError, InvalidArgument
from tiermem.engine.optim import AdamEngine, AdamHyper, CPUAdam, KernelState

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def eager_engine() -> Iterator[AdamEngine]:
    with AdamEngine(threads=2, compile=False, warmup=()) as engine:
        yield engine


@pytest.fixture(scope="module")
def compiled_engine() -> Iterator[AdamEngine]:
    with AdamEngine(threads=2, warmup=[(torch.float16, torch.float16)], min_piece_numel=1024) as engine:
        yield engine


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _groups(model: nn.Sequential, weight_decay: bool) -> list[dict[str, object]]:
    wd = 0.1 if weight_decay else 0.0
    return [
        {"params": list(model[0].parameters()), "lr": 1e-2, "weight_decay": wd},
        {"params": list(model[2].parameters()), "lr": 3e-3, "weight_decay": 0.0},
        {"params": list(model[4].parameters()), "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": wd / 2},
    ]


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    *,
    step: Callable[[], object] | None = None,
    seed: int = 123,
    start: int = 0,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
    for i in range(start + steps):
        x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
        if i < start:
            continue
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        if i % 5 == 4:  # this layer skips a step now and then: step counts are per parameter
            model[2].weight.grad = None  # type: ignore[index]
        (step or opt.step)()
        sched.step()


def _assert_same_training_state(ours: CPUAdam, ref: torch.optim.Optimizer) -> None:
    pairs = zip(
        (p for g in ours.param_groups for p in g["params"]),
        (p for g in ref.param_groups for p in g["params"]),
        strict=True,
    )
    for p, q in pairs:
        torch.testing.assert_close(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(ours.state[p][key], ref.state[q][key])


@pytest.mark.parametrize(
    ("adamw", "weight_decay", "maximize"),
    [(True, True, False), (True, False, False), (False, True, False), (False, False, True)],
    ids=["adamw-decay", "adamw", "adam-l2", "adam-maximize"],
)
def test_200_steps_match_torch_adam_and_adamw(
    eager_engine: AdamEngine, adamw: bool, weight_decay: bool, maximize: bool
) -> None:
    ref_model, our_model = _model(), _model()
    ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = ref_cls(_groups(ref_model, weight_decay), lr=1e-3, maximize=maximize, foreach=False)
    ours = CPUAdam(_groups(our_model, weight_decay), lr=1e-3, adamw=adamw, maximize=maximize, engine=eager_engine)
    _train(ref_model, ref, 200)
    _train(our_model, ours, 200)
    _assert_same_training_state(ours, ref)
    assert ours.state[our_model[2].weight]["step"] == 160  # skipped every 5th step


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_grads_update_fp32_master_as_torch_on_upcast_grads(
    eager_engine: AdamEngine, dtype: torch.dtype
) -> None:
    # DeepSpeedCPUAdam read fp16 grads of fp32 params as fp32; here they are read as what they are.
    torch.manual_seed(4)
    n = 5000
    master, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=dtype)
    ref = nn.Parameter(master.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01)
    hyper = AdamHyper(lr=1e-2, weight_decay=0.01)
    for t in range(1, 21):
        g = torch.randn(n).to(dtype)
        ref.grad = g.float()
        opt.step()
        eager_engine.update(master, m, v, g, out, group=hyper, step=t)
        torch.testing.assert_close(master, ref.detach())
        assert torch.equal(out, master.to(dtype))
    torch.testing.assert_close(m, opt.state[ref]["exp_avg"])
    torch.testing.assert_close(v, opt.state[ref]["exp_avg_sq"])


def test_low_precision_params_keep_an_fp32_master(eager_engine: AdamEngine) -> None:
    torch.manual_seed(5)
    ref = nn.Parameter(torch.randn(300, 7))
    ours = nn.Parameter(ref.detach().half())
    ref.data.copy_(ours.detach().float())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    opt = CPUAdam([ours], lr=1e-2, weight_decay=0.1, engine=eager_engine)
    for _ in range(10):
        g = torch.randn(300, 7).half()
        ref.grad, ours.grad = g.float(), g
        ref_opt.step()
        opt.step()
    state = opt.state[ours]
    assert state["exp_avg"].dtype == state["master"].dtype == torch.float32
    torch.testing.assert_close(state["master"], ref.detach())
    assert torch.equal(ours.detach(), ref.detach().half())
    restored = CPUAdam([nn.Parameter(ours.detach().clone())], engine=eager_engine)
    restored.load_state_dict(opt.state_dict())
    (rp,) = restored.param_groups[0]["params"]
    assert restored.state[rp]["master"].dtype == torch.float32
    assert torch.equal(restored.state[rp]["master"], state["master"])
    assert torch.equal(restored.state[rp]["exp_avg_sq"], state["exp_avg_sq"])


def test_overflow_skip_and_clipping_follow_grad_scaler_and_clip_grad_norm(eager_engine: AdamEngine) -> None:
    ref_model, our_model = _model(1), _model(1)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01)
    ours = CPUAdam(our_model.parameters(), lr=1e-2, weight_decay=0.01, engine=eager_engine)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10_000)
    scale, max_norm = 1024.0, 0.05
    gen = torch.Generator().manual_seed(7)
    clipped = 0
    for i in range(12):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        ref.zero_grad()
        ours.zero_grad()
        scaler.scale(nn.functional.mse_loss(ref_model(x), y)).backward()
        (nn.functional.mse_loss(our_model(x), y) * scale).backward()
        if i == 5:
            ref_model[0].weight.grad[0, 0] = math.inf  # type: ignore[index]
            our_model[0].weight.grad[0, 0] = math.inf  # type: ignore[index]
        scaler.unscale_(ref)
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm))
        scaler.step(ref)
        scaler.update()
        before = copy.deepcopy((list(our_model.parameters()), ours.state_dict()["state"]))
        ours.step(inv_scale=1.0 / scale, max_grad_norm=max_norm)
        report = ours.last_step
        assert report is not None
        if i == 5:
            assert report.skipped
            scale *= 0.5  # GradScaler's backoff
            for p, q in zip(our_model.parameters(), before[0], strict=True):
                assert torch.equal(p, q)
            for idx, st in ours.state_dict()["state"].items():
                for key, value in st.items():
                    assert torch.equal(value, before[1][idx][key])
        else:
            assert not report.skipped
            assert report.total_norm == pytest.approx(ref_norm, rel=1e-5)
            clipped += report.clip_coef < 1.0
    assert scale == scaler.get_scale()
    assert clipped >= 5
    for p, q in zip(our_model.parameters(), ref_model.parameters(), strict=True):
        # The update multiplies by inv_scale * clip_coef once where torch multiplies twice: fp32 rounding.
        torch.testing.assert_close(p, q)
    for p, q in zip(our_model.parameters(), ref_model.parameters(), strict=True):
        assert ours.state[p]["step"] == ref.state[q]["step"] == 11


@pytest.mark.parametrize("direction", ["cpuadam-to-adamw", "adamw-to-cpuadam"])
def test_state_dict_round_trips_with_torch_adamw(eager_engine: AdamEngine, direction: str) -> None:
    def make(kind: str, model: nn.Module) -> torch.optim.Optimizer:
        groups = _groups(model, weight_decay=True)  # type: ignore[arg-type]
        if kind == "ours":
            return CPUAdam(groups, lr=1e-3, adamw=True, engine=eager_engine)
        return torch.optim.AdamW(groups, lr=1e-3, foreach=False)

    full_model = _model(2)
    full = make("ref", full_model)
    _train(full_model, full, 40)

    first, second = ("ours", "ref") if direction == "cpuadam-to-adamw" else ("ref", "ours")
    model_a = _model(2)
    opt_a = make(first, model_a)
    _train(model_a, opt_a, 20)
    model_b = _model(3)
    model_b.load_state_dict(model_a.state_dict())
    opt_b = make(second, model_b)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    _train(model_b, opt_b, 20, start=20)

    ours, ref = (opt_b, full) if second == "ours" else (opt_a, full)
    if second == "ours":
        _assert_same_training_state(ours, ref)  # type: ignore[arg-type]
    else:
        for p, q in zip(model_b.parameters(), full_model.parameters(), strict=True):
            torch.testing.assert_close(p, q)
            torch.testing.assert_close(opt_b.state[p]["exp_avg_sq"], full.state[q]["exp_avg_sq"])


# --------------------------------------------------------------------------- operand checks


def _operands(n: int = 64) -> dict[str, torch.Tensor | None]:
    return {
        "master": torch.randn(n),
        "exp_avg": torch.zeros(n),
        "exp_avg_sq": torch.zeros(n),
        "grad": torch.randn(n).half(),
        "out": torch.empty(n, dtype=torch.float16),
    }


@pytest.mark.parametrize(
    ("name", "bad", "error", "message"),
    [
        ("grad", torch.randn(64, dtype=torch.float64), DTypeError, "grad has dtype torch.float64"),
        ("grad", torch.ones(64, dtype=torch.int32), DTypeError, "grad has dtype torch.int32"),
        ("master", torch.randn(64).half(), DTypeError, "master has dtype torch.float16"),
        ("exp_avg_sq", torch.zeros(64).bfloat16(), DTypeError, "exp_avg_sq has dtype"),
        ("out", torch.empty(64), DTypeError, "out has dtype torch.float32"),
        ("grad", torch.randn(63).half(), InvalidArgument, "grad has 63 elements but master has 64"),
        ("exp_avg", torch.zeros(65), InvalidArgument, "exp_avg has 65 elements"),
        ("grad", torch.randn(8, 8).half(), InvalidArgument, "contiguous 1-D"),
        ("exp_avg", torch.zeros(128)[::2], InvalidArgument, "contiguous 1-D"),
    ],
)
def test_bad_operands_raise_before_anything_is_written(
    eager_engine: AdamEngine, name: str, bad: torch.Tensor, error: type[Exception], message: str
) -> None:
    ops = _operands()
    master_before = ops["master"].clone()  # type: ignore[union-attr]
    ops[name] = bad
    with pytest.raises(error, match=message.replace("(", r"\(")):
        eager_engine.update(**ops, group=AdamHyper(), step=1)  # type: ignore[arg-type]
    if name != "master":
        assert torch.equal(ops["master"], master_before)  # type: ignore[arg-type]


def test_range_outside_the_buffers_is_rejected(eager_engine: AdamEngine) -> None:
    with pytest.raises(InvalidArgument, match="range"):
        eager_engine.update(**_operands(), group=AdamHyper(), step=1, start=10, stop=65)  # type: ignore[arg-type]


def test_cpuadam_rejects_amsgrad_and_mismatched_grads(eager_engine: AdamEngine) -> None:
    with pytest.raises(InvalidArgument, match="amsgrad"):
        CPUAdam([{"params": [nn.Parameter(torch.zeros(2))], "amsgrad": True}], engine=eager_engine)
    with pytest.raises(DTypeError, match="float64"):
        CPUAdam([nn.Parameter(torch.zeros(2, dtype=torch.float64))], engine=eager_engine)


def test_cpuadam_refuses_a_param_listed_twice_which_torch_would_update_twice(eager_engine: AdamEngine) -> None:
    lin = nn.Linear(3, 2)
    with pytest.raises(InvalidArgument, match=r"lists one param twice \(positions 0 and 2, shape \(2, 3\)\)"):
        CPUAdam([lin.weight, lin.bias, lin.weight], engine=eager_engine)
    opt = CPUAdam([lin.weight], engine=eager_engine)
    with pytest.raises(InvalidArgument, match="CPUAdam takes each param once"):
        opt.add_param_group({"params": [lin.bias, lin.bias]})
    assert len(opt.param_groups) == 1


def test_range_update_touches_only_the_range(eager_engine: AdamEngine) -> None:
    ops = _operands(1000)
    before = {k: v.clone() for k, v in ops.items() if v is not None}
    eager_engine.update(**ops, group=AdamHyper(), step=1, start=100, stop=900)  # type: ignore[arg-type]
    for key in ("master", "exp_avg", "exp_avg_sq"):
        t = ops[key]
        assert t is not None
        assert torch.equal(t[:100], before[key][:100])
        assert torch.equal(t[900:], before[key][900:])
        assert not torch.equal(t[100:900], before[key][100:900])


# --------------------------------------------------------------------------- the compiled kernel


def test_compiled_update_matches_torch_and_never_recompiles(compiled_engine: AdamEngine) -> None:
    import torch._dynamo.utils as dynamo_utils

    (rec,) = compiled_engine.kernels()
    assert rec.state is KernelState.COMPILED, rec.error
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    torch.manual_seed(6)
    n = 50_001
    master, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.float16)
    ref = nn.Parameter(master.clone())
    cases = [(True, 0.01, False), (False, 0.01, False), (True, 0.0, True)]
    for adamw, wd, maximize in cases:
        opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([ref], weight_decay=wd, maximize=maximize)
        for t in range(1, 11):
            lr = 1e-2 / t
            opt.param_groups[0]["lr"] = lr
            hyper = AdamHyper(lr=lr, weight_decay=wd, adamw=adamw, maximize=maximize)
            g = (torch.randn(n) * 100).half()
            ref.grad = g.float() * 0.25
            opt.step()
            # two ranges of odd lengths and offsets, as bucket chunks arrive
            compiled_engine.update(master, m, v, g, out, group=hyper, step=t, grad_scale=0.25, stop=777)
            compiled_engine.update(master, m, v, g, out, group=hyper, step=t, grad_scale=0.25, start=777)
        torch.testing.assert_close(master, ref.detach())
        torch.testing.assert_close(m, opt.state[ref]["exp_avg"])
        torch.testing.assert_close(v, opt.state[ref]["exp_avg_sq"])
        assert torch.equal(out, master.half())
        m.zero_()
        v.zero_()
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs

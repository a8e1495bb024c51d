"""``CPUAdam``: an in-process ``torch.optim.Optimizer`` over CPU parameters, driven by the Adam engine.

Owns the per-parameter optimizer state of CPU parameters.  Two kinds of
parameter, told apart by dtype:

- fp32 parameters (grads fp32): updated in place, state ``step`` (0-dim fp32
  tensor), ``exp_avg``, ``exp_avg_sq``: exactly ``torch.optim.Adam``/``AdamW``'s
  state, so ``state_dict()`` loads into torch's optimizers and back.
- fp16/bf16 parameters (grads in the same dtype, as autograd makes them): the
  state also holds ``master``, an fp32 copy made at the first step; the update
  reads the low-precision grad, updates ``master``/``exp_avg``/``exp_avg_sq``
  in fp32 and writes the parameter as ``master`` rounded to its dtype, all in
  one pass.  The fp32 state survives ``state_dict()`` round trips in fp32.

Param groups use torch's keys (``lr``, ``betas``, ``eps``, ``weight_decay``,
``maximize``, ``decoupled_weight_decay``, ``amsgrad`` ...); ``adamw=`` is
accepted as the name of ``decoupled_weight_decay``.  Step counts are per
parameter; a parameter without a gradient is skipped and its count stays.

Loss scaling and clipping: ``step(inv_scale=..., max_grad_norm=...)`` first
reads every gradient once for its norm and inf/nan (``grad_stats``), then
decides by ``tiermem.core.step_rules``: with a loss scale (``inv_scale`` not
1) an overflow skips the step as ``torch.amp.GradScaler`` does (nothing
changes, counts do not advance), reported in ``last_step``; otherwise the
grads are multiplied by ``inv_scale * clip_coef`` inside the update
(``clip_grad_norm_`` semantics: with a non-finite norm and no loss scale the
coefficient is 0 or NaN and the update applies it, as torch does), without
modifying ``.grad``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tiermem.core.adam_math import AdamHyper
from tiermem.core.errors import DTypeError, InvalidArgument
from tiermem.core.grad_mode import without_grad
from tiermem.core.param_groups import check_params_once
from tiermem.core.step_rules import combine_grad_stats, decide
from tiermem.engine.optim.engine import AdamEngine, PendingUpdate

__all__ = ["CPUAdam", "StepReport"]

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP32_STATE = ("exp_avg", "exp_avg_sq", "master")


@dataclass(frozen=True, slots=True)
class StepReport:
    """What the last ``step`` did."""

    skipped: bool
    """An inf/nan gradient was found: nothing was updated."""
    total_norm: float
    """Global L2 norm of the unscaled gradients (nan when not computed)."""
    clip_coef: float
    """The factor the unscaled gradients were multiplied by (1.0 without clipping)."""
    updated: int
    """Parameters updated."""


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW on the CPU with torch's numerics; see the module docstring."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw: bool = True,
        maximize: bool = False,
        *,
        engine: AdamEngine | None = None,
        threads: int = 0,
        compile: bool = True,
    ) -> None:
        """``engine`` is shared when given; else one is made with ``threads`` and ``compile``."""
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": False,
            "maximize": maximize,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": adamw,
        }
        AdamHyper.of(defaults)
        self._engine_given = engine is not None
        self._engine_threads = threads
        self._engine_compile = compile
        self.engine: AdamEngine | None = engine
        self.last_step: StepReport | None = None
        super().__init__(params, defaults)
        if self.engine is None:
            combos = {_combo(p) for group in self.param_groups for p in group["params"]}
            self.engine = AdamEngine(threads=threads, compile=compile, warmup=sorted(combos, key=str))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        check_params_once(param_group, "CPUAdam")
        group = dict(param_group)
        if "adamw" in group:
            group["decoupled_weight_decay"] = bool(group.pop("adamw"))
        for key in ("amsgrad", "capturable", "differentiable"):
            if group.get(key):
                raise InvalidArgument(f"CPUAdam does not support {key}=True")
        super().add_param_group(group)
        added = self.param_groups[-1]
        AdamHyper.of(added)
        for p in added["params"]:
            if p.device.type != "cpu":
                raise InvalidArgument(f"CPUAdam needs CPU parameters, got one on {p.device}")
            if p.dtype not in _PARAM_DTYPES:
                raise DTypeError(f"CPUAdam parameters must be float32, float16 or bfloat16, got {p.dtype}")
            if not p.is_contiguous():
                raise InvalidArgument(f"CPUAdam needs contiguous parameters, got strides {p.stride()}")
        if self.engine is not None and not self._engine_given:
            self.engine.warm_up({_combo(p) for p in added["params"]})

    # ----------------------------------------------------------------------- step

    @without_grad
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], float] | None = None,
        *,
        inv_scale: float = 1.0,
        max_grad_norm: float | None = None,
    ) -> float | None:
        """One step; ``inv_scale`` unscales the grads, ``max_grad_norm`` clips their global norm first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self.engine
        if engine is None:  # pragma: no cover - set in __init__
            raise InvalidArgument("CPUAdam has no engine")
        work = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        for _, p in work:
            _check_grad(p)
        stats = None
        if inv_scale != 1.0 or max_grad_norm is not None:
            stats = combine_grad_stats(engine.grad_stats(_flat(p.grad), inv_scale) for _, p in work)
        decision = decide(stats, inv_scale=inv_scale, max_grad_norm=max_grad_norm, skip_nonfinite=inv_scale != 1.0)
        total_norm = math.nan if decision.grad_norm is None else decision.grad_norm
        if decision.skip:
            self.last_step = StepReport(skipped=True, total_norm=total_norm, clip_coef=0.0, updated=0)
            return loss
        clip = decision.clip_coef
        grad_scale = decision.grad_scale
        pending: list[tuple[PendingUpdate, torch.Tensor]] = []
        try:
            for group, p in work:
                state = self.state[p]
                if not state:
                    _init_state(state, p)
                step_t = state["step"]
                master = state.get("master")
                target = p if master is None else master
                pending.append(
                    (
                        engine.update(
                            _flat(target),
                            _flat(state["exp_avg"]),
                            _flat(state["exp_avg_sq"]),
                            _flat(p.grad),
                            None if master is None else _flat(p),
                            group=group,
                            step=int(step_t.item()) + 1,
                            grad_scale=grad_scale,
                            wait=False,
                        ),
                        step_t,
                    )
                )
        finally:
            error: BaseException | None = None
            for handle, step_t in pending:
                try:
                    handle.wait()
                except BaseException as exc:
                    error = error or exc
                    continue
                step_t.add_(1)
            if error is not None:
                raise error
        self.last_step = StepReport(skipped=False, total_norm=total_norm, clip_coef=clip, updated=len(work))
        return loss

    # ----------------------------------------------------------------------- state dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's Adam/AdamW format; fp32 state stays fp32 whatever the parameter dtype."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        fp32_state = {
            p: {k: v for k, v in state_dict["state"].get(i, {}).items() if k in _FP32_STATE}
            for i, p in zip(saved_ids, params, strict=False)
        }
        for group in state_dict["param_groups"]:
            AdamHyper.of(group)
            if group.get("amsgrad"):
                raise InvalidArgument("cannot load a state with amsgrad=True into CPUAdam")
        super().load_state_dict(state_dict)
        for p, saved in fp32_state.items():
            state = self.state.get(p)
            if not state:
                continue
            for key, value in saved.items():
                state[key] = value.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
            if "step" in state:
                state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).detach().clone()
            if p.dtype != torch.float32 and "master" not in state:
                state["master"] = p.detach().to(torch.float32).contiguous()


def _combo(p: torch.Tensor) -> tuple[torch.dtype, torch.dtype | None]:
    return (p.dtype, None if p.dtype == torch.float32 else p.dtype)


def _init_state(state: dict[str, Any], p: torch.Tensor) -> None:
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32)
    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32)
    if p.dtype != torch.float32:
        state["master"] = p.detach().to(torch.float32).contiguous()


def _check_grad(p: torch.Tensor) -> None:
    g = p.grad
    if g is None:
        return
    if g.is_sparse:
        raise InvalidArgument("CPUAdam does not support sparse gradients")
    if g.dtype != p.dtype:
        raise DTypeError(f"gradient dtype {g.dtype} does not match parameter dtype {p.dtype}")
    if g.shape != p.shape:
        raise InvalidArgument(f"gradient shape {tuple(g.shape)} does not match parameter shape {tuple(p.shape)}")


def _flat(t: torch.Tensor | None) -> torch.Tensor:
    if t is None:  # pragma: no cover - guarded by callers
        raise InvalidArgument("missing tensor")
    t = t.detach()
    return (t if t.is_contiguous() else t.contiguous()).view(-1)

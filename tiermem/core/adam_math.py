"""The Adam/AdamW arithmetic as pure functions (no threads, no compilation, no I/O).

Owns the definition of one step, exactly as ``torch.optim.Adam`` and
``torch.optim.AdamW`` compute it (amsgrad off); the gradient handling around
it (unscaling, overflow, clipping) is ``tiermem.core.step_rules``'s.
Everything else in ``tiermem.engine.optim`` binds these functions to memory, threads
and the compiler.

One step of parameter ``p`` with gradient ``g`` (``t`` = the step count after
increment, all tensors fp32 except ``g``, which is read in its own dtype)::

    g = float(g) * grad_scale          # unscale and clip (1.0 when neither)
    g = -g                             # maximize
    g = g + weight_decay * p           # Adam (L2 weight decay)
    p = p * (1 - lr * weight_decay)    # AdamW (decoupled weight decay)
    m = lerp(m, g, 1 - beta1)
    v = v * beta2 + (1 - beta2) * g * g
    denom = sqrt(v) / sqrt(1 - beta2**t) + eps
    p = p + (-lr / (1 - beta1**t)) * m / denom

Step-dependent scalars are computed in double precision, as torch computes
them in Python, and applied in fp32 (``AdamScalars``).  The scalars are either
Python floats (the eager path: the same torch ops in the same order as
``torch.optim.Adam``'s single-tensor path, hence the same bits) or 0-dim fp32
tensors (the compiled path: one graph serves every step, learning rate and
flag combination, since maximize, L2 and decoupled decay become values).

Invariants: ``adam_update`` never modifies its inputs; ``step`` counts from 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tiermem.core.errors import InvalidArgument

__all__ = [
    "AdamHyper",
    "AdamScalars",
    "SCALAR_COUNT",
    "adam_update",
    "step_scalars",
]

Scalar = float | torch.Tensor


@dataclass(frozen=True, slots=True)
class AdamHyper:
    """Hyper-parameters of one parameter group (the step count is per parameter, passed apart)."""

    lr: float = 1e-3
    """Learning rate."""
    beta1: float = 0.9
    """Decay rate of the first moment (momentum)."""
    beta2: float = 0.999
    """Decay rate of the second moment (variance)."""
    eps: float = 1e-8
    """Added to the bias-corrected sqrt of the variance."""
    weight_decay: float = 0.0
    """Weight decay: L2 added to the gradient (Adam) or decoupled (AdamW)."""
    adamw: bool = True
    """Decoupled weight decay (``torch.optim.AdamW``); False: L2 as ``torch.optim.Adam``."""
    maximize: bool = False
    """Maximize the objective (ascend the gradient)."""

    def __post_init__(self) -> None:
        ranges = (
            ("lr", self.lr, math.inf),
            ("eps", self.eps, math.inf),
            ("beta1", self.beta1, 1.0),
            ("beta2", self.beta2, 1.0),
            ("weight_decay", self.weight_decay, math.inf),
        )
        for name, value, upper in ranges:
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not 0.0 <= value < upper:
                bound = "inf)" if upper == math.inf else f"{upper})"
                raise InvalidArgument(f"Adam {name} must be a number in [0, {bound}, got {value!r}")

    @classmethod
    def of(cls, group: Any) -> AdamHyper:
        """Build from an ``AdamHyper``, a torch param-group dict, or any record with the same attributes.

        Accepts ``betas=(b1, b2)`` or ``beta1``/``beta2``, and ``adamw`` or torch's
        ``decoupled_weight_decay`` key.
        """
        if isinstance(group, AdamHyper):
            return group
        get = group.get if isinstance(group, Mapping) else lambda k, d=None: getattr(group, k, d)
        betas = get("betas")
        beta1, beta2 = (get("beta1", 0.9), get("beta2", 0.999)) if betas is None else tuple(betas)
        adamw = get("adamw")
        if adamw is None:
            adamw = get("decoupled_weight_decay", True)
        lr = get("lr", 1e-3)
        if isinstance(lr, torch.Tensor):
            lr = float(lr)
        return cls(
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=get("eps", 1e-8),
            weight_decay=get("weight_decay", 0.0),
            adamw=bool(adamw),
            maximize=bool(get("maximize", False)),
        )


class AdamScalars(NamedTuple):
    """Per-step constants of one update, in the order the compiled kernel unpacks them."""

    grad_scale: Scalar
    """Multiplier of the raw gradient: 1/loss_scale * clip_coef, negated when maximizing."""
    l2: Scalar
    """weight_decay for Adam (L2), 0 for AdamW."""
    decay: Scalar
    """1 - lr * weight_decay for AdamW, 1 for Adam."""
    lerp_weight: Scalar
    """1 - beta1."""
    beta2: Scalar
    one_minus_beta2: Scalar
    bias2_sqrt: Scalar
    """sqrt(1 - beta2**step)."""
    eps: Scalar
    neg_step_size: Scalar
    """-lr / (1 - beta1**step)."""


SCALAR_COUNT = len(AdamScalars._fields)


def step_scalars(hyper: AdamHyper, step: int, grad_scale: float = 1.0) -> AdamScalars:
    """The constants of step ``step`` (>= 1), computed in double as torch does."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise InvalidArgument(f"Adam step count must be an integer >= 1, got {step!r}")
    if math.isinf(grad_scale):
        raise InvalidArgument(f"grad_scale must not be infinite, got {grad_scale!r}")
    # NaN passes: clip_grad_norm_ over a NaN norm multiplies every grad by NaN, and torch applies that
    t = float(step)
    bias1 = 1 - hyper.beta1**t
    bias2 = 1 - hyper.beta2**t
    decoupled = hyper.adamw and hyper.weight_decay != 0
    return AdamScalars(
        grad_scale=-float(grad_scale) if hyper.maximize else float(grad_scale),
        l2=0.0 if hyper.adamw else float(hyper.weight_decay),
        decay=1 - hyper.lr * hyper.weight_decay if decoupled else 1.0,
        lerp_weight=1 - hyper.beta1,
        beta2=float(hyper.beta2),
        one_minus_beta2=1 - hyper.beta2,
        bias2_sqrt=bias2**0.5,
        eps=float(hyper.eps),
        neg_step_size=-(hyper.lr / bias1),
    )


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    s: AdamScalars,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Adam/AdamW step: returns new (param, exp_avg, exp_avg_sq) in fp32; inputs are not modified.

    With float scalars this runs torch's own op sequence (bit-identical to
    ``torch.optim.Adam(foreach=False)``); with 0-dim tensor scalars it is written
    so that every flag is a value and the graph is the same for all of them.
    """
    as_values = isinstance(s.beta2, torch.Tensor)
    g = grad.to(torch.float32)
    if as_values or s.grad_scale != 1.0:
        g = g * s.grad_scale
    if as_values:
        g = g + s.l2 * param
    elif s.l2 != 0.0:
        g = torch.add(g, param, alpha=float(s.l2))
    p = param * s.decay if as_values or s.decay != 1.0 else param
    m = torch.lerp(exp_avg, g, s.lerp_weight)
    if as_values:
        v = exp_avg_sq * s.beta2 + s.one_minus_beta2 * g * g
    else:
        v = torch.addcmul(exp_avg_sq * s.beta2, g, g, value=float(s.one_minus_beta2))
    denom = v.sqrt() / s.bias2_sqrt + s.eps
    p = p + s.neg_step_size * m / denom if as_values else torch.addcdiv(p, m, denom, value=float(s.neg_step_size))
    return p, m, v

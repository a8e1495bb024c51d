"""The step rules: from gradient statistics and the scaler's verdict, whether a step is skipped, the global
norm, and the one factor the update multiplies the raw gradients by.  Pure (no I/O, no threads).

The one home of ``torch.nn.utils.clip_grad_norm_``'s and ``torch.amp.GradScaler``'s semantics in tiermem:
every optimizer (in process, the daemon's rank, the sharded ones) and the daemon decide through ``decide``;
no other clip or unscale computation exists.

- Statistics (``GradStats``) are a sum of squares of the *unscaled* gradients and a non-finite flag.  They
  add up over pieces, tensors and ranks (``combine_grad_stats``, or an all-reduce of the two numbers), so a
  sharded step takes them locally, all-reduces them, and decides on the global ones: at world size 1 the
  same rule over the same numbers.  NaN and inf propagate as torch's norms do (a NaN anywhere: the norm is
  NaN; an inf and no NaN: inf).
- Skip: the step is skipped, state and step counts untouched, when the scaler found an inf/nan
  (``GradScaler``: its own check, or the sharded scaler's global flag), or when the caller applies the
  scaler's rule to the statistics itself (``skip_nonfinite``: the grads are where only it can look).
- Clip: ``clip_grad_norm_``'s coefficient, computed as torch does in fp32:
  ``clamp(max_norm / (total_norm + 1e-6), max=1)``.  With a non-finite norm and no scaler torch does not
  skip: the coefficient is 0 (inf norm) or NaN (NaN norm), and the update applies what that makes of the
  gradients; so does tiermem.
- The update multiplies the raw gradients by ``grad_scale = inv_scale * clip_coef`` once (torch multiplies
  twice: fp32 rounding apart, the same).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from tiermem.core.errors import InvalidArgument

__all__ = [
    "CLIP_EPS",
    "GradStats",
    "StepDecision",
    "clip_coefficient",
    "combine_grad_stats",
    "decide",
    "grad_stats",
]

CLIP_EPS = 1e-6
"""Added to the total norm before dividing, as ``clip_grad_norm_`` does."""


class GradStats(NamedTuple):
    """Statistics of (a piece of) the unscaled gradients."""

    sq_norm: float
    """Sum of squares of ``grad * inv_scale`` (inf or NaN when an element is: NaN wins, as in torch)."""
    found_inf: bool
    """Some element is inf or nan."""

    @property
    def norm(self) -> float:
        return math.sqrt(self.sq_norm)  # inf and NaN propagate

    @classmethod
    def of(cls, sq_norm: float, nonfinite: bool | float) -> GradStats:
        """From the two all-reduced numbers (a non-finite flag summed over ranks is > 0 when any had one)."""
        return cls(float(sq_norm), bool(nonfinite) or not math.isfinite(sq_norm))


def grad_stats(grad: torch.Tensor, inv_scale: float = 1.0) -> GradStats:
    """Squared L2 norm of ``grad * inv_scale`` and whether ``grad`` holds inf/nan; one read of ``grad``.

    The norm accumulates in fp32 (fp16/bf16 grads are upcast on the fly), as
    ``clip_grad_norm_`` does on unscaled fp32 grads; if the fp32 sum overflows
    although every element is finite, it is redone in fp64.
    """
    if grad.numel() == 0:
        return GradStats(0.0, False)
    norm = float(torch.linalg.vector_norm(grad, 2, dtype=torch.float32))
    if not math.isfinite(norm):
        if not bool(torch.isfinite(grad).all()):
            return GradStats(norm * norm, True)  # NaN if any element is NaN, else inf
        norm = float(torch.linalg.vector_norm(grad, 2, dtype=torch.float64))
    scaled = norm * inv_scale
    return GradStats(scaled * scaled, False)


def combine_grad_stats(parts: Iterable[tuple[float, bool]]) -> GradStats:
    """Statistics of the whole gradient from those of its pieces."""
    total = 0.0
    found_inf = False
    for sq_norm, inf in parts:
        total += sq_norm
        found_inf = found_inf or bool(inf)
    return GradStats(total, found_inf or not math.isfinite(total))


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """The factor ``clip_grad_norm_`` multiplies the grads by, in fp32 as torch computes it:
    ``clamp(max_norm / (total_norm + 1e-6), max=1)`` (0 for an inf norm, NaN for a NaN norm)."""
    if max_norm is None:
        return 1.0
    if not max_norm > 0:
        raise InvalidArgument(f"max_norm must be > 0, got {max_norm!r}")
    with np.errstate(all="ignore"):
        coef = np.float32(max_norm) / (np.float32(total_norm) + np.float32(CLIP_EPS))
    return math.nan if math.isnan(coef) else min(float(coef), 1.0)


@dataclass(frozen=True, slots=True)
class StepDecision:
    """What one step does with its gradients."""

    skip: bool
    """Skip the step: no param, state or step count changes (only the skip count)."""
    nonfinite: bool
    """Some gradient is inf or nan (seen in the statistics, or by the scaler)."""
    grad_norm: float | None
    """The global norm of the unscaled gradients (None: the step needed none)."""
    inv_scale: float = 1.0
    """The scaler's inverse scale."""
    clip_coef: float = 1.0
    """``clip_grad_norm_``'s coefficient (1.0 without clipping)."""

    @property
    def grad_scale(self) -> float:
        """The one factor the update multiplies the raw gradients by."""
        return self.inv_scale * self.clip_coef


def decide(
    stats: GradStats | None,
    *,
    inv_scale: float = 1.0,
    max_grad_norm: float | None = None,
    scaler_found_inf: bool = False,
    skip_nonfinite: bool = False,
) -> StepDecision:
    """The step's decision from the (global) statistics of its unscaled gradients.

    ``stats``: None when nobody needed them (no clipping, no check here, or the scaler already skips);
    required with ``max_grad_norm`` or ``skip_nonfinite`` otherwise.  ``scaler_found_inf``: the scaler's
    verdict (it looked at the grads itself).  ``skip_nonfinite``: apply the scaler's rule to ``stats`` (the
    caller is where the scaler cannot look).
    """
    if not (inv_scale > 0 and math.isfinite(inv_scale)):
        raise InvalidArgument(f"inv_scale must be a positive finite number, got {inv_scale!r}")
    if stats is None and not scaler_found_inf and (max_grad_norm is not None or skip_nonfinite):
        raise InvalidArgument("clipping or an overflow check needs the gradient statistics")
    nonfinite = bool(scaler_found_inf) or (stats is not None and stats.found_inf)
    norm = None if stats is None else stats.norm
    skip = bool(scaler_found_inf) or (skip_nonfinite and nonfinite)
    if skip:
        return StepDecision(skip=True, nonfinite=nonfinite, grad_norm=norm, inv_scale=inv_scale, clip_coef=0.0)
    coef = 1.0 if norm is None else clip_coefficient(norm, max_grad_norm)
    return StepDecision(skip=False, nonfinite=nonfinite, grad_norm=norm, inv_scale=inv_scale, clip_coef=coef)

"""tiermem.engine.optim: the CPU Adam engine and the in-process ``CPUAdam`` optimizer.

- ``adam_math``: the arithmetic as pure functions (one Adam/AdamW step),
  tested alone against ``torch.optim``.
- ``step_rules``: skip, norm and grad scale of a step from the gradient
  statistics and the scaler (``clip_grad_norm_``'s and ``GradScaler``'s
  semantics), the one home of those rules.
- ``kernels``: that arithmetic compiled into one pass over memory per chunk
  (torch.compile, inductor C++), with an eager fallback.
- ``lowbit_native``: the fused update over compressed moments (bf16, int8),
  a C kernel built on the host, loaded with ctypes.
- ``engine``: ``AdamEngine``, checked multi-threaded chunked updates over
  flat fp32 buffers; what the daemon drives.
- ``optimizer``: ``CPUAdam``, a ``torch.optim.Optimizer`` on the same engine.
"""

from tiermem.core.adam_math import AdamHyper, AdamScalars, adam_update, step_scalars
from tiermem.core.step_rules import (
    GradStats,
    StepDecision,
    clip_coefficient,
    combine_grad_stats,
    decide,
    grad_stats,
)
from tiermem.engine.optim.engine import DEFAULT_WARMUP, AdamEngine, PendingUpdate
from tiermem.engine.optim.kernels import KernelKey, KernelRecord, KernelState
from tiermem.engine.optim.optimizer import CPUAdam, StepReport

__all__ = [
    "DEFAULT_WARMUP",
    "AdamEngine",
    "AdamHyper",
    "AdamScalars",
    "CPUAdam",
    "GradStats",
    "KernelKey",
    "KernelRecord",
    "KernelState",
    "PendingUpdate",
    "StepDecision",
    "StepReport",
    "adam_update",
    "clip_coefficient",
    "combine_grad_stats",
    "decide",
    "grad_stats",
    "step_scalars",
]

"""The daemon's binding of the CPU Adam engine to the step pipeline (``rank.AdamKernel``).

The engine writes fp16/bf16 params in the same pass as the update; a job whose
working precision is fp32 gets its params by a copy of the updated master
(the engine's low-precision output has no fp32 form: an fp32 "copy" is the
master itself).  fp32 moments take the engine's AdamW kernels; compressed
ones (bf16, int8) its fused pass over them (``AdamEngine.update_lowbit``),
built when the first such rank registers (``prepare``), not at its first step.

Kernels are compiled lazily, on the first update of each (grad dtype, param
dtype) pair, and kept in inductor's on-disk cache, so the daemon is ready as
soon as its pool is; the first step of a new combination pays the compile
(seconds), unless ``adam.warmup`` lists its job dtype: those are built at
start, before the daemon says it is ready.
"""

from __future__ import annotations

import torch

from tiermem.core.config import AdamConfig
from tiermem.core.protocol import ParamGroup
from tiermem.engine.optim import AdamEngine
from tiermemd.rank import AdamSlices

__all__ = ["EngineKernel", "default_kernel"]


class EngineKernel:
    def __init__(self, engine: AdamEngine) -> None:
        self.engine = engine

    def grad_stats(self, grad: torch.Tensor, inv_scale: float) -> tuple[float, bool]:
        stats = self.engine.grad_stats(grad, inv_scale)
        return stats.sq_norm, stats.found_inf

    def update(self, ops: AdamSlices, *, group: ParamGroup, step: int, grad_scale: float) -> None:
        master, moments, grad, out = ops
        low = out if out is not None and out.dtype != torch.float32 else None
        if moments.state_dtype == "fp32":
            m, v = moments.exp_avg, moments.exp_avg_sq
            self.engine.update(master, m, v, grad, low, group=group, step=step, grad_scale=grad_scale)
        else:
            self.engine.update_lowbit(master, moments, grad, low, group=group, step=step, grad_scale=grad_scale)
        if out is not None and low is None:
            out.copy_(master)

    def prepare(self, state_dtype: str) -> None:
        """Build what updates of moments in ``state_dtype`` run (the compressed pass's kernel: a compile of
        about a second the first time on a node, then a load from its cache)."""
        if state_dtype != "fp32":
            self.engine.lowbit_kernel()

    def close(self) -> None:
        self.engine.close()


def warmup_keys(dtypes: tuple[str, ...]) -> list[tuple[torch.dtype, torch.dtype | None]]:
    """The (grad dtype, out dtype) kernels the jobs of these dtypes run: fp16/bf16 params are written in the
    update's pass, fp32 ones are the master (no out)."""
    out: list[tuple[torch.dtype, torch.dtype | None]] = []
    for name in dtypes:
        dtype = getattr(torch, name)
        out.append((dtype, None if dtype == torch.float32 else dtype))
    return out


def default_kernel(config: AdamConfig) -> EngineKernel:
    engine = AdamEngine.from_config(config, warmup=warmup_keys(config.warmup))
    # the native fp32 path and the eager one parallelise over torch's intra-op threads: as many as the engine's
    torch.set_num_threads(engine.threads)
    return EngineKernel(engine)

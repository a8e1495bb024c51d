"""The daemon's binding of the CPU Adam engine to the step pipeline (``rank.AdamKernel``).

The engine writes fp16/bf16 params in the same pass as the update; a job whose
working precision is fp32 gets its params by a copy of the updated master
(the engine's low-precision output has no fp32 form: an fp32 "copy" is the
master itself).  fp32 moments take the engine's AdamW kernels; compressed
ones (bf16, int8) its fused pass over them (``AdamEngine.update_lowbit``).

When kernels are built:

- The compressed-moment kernel (a C file, about 1.5 s to compile with a cold
  cache, then a load from ``adam.cache_dir``) is built at daemon start, on a
  thread of its own, while the pool is allocated: never inside a request
  handler.  A rank of compressed moments that registers before the build is
  done waits for it (``prepare``) with its session's beacon ticking, so the
  stall detector (``tiermemd.health``) keeps feeding the watchdog; the build
  itself is bounded by the compiler's timeout.
- The inductor kernels of fp16/bf16 jobs are compiled on the first update of
  each (grad dtype, param dtype) pair and kept in inductor's on-disk cache,
  unless ``adam.warmup`` lists the job dtype: those are built at start,
  before the daemon says it is ready.

``statuses`` says where each kernel is: ``building``, ``built``, ``failed``
(the slower fallback runs: the plain-torch reference, or the eager update)
or ``off`` (the configuration chose the fallback: ``adam.compile = false``);
the Prometheus gauge ``tiermem_kernel_state`` shows it.  ``update`` returns
the path the update ran (``native``: torch's fused fp32 AdamW or the C kernel
of compressed moments; ``compiled``: an inductor kernel; ``fallback``: the
eager update or the plain-torch reference): each rank reports its last one, a
column of ``tiermem status`` and ``tiermem_kernel_path_ranks``.
"""

from __future__ import annotations

import enum
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tiermem.core.config import AdamConfig
from tiermem.core.protocol import ParamGroup
from tiermem.engine.optim import AdamEngine
from tiermem.engine.optim.kernels import KernelState
from tiermem.engine.optim.lowbit_native import LowbitKernel
from tiermemd import health
from tiermemd.rank import AdamKernel, AdamSlices

__all__ = ["BuildState", "EngineKernel", "KernelStatus", "default_kernel", "kernel_statuses"]

LOWBIT = "lowbit"
"""The compressed-moment kernel's name in ``KernelStatus`` and the gauge's ``kernel`` label."""


class BuildState(enum.Enum):
    BUILDING = "building"
    BUILT = "built"
    FAILED = "failed"
    """The build failed: the slower fallback runs (``KernelStatus.error`` says why)."""
    OFF = "off"
    """The configuration turned compiling off (``adam.compile = false``): the fallback runs by choice."""


@dataclass(frozen=True)
class KernelStatus:
    """Where one kernel is: ``lowbit``, or an inductor kernel (``adam grad=float16 out=float16``)."""

    name: str
    state: BuildState
    error: str = ""


_INDUCTOR_STATE = {KernelState.COMPILED: BuildState.BUILT, KernelState.EAGER: BuildState.OFF}


class EngineKernel:
    def __init__(self, engine: AdamEngine) -> None:
        self.engine = engine
        self._lowbit: Future[LowbitKernel] = Future()
        self._lowbit.set_running_or_notify_cancel()
        threading.Thread(target=self._build_lowbit, name="tiermem-kernel-build", daemon=True).start()

    def _build_lowbit(self) -> None:
        try:
            self._lowbit.set_result(self.engine.lowbit_kernel())  # a failed build returns the reference
        except BaseException as exc:  # a bug: re-raised by prepare() in the request that needs the kernel
            self._lowbit.set_exception(exc)

    def grad_stats(self, grad: torch.Tensor, inv_scale: float) -> tuple[float, bool]:
        stats = self.engine.grad_stats(grad, inv_scale)
        return stats.sq_norm, stats.found_inf

    def update(self, ops: AdamSlices, *, group: ParamGroup, step: int, grad_scale: float) -> str:
        master, moments, grad, out = ops
        low = out if out is not None and out.dtype != torch.float32 else None
        if moments.state_dtype == "fp32":
            m, v = moments.exp_avg, moments.exp_avg_sq
            self.engine.update(master, m, v, grad, low, group=group, step=step, grad_scale=grad_scale)
            path = self.engine.path(grad.dtype, None if low is None else low.dtype, grad_scale)
        else:
            self.engine.update_lowbit(master, moments, grad, low, group=group, step=step, grad_scale=grad_scale)
            path = "native" if self.engine.lowbit_kernel().native else "fallback"
        if out is not None and low is None:
            out.copy_(master)
        return path

    def prepare(self, state_dtype: str) -> None:
        """Wait, ticking the caller's beacon, for what updates of moments in ``state_dtype`` run: the
        compressed pass's kernel, whose build started with the daemon."""
        if state_dtype != "fp32":
            health.wait(self._lowbit)

    def statuses(self) -> tuple[KernelStatus, ...]:
        """The compressed-moment kernel's state, then each inductor kernel's asked for so far."""
        if not self._lowbit.done():
            lowbit = KernelStatus(LOWBIT, BuildState.BUILDING)
        elif self._lowbit.exception() is not None:
            lowbit = KernelStatus(LOWBIT, BuildState.FAILED, repr(self._lowbit.exception()))
        else:
            kernel = self._lowbit.result()
            state = BuildState.BUILT if kernel.native else BuildState.OFF if kernel.turned_off else BuildState.FAILED
            lowbit = KernelStatus(LOWBIT, state, kernel.error)
        inductor = (
            KernelStatus(f"adam {r.key}", _INDUCTOR_STATE.get(r.state, BuildState.FAILED), r.error)
            for r in self.engine.kernels()
        )
        return (lowbit, *inductor)

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


def kernel_statuses(kernel: AdamKernel) -> tuple[KernelStatus, ...]:
    """The kernels' states of the daemon's ``kernel`` (none for a kernel other than the engine's)."""
    return kernel.statuses() if isinstance(kernel, EngineKernel) else ()


def default_kernel(config: AdamConfig) -> EngineKernel:
    engine = AdamEngine.from_config(config, warmup=warmup_keys(config.warmup))
    # the native fp32 path and the eager one parallelise over torch's intra-op threads: as many as the engine's
    torch.set_num_threads(engine.threads)
    return EngineKernel(engine)

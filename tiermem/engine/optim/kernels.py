"""Compiled single-pass Adam kernels, one per (grad dtype, output dtype), with an eager fallback.

Owns the ``torch.compile`` side of the engine.  A kernel reads the gradient and
the fp32 master, exp_avg and exp_avg_sq once and writes the three back, plus
the low-precision copy of the updated master when an output is given: 28 bytes
per parameter for fp16 grads and an fp16 copy, the least an Adam step can
move.  Inductor's C++ backend turns ``adam_math.adam_update`` plus the
in-place copies into one vectorised loop.

How compilation is kept off the hot path:

- Step-dependent values travel in one fp32 tensor of ``SCALAR_COUNT`` entries
  (``AdamScalars``), and maximize / L2 / decoupled decay are values in it, so
  one graph serves every step, learning rate and flag combination.
- Lengths are dynamic (``dynamic=True``): any chunk length of at least
  ``MIN_COMPILED_NUMEL`` uses the same graph (torch specialises lengths 0
  and 1, so shorter pieces run eagerly).
- Graphs are compiled at engine creation (``KernelSet.get`` during warm-up)
  and timed; a combination first met in the hot path compiles there once and
  logs a warning naming it.
- The C++ wrapper (``cpp_wrapper``) releases the GIL while the kernel runs and
  kernels are single-threaded (``cpp.threads=1``): parallelism comes from the
  engine's own threads, each running a piece, so the thread count is the
  engine's setting rather than baked into the code.

Each function below is its own code object, and torch caches graphs per code
object (at most 8 by default): one function with an output (3 grad x 2 out
dtypes) and one without (3 grad dtypes) stay under that limit.

When compilation is off or fails, the kernel runs the same ``adam_update``
eagerly, block by block (bit-identical to ``torch.optim.Adam``), and the
failure is logged once per combination.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from tiermem.core.adam_math import SCALAR_COUNT, AdamScalars, adam_update

__all__ = [
    "EAGER_BLOCK_NUMEL",
    "GRAD_DTYPES",
    "KernelKey",
    "KernelRecord",
    "KernelSet",
    "KernelState",
    "MIN_COMPILED_NUMEL",
    "OUT_DTYPES",
    "run_eager",
]

log = logging.getLogger(__name__)

GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OUT_DTYPES = (torch.float16, torch.bfloat16)
MIN_COMPILED_NUMEL = 16
"""Shorter pieces run eagerly (torch specialises lengths 0 and 1 into their own graphs)."""
EAGER_BLOCK_NUMEL = 1 << 18
"""The eager path works block by block so that its temporaries stay small."""
_WARMUP_NUMEL = 1024
_COMPILE_OPTIONS = {"cpp_wrapper": True, "cpp.threads": 1}


class KernelState(enum.Enum):
    EAGER = "eager"
    """Compilation is off: the eager path runs."""
    COMPILED = "compiled"
    FAILED = "failed"
    """Compilation failed: the eager path runs; ``error`` says why."""


@dataclass(frozen=True, slots=True)
class KernelKey:
    grad_dtype: torch.dtype
    out_dtype: torch.dtype | None

    def __str__(self) -> str:
        out = "none" if self.out_dtype is None else _name(self.out_dtype)
        return f"grad={_name(self.grad_dtype)} out={out}"


@dataclass
class KernelRecord:
    """One kernel: its state, the compiled callable (when compiled) and what compiling cost."""

    key: KernelKey
    state: KernelState
    fn: Callable[..., Any] | None = field(default=None, repr=False)
    compile_s: float = 0.0
    error: str = ""

    def fail(self, exc: BaseException) -> None:
        if self.state is not KernelState.COMPILED:
            return
        self.state = KernelState.FAILED
        self.fn = None
        self.error = f"{type(exc).__name__}: {exc}"
        log.warning("compiled Adam kernel %s failed (%s); using the eager path", self.key, self.error)


def _kernel_with_out(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, out: torch.Tensor, coef: torch.Tensor
) -> None:
    p_new, m_new, v_new = adam_update(p, g, m, v, AdamScalars(*(coef[i] for i in range(SCALAR_COUNT))))
    p.copy_(p_new)
    m.copy_(m_new)
    v.copy_(v_new)
    out.copy_(p_new)


def _kernel_no_out(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, coef: torch.Tensor) -> None:
    p_new, m_new, v_new = adam_update(p, g, m, v, AdamScalars(*(coef[i] for i in range(SCALAR_COUNT))))
    p.copy_(p_new)
    m.copy_(m_new)
    v.copy_(v_new)


def run_eager(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None,
    scalars: AdamScalars,
) -> None:
    """The update in plain torch ops, in place, block by block."""
    n = p.numel()
    for a in range(0, n, EAGER_BLOCK_NUMEL):
        b = min(a + EAGER_BLOCK_NUMEL, n)
        p_new, m_new, v_new = adam_update(p[a:b], g[a:b], m[a:b], v[a:b], scalars)
        p[a:b].copy_(p_new)
        m[a:b].copy_(m_new)
        v[a:b].copy_(v_new)
        if out is not None:
            out[a:b].copy_(p_new)


class KernelSet:
    """The kernels of one engine, compiled on first request (normally at warm-up)."""

    _compiled: ClassVar[dict[str, Callable[..., Any]]] = {}
    """Process-wide compiled wrappers, one per kernel function (graphs are cached per code object anyway)."""
    _compile_lock = threading.Lock()

    def __init__(self, *, compile: bool = True, cache_dir: str | None = None) -> None:
        self.compile = compile
        self.cache_dir = cache_dir
        self._records: dict[KernelKey, KernelRecord] = {}

    def records(self) -> list[KernelRecord]:
        return list(self._records.values())

    def built(self, key: KernelKey) -> bool:
        """Whether ``key``'s kernel is compiled (never compiles)."""
        rec = self._records.get(key)
        return rec is not None and rec.fn is not None

    def get(self, key: KernelKey, *, hot: bool = False) -> KernelRecord:
        """The record for ``key``, compiling it first if needed; ``hot`` marks a request from the update path."""
        rec = self._records.get(key)
        if rec is not None:
            return rec
        with KernelSet._compile_lock:
            rec = self._records.get(key)
            if rec is None:
                rec = self._build(key, hot)
                self._records[key] = rec
        return rec

    def _build(self, key: KernelKey, hot: bool) -> KernelRecord:
        if not self.compile:
            return KernelRecord(key, KernelState.EAGER)
        if self.cache_dir:
            # Inductor reads its cache location from this variable at compile time.
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.cache_dir
        started = time.perf_counter()
        try:
            fn = self._wrapper(key.out_dtype is not None)
            _warm(fn, key)
        except Exception as exc:  # any compiler failure means: run eagerly
            rec = KernelRecord(key, KernelState.FAILED, error=f"{type(exc).__name__}: {exc}")
            log.warning("cannot compile the Adam kernel %s (%s); using the eager path", key, rec.error)
            return rec
        seconds = time.perf_counter() - started
        if hot:
            log.warning(
                "compiled the Adam kernel %s on first use (%.1f s); list it in the warmup (tiermemd: its job dtype "
                "in adam.warmup)",
                key,
                seconds,
            )
        else:
            log.info("compiled the Adam kernel %s in %.1f s", key, seconds)
        return KernelRecord(key, KernelState.COMPILED, fn=fn, compile_s=seconds)

    @classmethod
    def _wrapper(cls, with_out: bool) -> Callable[..., Any]:
        name = "with_out" if with_out else "no_out"
        fn = cls._compiled.get(name)
        if fn is None:
            target = _kernel_with_out if with_out else _kernel_no_out
            fn = torch.compile(target, dynamic=True, fullgraph=True, options=dict(_COMPILE_OPTIONS))
            cls._compiled[name] = fn
        return fn


def _warm(fn: Callable[..., Any], key: KernelKey) -> None:
    n = _WARMUP_NUMEL
    p = torch.zeros(n, dtype=torch.float32)
    g = torch.zeros(n, dtype=key.grad_dtype)
    m = torch.zeros(n, dtype=torch.float32)
    v = torch.zeros(n, dtype=torch.float32)
    coef = torch.ones(SCALAR_COUNT, dtype=torch.float32)
    if key.out_dtype is None:
        fn(p, g, m, v, coef)
    else:
        fn(p, g, m, v, torch.zeros(n, dtype=key.out_dtype), coef)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

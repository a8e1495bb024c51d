"""The CPU Adam engine: checked, multi-threaded, chunked updates over flat fp32 buffers.

Owns the engine's threads and the binding of ``adam_math`` to memory.  The
operands of one update are equal-length 1-D contiguous CPU tensors (views into
pool memory or a shared window):

    master, exp_avg, exp_avg_sq   fp32, read and written
    grad                          fp32, fp16 or bf16, read
    out (optional)                fp16 or bf16, written: the updated master cast down

``update(..., start=a, stop=b)`` updates elements [a, b) only, so callers can
pipeline chunk by chunk (read state chunk i+1, update chunk i, write back
chunk i-1); with ``wait=False`` it returns a handle instead of waiting.
Every dtype, shape and length is checked before anything is written: a
mismatch raises ``DTypeError`` / ``InvalidArgument`` saying what was expected.

Threads: an update is cut into at most ``threads`` pieces (cache-line aligned,
at least ``min_piece_numel`` elements each) that run on the engine's pool; the
compiled kernels release the GIL, so an event loop in the same process keeps
running.  With ``threads=1`` the update runs in the calling thread.

The native path: an fp32 update with no output (fp32 params that are their
own master) runs torch's own fused CPU kernel (``torch._fused_adamw_`` /
``torch._fused_adam_``) over the whole range in the calling thread, parallel
over torch's intra-op threads.  It moves the same 28 bytes per param as the
compiled kernel, costs a few microseconds per call instead of a compiled
graph's guard checks, and needs no compiler in the process (the daemon of an
fp32 job never imports inductor or runs a C++ compiler: about 250 MB less at
peak).  A grad scale (loss scaling, clipping) is applied block by block: each
1 MiB block of ``grad * grad_scale`` goes to a scratch block that the fused
kernel reads back from cache (torch's own ``grad_scale`` argument divides,
and writes the unscaled grad back into ``grad``, which may be the trainer's
``.grad``).  That costs about 1.2x the compiled kernel's time, measured by
``bench_cpu_adam``, but compiles nothing: the compiled kernel's first scaled
step would pay its compile on the hot path (measured: 7 s on a 2-core host,
55 s on a 16-core GPU node with a cold cache).  Where the fp32 kernel was
built at warm-up (tiermemd: ``float32`` in ``adam.warmup``), scaled fp32
updates run it instead; which path runs thus depends on the configuration
only, never on timing, so a run's bits are reproducible.  ``native=False``
turns the path off.

Compressed moments (``state_dtype`` bf16 or int8, ``tiermem.core.lowbit``):
``update_lowbit`` takes the moments as a ``LowbitMoments``
and run the fused C kernel (``lowbit_native``) over pieces that begin on a
quantization block, on the same threads; without a C compiler the
plain-torch reference runs instead.

Overflow and clipping: ``grad_stats`` is one cheap read of a gradient piece,
run per bucket as buckets arrive; once all are in, ``combine_grad_stats`` and
``clip_coefficient`` (``adam_math``) give the skip decision and the
``grad_scale = inv_scale * clip_coef`` that the update applies in its pass.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from tiermem.core.adam_math import AdamHyper, AdamScalars, step_scalars
from tiermem.core.closing import Closing
from tiermem.core.config import AdamConfig
from tiermem.core.errors import DTypeError, InvalidArgument
from tiermem.core.lowbit import BLOCK, LowbitMoments, blocks_of
from tiermem.core.step_rules import GradStats, grad_stats
from tiermem.engine.cpus import usable_cpus
from tiermem.engine.optim.kernels import (
    GRAD_DTYPES,
    MIN_COMPILED_NUMEL,
    OUT_DTYPES,
    KernelKey,
    KernelRecord,
    KernelSet,
    run_eager,
)
from tiermem.engine.optim.lowbit_native import LowbitKernel
from tiermem.engine.workers import started_pool

__all__ = ["AdamEngine", "DEFAULT_WARMUP", "PendingUpdate", "kernel_key"]

DEFAULT_WARMUP: tuple[tuple[torch.dtype, torch.dtype | None], ...] = (
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
)
"""The daemon's combinations: fp16 grads -> fp16 params, bf16 -> bf16."""

_ALIGN_NUMEL = 16  # 64 bytes of fp32: pieces start on cache lines when the buffer does
_Piece = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]
"""(master, grad, exp_avg, exp_avg_sq, out) slices of one piece."""


class PendingUpdate:
    """An update running on the engine's threads."""

    def __init__(self, futures: list[Future[None]]) -> None:
        self._futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        """Block until every piece finished; re-raise the first piece's error."""
        error: BaseException | None = None
        for f in self._futures:
            exc = f.exception()
            if exc is not None and error is None:
                error = exc
        if error is not None:
            raise error


class AdamEngine(Closing):
    """Runs Adam/AdamW updates over flat buffers; see the module docstring."""

    def __init__(
        self,
        *,
        threads: int = 0,
        compile: bool = True,
        cache_dir: str | None = None,
        warmup: Iterable[tuple[torch.dtype, torch.dtype | None]] = DEFAULT_WARMUP,
        min_piece_numel: int = 1 << 16,
        native: bool = True,
    ) -> None:
        """``threads`` 0 uses the CPUs this process can get (``usable_cpus``: its affinity, capped by its
        cgroups' CPU quota); ``compile`` False forces the eager path.

        ``warmup`` lists the (grad dtype, out dtype) combinations compiled now,
        so that their first-compile latency is paid here (see ``kernels()``).
        ``cache_dir`` is inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR).
        """
        if threads < 0:
            raise InvalidArgument(f"threads must be >= 0, got {threads}")
        if min_piece_numel < 1:
            raise InvalidArgument(f"min_piece_numel must be >= 1, got {min_piece_numel}")
        self.threads = threads or usable_cpus()
        self.min_piece_numel = min_piece_numel
        self.native = native and hasattr(torch, "_fused_adamw_")
        self._kernels = KernelSet(compile=compile, cache_dir=cache_dir or None)
        self._lowbit: LowbitKernel | None = None
        self._pool = started_pool(self.threads, "tiermem-adam") if self.threads > 1 else None
        self.warm_up(warmup)

    @classmethod
    def from_config(
        cls, config: AdamConfig, warmup: Iterable[tuple[torch.dtype, torch.dtype | None]] = DEFAULT_WARMUP
    ) -> AdamEngine:
        return cls(threads=config.threads, compile=config.compile, cache_dir=config.cache_dir, warmup=warmup)

    def warm_up(self, combos: Iterable[tuple[torch.dtype, torch.dtype | None]]) -> None:
        """Build the kernels of these (grad dtype, out dtype) combinations now (a no-op for built ones)."""
        for grad_dtype, out_dtype in combos:
            self._kernels.get(kernel_key(grad_dtype, out_dtype))

    def kernels(self) -> list[KernelRecord]:
        """The kernels built so far: state (compiled / eager / failed), compile seconds, error."""
        return self._kernels.records()

    def path(self, grad_dtype: torch.dtype, out_dtype: torch.dtype | None, grad_scale: float = 1.0) -> str:
        """The code an update of these dtypes runs (``update``): ``native`` (torch's fused CPU AdamW),
        ``compiled`` (the inductor kernel) or ``fallback`` (the eager update: compiling off or failed, or the
        kernel not built yet).  Never compiles."""
        if self._runs_native(grad_dtype, out_dtype, grad_scale):
            return "native"
        return "compiled" if self._kernels.built(kernel_key(grad_dtype, out_dtype)) else "fallback"

    def _runs_native(self, grad_dtype: torch.dtype, out_dtype: torch.dtype | None, grad_scale: float) -> bool:
        return (
            self.native
            and out_dtype is None
            and grad_dtype == torch.float32
            and (grad_scale == 1.0 or not self._kernels.built(_FP32_KEY))
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # ----------------------------------------------------------------------- gradient statistics

    def grad_stats(self, grad: torch.Tensor, inv_scale: float = 1.0) -> GradStats:
        """(sum of squares of ``grad * inv_scale``, whether ``grad`` holds inf/nan) for one piece."""
        _check_tensor("grad", grad, GRAD_DTYPES)
        return grad_stats(grad, inv_scale)

    # ----------------------------------------------------------------------- update

    def update(
        self,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        group: Any,
        step: int,
        grad_scale: float = 1.0,
        start: int = 0,
        stop: int | None = None,
        wait: bool = True,
    ) -> PendingUpdate:
        """One Adam step of elements [start, stop) of the operands.

        ``group`` is an ``AdamHyper`` or anything ``AdamHyper.of`` reads (a
        torch param-group dict, a protocol ``ParamGroup``); ``step`` is the step
        count of these elements after this update (1 for the first);
        ``grad_scale`` multiplies the raw gradient (``inv_scale * clip_coef``).
        ``wait``: return when it is written, this thread running the first piece
        itself; ``wait=False`` queues every piece on the engine's threads and
        the returned ``PendingUpdate`` waits for them.
        """
        stop = _check_range(start, stop, _check_operands(master, exp_avg, exp_avg_sq, grad, out))
        hyper = AdamHyper.of(group)
        if self._runs_native(grad.dtype, None if out is None else out.dtype, grad_scale):
            piece = (master[start:stop], grad[start:stop], exp_avg[start:stop], exp_avg_sq[start:stop])
            native = functools.partial(_run_native, *piece, hyper, step, grad_scale)
            return _pending([_run_here(native)] if stop > start else [], wait)
        scalars = step_scalars(hyper, step, grad_scale)
        rec = self._kernels.get(kernel_key(grad.dtype, None if out is None else out.dtype), hot=True)
        coef = torch.tensor(scalars, dtype=torch.float32)
        cuts = self._cuts(start, stop, compiled=rec.fn is not None)
        pieces: list[_Piece] = [
            (master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], None if out is None else out[a:b])
            for a, b in itertools.pairwise(cuts)
        ]
        return self._started([functools.partial(_run_piece, rec, piece, scalars, coef) for piece in pieces], wait)

    def _started(self, calls: Sequence[Callable[[], None]], wait: bool) -> PendingUpdate:
        """Run the pieces' ``calls``: without a pool all here; else on the pool, the caller's thread taking the
        first itself when it is going to wait anyway (``wait``, which returns once all are done)."""
        n_inline = len(calls) if self._pool is None else int(wait and bool(calls))
        futures: list[Future[None]] = []
        if self._pool is not None:
            futures = [self._pool.submit(call) for call in calls[n_inline:]]
        futures += [_run_here(call) for call in calls[:n_inline]]
        return _pending(futures, wait)

    def _cuts(self, start: int, stop: int, *, compiled: bool, align: int = _ALIGN_NUMEL) -> list[int]:
        n = stop - start
        # The eager path is already parallel inside each torch op: one piece.
        pieces = 1 if not compiled else max(1, min(self.threads, n // self.min_piece_numel))
        if pieces == 1:
            return [start, stop] if n else []
        size = -(-n // pieces)
        size = -(-size // align) * align
        return [*range(start, stop, size), stop]

    # ----------------------------------------------------------------------- compressed moments

    def lowbit_kernel(self) -> LowbitKernel:
        """The fused kernel of compressed moments (built on the first call: about 1.5 s with a cold cache)."""
        if self._lowbit is None:
            self._lowbit = LowbitKernel.load(self._kernels.cache_dir, build=self._kernels.compile)
        return self._lowbit

    def update_lowbit(
        self,
        master: torch.Tensor,
        moments: LowbitMoments,
        grad: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        group: Any,
        step: int,
        grad_scale: float = 1.0,
        start: int = 0,
        stop: int | None = None,
        wait: bool = True,
    ) -> PendingUpdate:
        """``update`` over compressed moments (``state_dtype`` bf16 or int8): one fused pass per piece.

        ``start`` must begin a block of int8 moments (a multiple of ``lowbit.BLOCK``); the rounding of
        element ``i`` hashes ``moments.start + i`` and ``step``."""
        stop = _check_range(start, stop, _check_lowbit_operands(master, moments, grad, out))
        moments.piece(start, stop)  # refuses an int8 start off a block before any piece runs
        scalars = step_scalars(AdamHyper.of(group), step, grad_scale)
        coef = torch.tensor(scalars, dtype=torch.float32)
        kernel = self.lowbit_kernel()
        calls = [
            functools.partial(kernel.update, master, grad, moments, out, scalars, coef, step=step, start=a, stop=b)
            for a, b in itertools.pairwise(self._cuts(start, stop, compiled=kernel.native, align=BLOCK))
        ]
        return self._started(calls, wait)


def _pending(futures: list[Future[None]], wait: bool) -> PendingUpdate:
    """The handle of an update's pieces; with ``wait``, once they are done (raising the first error)."""
    pending = PendingUpdate(futures)
    if wait:
        pending.wait()
    return pending


def _run_here(call: Callable[[], None]) -> Future[None]:
    """Run ``call`` in this thread; a done future holding its error, if any (raised by ``PendingUpdate.wait``)."""
    done: Future[None] = Future()
    try:
        call()
        done.set_result(None)
    except Exception as exc:
        done.set_exception(exc)
    return done


def _run_piece(rec: KernelRecord, piece: _Piece, scalars: AdamScalars, coef: torch.Tensor) -> None:
    p, g, m, v, out = piece
    fn = rec.fn
    if fn is not None and p.numel() >= MIN_COMPILED_NUMEL:
        try:
            if out is None:
                fn(p, g, m, v, coef)
            else:
                fn(p, g, m, v, out, coef)
            return
        except Exception as exc:  # a compiler failure at call time: fall back, once
            rec.fail(exc)
    run_eager(p, g, m, v, out, scalars)


_FP32_KEY = KernelKey(torch.float32, None)
NATIVE_SCALE_BLOCK_NUMEL = 1 << 18
"""Elements of grad scaled per block on the native path (1 MiB of fp32: the scratch stays in cache)."""


def _run_native(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    hyper: AdamHyper,
    step: int,
    grad_scale: float = 1.0,
) -> None:
    """torch's fused CPU AdamW/Adam over ``p`` in place; with ``grad_scale`` != 1, block by block over
    ``g * grad_scale`` (one fp32 product per element, the compiled kernel's) written to a scratch block, so
    ``g`` is never written and the scratch is read back from cache."""
    if grad_scale == 1.0:
        _fused(p, g, m, v, hyper, step)
        return
    n = p.numel()
    scratch = torch.empty(min(n, NATIVE_SCALE_BLOCK_NUMEL), dtype=torch.float32)
    for a in range(0, n, NATIVE_SCALE_BLOCK_NUMEL):
        b = min(a + NATIVE_SCALE_BLOCK_NUMEL, n)
        scaled = torch.mul(g[a:b], grad_scale, out=scratch[: b - a])
        _fused(p[a:b], scaled, m[a:b], v[a:b], hyper, step)


def _fused(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hyper: AdamHyper, step: int) -> None:
    fused = torch._fused_adamw_ if hyper.adamw else torch._fused_adam_
    fused(
        [p],
        [g],
        [m],
        [v],
        [],
        [torch.tensor(float(step))],
        lr=hyper.lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=hyper.maximize,
    )


def kernel_key(grad_dtype: torch.dtype, out_dtype: torch.dtype | None) -> KernelKey:
    if grad_dtype not in GRAD_DTYPES:
        raise DTypeError(f"grad dtype {grad_dtype} is not supported; expected one of {_names(GRAD_DTYPES)}")
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise DTypeError(f"out dtype {out_dtype} is not supported; expected one of {_names(OUT_DTYPES)} or None")
    return KernelKey(grad_dtype, out_dtype)


def _check_range(start: int, stop: int | None, numel: int) -> int:
    """``stop`` resolved (None: ``numel``), once ``[start, stop)`` is known to lie within ``[0, numel]``."""
    stop = numel if stop is None else stop
    if not 0 <= start <= stop <= numel:
        raise InvalidArgument(f"range [{start}, {stop}) is not within [0, {numel}]")
    return stop


def _check_tensor(name: str, t: Any, dtypes: tuple[torch.dtype, ...]) -> int:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise DTypeError(f"{name} has dtype {t.dtype}; expected {_names(dtypes)}")
    if t.device.type != "cpu":
        raise InvalidArgument(f"{name} is on {t.device}; the CPU Adam engine needs CPU tensors")
    if t.dim() != 1 or not t.is_contiguous():
        raise InvalidArgument(
            f"{name} must be a contiguous 1-D tensor (a flat view), got shape {tuple(t.shape)} "
            f"with strides {t.stride()}; pass t.view(-1) of a contiguous tensor"
        )
    return t.numel()


def _check_operands(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor | None,
) -> int:
    fp32 = (torch.float32,)
    numel = _check_tensor("master", master, fp32)
    named: list[tuple[str, Any, tuple[torch.dtype, ...]]] = [
        ("exp_avg", exp_avg, fp32),
        ("exp_avg_sq", exp_avg_sq, fp32),
        ("grad", grad, GRAD_DTYPES),
    ]
    return _check_against_master(numel, named, out)


def _check_against_master(numel: int, named: list[tuple[str, Any, tuple[torch.dtype, ...]]], out: Any) -> int:
    """Each of ``named`` (and ``out`` where given) a flat CPU tensor of its dtypes with ``numel`` elements."""
    if out is not None:
        named = [*named, ("out", out, OUT_DTYPES)]
    for name, t, dtypes in named:
        n = _check_tensor(name, t, dtypes)
        if n != numel:
            raise InvalidArgument(f"{name} has {n} elements but master has {numel}; every operand must match")
    return numel


_MOMENT_DTYPES = {"bf16": (torch.bfloat16, torch.bfloat16), "int8": (torch.int8, torch.uint8)}


def _check_lowbit_operands(
    master: torch.Tensor, moments: LowbitMoments, grad: torch.Tensor, out: torch.Tensor | None
) -> int:
    numel = _check_tensor("master", master, (torch.float32,))
    if moments.state_dtype not in _MOMENT_DTYPES:
        raise InvalidArgument(
            f"compressed moments are bf16 or int8, got {moments.state_dtype!r} (fp32 moments: use update)"
        )
    m_dtype, v_dtype = _MOMENT_DTYPES[moments.state_dtype]
    named: list[tuple[str, Any, tuple[torch.dtype, ...]]] = [
        ("exp_avg", moments.exp_avg, (m_dtype,)),
        ("exp_avg_sq", moments.exp_avg_sq, (v_dtype,)),
        ("grad", grad, GRAD_DTYPES),
    ]
    _check_against_master(numel, named, out)
    if moments.state_dtype == "int8":
        blocks = blocks_of(numel)
        for name, t in (("exp_avg_scale", moments.exp_avg_scale), ("exp_avg_sq_scale", moments.exp_avg_sq_scale)):
            if _check_tensor(name, t, (torch.float32,)) != blocks:
                raise InvalidArgument(f"{name} has {t.numel()} block scales; {numel} elements need {blocks}")
    return numel


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)

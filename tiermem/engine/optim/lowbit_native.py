"""The fused Adam pass over compressed moments (``lowbit_kernel.c``): built once per host, loaded with ctypes.

One call updates one piece of a chunk in a single pass over memory:
dequantize the moments, update the fp32 master, write the working copy,
round the new moments back (``tiermem.core.lowbit``'s scheme: the moments'
codes and scales bit for bit, the master within two ulps of ``lowbit_update``,
the reference it is tested against).

Why plain C through ctypes, not ``torch.compile`` or a torch extension:

- torch 2.13's inductor cannot compile the scheme: its C++ backend fails on
  the 32-bit hash and the fp32/int32 bit casts (``Vectorized<float>``
  compile errors).
- A torch C++ extension includes torch's headers: about a minute to build on
  a 2-core host, against 1.5 s for this file, and a binary tied to one torch
  build.  The kernel needs no torch type: it takes pointers.
- ctypes releases the GIL for the call, so the engine's threads run pieces in
  parallel, as with the compiled fp32 kernels.

The build: ``$CC`` (else ``cc``) with ``-O3 -march=native`` (AVX2/AVX-512 and
F16C where the CPU has them) and ``-ffp-contract=off`` (no fused multiply-add
that the reference does not do), into a cache directory, keyed by a hash of
the source, the flags, the compiler's version and the CPU's feature flags:
a node image shared by different CPUs never loads a binary built for
another.  The directory (``adam.cache_dir``, else ``~/.cache/tiermem``) must
belong to this user and not be writable by others, since loading a library
runs its code; when it cannot be used, the build goes to this user's private
directory under the temporary directory instead.  Without a compiler, or
when the build fails, the same update runs through the plain-torch reference
(the same bits, several times slower), and the reason is logged once and
kept in ``LowbitKernel.error``.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import ClassVar

import torch

from tiermem.core.adam_math import AdamScalars
from tiermem.core.errors import InvalidArgument
from tiermem.core.lowbit import LowbitMoments, lowbit_update

__all__ = [
    "FLAGS",
    "TURNED_OFF",
    "LowbitKernel",
    "build_library",
    "built_lowbit_library",
    "cache_directories",
    "library_name",
    "step_term",
]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("lowbit_kernel.c")
FLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fPIC",
    "-shared",
)
"""``-fno-math-errno`` and ``-fno-trapping-math`` change no result; they let sqrt and compares vectorise.
``-mprefer-vector-width=512``: where the CPU has AVX-512 (gcc prefers 256-bit vectors there by default),
measured 1.2x faster per thread; ignored elsewhere."""
_BUILD_TIMEOUT_S = 300.0
_GRAD_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_OUT_KINDS = {None: 0, torch.float16: 1, torch.bfloat16: 2}
_STATE_KINDS = {"bf16": 1, "int8": 2}
_MASK32 = 0xFFFFFFFF
TURNED_OFF = "the native kernel is turned off"
"""``LowbitKernel.error`` when the configuration chose the reference (``load(build=False)``)."""


def step_term(step: int) -> int:
    """The step's share of the rounding hash (``lowbit.hash32``'s, modulo 2**32)."""
    return (step * 0x85EBCA77 + 0x3C6EF372) & _MASK32


class LowbitKernel:
    """The loaded kernel of one process (``load``), or the reason there is none and the reference runs."""

    _loaded: ClassVar[dict[str, LowbitKernel]] = {}
    _lock = threading.Lock()

    def __init__(self, lib: ctypes.CDLL | None, *, path: str = "", error: str = "") -> None:
        self._fn = None
        if lib is not None:
            fn = lib.tm_lowbit_adam
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.c_int64,
                ctypes.c_uint32,
                ctypes.c_uint32,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
            ]
            self._fn = fn
        self.path = path
        self.error = error

    @property
    def native(self) -> bool:
        """Whether the compiled kernel runs (else the plain-torch reference)."""
        return self._fn is not None

    @property
    def turned_off(self) -> bool:
        """Whether the reference runs by the configuration's choice rather than because the build failed."""
        return self._fn is None and self.error == TURNED_OFF

    @classmethod
    def load(cls, cache_dir: str | None = None, *, build: bool = True) -> LowbitKernel:
        """This process's kernel for ``cache_dir`` (built there on first use); ``build`` False: the reference."""
        key = f"{cache_dir or ''}|{build}"
        with cls._lock:
            kernel = cls._loaded.get(key)
            if kernel is None:
                kernel = cls._build(cache_dir) if build else cls(None, error=TURNED_OFF)
                cls._loaded[key] = kernel
            return kernel

    @classmethod
    def _build(cls, cache_dir: str | None) -> LowbitKernel:
        try:
            path = _built_library(cache_dir)
            return cls(ctypes.CDLL(path), path=path)
        except Exception as exc:  # no compiler, a failed build, an unloadable file: the reference runs
            error = f"{type(exc).__name__}: {exc}"
            log.warning("cannot build the compressed-moment Adam kernel (%s); using the plain-torch path", error)
            return cls(None, error=error)

    def update(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        moments: LowbitMoments,
        out: torch.Tensor | None,
        scalars: AdamScalars,
        coef: torch.Tensor,
        *,
        step: int,
        start: int,
        stop: int,
    ) -> None:
        """Elements [start, stop) of one chunk's operands (``start`` on a block of ``moments``); ``coef`` is
        ``scalars`` as an fp32 tensor.  The caller has checked dtypes and lengths."""
        piece = moments.piece(start, stop)  # checks the range and the block
        if stop <= start:
            return
        p, g = master[start:stop], grad[start:stop]
        o = None if out is None else out[start:stop]
        if self._fn is None:
            lowbit_update(p, g, piece, scalars, step=step)
            if o is not None:
                o.copy_(p)
            return
        int8 = piece.state_dtype == "int8"
        rc = self._fn(
            stop - start,
            piece.start & _MASK32,
            step_term(step),
            p.data_ptr(),
            g.data_ptr(),
            _GRAD_KINDS[g.dtype],
            0 if o is None else o.data_ptr(),
            _OUT_KINDS[None if o is None else o.dtype],
            _STATE_KINDS[piece.state_dtype],
            piece.exp_avg.data_ptr(),
            piece.exp_avg_sq.data_ptr(),
            piece.exp_avg_scale.data_ptr() if int8 else 0,
            piece.exp_avg_sq_scale.data_ptr() if int8 else 0,
            coef.data_ptr(),
        )
        if rc != 0:
            raise InvalidArgument(f"the compressed-moment Adam kernel refused its arguments (code {rc})")


def _built_library(cache_dir: str | None) -> str:
    return build_library(SOURCE, "lowbit", cache_dir)


def library_name(source_path: Path, prefix: str) -> tuple[str, str]:
    """(the compiler, the file name ``source_path`` builds to on this host): the name is keyed by the source,
    ``FLAGS``, the compiler's version and the CPU's features.  ``FileNotFoundError`` without a compiler."""
    cc = os.environ.get("CC") or "cc"
    compiler = shutil.which(cc)
    if compiler is None:
        raise FileNotFoundError(f"no C compiler {cc!r} on PATH (set CC, or install gcc)")
    version = subprocess.run([compiler, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    for part in (source_path.read_bytes(), "\0".join(FLAGS).encode(), version.encode(), _cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    return compiler, f"{prefix}-{digest.hexdigest()[:24]}.so"


def cache_directories(cache_dir: str | None) -> tuple[str, str]:
    """Where kernels are built, in order: ``cache_dir`` (else ``~/.cache/tiermem``), then this user's
    private directory in the temporary directory."""
    wanted = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "tiermem")
    return wanted, os.path.join(tempfile.gettempdir(), f"tiermem-kernels-{os.getuid()}")


def built_lowbit_library(cache_dir: str | None = None) -> str | None:
    """The compressed-moment kernel already built for this host in one of ``cache_directories``, or None;
    never builds, never creates a directory.  ``FileNotFoundError`` without a compiler."""
    _, name = library_name(SOURCE, "lowbit")
    for directory in cache_directories(cache_dir):
        path = os.path.join(directory, name)
        try:
            if _private_dir(directory) and _private_file(path):
                return path
        except OSError:
            continue
    return None


def build_library(source_path: Path, prefix: str, cache_dir: str | None = None) -> str:
    """The path of ``source_path`` built with ``FLAGS`` into the cache directory (built now unless there)."""
    compiler, name = library_name(source_path, prefix)
    directory = _cache_directory(cache_dir)
    path = os.path.join(directory, name)
    if os.path.exists(path) and _private_file(path):
        return path
    fd, tmp = tempfile.mkstemp(prefix=f".{prefix}-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        returncode, stderr = _compile([compiler, *FLAGS, "-o", tmp, str(source_path)], _BUILD_TIMEOUT_S)
        if returncode != 0:
            raise RuntimeError(f"{os.path.basename(compiler)} exited with {returncode}: {stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # atomic: a concurrent builder's equal file may win, either is complete
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _compile(argv: list[str], timeout_s: float) -> tuple[int, str]:
    """Run a compiler driver; (its exit code, its stderr).  Past ``timeout_s`` its whole process group is
    killed (``cc`` runs ``cc1``, ``as`` and ``ld`` as children: killing the driver alone left ``cc1``
    compiling on a loaded node) and ``subprocess.TimeoutExpired`` is raised."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return proc.returncode, stderr


def _cache_directory(cache_dir: str | None) -> str:
    """``cache_dir`` (else ``~/.cache/tiermem``) when it is ours and private; else this user's private
    directory in the temporary directory; else (someone else made that one) a new private temporary one."""
    for candidate in cache_directories(cache_dir):
        try:
            os.makedirs(candidate, mode=0o700, exist_ok=True)
            if _private_dir(candidate):
                return candidate
            log.warning("%s is not a directory of this user closed to others; not building the kernel there", candidate)
        except OSError as exc:
            log.warning("cannot build the kernel in %s (%s)", candidate, exc)
    return tempfile.mkdtemp(prefix="tiermem-kernels-")


def _private_dir(path: str) -> bool:
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _private_file(path: str) -> bool:
    st = os.lstat(path)
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _cpu_flags() -> str:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); the architecture alone where /proc has none."""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    return os.uname().machine

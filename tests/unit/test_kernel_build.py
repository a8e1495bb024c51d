"""The daemon builds the compressed-moment kernel at start, on a thread of its own, and says where it is.

A real ``AdamEngine`` and the real C compiler (skipped without one), building
into this user's default cache as the daemon does (a build costs 2-20 s here,
a load from the cache none); a compiler that takes seconds and fails is a shell
script.  ``LowbitKernel.load`` keeps one kernel per cache directory for the
process, so the other tests build into directories of their own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiermem.engine.optim import AdamEngine
from tiermem.engine.optim.lowbit_native import built_lowbit_library
from tiermemd import health
from tiermemd.kernel import BuildState, EngineKernel

CC = shutil.which(os.environ.get("CC") or "cc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler here")


@contextlib.contextmanager
def _kernel(cache: Path | None, *, compile: bool = True) -> Iterator[EngineKernel]:
    """An ``EngineKernel`` over a one-thread engine building into ``cache`` (None: the default), closed on exit."""
    kernel = EngineKernel(AdamEngine(threads=1, warmup=[], cache_dir=cache and str(cache), compile=compile))
    try:
        yield kernel
    finally:
        kernel.close()


def _lowbit(kernel: EngineKernel) -> BuildState:
    return kernel.statuses()[0].state


@needs_cc
def test_the_kernel_is_built_without_any_request_and_found_in_the_cache(tmp_path: Path) -> None:
    assert built_lowbit_library(str(tmp_path)) is None
    with _kernel(None) as kernel:
        kernel.prepare("int8")
        (lowbit,) = kernel.statuses()
        assert (lowbit.name, lowbit.state, lowbit.error) == ("lowbit", BuildState.BUILT, "")
        assert built_lowbit_library(None) == kernel.engine.lowbit_kernel().path


def test_compile_off_is_off_not_failed(tmp_path: Path) -> None:
    with _kernel(tmp_path, compile=False) as kernel:
        kernel.prepare("bf16")
        assert _lowbit(kernel) is BuildState.OFF


def test_a_failed_build_is_failed_and_names_the_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-cc")
    with _kernel(tmp_path) as kernel:
        kernel.prepare("int8")  # the reference runs: registering still succeeds
        (lowbit,) = kernel.statuses()
        assert lowbit.state is BuildState.FAILED and "no C compiler 'no-such-cc'" in lowbit.error


def test_a_rank_that_registers_during_the_build_waits_with_its_beacon_ticking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = tmp_path / "slow-cc"
    slow.write_text('#!/bin/sh\n[ "$1" = --version ] && echo slow-cc 1 && exit 0\nsleep 3\nexit 1\n')
    slow.chmod(0o755)
    monkeypatch.setenv("CC", str(slow))
    registry = health.Health(stall_s=1.5)
    with _kernel(tmp_path / "cache") as kernel:
        assert _lowbit(kernel) is BuildState.BUILDING
        verdicts: list[bool] = []

        def register() -> None:
            with health.track("session 1", kind="session", health=registry):
                kernel.prepare("int8")

        session = threading.Thread(target=register)
        session.start()
        while session.is_alive():
            verdicts.append(registry.check())
            time.sleep(0.1)
        session.join()
        assert _lowbit(kernel) is BuildState.FAILED  # and the reference runs
        assert len(verdicts) > 20 and all(verdicts)  # waited seconds, never stalled


def test_a_build_past_its_time_limit_kills_the_compilers_children_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cc`` compiles in a child (``cc1``): a timeout that killed only the driver left the child compiling."""
    import subprocess

    from tiermem.engine.optim import lowbit_native

    pidfile = tmp_path / "child.pid"
    compiler = tmp_path / "slowcc"
    # a driver that answers --version at once, and otherwise starts a long-running child and waits for it
    compiler.write_text(
        f'#!/bin/sh\nif [ "$1" = --version ]; then echo slowcc 1; exit 0; fi\nsleep 60 & echo $! > {pidfile}\nwait\n'
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setattr(lowbit_native, "_BUILD_TIMEOUT_S", 1.0)
    with pytest.raises(subprocess.TimeoutExpired):
        lowbit_native.build_library(lowbit_native.SOURCE, "lowbit", str(tmp_path / "cache"))
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the compiler's child {child} still runs after the build timed out")
    assert not list((tmp_path / "cache").glob("*.so")), "no half-built library is left"

"""A fault-injecting I/O engine for tests: wraps a real engine and breaks chosen requests.

``FaultyEngine(inner)`` passes every request to ``inner`` except those matching
an injected ``Fault``:
- ``FaultKind.ERRNO``: the request is not performed at all and fails with that
  errno (EIO by default), as a disk error would report it;
- ``FaultKind.SHORT``: only the first half of the request (page-aligned) is
  performed and the completion reports that many bytes.
Failures are produced by the product's own completion check (``Transfer``), so
tests exercise the same error path a real kernel result takes.

``mounted(fstype, options)`` mounts a small file system for a test (a 4 MiB
tmpfs that fills up, a ramfs that refuses O_DIRECT) and skips without root;
``failing_writeback()`` mounts an ext4 whose ``fdatasync`` fails (a loop
image on a tmpfs too small for it).
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

import pytest

from tiermem.engine.swap.engine import IOEngine, IOOp, IORequest, Transfer


class FaultKind(Enum):
    ERRNO = "errno"
    SHORT = "short"


@dataclass
class Fault:
    op: IOOp
    kind: FaultKind = FaultKind.ERRNO
    errno: int = errno_mod.EIO
    path_contains: str = ""
    skip: int = 0
    """Matching requests to let through before the fault fires."""
    count: int = 1
    """Matching requests to break once it fires."""
    hits: int = 0

    def fires(self, request: IORequest) -> bool:
        if request.op is not self.op or self.path_contains not in request.path or self.count <= 0:
            return False
        if self.skip > 0:
            self.skip -= 1
            return False
        self.count -= 1
        self.hits += 1
        return True


class FaultyEngine:
    """An ``IOEngine`` that breaks the requests its faults match; see the module docstring."""

    def __init__(self, inner: IOEngine) -> None:
        self.inner = inner
        self.name = f"faulty-{inner.name}"
        self.direct = inner.direct  # requests reach ``inner`` unchanged: its alignment and block size hold
        self.block_size = inner.block_size
        self.faults: list[Fault] = []

    def inject(self, fault: Fault) -> Fault:
        self.faults.append(fault)
        return fault

    def submit(self, requests: Sequence[IORequest]) -> list[Future[int]]:
        out: list[Future[int]] = []
        for request in requests:
            fault = next((f for f in self.faults if f.fires(request)), None)
            if fault is None:
                out.extend(self.inner.submit([request]))
                continue
            transfer = Transfer(request, 1)
            if fault.kind is FaultKind.ERRNO:
                transfer.block_done(request.offset, request.nbytes, -fault.errno)
            else:
                half = (request.nbytes // 2) // 4096 * 4096
                if half:
                    done = self.inner.submit([replace(request, nbytes=half)])[0]
                    done.add_done_callback(
                        lambda f, t=transfer, r=request, h=half: t.block_done(
                            r.offset, r.nbytes, h if f.exception() is None else -errno_mod.EIO
                        )
                    )
                else:
                    transfer.block_done(request.offset, request.nbytes, 0)
            out.append(transfer.future)
        return out

    def close(self) -> None:
        self.inner.close()


@contextlib.contextmanager
def mounted(fstype: str, options: str = "") -> Iterator[Path]:
    """A fresh ``fstype`` mount (tmpfs with size=4m, ramfs, ...) in a temporary directory; skips without permission."""
    with tempfile.TemporaryDirectory(prefix=f"tiermem-{fstype}-", dir="/var/tmp") as d:
        _run_or_skip(["mount", "-t", fstype, *(["-o", options] if options else []), fstype, d], f"mount {fstype}")
        try:
            yield Path(d)
        finally:
            subprocess.run(["umount", "-l", d], capture_output=True, check=False)


def _run_or_skip(args: Sequence[str], what: str) -> None:
    """Run ``args``; skip the test, naming ``what``, where it fails (not root, no loop devices, ...)."""
    done = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot {what} here ({done.stderr.strip() or done.returncode}); needs root")


@contextlib.contextmanager
def failing_writeback(backing_nbytes: int = 8 * 1024 * 1024) -> Iterator[Path]:
    """An ext4 file system whose writeback fails: a 64 MiB image on a ``backing_nbytes`` tmpfs, loop-mounted.

    Buffered writes into it succeed (they land in the page cache) until the image's backing runs out of
    room; the ``fdatasync`` that flushes them then fails (ENOSPC, then EIO), as a disk that dies under
    dirty pages does.  Skips without root or loop devices."""
    with mounted("tmpfs", f"size={backing_nbytes}") as backing:
        image = backing / "image"
        with open(image, "wb") as f:
            f.truncate(64 * 1024 * 1024)
        with tempfile.TemporaryDirectory(prefix="tiermem-ext4-", dir="/var/tmp") as d:
            _run_or_skip(["mkfs.ext4", "-q", "-F", "-E", "nodiscard", str(image)], "make an ext4 image")
            _run_or_skip(["mount", "-o", "loop", str(image), d], "loop-mount an ext4 image")
            try:
                yield Path(d)
            finally:
                subprocess.run(["umount", "-l", d], capture_output=True, check=False)

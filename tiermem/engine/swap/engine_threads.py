"""``ThreadEngine``: os.preadv/os.pwritev on a pool of threads.

The fallback where libaio or O_DIRECT is missing (tmpfs, some network file
systems).  Files are opened without O_DIRECT, so transfers go through the page
cache and need no alignment; the store still aligns them.

Owns a ``ThreadPoolExecutor`` of ``threads`` workers.  Each request is split
into ``block_size`` blocks, one task per block; the syscalls release the GIL,
so blocks of one request run in parallel.  Every result is checked (OSError ->
errno, fewer bytes than asked -> short transfer).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from concurrent.futures import Future

from tiermem.core.errors import InvalidArgument, InvalidState
from tiermem.engine.swap.engine import IOOp, IORequest, Transfer
from tiermem.engine.workers import started_pool

__all__ = ["ThreadEngine"]


class ThreadEngine:
    """Blocking positional I/O on worker threads; see the module docstring."""

    name = "threads"
    direct = False

    def __init__(self, *, block_size: int, threads: int) -> None:
        if block_size <= 0:
            raise InvalidArgument(f"block_size must be > 0, got {block_size}")
        if threads <= 0:
            raise InvalidArgument(f"threads must be > 0, got {threads}")
        self._block_size = block_size
        self._pool = started_pool(threads, "tiermem-io")
        self._closed = False

    @property
    def block_size(self) -> int:
        return self._block_size

    def submit(self, requests: Sequence[IORequest]) -> list[Future[int]]:
        if self._closed:
            raise InvalidState("the thread I/O engine is closed")
        transfers = [Transfer(r, -(-r.nbytes // self._block_size)) for r in requests]
        for t in transfers:
            for offset, address, nbytes in t.blocks(self._block_size):
                self._pool.submit(_run_block, t, offset, address, nbytes)
        return [t.future for t in transfers]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)


def _run_block(transfer: Transfer, offset: int, address: int, nbytes: int) -> None:
    try:
        view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
        fd = transfer.request.fd
        io = os.preadv if transfer.request.op is IOOp.READ else os.pwritev
        done = io(fd, [view], offset)
    except OSError as exc:
        transfer.block_done(offset, nbytes, -(exc.errno or 5))
    except BaseException as exc:  # a bug must still resolve the future, never hang the caller
        transfer.block_failed(exc)
    else:
        transfer.block_done(offset, nbytes, done)

"""The I/O engine interface and what every engine shares.

An engine moves bytes between memory and files.  Callers hand it a batch of
``IORequest``s (read or write ``nbytes`` between the memory at ``address`` and
the file ``fd`` at ``offset``) and get one ``concurrent.futures.Future`` per
request, resolved with the byte count once every block of the request is done.
Those futures work from threads (``.result()``) and from asyncio
(``asyncio.wrap_future``).

Invariants every engine keeps:
- a request larger than the engine's ``block_size`` is split into blocks that
  may run concurrently and complete in any order; the request's future resolves
  once, after its last block;
- every completion is checked: an errno becomes ``SwapIOError(path, offset,
  nbytes, errno)`` naming the failing block, and a transfer of fewer bytes than
  asked is a ``SwapIOError`` with errno 0 ("short transfer");
- the memory of a request must stay valid and, for writes, unchanged until its
  future is done; the request keeps a reference to the object that owns it.

Engines: ``LibaioEngine`` (O_DIRECT, Linux AIO, ``engine_libaio``) and
``ThreadEngine`` (os.preadv/os.pwritev on a thread pool, ``engine_threads``).
``open_engine`` (``engine_select``) picks one from a ``SwapConfig``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tiermem.core.errors import InvalidArgument, SwapIOError
from tiermem.core.units import PAGE_SIZE

__all__ = [
    "DIRECT_ALIGNMENT",
    "IOEngine",
    "IOOp",
    "IORequest",
    "Memory",
    "Transfer",
    "buffer_address",
    "check_direct",
    "gather",
    "make_request",
]

DIRECT_ALIGNMENT = PAGE_SIZE
"""Alignment of address, offset and length that O_DIRECT requests must respect."""

Memory = memoryview | tuple[int, int]
"""Memory of a request: a contiguous memoryview, or (address, nbytes) of memory the caller keeps alive."""


class IOOp(Enum):
    READ = "read"
    WRITE = "write"


@dataclass(frozen=True, slots=True)
class IORequest:
    """One transfer between ``nbytes`` of memory at ``address`` and ``fd`` at ``offset``."""

    op: IOOp
    fd: int
    offset: int
    address: int
    nbytes: int
    path: str = ""
    """The file's name, for error messages."""
    keepalive: Any = None
    """The object owning the memory; referenced until the request completes."""


def buffer_address(memory: memoryview) -> int:
    """The address of a C-contiguous buffer (read-only buffers included)."""
    if not memory.c_contiguous:
        raise InvalidArgument("I/O memory must be C-contiguous")
    if memory.nbytes == 0:
        return 0
    return int(np.frombuffer(memory.cast("B") if memory.format != "B" else memory, dtype=np.uint8).ctypes.data)


def make_request(op: IOOp, fd: int, offset: int, memory: Memory, path: str = "") -> IORequest:
    """An ``IORequest`` for ``memory`` (a memoryview, or (address, nbytes))."""
    if isinstance(memory, tuple):
        address, nbytes = memory
        return IORequest(op, fd, offset, address, nbytes, path, None)
    view = memory if isinstance(memory, memoryview) else memoryview(memory)
    if op is IOOp.READ and view.readonly:
        raise InvalidArgument("a read needs writable memory, got a read-only buffer")
    return IORequest(op, fd, offset, buffer_address(view), view.nbytes, path, view)


def check_direct(request: IORequest) -> None:
    """Raise ``InvalidArgument`` unless ``request`` satisfies O_DIRECT alignment."""
    a = DIRECT_ALIGNMENT
    if request.offset % a or request.address % a or request.nbytes % a:
        raise InvalidArgument(
            f"O_DIRECT {request.op.value} of {request.path or 'fd ' + str(request.fd)} needs address, offset and "
            f"length aligned to {a} bytes; got address {request.address:#x}, offset {request.offset}, "
            f"length {request.nbytes}"
        )


@runtime_checkable
class IOEngine(Protocol):
    """What the swap store needs from an engine."""

    @property
    def name(self) -> str:
        """A short name for logs and metrics ("libaio", "threads")."""
        ...

    @property
    def direct(self) -> bool:
        """True when files must be opened with O_DIRECT (and requests aligned)."""
        ...

    @property
    def block_size(self) -> int:
        """Largest single request sent to the kernel; bigger transfers are split."""
        ...

    def submit(self, requests: Sequence[IORequest]) -> list[Future[int]]:
        """Start every request; one future per request, in order."""
        ...

    def close(self) -> None:
        """Wait for in-flight requests, then release the engine's resources."""
        ...


class Transfer:
    """The progress of one request split into blocks: a countdown and the first error.

    ``block_done`` may be called from any thread; the future resolves after the
    last block, with the first error if any block failed.
    """

    __slots__ = ("_error", "_lock", "_remaining", "future", "request")

    def __init__(self, request: IORequest, nblocks: int) -> None:
        self.request = request
        self.future: Future[int] = Future()
        self._remaining = nblocks
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        if nblocks == 0:
            self.future.set_result(0)

    def blocks(self, block_size: int) -> list[tuple[int, int, int]]:
        """(file offset, address, nbytes) of each block of the request."""
        r = self.request
        return [(r.offset + i, r.address + i, min(block_size, r.nbytes - i)) for i in range(0, r.nbytes, block_size)]

    def block_done(self, offset: int, nbytes: int, result: int) -> None:
        """Record a block's result: bytes moved (>= 0) or -errno."""
        error: BaseException | None = None
        if result < 0:
            error = SwapIOError(self.request.path, offset, nbytes, -result)
        elif result != nbytes:
            verb = "read" if self.request.op is IOOp.READ else "wrote"
            error = SwapIOError(self.request.path, offset, nbytes, 0, f"{verb} {result} of {nbytes} bytes")
        if error is not None:
            self.block_failed(error)
        else:
            self._count_down()

    def block_failed(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
        self._count_down()

    def _count_down(self) -> None:
        with self._lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            if self._error is not None:
                self.future.set_exception(self._error)
            else:
                self.future.set_result(self.request.nbytes)


def gather(futures: Sequence[Future[Any]], done: Callable[[BaseException | None], None]) -> None:
    """Call ``done(first_error_or_None)`` once, after every future in ``futures`` is done."""
    if not futures:
        done(None)
        return
    lock = threading.Lock()
    state: list[Any] = [len(futures), None]

    def one(fut: Future[Any]) -> None:
        exc = fut.exception()
        with lock:
            if exc is not None and state[1] is None:
                state[1] = exc
            state[0] -= 1
            last = state[0] == 0
        if last:
            done(state[1])

    for fut in futures:
        fut.add_done_callback(one)

"""Arenas: sealed, pre-faulted, locked shared-memory segments that can travel as an fd.

Owns one memfd and its mapping.  An arena is made once, at start, and never
resized:

- ``memfd_create(MFD_CLOEXEC | MFD_ALLOW_SEALING)``: anonymous shared memory
  with no name in any filesystem; the only ways in are the fd itself (passed
  with SCM_RIGHTS or ``pass_fds``) or the owner's ``/proc/<pid>/fd`` entry,
  which other unprivileged users cannot open;
- ``ftruncate`` to the size (rounded up to 4 KiB), then ``posix_fallocate`` so
  that the pages exist now (a short node fails here with ``HostMemoryError``,
  not later with SIGBUS on first touch);
- sealed with ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``: nobody holding
  the fd can truncate it under a mapping;
- mapped ``MAP_SHARED | MAP_POPULATE``: page tables are filled now, so the hot
  path takes no page faults (copies into fresh shared memory run at
  0.4-1 GB/s against 8-16 GB/s once touched);
- ``mlock``ed where RLIMIT_MEMLOCK allows.  When it does not, the arena works
  unlocked and records why (``mlock_refusal``); ``Arena.create`` logs one
  warning saying how to raise the limit unless the caller (the pool) reports
  for all its arenas at once.

Views handed out are slices of the mapping.  ``close()`` with views still
alive does not unmap under them: the mapping lives until the last view is
released; only new views are refused.  Raw addresses (``address``) given to C
code are the caller's to stop using before ``close()``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import resource
import weakref
from dataclasses import dataclass

import numpy as np

from tiermem.core.closing import Closing
from tiermem.core.errors import BoundsError, HostMemoryError, InvalidArgument, InvalidState
from tiermem.core.units import PAGE_SIZE, align_up, format_size

__all__ = ["Arena", "MlockRefusal", "memlock_warning"]

log = logging.getLogger(__name__)

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mlock.restype = ctypes.c_int
_libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.munlock.restype = ctypes.c_int


@dataclass(frozen=True)
class MlockRefusal:
    """Why ``mlock`` refused an arena: the errno and the RLIMIT_MEMLOCK in force."""

    nbytes: int
    errno: int
    limit_soft: int
    limit_hard: int

    @classmethod
    def now(cls, nbytes: int, err: int) -> MlockRefusal:
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        return cls(nbytes, err, soft, hard)


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else format_size(value)


def memlock_warning(refused: list[MlockRefusal], total: int, what: str = "host memory pool") -> str:
    """The one warning for arenas ``mlock`` refused: sizes, the limit, and how to raise it."""
    unlocked = sum(r.nbytes for r in refused)
    first = refused[0]
    return (
        f"{what}: mlock refused for {format_size(unlocked)} of {format_size(total)} "
        f"({errno.errorcode.get(first.errno, first.errno)}); RLIMIT_MEMLOCK is {_limit(first.limit_soft)} "
        f"(hard {_limit(first.limit_hard)}). The pool works unlocked, but the kernel may swap it out. "
        "To lock it, raise the limit: LimitMEMLOCK=infinity in the systemd unit, "
        "or `ulimit -l unlimited` in the shell that starts the process."
    )


class Arena(Closing):
    """One shared-memory segment, mapped read-write (or read-only), of a fixed size."""

    def __init__(self, fd: int, nbytes: int, *, writable: bool, name: str, populate: bool = True) -> None:
        """Map ``fd`` (which the arena then owns); use ``create`` or ``from_fd``.  ``populate`` pre-faults
        the mapping (MAP_POPULATE), which for shared memory allocates every page."""
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        self._mm: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=flags, prot=prot)
        self._fd = fd
        self._close_fd = weakref.finalize(self, os.close, fd)
        self._base: memoryview | None = memoryview(self._mm)
        probe = np.frombuffer(self._mm, dtype=np.uint8)
        self._address = int(probe.ctypes.data)
        del probe
        self._nbytes = nbytes
        self._name = name
        self._writable = writable
        self._locked = False
        self._refusal: MlockRefusal | None = None

    # ------------------------------------------------------------------ making

    @classmethod
    def create(
        cls, nbytes: int, *, name: str = "tiermem", mlock: bool = True, warn: bool = True, reserve: bool = True
    ) -> Arena:
        """A new sealed, pre-faulted arena of ``nbytes`` rounded up to 4 KiB.

        With ``mlock``, locks it where RLIMIT_MEMLOCK allows; otherwise it runs
        unlocked and, with ``warn``, logs one warning saying how to raise the limit.
        Raises ``HostMemoryError`` when the node cannot supply the memory.
        ``reserve=False`` (only without ``mlock``) neither reserves nor pre-faults:
        pages are allocated as they are first written, for memory that replaces memory the
        client already holds (a trainer's params moving into shared storage),
        where reserving it all first would double the footprint meanwhile.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument(f"arena size must be a positive number of bytes, got {nbytes!r}")
        size = align_up(nbytes, PAGE_SIZE)
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            try:
                if reserve or mlock:
                    os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise HostMemoryError(size, exc.errno or errno.ENOMEM, what=f"arena {name!r}") from None
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            arena = cls(fd, size, writable=True, name=name, populate=reserve or mlock)
        except BaseException:
            os.close(fd)
            raise
        if mlock and not arena.lock() and warn and arena.mlock_refusal is not None:
            log.warning(memlock_warning([arena.mlock_refusal], size, what=f"arena {name!r}"))
        return arena

    @classmethod
    def from_fd(cls, fd: int, nbytes: int | None = None, *, writable: bool = True, name: str = "") -> Arena:
        """Map an arena received as ``fd`` (from another process); the arena owns ``fd`` afterwards.

        ``nbytes`` defaults to the file's size; a larger ``nbytes`` is a ``BoundsError``.
        """
        size = os.fstat(fd).st_size
        if nbytes is None:
            nbytes = size
        if nbytes <= 0 or nbytes > size:
            raise BoundsError(f"cannot map {nbytes} bytes of fd {fd}: the segment holds {size} bytes")
        return cls(fd, nbytes, writable=writable, name=name or f"fd{fd}")

    def lock(self) -> bool:
        """``mlock`` the whole mapping; False (and ``mlock_refusal`` set) when the kernel refuses."""
        self._require_open()
        if self._locked:
            return True
        if _libc.mlock(self._address, self._nbytes) == 0:
            self._locked = True
            self._refusal = None
            return True
        self._refusal = MlockRefusal.now(self._nbytes, ctypes.get_errno())
        _libc.munlock(self._address, self._nbytes)  # drop whatever part did get locked
        return False

    # ------------------------------------------------------------------ facts

    @property
    def fd(self) -> int:
        self._require_open()
        return self._fd

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def address(self) -> int:
        """Base address of the mapping (page aligned), for ctypes, libaio, cudaHostRegister."""
        return self._address

    @property
    def name(self) -> str:
        return self._name

    @property
    def locked(self) -> bool:
        return self._locked

    @property
    def mlock_refusal(self) -> MlockRefusal | None:
        """Why the last ``lock()`` failed; None when locked or never asked to lock."""
        return self._refusal

    @property
    def sealed(self) -> bool:
        """True when the segment can neither shrink nor grow."""
        self._require_open()
        seals = fcntl.fcntl(self._fd, fcntl.F_GET_SEALS)
        return seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) == (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)

    @property
    def closed(self) -> bool:
        return self._base is None

    # ------------------------------------------------------------------ access

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A memoryview of ``[offset, offset + nbytes)``; ``BoundsError`` when outside the arena."""
        base = self._require_open()
        if offset < 0 or nbytes < 0 or offset + nbytes > self._nbytes:
            raise BoundsError(
                f"range [{offset}, {offset + nbytes}) is outside arena {self._name!r} of {self._nbytes} bytes"
            )
        return base[offset : offset + nbytes]

    def close(self) -> None:
        """Close the fd and unmap; with views still alive the mapping lasts until they are gone."""
        if self._base is None:
            return
        self._base.release()
        self._base = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                log.debug("arena %r closed with live views; unmapped when the last one goes", self._name)
        self._close_fd()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("locked" if self._locked else "unlocked")
        return f"Arena({self._name!r}, {format_size(self._nbytes)}, {state})"

    def _require_open(self) -> memoryview:
        if self._base is None:
            raise InvalidState(f"arena {self._name!r} is closed")
        return self._base

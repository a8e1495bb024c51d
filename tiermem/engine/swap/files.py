"""Swap files: one per swap directory and job, opened once, space preallocated.

A ``SwapFile`` owns the descriptor of ``<dir>/<job>.swap`` (mode 0600, O_DIRECT
when the engine needs it) and the ``ExtentAllocator`` over its capacity.
Capacity only grows, and only through ``grow``, which preallocates the bytes
with ``posix_fallocate`` first: a disk that cannot hold them is reported at
admission as ``SwapFullError`` (naming the directory, the bytes asked and the
bytes free), never as a failed write in the middle of training.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tiermem.core.errors import InvalidArgument, SwapFullError
from tiermem.core.units import PAGE_SIZE, format_size
from tiermem.engine.swap.extents import ExtentAllocator

__all__ = ["SwapFile", "check_job_id"]

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_job_id(job_id: str) -> str:
    if not _JOB_ID.match(job_id):
        raise InvalidArgument(
            f"job id must be 1-128 characters of [A-Za-z0-9._-] not starting with a dot, got {job_id!r}"
        )
    return job_id


@dataclass(eq=False)
class SwapFile:
    path: Path
    fd: int
    allocator: ExtentAllocator

    @classmethod
    def open(cls, directory: Path, job_id: str, *, direct: bool) -> SwapFile:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = directory / f"{check_job_id(job_id)}.swap"
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise
        return cls(path, fd, ExtentAllocator(size - size % PAGE_SIZE))

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def grow(self, capacity: int, job_id: str) -> None:
        """Preallocate the file up to ``capacity`` bytes; ``SwapFullError`` when the disk cannot hold them."""
        old = self.capacity
        if capacity <= old:
            return
        try:
            os.posix_fallocate(self.fd, old, capacity - old)
        except OSError as exc:
            os.ftruncate(self.fd, old)
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            st = os.statvfs(self.path.parent)
            available = st.f_bavail * st.f_frsize
            raise SwapFullError(
                f"swap directory {self.path.parent} cannot hold job {job_id!r}: asked for "
                f"{format_size(capacity - old)} more, {format_size(available)} free "
                f"({os.strerror(exc.errno or 0)}); free space there, add a swap directory or lower the job's size",
                requested=capacity - old,
                available=available,
                path=str(self.path.parent),
            ) from None
        self.allocator.grow(capacity)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

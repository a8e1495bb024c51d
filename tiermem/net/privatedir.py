"""The directory of a private tiermemd: made by its user, locked while in use, removed by whoever outlives it.

A client with no node daemon starts a private one (``tiermem.client.link.EmbeddedDaemon``)
in a fresh ``$TMPDIR/tiermemd-XXXXXXXX`` (``mkdtemp``: mode 0700, owned by this
user) holding its socket, config, log, state and swap files.  Where
``$TMPDIR`` is so deep that the socket's path would pass AF_UNIX's 107 bytes
(a batch scheduler's or a test runner's per-job directory), it goes in
``/tmp`` instead (``parent_dir``).  The directory
must not outlive both processes, however they end:

- the daemon is given ``--private-dir DIR`` and removes DIR when it exits; with
  ``--exit-with-parent`` it exits when its trainer dies, even by SIGKILL, so
  the daemon is the reaper that outlives the trainer;
- the client removes it after it stopped the daemon;
- when both are killed at once (SIGKILL of the process group, the OOM killer)
  neither can.  So each directory has a ``lock`` file on which the client takes
  an ``flock`` and whose descriptor the daemon inherits: the lock is held while
  either process lives.  Every new private daemon first removes this user's
  directories whose lock it can take (``sweep``): nobody alive uses them.

Files unlinked right after open were the other way: they cannot cover the
socket, which must stay bound to a path for clients to connect by name, nor a
log one can read after a failed start.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from tiermem.net.sockpath import MAX_SOCKET_PATH_BYTES

__all__ = [
    "LOCK_NAME",
    "PREFIX",
    "PRIVATE_SWAP",
    "SOCKET_NAME",
    "create",
    "is_private_dir",
    "parent_dir",
    "remove",
    "sweep",
]

log = logging.getLogger(__name__)

PREFIX = "tiermemd-"
LOCK_NAME = "lock"
SOCKET_NAME = "tiermemd.sock"
FALLBACK_PARENT = "/tmp"  # noqa: S108 (mkdtemp makes a fresh 0700 directory in it)
PRIVATE_SWAP = "a private daemon's swap goes under it"
"""What commands that measure ``parent_dir()`` as a node's swap (no node settings) say of it."""
UNLOCKED_GRACE_S = 600.0
"""A directory without a lock file (being created right now, or made before locks existed) is left alone
this long."""


def parent_dir() -> str:
    """Where private directories go: the temp dir, or ``/tmp`` when a socket under it would be longer than
    AF_UNIX allows (``mkdtemp`` adds 8 characters to ``PREFIX``)."""
    base = tempfile.gettempdir()
    socket = os.path.join(base, PREFIX + "x" * 8, SOCKET_NAME)
    return base if len(os.fsencode(socket)) <= MAX_SOCKET_PATH_BYTES else FALLBACK_PARENT


def create() -> tuple[str, int]:
    """A new private directory and the descriptor of its lock (held; ``O_CLOEXEC``: pass it to the daemon).

    The lock file is locked under another name and then renamed into place, so it is never seen unlocked: a
    ``sweep`` by another process of this user (the other ranks of a job start their daemons at the same
    moment) finds either no lock file, a directory being created (kept for ``UNLOCKED_GRACE_S``), or a held
    one.  Created as ``lock`` and locked after, the lock could be taken by such a sweep in between, which
    then removed the new directory or made this ``flock`` fail."""
    directory = tempfile.mkdtemp(prefix=PREFIX, dir=parent_dir())
    try:
        staging = os.path.join(directory, LOCK_NAME + ".new")  # no sweep opens it
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(staging, os.path.join(directory, LOCK_NAME))
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory, fd


def _ours(path: str) -> bool:
    """A real directory (not a symlink) of this user, private to it."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def remove(path: str | os.PathLike[str]) -> bool:
    """Remove a private directory and everything in it; only one that is this user's and private."""
    path = os.fspath(path)
    if not _ours(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def sweep(parent: str | None = None, *, now: float | None = None) -> list[str]:
    """Remove this user's private directories under ``parent`` (default: where ``create`` puts them) that
    nobody uses."""
    parent = parent or parent_dir()
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = [e.name for e in os.scandir(parent) if e.name.startswith(PREFIX)]
    except OSError:
        return removed
    for name in entries:
        path = os.path.join(parent, name)
        if not _ours(path):
            continue
        try:
            fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if now - os.lstat(path).st_mtime > UNLOCKED_GRACE_S and remove(path):
                    removed.append(path)
            continue
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its client or its daemon is alive
            if remove(path):
                removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d private tiermemd director(ies) nobody uses any more: %s", len(removed), removed)
    return removed


def is_private_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` looks like a directory ``create`` made (its name and its lock file)."""
    p = Path(path)
    return p.name.startswith(PREFIX) and _ours(str(p)) and (p / LOCK_NAME).exists()

"""Keeping the daemon reachable at its socket path while it runs.

A node daemon lives for weeks; its socket file can go in the meantime (an
operator's ``rm``, a cleanup of ``/run`` or ``/tmp``, a package script that
wipes the directory).  The daemon then still runs, holds its jobs' state and
answers its connected trainers, but no new trainer, ``tiermem status`` or
``doctor`` reaches it: they find no socket file and say the daemon is not
there, and trainers fall back to private daemons.

``SocketKeeper`` looks at the path every ``SOCKET_CHECK_S`` (an ``lstat``) and
compares what is there with the inode this daemon bound (``identify``):

- this daemon's socket: nothing to do;
- nothing: bind the path again (``rebind``, the start's own bind: a trusted
  directory, created again if it went too, the configured mode and group)
  and hand the new listener to the server (``Server.replace_listener``,
  which restarts the acceptor on it); a warning says so.  A bind that fails
  is logged with its reason (once per reason) and tried again each check;
- something else (another socket renamed over it, a file): it is not ours to
  remove.  An error says that new clients reach whatever is there, and
  nothing is touched; when the path is freed, the daemon binds it again.

At shutdown the socket file is removed only when the path still names this
daemon's socket (``owns``), never another daemon's that took the path over.
Socket activation (the service manager owns the path) has no keeper.
"""

from __future__ import annotations

import enum
import logging
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from tiermem.core.errors import TiermemError
from tiermemd.listener import Listener

__all__ = ["SOCKET_CHECK_S", "SocketKeeper", "SocketSeen", "identify", "look"]

log = logging.getLogger(__name__)

SOCKET_CHECK_S = 2.0
"""How often the keeper looks at the socket path."""

Identity = tuple[int, int]
"""(st_dev, st_ino) of a socket file."""


class SocketSeen(enum.Enum):
    OURS = "ours"
    GONE = "gone"
    OTHER = "other"


def identify(path: str) -> Identity | None:
    """The identity of the socket file at ``path`` (not following a symlink); None if no socket is there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def look(path: str, ours: Identity | None) -> SocketSeen:
    """What ``path`` names now, against the socket this daemon bound (``ours``)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return SocketSeen.GONE
    if ours is not None and stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == ours:
        return SocketSeen.OURS
    return SocketSeen.OTHER


@dataclass(eq=False)
class SocketKeeper:
    """See the module docstring.  ``rebind()`` binds the path again (raising ``TiermemError`` or ``OSError``
    with the reason); ``replace(listener)`` gives the server the new listener and returns False when the
    server no longer accepts (the keeper then closes it)."""

    path: str
    ours: Identity | None
    """The socket this daemon bound there (``identify``), the one it removes at shutdown."""
    rebind: Callable[[], Listener]
    replace: Callable[[Listener], bool]
    every_s: float = SOCKET_CHECK_S
    rebinds: int = field(default=0, init=False)
    """Times the path was bound again."""
    _said: str = field(default="", init=False)
    """The last problem logged (a changed one is logged again)."""
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tiermemd-socket", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def owns(self) -> bool:
        """Whether the path names this daemon's socket (the one to remove at shutdown)."""
        return look(self.path, self.ours) is SocketSeen.OURS

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check()
            except Exception:  # the keeper must outlive what it meets; the next check tries again
                log.exception("checking the socket path %s failed", self.path)

    def check(self) -> SocketSeen:
        """One look at the path, and what follows from it (see the module docstring)."""
        seen = look(self.path, self.ours)
        if seen is SocketSeen.OURS:
            self._said = ""
        elif seen is SocketSeen.OTHER:
            self._say(
                f"the socket path {self.path} no longer names this daemon's socket: something else was put "
                "there, and new trainers, status and doctor reach it instead of this daemon. It is left as it "
                "is; remove it and this daemon listens there again, or stop this daemon"
            )
        else:
            self._bind_again()
        return seen

    def _bind_again(self) -> None:
        try:
            listener = self.rebind()
        except (TiermemError, OSError) as exc:
            self._say(
                f"the socket file {self.path} is gone and cannot be bound again: {exc}; new trainers cannot "
                "reach this daemon (it tries again every "
                f"{self.every_s:g}s)"
            )
            return
        if not self.replace(listener):
            listener.close()
            return
        self.ours = identify(self.path)
        self.rebinds += 1
        self._said = ""
        log.warning(
            "the socket file %s was removed while this daemon ran (new trainers, status and doctor could not "
            "reach it); listening there again",
            self.path,
        )

    def _say(self, problem: str) -> None:
        if problem != self._said:
            log.error("%s", problem)
            self._said = problem

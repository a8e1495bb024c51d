"""The daemon's end of the control channel: the listening socket and one ``Peer`` per client.

- A socket path is removed only when nothing listens on it (a connect test),
  never when another daemon is alive.  It is bound only inside a directory
  nobody else can change, born mode 0600 and then given its configured mode
  and group through a handle on its inode, never by path (``tiermem.net.sockpath``
  says why this is race-free), so it is never more open than configured.
- ``Listener``/``Peer`` are usable from a thread per peer (blocking) or from an
  event loop (``Peer.set_blocking(False)`` plus ``loop.add_reader``; asyncio's
  stream API does not support SEQPACKET).  Frames are ``tiermem.net.frames``'.
"""

from __future__ import annotations

import contextlib
import grp
import os
import socket
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from tiermem.core.errors import (
    ConfigError,
    UnsafePathError,
)
from tiermem.core.protocol import (
    DEFAULT_MAX_FRAME,
)
from tiermem.net.frames import FrameSocket, PeerCred, open_peer_pidfd, peer_cred
from tiermem.net.sockpath import (
    SecureDir,
    Trust,
    remove_socket,
    socket_dir_mode,
    socket_path_problem,
    uid_label,
)

__all__ = [
    "LISTEN_BACKLOG",
    "Listener",
    "Peer",
    "adopt_listener",
    "bind_listener",
]

LISTEN_BACKLOG = 4096
"""Connections the kernel queues before ``accept`` (capped by ``net.core.somaxconn``)."""


# --------------------------------------------------------------------------- the daemon's side


def bind_listener(path: str | os.PathLike[str], *, mode: int = 0o660, group: str | int | None = None) -> socket.socket:
    """A listening SEQPACKET socket at ``path``, bound so that nobody else can take it over.

    The parent directory must be trusted for this process (``tiermem.net.sockpath``):
    created here with mode 0700 when missing (and opened up to
    ``socket_dir_mode(mode)`` once the socket is in place), or an existing
    directory owned by this uid (or root) that nobody else can write, with no
    symlink as its last component.  The socket file is born mode 0600
    (``fchmod`` before bind) and then given ``mode`` and ``group`` (a name or
    gid) through an ``O_PATH`` handle: no operation by path that could follow
    a symlink.  An existing socket file is removed only if nothing accepts
    connections on it; a live one raises ``ConfigError`` naming the path.
    Raises ``UnsafePathError`` for an untrusted directory and ``ConfigError``
    for every other failure.
    """
    target = os.path.abspath(os.fspath(path))
    too_long = socket_path_problem(target)
    if too_long is not None:
        raise ConfigError("server.socket", too_long)
    gid = gid_of(group) if group is not None and group != "" else None
    directory, name = os.path.split(target)
    uid = os.geteuid()
    fix = f"remove it, or create it as {uid_label(uid)} with mode 0700"
    with contextlib.suppress(OSError):
        if _shared_sticky(os.lstat(directory).st_mode):  # /tmp: not to be removed, but a place for one of our own
            own = os.path.join(directory, "tiermemd", name)
            fix = f"put the socket in a directory of its own, such as {own} (the daemon creates it with mode 0700)"
    try:
        sdir = SecureDir.open(directory, Trust.of(uid, what="this tiermemd"), create=True, fix=fix)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ConfigError("server.socket", f"cannot use {directory} as the socket directory: {why}") from None
    with sdir:
        _remove_stale(sdir, name)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            os.fchmod(sock.fileno(), 0o600)  # the file bind creates takes this mode (masked by the umask)
            sock.bind(target)
            if sdir.entry(name) is None:
                raise UnsafePathError(
                    directory, "was replaced while the socket was being bound", fix="check who can rename its parents"
                )
            sdir.set_socket_access(name, mode=mode, gid=gid)
            sock.listen(LISTEN_BACKLOG)
            sdir.open_up(socket_dir_mode(mode), gid)
        except OSError as exc:
            sock.close()
            raise ConfigError("server.socket", f"cannot listen on {target}: {exc.strerror or exc}") from None
        except BaseException:
            sock.close()
            raise
    return sock


def adopt_listener(fd: int) -> socket.socket:
    """A listening socket inherited from the service manager (socket activation)."""
    sock = socket.socket(fileno=fd)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
        sock.detach()
        raise ConfigError("server.socket", f"inherited fd {fd} is not an AF_UNIX SOCK_SEQPACKET socket")
    return sock


def _shared_sticky(mode: int) -> bool:
    """A directory every user may write with the sticky bit (``/tmp``): shared by design."""
    return stat.S_ISDIR(mode) and bool(mode & stat.S_ISVTX) and bool(mode & stat.S_IWOTH)


def gid_of(group: str | int) -> int:
    """The gid ``server.socket_group`` names (a name or a number); ``ConfigError`` when no group has it."""
    if isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError("server.socket_group", f"no group named {group!r}") from None


def _remove_stale(sdir: SecureDir, name: str) -> None:
    path = os.path.join(sdir.path, name)
    info = sdir.entry(name)
    if info is None:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ConfigError("server.socket", f"{path} exists and is not a socket; refusing to remove it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            sdir.unlink(name)
        return
    except OSError:
        pass  # a live listener of another kind, or a full backlog: not ours to remove
    finally:
        probe.close()
    raise ConfigError("server.socket", f"another process is listening on {path}; is tiermemd already running?")


@dataclass(eq=False)
class Peer:
    """One accepted client connection: its frames, its identity, and a pidfd watching its process."""

    frames: FrameSocket
    cred: PeerCred
    pidfd: int | None

    def fileno(self) -> int:
        return self.frames.fileno()

    def watch(self) -> None:
        """Open the pidfd watching the peer's process (none when it is already gone: its socket reads EOF)."""
        if self.pidfd is None:
            with contextlib.suppress(OSError):
                self.pidfd = open_peer_pidfd(self.frames.sock, self.cred.pid)

    def set_blocking(self, blocking: bool) -> None:
        self.frames.set_blocking(blocking)

    def recv(self) -> bytes:
        """One frame (fds sent by the client are closed and reported as ``ProtocolError``)."""
        data, _ = self.frames.recv()
        return data

    def send(self, data: bytes, fds: Sequence[int] = ()) -> None:
        self.frames.send(data, fds)

    def close(self) -> None:
        self.frames.close()
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None


class Listener:
    """The daemon's listening socket; ``accept`` yields ``Peer``s."""

    def __init__(self, sock: socket.socket, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.sock = sock
        self.max_frame = max_frame

    @classmethod
    def bind(
        cls, path: str, *, mode: int = 0o660, group: str | int | None = None, max_frame: int = DEFAULT_MAX_FRAME
    ) -> Listener:
        return cls(bind_listener(path, mode=mode, group=group), max_frame=max_frame)

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> Peer:
        """Accept one connection (blocking unless the listener is non-blocking)."""
        conn, cred = self.accept_socket()
        return self.peer(conn, cred)

    def accept_socket(self) -> tuple[socket.socket, PeerCred]:
        """Accept one connection and read who connected, nothing more: the cheap first half of ``accept``,
        so that a refused peer costs one accept, one getsockopt and a close."""
        conn, _ = self.sock.accept()
        try:
            return conn, peer_cred(conn)
        except BaseException:
            conn.close()
            raise

    def peer(self, conn: socket.socket, cred: PeerCred, *, watch: bool = True) -> Peer:
        """The second half of ``accept`` for an admitted connection: its frames and (``watch``) a pidfd
        watching it (``Peer.watch`` opens one later)."""
        try:
            peer = Peer(FrameSocket(conn, max_frame=self.max_frame, accept_fds=False), cred, None)
            if watch:
                peer.watch()
            return peer
        except BaseException:
            conn.close()
            raise

    def close(self, unlink: str | None = None) -> None:
        """Close; with ``unlink``, also remove the socket file at that path (through its verified directory)."""
        self.sock.close()
        if unlink:
            remove_socket(unlink)

"""The Unix-socket transport: listening and connecting, one frame per packet, fds, peer identity.

Owns the operating-system side of the control channel; the bytes it moves are
frames of ``tiermem.protocol``.  Invariants:

- Sockets are ``AF_UNIX``/``SOCK_SEQPACKET``: one ``send`` is one frame and one
  ``recv`` returns exactly one frame, so message boundaries need no parsing.
  A packet longer than ``max_frame`` is detected (``MSG_TRUNC``), discarded
  whole, and reported as a ``ProtocolError``; the channel stays framed.
- File descriptors travel only from the daemon to a client (``SCM_RIGHTS``, the
  job's window memfd at attach).  The daemon's receive path (``accept_fds=False``)
  closes every fd a client sends and reports a ``ProtocolError``.
- Unix datagram-style sockets limit one packet to the *sender's* send buffer;
  ``size_send_buffer`` raises it so a ``max_frame`` packet fits, and
  ``FrameSocket.max_send`` tells what the kernel granted.
- A socket path is removed only when nothing listens on it (a connect test),
  never when another daemon is alive.  It is bound only inside a directory
  nobody else can change, born mode 0600 and then given its configured mode
  and group through a handle on its inode, never by path (``tiermem.sockpath``
  says why this is race-free), so it is never more open than configured.
- ``connect_trusted`` connects only to a daemon of the expected uids: the
  socket's directory and file are checked before connecting, the listener's
  ``SO_PEERCRED`` uid after connecting and before a byte is sent.
- Peers are identified by the kernel (``SO_PEERCRED``: the pid, uid and gid of
  the process that connected), and watched through a pidfd, which becomes
  readable when that process exits even if forked children keep the socket open.

``Connection`` is the blocking client: one request and its reply at a time
under a lock (an optimizer thread and a hook thread may share it).  Its reply
wait is bounded by ``timeout_s`` of *silence*: while the daemon works on a
request it sends a heartbeat (a PONG with request id 0, see
``docs/protocol.md``) twice a second, and each one restarts the wait, so a long
request (a STEP paging state from NVMe, a wait for a delayed update) lives as
long as the daemon makes progress, while a stopped or wedged daemon fails
the request with ``DaemonTimeout`` after ``timeout_s`` (default
``DEFAULT_TIMEOUT_S``).

Memory per connection: the receive buffer (``max_frame``) is an anonymous
mapping, so only the pages a frame touched are resident, and they are given
back after a large frame; an idle connection costs a few KiB, not ``max_frame``.
``Listener``/``Peer`` are the daemon's side, usable from a thread per peer
(blocking) or from an event loop (``Peer.set_blocking(False)`` plus
``loop.add_reader``; asyncio's stream API does not support SEQPACKET).
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import grp
import mmap
import os
import socket
import stat
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType

from tiermem.errors import (
    ConfigError,
    ConnectionClosed,
    DaemonTimeout,
    DaemonUnavailable,
    InvalidArgument,
    ProtocolError,
    TiermemError,
    UnsafePathError,
)
from tiermem.protocol import (
    DEFAULT_MAX_FRAME,
    FLAG_FDS,
    FLAG_ONEWAY,
    MAX_REQUEST_ID,
    REPLY_TYPES,
    ErrorReply,
    Message,
    MsgType,
    Ping,
    Pong,
    decode_frame,
    decode_message,
    encode_message,
)
from tiermem.sockpath import (
    SecureDir,
    Trust,
    peer_problem,
    remove_socket,
    socket_dir_mode,
    socket_path_problem,
    uid_label,
    verify_socket,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HEARTBEAT",
    "LISTEN_BACKLOG",
    "MAX_FDS",
    "Connection",
    "FrameSocket",
    "Listener",
    "Peer",
    "PeerCred",
    "adopt_listener",
    "bind_listener",
    "connect_socket",
    "connect_trusted",
    "is_heartbeat",
    "open_peer_pidfd",
    "peer_cred",
    "set_send_timeout",
    "size_send_buffer",
]

MAX_FDS = 4
"""Most fds one frame may carry (the daemon sends one: the window memfd)."""
DEFAULT_TIMEOUT_S = 60.0
"""A client's default reply wait: the longest the daemon may stay silent (no reply, no heartbeat).

The daemon sends a heartbeat twice a second while it works on a request, so this bounds silence, not the
length of a request.  A minute of silence rides out what a busy node does to a healthy daemon (CPU
contention, a swap storm, a long garbage collection); a stopped or wedged daemon fails the training
step within a minute with an error naming it, well before a collective's timeout (torch.distributed
waits 10-30 minutes) would hide the cause."""
HEARTBEAT = encode_message(Pong(), 0)
"""What the daemon sends while a request runs: a PONG frame with request id 0 (which no request uses)."""
LISTEN_BACKLOG = 4096
"""Connections the kernel queues before ``accept`` (capped by ``net.core.somaxconn``)."""
_LARGE_FRAME = 64 * 1024  # after a frame this large, the receive buffer's pages are given back
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5+
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
_UCRED = struct.Struct("3i")
_SEND_SLACK = 512  # per-packet overhead the kernel charges against the send buffer
_ANCBUF = socket.CMSG_SPACE(MAX_FDS * 4)
# socket's flag constants are enum members; plain ints keep the per-frame path free of enum arithmetic.
_RECV_FLAGS = int(socket.MSG_TRUNC) | int(socket.MSG_CMSG_CLOEXEC)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)


# --------------------------------------------------------------------------- identity


@dataclass(frozen=True, slots=True)
class PeerCred:
    """The process on the other end, as the kernel saw it at connect()."""

    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """``SO_PEERCRED`` of a connected Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCred(pid, uid, gid)


def open_peer_pidfd(sock: socket.socket, pid: int) -> int:
    """A pidfd for the connecting process: readable once it has exited.

    Uses ``SO_PEERPIDFD`` (Linux 6.5+), which cannot name a recycled pid, and
    falls back to ``os.pidfd_open(pid)`` (Linux 5.3+).  Raises ``OSError`` when
    neither works (e.g. the process is already gone: ``ESRCH``).
    """
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD, 4)
        fd = int.from_bytes(raw, "little", signed=True)
        if fd >= 0:
            os.set_inheritable(fd, False)
            return fd
    except OSError as exc:
        if exc.errno not in (errno.ENOPROTOOPT, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    return os.pidfd_open(pid)


# --------------------------------------------------------------------------- framing


def size_send_buffer(sock: socket.socket, max_frame: int) -> int:
    """Raise the send buffer so a ``max_frame`` packet fits; return the largest packet it now allows.

    ``SO_SNDBUFFORCE`` is tried first (it passes ``net.core.wmem_max`` when the
    process has CAP_NET_ADMIN), then ``SO_SNDBUF``.  The kernel refuses a packet
    larger than the send buffer minus a small overhead with ``EMSGSIZE``.
    """
    want = max_frame + _SEND_SLACK
    for option in (_SO_SNDBUFFORCE, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, want)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= want:
                break
    granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    return min(max_frame, granted - _SEND_SLACK)


class FrameSocket:
    """A connected SEQPACKET socket that sends and receives whole frames (bytes), with fd passing.

    ``accept_fds`` False (the daemon's side): fds arriving with a frame are
    closed and reported as a ``ProtocolError``.  Not thread-safe by itself.
    """

    def __init__(self, sock: socket.socket, *, max_frame: int = DEFAULT_MAX_FRAME, accept_fds: bool) -> None:
        if sock.type != socket.SOCK_SEQPACKET:
            raise ConfigError("server.socket", f"expected a SOCK_SEQPACKET socket, got {sock.type!r}")
        self.sock = sock
        self.max_frame = max_frame
        self.accept_fds = accept_fds
        self.max_send = size_send_buffer(sock, max_frame)
        # anonymous memory: untouched pages cost nothing, so an idle connection does not hold max_frame
        self._buf = mmap.mmap(-1, max_frame, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._buf)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()
        self._view.release()
        with contextlib.suppress(BufferError):  # a caller still holding a view keeps the mapping alive
            self._buf.close()

    def send_nowait(self, data: bytes) -> bool:
        """Send one small frame only if the socket has room now (a heartbeat); False when it was not sent."""
        try:
            self.sock.send(data, socket.MSG_DONTWAIT)
        except OSError:
            return False
        return True

    def send(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """Send one frame (and ``fds`` with it).  ``ProtocolError`` when the frame exceeds what may be sent;
        ``ConnectionClosed`` when the peer is gone, or has not made room within the socket's send timeout
        (``set_send_timeout``: a peer that does not read its replies)."""
        if len(data) > self.max_send:
            raise ProtocolError(
                f"frame of {len(data)} bytes exceeds the sendable maximum {self.max_send} "
                f"(max_frame {self.max_frame}, send buffer granted by the kernel)"
            )
        try:
            if fds:
                self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                self.sock.send(data)
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                raise ProtocolError(f"frame of {len(data)} bytes refused by the kernel: {exc.strerror}") from None
            if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                raise ConnectionClosed(f"peer closed the connection: {exc.strerror}") from None
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK) or isinstance(exc, TimeoutError):
                raise ConnectionClosed("peer does not read: no room for a frame within the send timeout") from None
            raise

    def recv(self) -> tuple[bytes, list[int]]:
        """One frame and the fds that came with it.

        Raises ``ConnectionClosed`` at end of stream, ``BlockingIOError`` on a
        non-blocking socket with nothing to read, ``socket.timeout`` past the
        socket's timeout, ``ProtocolError`` for an oversize packet or for fds
        sent to a side that does not accept them (those fds are closed first).
        """
        try:
            nbytes, ancdata, msg_flags, _ = self.sock.recvmsg_into([self._view], _ANCBUF, _RECV_FLAGS)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise ConnectionClosed(f"peer closed the connection: {exc.strerror}") from None
        fds = _collect_fds(ancdata) if ancdata else []
        if nbytes == 0 and not fds:  # end of stream (an empty packet is no frame either)
            raise ConnectionClosed("peer closed the connection")
        if fds and not self.accept_fds:
            _close_all(fds)
            raise ProtocolError(f"peer sent {len(fds)} file descriptor(s); they were closed (fds are never accepted)")
        if msg_flags & _MSG_CTRUNC:
            _close_all(fds)
            raise ProtocolError(f"peer sent more than {MAX_FDS} file descriptors or other ancillary data")
        if nbytes > self.max_frame:
            _close_all(fds)
            self._give_back(self.max_frame)
            raise ProtocolError(f"oversize frame: {nbytes} bytes, max_frame is {self.max_frame}; frame discarded")
        data = bytes(self._view[:nbytes])
        self._give_back(nbytes)
        return data, fds

    def _give_back(self, nbytes: int) -> None:
        if nbytes >= _LARGE_FRAME:
            self._buf.madvise(mmap.MADV_DONTNEED)

    def set_blocking(self, blocking: bool) -> None:
        self.sock.setblocking(blocking)


def _collect_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds.extend(array.array("i", data[:usable]))
    return fds


def set_send_timeout(sock: socket.socket, timeout_s: float | None) -> None:
    """A kernel send timeout (``SO_SNDTIMEO``) on a blocking socket: a send the peer leaves no room for
    fails with EAGAIN after ``timeout_s`` (None: wait forever)."""
    micros = 0 if timeout_s is None else max(1, round(timeout_s * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", micros // 1_000_000, micros % 1_000_000))


def is_heartbeat(raw: bytes) -> bool:
    """Whether a frame read by a client is the daemon's heartbeat (not a reply)."""
    return raw == HEARTBEAT


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


# --------------------------------------------------------------------------- the daemon's side


def bind_listener(path: str | os.PathLike[str], *, mode: int = 0o660, group: str | int | None = None) -> socket.socket:
    """A listening SEQPACKET socket at ``path``, bound so that nobody else can take it over.

    The parent directory must be trusted for this process (``tiermem.sockpath``):
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
    gid = _gid_of(group) if group is not None and group != "" else None
    directory, name = os.path.split(target)
    uid = os.geteuid()
    fix = f"remove it, or create it as {uid_label(uid)} with mode 0700"
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


def _gid_of(group: str | int) -> int:
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


# --------------------------------------------------------------------------- the client's side


def connect_socket(path: str | os.PathLike[str], *, timeout_s: float | None = 5.0) -> socket.socket:
    """A SEQPACKET socket connected to ``path``; ``DaemonUnavailable`` says why not.

    The connect is blocking with a kernel send timeout (``SO_SNDTIMEO``), so when the daemon's backlog
    is full (a connection storm) the kernel queues this connect until there is room, for up to
    ``timeout_s``, instead of failing at once with EAGAIN as a non-blocking connect does."""
    where = os.fspath(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        set_send_timeout(sock, timeout_s)
        sock.connect(where)
        set_send_timeout(sock, None)
    except OSError as exc:
        sock.close()
        raise DaemonUnavailable(where, _connect_reason(exc, timeout_s)) from None
    return sock


def connect_trusted(path: str | os.PathLike[str], trust: Trust, *, timeout_s: float | None = 5.0) -> socket.socket:
    """Like ``connect_socket``, but only to a daemon of ``trust``'s uids (see ``tiermem.sockpath``).

    Before connecting: the directory and the socket file must be trusted (else
    ``UnsafePathError``; nothing is connected).  After connecting and before
    anything is sent: the listener's ``SO_PEERCRED`` uid must be one of
    ``trust``'s (else the socket is closed and ``UnsafePathError`` names the
    socket, the listener's pid and uid).
    """
    where = os.fspath(path)
    try:
        verify_socket(where, trust)
    except OSError as exc:
        raise DaemonUnavailable(where, _connect_reason(exc, timeout_s)) from None
    sock = connect_socket(where, timeout_s=timeout_s)
    try:
        cred = peer_cred(sock)
        problem = peer_problem(cred.uid, cred.pid, trust, uid_label)
    except BaseException:
        sock.close()
        raise
    if problem is not None:
        sock.close()
        raise UnsafePathError(where, problem, owner_uid=cred.uid, expected_uids=trust.uids)
    return sock


def _connect_reason(exc: OSError, timeout_s: float | None) -> str:
    if isinstance(exc, TimeoutError) or exc.errno is None:
        return f"connect timed out after {timeout_s}s (daemon overloaded or hung)"
    reasons = {
        errno.ENOENT: "no socket file (is tiermemd running? is the path right?)",
        errno.ECONNREFUSED: "connection refused: a stale socket file, no daemon is listening",
        errno.EACCES: "permission denied (the socket's mode or group does not admit this user)",
        errno.EPERM: "permission denied",
        errno.ENOTDIR: "a component of the path is not a directory",
        errno.EPROTOTYPE: "the socket is not a SOCK_SEQPACKET socket (not a tiermemd socket)",
        errno.EAGAIN: f"the daemon's connection backlog stayed full for {timeout_s}s (overloaded or hung)",
    }
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    return f"{name}: {reasons.get(exc.errno, exc.strerror)}"


def _set_recv_timeout(sock: socket.socket, timeout_s: float | None) -> None:
    """A kernel receive timeout (``SO_RCVTIMEO``) on a blocking socket: a late reply fails with EAGAIN.

    Unlike ``socket.settimeout`` this adds no poll() before every receive, which
    costs a second system call (and a wake-up) per reply on the hot path.
    """
    micros = 0 if timeout_s is None else max(1, round(timeout_s * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", micros // 1_000_000, micros % 1_000_000))


class Connection:
    """A blocking client connection: ``request(msg)`` sends one request and returns its reply.

    Thread-safe: one request/reply exchange at a time under a lock.  An error
    reply is raised as the same ``TiermemError`` type the daemon raised; an
    error with request id 0 answers the request in flight (the daemon could
    not read its id: an oversize frame, fds attached).  A lost
    or silent daemon, or a reply that breaks the protocol, closes the connection
    and raises ``DaemonUnavailable`` (or ``ProtocolError``); later calls raise
    ``DaemonUnavailable``.  A daemon silent for ``timeout_s`` during a request
    (no reply, no heartbeat) raises ``DaemonTimeout``; ``timeout_s=None`` waits forever.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        path: str = "",
        max_frame: int = DEFAULT_MAX_FRAME,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be > 0 seconds (or None: wait forever), got {timeout_s!r}")
        self.path = path
        self.timeout_s = timeout_s
        self._frames = FrameSocket(sock, max_frame=max_frame, accept_fds=True)
        self._lock = threading.Lock()
        self._next_id = 1
        self._socket_timeout: float | None = None
        self._closed_why = ""
        self._abandoned: dict[int, MsgType] = {}
        """Requests whose reply wait was interrupted (KeyboardInterrupt): their replies are still coming."""
        self.late: dict[int, Message | TiermemError] = {}
        """Replies (or errors) of abandoned requests, read before the next request went out."""
        self.last_request_id = 0

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = 5.0,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> Connection:
        """Connect to the daemon at ``path``; ``timeout_s`` bounds the daemon's silence during each reply
        wait (None: wait forever)."""
        sock = connect_socket(path, timeout_s=connect_timeout_s)
        return cls(sock, path=os.fspath(path), max_frame=max_frame, timeout_s=timeout_s)

    @property
    def closed(self) -> bool:
        return bool(self._closed_why)

    @property
    def max_send(self) -> int:
        """Largest frame this connection can send (split larger REGISTER batches)."""
        return self._frames.max_send

    def request(self, msg: Message, *, timeout_s: float | None = None) -> Message:
        """Send ``msg`` and return its reply; raises the typed error of an error reply."""
        reply, fds = self._exchange(msg, timeout_s)
        if fds:
            _close_all(fds)
            raise self._fail(ProtocolError(f"{reply.TYPE.name} reply carried {len(fds)} unexpected fd(s)"))
        return reply

    def request_fds(self, msg: Message, *, timeout_s: float | None = None) -> tuple[Message, list[int]]:
        """Like ``request``, also returning the fds sent with the reply (the caller owns them)."""
        return self._exchange(msg, timeout_s)

    def pipeline(
        self,
        requests: Iterable[Message],
        *,
        depth: int,
        on_reply: Callable[[int, Message], None] | None = None,
        timeout_s: float | None = None,
    ) -> int:
        """Send ``requests`` with up to ``depth`` of them outstanding; read their replies in order.

        Request ``i`` is drawn from ``requests`` only once the reply of request ``i - depth`` was read and
        handed to ``on_reply(i - depth, reply)``: a caller that stages request ``i``'s data in slot
        ``i % depth`` of a buffer as it yields the request never overwrites bytes the daemon may still be
        reading, and ``on_reply`` may copy a reply's data out of that slot before it is reused.  The daemon
        answers a connection's requests in order, so this costs one round trip per ``depth`` requests
        while both sides copy.  An error reply (or an error raised by ``requests`` or ``on_reply``) stops
        the drawing of requests; the replies still coming are read, so the stream stays in step, and the
        first error is raised.  The requests already sent after the failed one (at most ``depth - 1``) were
        carried out by the daemon; their replies are not handed to ``on_reply``.  Returns the number of
        requests sent."""
        if depth < 1:
            raise InvalidArgument(f"pipeline depth must be >= 1, got {depth}")
        wait_s = timeout_s if timeout_s is not None else self.timeout_s
        with self._lock:
            self._check_open()
            self._drain_abandoned()
            pending: collections.deque[tuple[int, int, Message]] = collections.deque()
            source = iter(requests)
            sent = 0
            error: Exception | None = None
            exhausted = False
            while True:
                if not exhausted and error is None and len(pending) < depth:
                    try:
                        msg = next(source)
                    except StopIteration:
                        exhausted = True
                        continue
                    except Exception as exc:
                        error = exc
                        continue
                    if REPLY_TYPES.get(msg.TYPE) is None:
                        error = ProtocolError(f"{msg.TYPE.name} is not a request that gets a reply")
                        continue
                    request_id = self._take_id()
                    self.last_request_id = request_id
                    data = encode_message(msg, request_id, max_frame=self._frames.max_frame)
                    self._abandoned[request_id] = msg.TYPE  # until its reply is in hand (see _exchange)
                    self._send(data)
                    pending.append((sent, request_id, msg))
                    sent += 1
                    continue
                if not pending:
                    break
                index, request_id, msg = pending.popleft()
                reply, fds = self._read_reply(msg, request_id, wait_s)
                if fds:
                    _close_all(fds)
                    raise self._fail(ProtocolError(f"{reply.TYPE.name} reply carried {len(fds)} unexpected fd(s)"))
                if isinstance(reply, ErrorReply):
                    error = error or reply.to_exception()
                elif on_reply is not None and error is None:
                    try:
                        on_reply(index, reply)
                    except Exception as exc:
                        error = exc
        if error is not None:
            raise error
        return sent

    def send_oneway(self, msg: Message) -> None:
        """Send a message that gets no reply (``BUCKET_READY``); its errors fail the next request."""
        if REPLY_TYPES.get(msg.TYPE, MsgType.OK) is not None:
            raise ProtocolError(f"{msg.TYPE.name} expects a reply; use request()")
        with self._lock:
            self._check_open()
            self._drain_abandoned()
            data = encode_message(msg, self._take_id(), FLAG_ONEWAY, max_frame=self._frames.max_frame)
            self._send(data)

    def close(self) -> None:
        with self._lock:
            if not self._closed_why:
                self._closed_why = "closed by the client"
                self._frames.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _exchange(self, msg: Message, timeout_s: float | None) -> tuple[Message, list[int]]:
        expected = REPLY_TYPES.get(msg.TYPE)
        if expected is None:
            raise ProtocolError(f"{msg.TYPE.name} is not a request that gets a reply")
        with self._lock:
            self._check_open()
            self._drain_abandoned()
            request_id = self._take_id()
            self.last_request_id = request_id
            data = encode_message(msg, request_id, max_frame=self._frames.max_frame)
            # counted as abandoned until its reply is in hand: an interrupt (KeyboardInterrupt) anywhere in
            # between leaves the reply to be read (or found missing) before the next request
            self._abandoned[request_id] = msg.TYPE
            self._send(data)
            reply, fds = self._read_reply(msg, request_id, timeout_s if timeout_s is not None else self.timeout_s)
        if isinstance(reply, ErrorReply):
            _close_all(fds)
            raise reply.to_exception()
        return reply, fds

    def _read_reply(self, msg: Message, request_id: int, timeout_s: float | None) -> tuple[Message, list[int]]:
        """Read the reply of ``request_id`` (an ``ErrorReply`` is returned, not raised); under the lock."""
        expected = REPLY_TYPES.get(msg.TYPE)
        raw, fds = self._recv(msg, timeout_s)
        self._abandoned.pop(request_id, None)
        try:
            frame = decode_frame(raw, max_frame=self._frames.max_frame)
            if frame.request_id != request_id and not (frame.request_id == 0 and frame.type is MsgType.ERROR):
                raise ProtocolError(f"reply for request {frame.request_id} while waiting for {request_id}")
            if frame.type is not expected and frame.type is not MsgType.ERROR:
                name = expected.name if expected is not None else "none"
                raise ProtocolError(f"{msg.TYPE.name} got a {frame.type.name} reply, expected {name}")
            if bool(fds) != bool(frame.flags & FLAG_FDS):
                raise ProtocolError(f"{frame.type.name}: {len(fds)} fd(s) received, flags {frame.flags:#x}")
            return decode_message(frame), fds
        except ProtocolError as exc:
            _close_all(fds)
            raise self._fail(exc) from None

    def take_late(self, request_id: int) -> Message | TiermemError | None:
        """The late reply of an abandoned request, once it has been read (None: not (yet) read)."""
        with self._lock:
            if request_id in self._abandoned:
                self._drain_abandoned()
            return self.late.pop(request_id, None)

    def _drain_abandoned(self) -> None:
        """Read the replies of interrupted requests and keep them in ``late``.

        A PING goes out first and frames are read until its PONG: the daemon answers a connection's
        requests in order, so every reply still coming arrives before it.  An interrupt that landed just
        after a reply was read leaves that request without one here (``take_late`` answers None), and its
        caller must find out another way what the request did."""
        if not self._abandoned:
            return
        ping_id = self._take_id()
        self._abandoned[ping_id] = MsgType.PING
        self._send(encode_message(Ping(), ping_id, max_frame=self._frames.max_frame))
        while True:
            raw, fds = self._recv_type(MsgType.PING, self.timeout_s)
            _close_all(fds)
            try:
                frame = decode_frame(raw, max_frame=self._frames.max_frame)
                reply = decode_message(frame)
            except ProtocolError as exc:
                raise self._fail(exc) from None
            if frame.request_id == ping_id:
                self._abandoned.clear()
                return
            if frame.request_id in self._abandoned and self._abandoned[frame.request_id] is not MsgType.PING:
                self.late[frame.request_id] = reply.to_exception() if isinstance(reply, ErrorReply) else reply

    def _take_id(self) -> int:
        request_id = self._next_id
        self._next_id = request_id + 1 if request_id < MAX_REQUEST_ID else 1
        return request_id

    def _check_open(self) -> None:
        if self._closed_why:
            raise DaemonUnavailable(self.path, f"connection is closed ({self._closed_why})")

    def _send(self, data: bytes) -> None:
        try:
            self._frames.send(data)
        except (ConnectionClosed, OSError) as exc:
            refusal = self._pending_refusal()
            if refusal is not None:
                raise self._fail(refusal) from None
            raise self._fail(DaemonUnavailable(self.path, f"connection lost while sending: {exc}")) from None

    def _pending_refusal(self) -> TiermemError | None:
        """The ERROR a daemon sent before closing (a refused peer), if it is waiting to be read."""
        try:
            self._frames.sock.setblocking(False)
            raw, fds = self._frames.recv()
        except (OSError, ConnectionClosed, ProtocolError):
            return None
        _close_all(fds)
        try:
            reply = decode_message(decode_frame(raw, max_frame=self._frames.max_frame))
        except ProtocolError:
            return None
        return reply.to_exception() if isinstance(reply, ErrorReply) else None

    def _recv(self, msg: Message, timeout_s: float | None) -> tuple[bytes, list[int]]:
        return self._recv_type(msg.TYPE, timeout_s)

    def _recv_type(self, msg_type: MsgType, timeout_s: float | None) -> tuple[bytes, list[int]]:
        if timeout_s != self._socket_timeout:
            _set_recv_timeout(self._frames.sock, timeout_s)
            self._socket_timeout = timeout_s
        try:
            while True:
                raw, fds = self._frames.recv()  # each heartbeat restarts the kernel's receive timeout
                if fds or not is_heartbeat(raw):
                    return raw, fds
        except (BlockingIOError, TimeoutError):
            raise self._fail(DaemonTimeout(self.path, msg_type.name, timeout_s or 0.0)) from None
        except ConnectionClosed:
            why = f"the daemon closed the connection during {msg_type.name}"
        except ProtocolError as exc:
            raise self._fail(exc) from None
        except OSError as exc:
            why = f"connection lost during {msg_type.name}: {exc.strerror}"
        raise self._fail(DaemonUnavailable(self.path, why))

    def _fail(self, exc: Exception) -> Exception:
        """Close after an error that leaves the reply stream out of step; return ``exc`` to raise."""
        if not self._closed_why:
            self._closed_why = str(exc)
            self._frames.close()
        return exc

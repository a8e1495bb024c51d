"""The control channel's framing, shared by both ends: one frame per SEQPACKET packet, fds, peer identity.

Owns the operating-system side of moving ``tiermem.core.protocol`` frames; the client's end
(``tiermem.client.connection``) and the daemon's (``tiermemd.listener``) are built on it.  Invariants:

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
- Peers are identified by the kernel (``SO_PEERCRED``: the pid, uid and gid of
  the process that connected), and watched through a pidfd, which becomes
  readable when that process exits even if forked children keep the socket open.

Memory per connection: the receive buffer (``max_frame``) is an anonymous
mapping, so only the pages a frame touched are resident, and they are given
back after a large frame; an idle connection costs a few KiB, not ``max_frame``.
"""

from __future__ import annotations

import array
import contextlib
import errno
import mmap
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from tiermem.core.errors import (
    ConfigError,
    ConnectionClosed,
    ProtocolError,
)
from tiermem.core.protocol import (
    DEFAULT_MAX_FRAME,
    Pong,
    encode_message,
)

__all__ = [
    "FrameSocket",
    "HEARTBEAT",
    "MAX_FDS",
    "PeerCred",
    "close_fds",
    "is_heartbeat",
    "open_peer_pidfd",
    "peer_cred",
    "set_send_timeout",
    "size_send_buffer",
]

MAX_FDS = 4
"""Most fds one frame may carry (the daemon sends one: the window memfd)."""
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
        self._receiving = False

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

        A ``recv`` made while another is under way on this thread (from a signal handler that interrupted it,
        perhaps after its frame arrived and before it was copied out) reads into a buffer of its own.
        """
        interrupted = self._receiving
        self._receiving = True
        try:
            return self._recv(memoryview(bytearray(self.max_frame)) if interrupted else self._view)
        finally:
            self._receiving = interrupted

    def _recv(self, view: memoryview) -> tuple[bytes, list[int]]:
        try:
            nbytes, ancdata, msg_flags, _ = self.sock.recvmsg_into([view], _ANCBUF, _RECV_FLAGS)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise ConnectionClosed(f"peer closed the connection: {exc.strerror}") from None
        fds = _collect_fds(ancdata) if ancdata else []
        if nbytes == 0 and not fds:  # end of stream (an empty packet is no frame either)
            raise ConnectionClosed("peer closed the connection")
        if fds and not self.accept_fds:
            close_fds(fds)
            raise ProtocolError(f"peer sent {len(fds)} file descriptor(s); they were closed (fds are never accepted)")
        if msg_flags & _MSG_CTRUNC:
            close_fds(fds)
            raise ProtocolError(f"peer sent more than {MAX_FDS} file descriptors or other ancillary data")
        if nbytes > self.max_frame:
            close_fds(fds)
            self._give_back(self.max_frame)
            raise ProtocolError(f"oversize frame: {nbytes} bytes, max_frame is {self.max_frame}; frame discarded")
        data = bytes(view[:nbytes])
        if view is self._view:
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


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)

"""The client's end of the control channel: connecting (to a trusted daemon only) and ``Connection``.

- ``connect_trusted`` connects only to a daemon of the expected uids: the
  socket's directory and file are checked before connecting, the listener's
  ``SO_PEERCRED`` uid after connecting and before a byte is sent.
- ``Connection`` is the blocking client: one request and its reply at a time
  under a lock (an optimizer thread and a hook thread may share it).  Its reply
  wait is bounded by ``timeout_s`` of *silence*: while the daemon works on a
  request it sends a heartbeat (a PONG with request id 0, see
  ``docs/protocol.md``) twice a second, and each one restarts the wait, so a long
  request (a STEP paging state from NVMe, a wait for a delayed update) lives as
  long as the daemon makes progress, while a stopped or wedged daemon fails
  the request with ``DaemonTimeout`` after ``timeout_s`` (default
  ``DEFAULT_TIMEOUT_S``).  Frames are ``tiermem.net.frames``'.
- A daemon that closes the connection mid-session (end of stream, EPIPE,
  ECONNRESET) fails the request, and every later one, with ``DaemonGone``,
  built by the connection's ``gone`` (``link.connect`` passes the private
  daemon's, which names the child's pid and exit status); by default it names
  the node daemon's socket.
- A message longer than a frame goes in parts (``tiermem.core.protocol.parts``):
  a request in parts no larger than the daemon's ``max_frame`` (learnt from
  ATTACH_OK) and what the kernel lets this socket send, a reply joined here.
- A signal handler that runs on a thread while that thread waits for a reply
  (Lightning's SLURM requeue handler saves a checkpoint so, mid-``step()``)
  may make requests of its own: the lock is reentrant, and the reentered call
  keeps the replies the interrupted frames are waiting for (``_early``) as it
  reads past them, then sends a PING whose PONG wakes an interrupted ``recv``
  that would otherwise wait for a reply already read.  Only a request between
  the parts of a message being sent is refused (the daemon would end that
  message).  A plain lock made such a handler wait forever for itself.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator

from tiermem.core.closing import Closing
from tiermem.core.errors import (
    ConnectionClosed,
    DaemonGone,
    DaemonTimeout,
    DaemonUnavailable,
    InvalidArgument,
    InvalidState,
    ProtocolError,
    TiermemError,
    UnsafePathError,
    error_from_wire,
)
from tiermem.core.protocol import (
    DEFAULT_MAX_FRAME,
    FLAG_FDS,
    FLAG_ONEWAY,
    MAGIC,
    MAX_REQUEST_ID,
    REPLY_TYPES,
    SUPPORTED_VERSIONS,
    AttachOk,
    Dropped,
    ErrorReply,
    Frame,
    Joiner,
    Message,
    MsgType,
    Ping,
    decode_frame,
    decode_message,
    encode_parts,
)
from tiermem.core.protocol.records import DEFAULT_MAX_INFLIGHT
from tiermem.net.frames import FrameSocket, close_fds, is_heartbeat, peer_cred, set_send_timeout
from tiermem.net.sockpath import (
    Trust,
    peer_problem,
    uid_label,
    verify_socket,
)

__all__ = [
    "Connection",
    "DEFAULT_TIMEOUT_S",
    "connect_socket",
    "connect_trusted",
]

DEFAULT_TIMEOUT_S = 60.0
"""A client's default reply wait: the longest the daemon may stay silent (no reply, no heartbeat).

The daemon sends a heartbeat twice a second while it works on a request, so this bounds silence, not the
length of a request.  A minute of silence rides out what a busy node does to a healthy daemon (CPU
contention, a swap storm, a long garbage collection); a stopped or wedged daemon fails the training
step within a minute with an error naming it, well before a collective's timeout (torch.distributed
waits 10-30 minutes) would hide the cause."""


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
    """Like ``connect_socket``, but only to a daemon of ``trust``'s uids (see ``tiermem.net.sockpath``).

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


_PEER_GONE = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN)
"""What a send or receive fails with once the daemon has closed its end (end of stream aside)."""


def _outcome(reply: Message) -> Message | TiermemError:
    """A reply as a caller takes it in: an error reply as the ``TiermemError`` it carries."""
    return reply.to_exception() if isinstance(reply, ErrorReply) else reply


def _set_recv_timeout(sock: socket.socket, timeout_s: float | None) -> None:
    """A kernel receive timeout (``SO_RCVTIMEO``) on a blocking socket: a late reply fails with EAGAIN.

    Unlike ``socket.settimeout`` this adds no poll() before every receive, which
    costs a second system call (and a wake-up) per reply on the hot path.
    """
    micros = 0 if timeout_s is None else max(1, round(timeout_s * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", micros // 1_000_000, micros % 1_000_000))


class Connection(Closing):
    """A blocking client connection: ``request(msg)`` sends one request and returns its reply.

    Thread-safe: one request/reply exchange at a time under a lock.  An error
    reply is raised as the same ``TiermemError`` type the daemon raised; an
    error with request id 0 answers the request in flight (the daemon could
    not read its id: an oversize frame, fds attached).  A lost
    or silent daemon, or a reply that breaks the protocol, closes the connection
    and raises ``DaemonUnavailable`` (or ``ProtocolError``); later calls raise
    ``DaemonUnavailable``.  A daemon silent for ``timeout_s`` during a request
    (no reply, no heartbeat) raises ``DaemonTimeout``; ``timeout_s=None`` waits forever.
    A daemon that closed the connection raises ``gone(request type)``, and so do
    later calls (default: ``DaemonGone`` naming the node daemon at ``path``).
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        path: str = "",
        max_frame: int = DEFAULT_MAX_FRAME,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        gone: Callable[[str], TiermemError] | None = None,
    ) -> None:
        """``gone(request)``: the error for a daemon that closed the connection during ``request`` (a
        message type's name), asked once, when it happens."""
        if timeout_s is not None and not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be > 0 seconds (or None: wait forever), got {timeout_s!r}")
        self.path = path
        self.timeout_s = timeout_s
        self._frames = FrameSocket(sock, max_frame=max_frame, accept_fds=True)
        self._lock = threading.RLock()
        """Reentrant for a signal handler on the thread that holds it (see the module docstring)."""
        self._next_id = 1
        self._socket_timeout: float | None = None
        self._closed_why = ""
        self._gone = gone
        self._lost: TiermemError | None = None
        """What the daemon's closing of the connection was reported as (raised again by later calls)."""
        self._abandoned: dict[int, MsgType] = {}
        """Requests whose reply wait was interrupted (KeyboardInterrupt): their replies are still coming."""
        self.late: dict[int, Message | TiermemError] = {}
        """Replies (or errors) of abandoned requests, read before the next request went out."""
        self._awaited: set[int] = set()
        """Requests whose reply a frame on the stack is waiting for (an abandoned one is not among them)."""
        self._early: dict[int, tuple[Frame, list[int]]] = {}
        """Replies of awaited requests read by a reentered call, for the frames that wait for them."""
        self._wakes: set[int] = set()
        """PINGs a reentered call sent to wake an interrupted ``recv``: their PONGs are read past."""
        self._sending_parts = False
        self.last_request_id = 0
        self.peer_max_frame = DEFAULT_MAX_FRAME
        """The daemon's frame limit (``ATTACH_OK.max_frame``; before it, the protocol's default)."""
        self.peer_max_inflight = DEFAULT_MAX_INFLIGHT
        """One-way messages the daemon takes in a row (``ATTACH_OK.max_inflight``)."""
        self._oneway_run = 0
        """One-way messages sent since the last request."""
        self._joiner = Joiner()

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
    def part_nbytes(self) -> int:
        """Largest frame this connection sends: a longer message goes in parts of this size."""
        return min(self._frames.max_send, self.peer_max_frame)

    def request(self, msg: Message, *, timeout_s: float | None = None) -> Message:
        """Send ``msg`` and return its reply; raises the typed error of an error reply."""
        reply, fds = self._exchange(msg, timeout_s)
        if fds:
            close_fds(fds)
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
        with self._held():
            self._check_open()
            self._drain_abandoned()
            pending: collections.deque[tuple[int, int, Message]] = collections.deque()
            try:
                sent, error = self._pipeline(requests, depth, pending, on_reply, wait_s)
            finally:
                for _, request_id, _ in pending:
                    self._unawait(request_id)
        if error is not None:
            raise error
        return sent

    def _pipeline(
        self,
        requests: Iterable[Message],
        depth: int,
        pending: collections.deque[tuple[int, int, Message]],
        on_reply: Callable[[int, Message], None] | None,
        wait_s: float | None,
    ) -> tuple[int, Exception | None]:
        """``pipeline``'s loop, under the lock: the requests sent, and the first error."""
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
                frames = self._encode(msg, request_id)
                self._abandoned[request_id] = msg.TYPE  # until its reply is in hand (see _exchange)
                self._awaited.add(request_id)
                pending.append((sent, request_id, msg))
                self._send(frames, msg.TYPE)
                sent += 1
                continue
            if not pending:
                break
            index, request_id, msg = pending[0]
            reply, fds = self._read_reply(msg, request_id, wait_s)
            pending.popleft()
            self._unawait(request_id)
            if fds:
                close_fds(fds)
                raise self._fail(ProtocolError(f"{reply.TYPE.name} reply carried {len(fds)} unexpected fd(s)"))
            if isinstance(reply, ErrorReply):
                error = error or reply.to_exception()
            elif on_reply is not None and error is None:
                try:
                    on_reply(index, reply)
                except Exception as exc:
                    error = exc
        return sent, error

    def send_oneway(self, msg: Message) -> None:
        """Send a message that gets no reply (``BUCKET_READY``); its errors fail the next request."""
        if REPLY_TYPES.get(msg.TYPE, MsgType.OK) is not None:
            raise ProtocolError(f"{msg.TYPE.name} expects a reply; use request()")
        with self._held():
            self._check_open()
            self._drain_abandoned()
            if self._oneway_run >= self.peer_max_inflight:
                self._ping()  # the daemon closes a connection past max_inflight one-way messages in a row
            self._send(self._encode(msg, self._take_id(), FLAG_ONEWAY), msg.TYPE)
            self._oneway_run += 1

    @property
    def reentered(self) -> bool:
        """Whether this thread is inside an exchange already: the caller runs in a signal handler (or a
        callback) that interrupted it."""
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]

    def sync(self) -> None:
        """A PING round trip: the daemon has answered every request sent before it (their replies are kept for
        whoever waits for them)."""
        with self._held():
            self._check_open()
            self._ping()

    def reply_awaited(self, request_id: int) -> Message | TiermemError | None:
        """For a call that interrupted this thread's wait for the reply of ``request_id`` (a signal handler):
        that reply (an error reply as its ``TiermemError``), read now and still kept for the frame that waits
        for it.  None: no frame waits for it, or the request had not left when the interrupt came (a PING's
        round trip tells, the daemon answering in order)."""
        with self._held():
            if request_id not in self._awaited:
                return None
            if request_id not in self._early:
                self._check_open()
                self._ping()
            early = self._early.get(request_id)
            if early is None:
                return None
            try:
                reply = decode_message(early[0])
            except ProtocolError:
                return None  # the waiting frame gets the error itself
            return _outcome(reply)

    def close(self) -> None:
        with self._lock:
            if not self._closed_why:
                self._closed_why = "closed by the client"
                self._frames.close()

    # ------------------------------------------------------------------ internals

    def _exchange(self, msg: Message, timeout_s: float | None) -> tuple[Message, list[int]]:
        expected = REPLY_TYPES.get(msg.TYPE)
        if expected is None:
            raise ProtocolError(f"{msg.TYPE.name} is not a request that gets a reply")
        with self._held():
            self._check_open()
            self._drain_abandoned()
            request_id = self._take_id()
            self.last_request_id = request_id
            reply, fds = self._round_trip(msg, request_id, timeout_s if timeout_s is not None else self.timeout_s)
            if isinstance(reply, AttachOk):
                self.peer_max_frame, self.peer_max_inflight = reply.max_frame, reply.max_inflight
        if isinstance(reply, ErrorReply):
            close_fds(fds)
            raise reply.to_exception()
        return reply, fds

    def _round_trip(self, msg: Message, request_id: int, timeout_s: float | None) -> tuple[Message, list[int]]:
        """Send request ``msg`` and read its reply (an ``ErrorReply`` is returned, not raised); under the lock."""
        frames = self._encode(msg, request_id)
        # counted as abandoned until its reply is in hand: an interrupt (KeyboardInterrupt) anywhere in
        # between leaves the reply to be read (or found missing) before the next request; one between
        # two parts of the request leaves the daemon an incomplete message, which it answers with an error
        self._abandoned[request_id] = msg.TYPE
        self._awaited.add(request_id)
        try:
            self._send(frames, msg.TYPE)
            return self._read_reply(msg, request_id, timeout_s)
        finally:
            self._unawait(request_id)

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """The lock, for one exchange.  Taken again by the thread that holds it (a signal handler that
        interrupted one of its exchanges): the call goes ahead, and on its way out wakes the frames it
        interrupted (``_wake``)."""
        reentered = self.reentered
        with self._lock:
            if reentered and self._sending_parts:
                raise InvalidState(
                    "a request to tiermemd was made (from a signal handler?) while this thread was sending it a "
                    "message in parts, and nothing can go between them; make it after the interrupted call returns"
                )
            try:
                yield
            finally:
                if reentered:
                    self._wake()

    def _wake(self) -> None:
        """After a reentered call: a frame it interrupted may be blocked in ``recv`` for a reply this call read
        and kept (``_early``), and would wait there for good; a PING's PONG wakes it, and is read past.  One
        such PING at a time: a later reentered call reads the PONG of the one before, and sends its own."""
        if self._closed_why or self._wakes or not any(request_id in self._early for request_id in self._awaited):
            return
        ping_id = self._take_id()
        self._wakes.add(ping_id)
        with contextlib.suppress(TiermemError):  # a connection that fails here fails the woken frame as well
            self._send(self._encode(Ping(), ping_id), MsgType.PING)

    def _unawait(self, request_id: int) -> None:
        """No frame waits for ``request_id``'s reply any more (it is in hand, or an interrupt unwound the frame):
        a reply a reentered call kept for it is a late one now (``take_late``)."""
        self._awaited.discard(request_id)
        early = self._early.pop(request_id, None)
        if early is None:
            return
        frame, fds = early
        close_fds(fds)
        self._abandoned.pop(request_id, None)
        with contextlib.suppress(ProtocolError):
            reply = decode_message(frame)
            self.late[request_id] = _outcome(reply)

    def _next_reply(self, want: int, msg_type: MsgType, timeout_s: float | None) -> tuple[Frame, list[int]]:
        """``want``'s reply if a reentered call kept it, else the next message that is neither a wake's PONG
        (read past) nor the reply of a request another frame waits for (kept for it in ``_early``)."""
        while True:
            early = self._early.pop(want, None)
            if early is not None:
                return early
            frame, fds = self._recv_message(msg_type, timeout_s)
            if frame.request_id in self._wakes:
                self._wakes.discard(frame.request_id)
                close_fds(fds)
            elif frame.request_id != want and frame.request_id in self._awaited:
                self._early[frame.request_id] = (frame, fds)
            else:
                return frame, fds

    def _ping(self) -> None:
        """A PING round trip under the lock, between one-way messages: the daemon's count of them in a row starts
        again.  Its reply comes after theirs are handled, so an error one of them caused is raised here."""
        reply, fds = self._round_trip(Ping(), self._take_id(), self.timeout_s)
        close_fds(fds)
        if isinstance(reply, ErrorReply):
            raise reply.to_exception()

    def _read_reply(self, msg: Message, request_id: int, timeout_s: float | None) -> tuple[Message, list[int]]:
        """Read the reply of ``request_id`` (an ``ErrorReply`` is returned, not raised); under the lock."""
        expected = REPLY_TYPES.get(msg.TYPE)
        frame, fds = self._next_reply(request_id, msg.TYPE, timeout_s)
        self._abandoned.pop(request_id, None)
        try:
            if frame.request_id != request_id and not (frame.request_id == 0 and frame.type is MsgType.ERROR):
                raise ProtocolError(f"reply for request {frame.request_id} while waiting for {request_id}")
            if frame.type is not expected and frame.type is not MsgType.ERROR:
                name = expected.name if expected is not None else "none"
                raise ProtocolError(f"{msg.TYPE.name} got a {frame.type.name} reply, expected {name}")
            return decode_message(frame), fds
        except ProtocolError as exc:
            close_fds(fds)
            raise self._fail(exc) from None

    def take_late(self, request_id: int) -> Message | TiermemError | None:
        """The late reply of an abandoned request, once it has been read (None: not (yet) read)."""
        with self._held():
            if request_id in self._abandoned:
                self._drain_abandoned()
            return self.late.pop(request_id, None)

    def _drain_abandoned(self) -> None:
        """Read the replies of interrupted requests and keep them in ``late``.

        A PING goes out first and frames are read until its PONG: the daemon answers a connection's
        requests in order, so every reply still coming arrives before it.  An interrupt that landed just
        after a reply was read leaves that request without one here (``take_late`` answers None), and its
        caller must find out another way what the request did."""
        if not self._abandoned.keys() - self._awaited:
            return  # (the requests an interrupted frame of this thread waits for are not abandoned)
        ping_id = self._take_id()
        self._abandoned[ping_id] = MsgType.PING
        self._awaited.add(ping_id)
        try:
            self._send(self._encode(Ping(), ping_id), MsgType.PING)
            while True:
                frame, fds = self._next_reply(ping_id, MsgType.PING, self.timeout_s)
                close_fds(fds)
                try:
                    reply = decode_message(frame)
                except ProtocolError as exc:
                    raise self._fail(exc) from None
                if frame.request_id == ping_id:
                    for request_id in self._abandoned.keys() - self._awaited:
                        del self._abandoned[request_id]
                    del self._abandoned[ping_id]
                    return
                if frame.request_id in self._abandoned and self._abandoned[frame.request_id] is not MsgType.PING:
                    self.late[frame.request_id] = _outcome(reply)
        finally:
            self._awaited.discard(ping_id)

    def _take_id(self) -> int:
        request_id = self._next_id
        self._next_id = request_id + 1 if request_id < MAX_REQUEST_ID else 1
        return request_id

    def _check_open(self) -> None:
        if self._lost is not None:
            raise error_from_wire(self._lost.to_wire())  # a new one of the same type: the first keeps its traceback
        if self._closed_why:
            raise DaemonUnavailable(self.path, f"connection is closed ({self._closed_why})")

    def _encode(self, msg: Message, request_id: int, flags: int = 0) -> list[bytes]:
        """``msg``'s frame, or its parts (``part_nbytes``)."""
        return encode_parts(msg, request_id, flags, part_nbytes=self.part_nbytes)

    def _send(self, frames: list[bytes], msg_type: MsgType) -> None:
        """Send a message's frames in a row (nothing else goes between them: the caller holds the lock)."""
        if REPLY_TYPES.get(msg_type) is not None:
            self._oneway_run = 0  # a request: the daemon counts one-way messages in a row from zero again
        self._sending_parts = len(frames) > 1
        try:
            for data in frames:
                self._frames.send(data)
        except (ConnectionClosed, OSError) as exc:
            refusal = self._pending_refusal()
            if refusal is not None:
                raise self._fail(refusal) from None
            if isinstance(exc, ConnectionClosed) or exc.errno in _PEER_GONE:
                raise self._lose(msg_type) from None
            raise self._fail(DaemonUnavailable(self.path, f"connection lost while sending: {exc}")) from None
        finally:
            self._sending_parts = False

    def _lose(self, msg_type: MsgType) -> Exception:
        """The daemon closed the connection during a ``msg_type`` request: close, and return what to raise."""
        lost = self._gone(msg_type.name) if self._gone is not None else DaemonGone(self.path, msg_type.name)
        self._lost = lost
        return self._fail(lost)

    def _other_version(self, version: int) -> str:
        """What a reply in another protocol version means: the daemon and this client are different releases."""
        from tiermem import __version__

        ours = ", ".join(map(str, SUPPORTED_VERSIONS))
        return (
            f"tiermemd at {self.path or 'the socket'} speaks protocol version {version}, this client (tiermem "
            f"{__version__}) version {ours}: they are different tiermem releases; install one for the node "
            "service and the trainers"
        )

    def _pending_refusal(self) -> TiermemError | None:
        """The ERROR a daemon sent before closing (a refused peer), if it is waiting to be read."""
        try:
            self._frames.sock.setblocking(False)
            raw, fds = self._frames.recv()
        except (OSError, ConnectionClosed, ProtocolError):
            return None
        close_fds(fds)
        try:
            reply = decode_message(decode_frame(raw, max_frame=self._frames.max_frame))
        except ProtocolError:
            return None
        return reply.to_exception() if isinstance(reply, ErrorReply) else None

    def _recv_message(self, msg_type: MsgType, timeout_s: float | None) -> tuple[Frame, list[int]]:
        """The next whole message from the daemon (its parts joined), with the fds of its last part.  Each
        part restarts the ``timeout_s`` wait, as a heartbeat does."""
        while True:
            raw, fds = self._recv_type(msg_type, timeout_s)
            try:
                if raw[:2] == MAGIC and len(raw) > 2 and raw[2] not in SUPPORTED_VERSIONS:
                    raise ProtocolError(self._other_version(raw[2]))
                frame = decode_frame(raw, max_frame=self._frames.max_frame)
                if bool(fds) != bool(frame.flags & FLAG_FDS):
                    raise ProtocolError(f"{frame.type.name}: {len(fds)} fd(s) received, flags {frame.flags:#x}")
                for got in self._joiner.add(frame):
                    if isinstance(got, Dropped):  # the daemon sends a message's parts in a row: out of step
                        raise got.error
                    return got, fds
            except ProtocolError as exc:
                close_fds(fds)
                raise self._fail(exc) from None

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
            raise self._lose(msg_type) from None
        except ProtocolError as exc:
            raise self._fail(exc) from None
        except OSError as exc:
            if exc.errno in _PEER_GONE:
                raise self._lose(msg_type) from None
            why = f"connection lost during {msg_type.name}: {exc.strerror}"
            raise self._fail(DaemonUnavailable(self.path, why)) from None

    def _fail(self, exc: Exception) -> Exception:
        """Close after an error that leaves the reply stream out of step; return ``exc`` to raise."""
        if not self._closed_why:
            self._closed_why = str(exc)
            self._frames.close()
        return exc

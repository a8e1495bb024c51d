"""The daemon's socket side: accepting, admitting and serving connections.

Threading model (chosen by measurement, see ``benchmarks/bench_ipc.py``): one
thread per connection doing blocking ``recv`` -> handle -> ``send``.  A control
round trip then costs what a blocking Unix-socket echo costs (asyncio's
default loop adds ~4x to every request), connections are few (one per training
process), and a handler that waits for a step blocks only its own client.  CPU
work never runs on these threads: it goes to the ``CpuScheduler``.

- The accept thread checks each peer's credentials (``SO_PEERCRED``) against the
  allowed uids/gids and the per-uid connection limit before serving it; a
  refused peer gets an ``AuthError``/``AdmissionError`` reply and is closed.
- The watcher thread polls every session's pidfd: when a client process exits
  (even if a forked DataLoader worker still holds its socket), the session is
  shut down, which wakes its thread with end-of-stream, and the service aborts
  its queued work and releases its pins.
- Error boundary (``Session.serve``): a ``TiermemError`` from a handler becomes
  an error reply and the session goes on; a frame that cannot be decoded gets
  an error reply, and when even its header is unreadable (too short, bad magic,
  a protocol version we do not speak) the session is closed after it; any other
  exception is logged with its traceback and closes that session only.  Error
  replies are clipped to what the wire allows, so a hostile request cannot
  provoke an error frame the client could not decode.
- Drain: once ``Server.draining`` is set, a request that arrives gets an
  ``AdmissionError`` instead of being started, so the service waits only for
  the requests already running (``Session.busy``) before it frees memory.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import os
import pwd
import select
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tiermem.config import ServerConfig
from tiermem.errors import AdmissionError, AuthError, ConnectionClosed, ProtocolError, TiermemError
from tiermem.protocol import (
    FLAG_FDS,
    FLAG_ONEWAY,
    HEADER_NBYTES,
    MAGIC,
    SUPPORTED_VERSIONS,
    ErrorReply,
    Message,
    decode_frame,
    decode_message,
    encode_message,
    peek_request_id,
)
from tiermem.transport import Listener, Peer, PeerCred
from tiermemd.serverstats import DisconnectReason, ServerCounters, ServerStats

__all__ = ["MAX_ERROR_CHARS", "Reply", "Server", "Session", "SessionState", "error_frame", "header_readable"]

log = logging.getLogger(__name__)

_REFUSAL_LINGER_S = 2.0
MAX_ERROR_CHARS = 16384
"""The wire limit on ``ERROR.message`` (docs/protocol.md, Limits); longer ones are clipped."""


class SessionState(enum.Enum):
    OPEN = "open"
    ATTACHED = "attached"
    CLOSED = "closed"


@dataclass
class Reply:
    """What a handler returns: a message, and fds to send with it (the window memfd at attach)."""

    message: Message
    fds: tuple[int, ...] = ()


class Handlers(Protocol):
    def dispatch(self, session: Session, msg: Message) -> Reply | None: ...
    def session_closed(self, session: Session, why: str) -> None: ...


@dataclass(eq=False)
class Session:
    """One client connection and what it is bound to."""

    id: int
    peer: Peer
    state: SessionState = SessionState.OPEN
    job_id: str | None = None
    rank: int | None = None
    deferred_error: TiermemError | None = None
    """An error raised by a one-way message, reported on the next request."""
    started: float = field(default_factory=time.monotonic)
    requests: int = 0
    busy: bool = False
    """True while a request is being handled (a drain waits for it)."""
    max_oneway: int = 4096
    """One-way messages (BUCKET_READY) allowed between two requests (``server.max_inflight``)."""
    oneway_run: int = 0
    close_reason: str = ""
    disconnect: DisconnectReason | None = None
    """Why the session ended (set with ``close_reason``; counted by the server)."""
    counters: ServerCounters | None = None
    """Where the session counts the protocol and authentication errors it answers."""

    @property
    def cred(self) -> PeerCred:
        return self.peer.cred

    def transition(self, to: SessionState) -> None:
        allowed = {
            SessionState.OPEN: {SessionState.ATTACHED, SessionState.CLOSED},
            SessionState.ATTACHED: {SessionState.CLOSED, SessionState.OPEN},
            SessionState.CLOSED: set(),
        }
        if to not in allowed[self.state]:
            raise ProtocolError(f"session cannot go from {self.state.value} to {to.value}")
        self.state = to

    def shutdown(self, why: str, reason: DisconnectReason = DisconnectReason.SHUTDOWN) -> None:
        """Wake the session's thread with end-of-stream (called from other threads)."""
        if not self.close_reason:
            self.close_reason = why
            self.disconnect = reason
        with contextlib.suppress(OSError):
            self.peer.frames.sock.shutdown(socket.SHUT_RDWR)

    def serve(self, handlers: Handlers, draining: Callable[[], bool] = lambda: False) -> None:
        """The session thread: receive, dispatch, reply, until the peer goes away.

        ``draining()`` true: requests are refused (``AdmissionError``) instead of started.
        """
        why = "client closed the connection"
        reason = DisconnectReason.CLIENT_CLOSED
        try:
            while True:
                try:
                    data = self.peer.recv()
                except ConnectionClosed:
                    break
                except ProtocolError as exc:  # oversize frame or fds sent: report, keep the channel
                    self._send_error(0, exc)
                    continue
                self.requests += 1
                self.busy = True  # before the drain check: a drain either sees us busy or we see it
                try:
                    if draining():
                        self._refuse_draining(data)
                    elif not self._handle(handlers, data):
                        why = "closed after a frame that could not be parsed"
                        reason = DisconnectReason.PROTOCOL_ERROR
                        break
                finally:
                    self.busy = False
        except ConnectionClosed:
            why = "client went away while a reply was sent"
            reason = DisconnectReason.SEND_FAILED
        except Exception:
            log.exception("session %d (pid %d, uid %d) failed; closing it", self.id, self.cred.pid, self.cred.uid)
            why = "internal error (logged)"
            reason = DisconnectReason.INTERNAL_ERROR
        finally:
            self.state = SessionState.CLOSED
            self.disconnect = self.disconnect or reason
            handlers.session_closed(self, self.close_reason or why)

    def _refuse_draining(self, data: bytes) -> None:
        try:
            frame = decode_frame(data, max_frame=self.peer.frames.max_frame)
        except ProtocolError:
            return
        if not frame.flags & FLAG_ONEWAY:
            self._send_error(frame.request_id, AdmissionError("tiermemd is shutting down; the request was not started"))

    def _handle(self, handlers: Handlers, data: bytes) -> bool:
        """Decode, dispatch and answer one frame; False when the session must end (unreadable header)."""
        try:
            frame = decode_frame(data, max_frame=self.peer.frames.max_frame)
        except ProtocolError as exc:
            self._send_error(peek_request_id(data) or 0, exc)
            return header_readable(data)
        oneway = bool(frame.flags & FLAG_ONEWAY)
        self.oneway_run = self.oneway_run + 1 if oneway else 0
        if self.oneway_run > self.max_oneway:
            self._send_error(
                0,
                AdmissionError(
                    f"more than {self.max_oneway} one-way messages without a request (server.max_inflight); "
                    "closing the connection"
                ),
            )
            return False
        try:
            msg = decode_message(frame)
            if not oneway and self.deferred_error is not None:
                err, self.deferred_error = self.deferred_error, None
                raise err
            reply = handlers.dispatch(self, msg)
        except TiermemError as exc:
            if oneway:
                self.deferred_error = self.deferred_error or exc
            else:
                self._send_error(frame.request_id, exc)
            return True
        if oneway or reply is None:
            return True
        flags = FLAG_FDS if reply.fds else 0
        out = encode_message(reply.message, frame.request_id, flags, max_frame=self.peer.frames.max_frame)
        self.peer.send(out, reply.fds)
        return True

    def _send_error(self, request_id: int, exc: TiermemError) -> None:
        if self.counters is not None:
            self.counters.error_reply(exc)
        self.peer.send(error_frame(request_id, exc, self.peer.frames.max_frame))


def header_readable(data: bytes) -> bool:
    """Whether a frame's header can be trusted enough to keep reading the stream after it."""
    return len(data) >= HEADER_NBYTES and data[:2] == MAGIC and data[2] in SUPPORTED_VERSIONS


def error_frame(request_id: int, exc: TiermemError, max_frame: int) -> bytes:
    """An ERROR frame for ``exc`` that the peer can decode: the message clipped to the wire limit, and
    cut further (facts dropped) when the frame would exceed ``max_frame``."""
    reply = ErrorReply.from_exception(exc)
    if len(reply.message) > MAX_ERROR_CHARS:
        reply = ErrorReply(reply.kind, reply.message[: MAX_ERROR_CHARS - 3] + "...", reply.fields)
    try:
        return encode_message(reply, request_id, 0, max_frame=max_frame)
    except ProtocolError:
        # JSON may spend 6 bytes per character; max_frame >= 4 KiB leaves room for this much
        short = reply.message[: max_frame // 8 - 3] + "..."
        return encode_message(ErrorReply(reply.kind, short, ()), request_id, 0, max_frame=max_frame)


class Server:
    """Accepts connections on ``listener`` and runs a ``Session`` thread for each."""

    def __init__(self, listener: Listener, handlers: Handlers, config: ServerConfig) -> None:
        self.listener = listener
        self.handlers = handlers
        self.config = config
        self._ids = itertools.count(1)
        self._sessions: dict[int, Session] = {}
        self._per_uid: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._accepting = True
        self.draining = False
        """Set by the service when it drains: sessions refuse new requests."""
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._own_uid = os.getuid()
        self._threads: list[threading.Thread] = []
        self.on_client_exit: Callable[[Session], None] = lambda _session: None
        """Called from the watcher thread when a client's process exits (abort its queued work)."""
        self.counters = ServerCounters()

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        for target, name in ((self._accept_loop, "tiermemd-accept"), (self._watch_loop, "tiermemd-pidfds")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop_accepting(self) -> None:
        self._accepting = False
        with contextlib.suppress(OSError):
            self.listener.sock.shutdown(socket.SHUT_RDWR)

    def close_sessions(self, why: str, timeout_s: float = 5.0) -> None:
        for session in self.sessions():
            session.shutdown(why)
        deadline = time.monotonic() + timeout_s
        while self.sessions() and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.stop_accepting()
        os.write(self._wake_w, b"x")
        self.listener.close()

    def session_alive(self, session_id: int) -> bool:
        """The session exists and its client has not gone (a dead one may still be finishing a request)."""
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None or session.close_reason:
            return False
        pidfd = session.peer.pidfd
        if pidfd is None:
            return True
        try:  # the watcher may not have seen the exit yet: ask the pidfd itself
            readable, _, _ = select.select([pidfd], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def stats(self) -> ServerStats:
        with self._lock:
            open_sessions = len(self._sessions)
        return self.counters.stats(open_sessions)

    # ----------------------------------------------------------------- admission

    def allowed(self, cred: PeerCred) -> bool:
        if cred.uid in (0, self._own_uid) or cred.uid in self.config.allowed_uids:
            return True
        if not self.config.allowed_gids:
            return False
        groups = {cred.gid}
        with contextlib.suppress(KeyError):
            entry = pwd.getpwuid(cred.uid)
            groups.update(os.getgrouplist(entry.pw_name, entry.pw_gid))
        return bool(groups & set(self.config.allowed_gids))

    def _refuse(self, peer: Peer, exc: TiermemError) -> None:
        """Send the refusal, then read and drop what the client sends until it hangs up (at most
        ``_REFUSAL_LINGER_S``): closing with its request unread would reset the connection, and the
        client would lose the frame that says why."""
        self.counters.refused(exc)
        with contextlib.suppress(Exception):
            peer.send(error_frame(0, exc, peer.frames.max_frame))
            peer.frames.sock.shutdown(socket.SHUT_WR)

        def linger() -> None:
            deadline = time.monotonic() + _REFUSAL_LINGER_S
            with contextlib.suppress(Exception):
                peer.frames.sock.settimeout(0.1)
                while time.monotonic() < deadline:
                    try:
                        peer.frames.recv()
                    except (TimeoutError, ProtocolError):
                        continue
            peer.close()

        threading.Thread(target=linger, name="tiermemd-refuse", daemon=True).start()

    def _accept_loop(self) -> None:
        while self._accepting:
            try:
                peer = self.listener.accept()
            except OSError as exc:
                if not self._accepting:
                    return
                log.warning("accept failed: %s", exc)
                time.sleep(0.05)
                continue
            cred = peer.cred
            if not self.allowed(cred):
                log.warning("refused connection from pid %d uid %d gid %d: not allowed", cred.pid, cred.uid, cred.gid)
                self._refuse(
                    peer,
                    AuthError(f"uid {cred.uid} is not allowed to use this tiermemd (server.allowed_uids/allowed_gids)"),
                )
                continue
            with self._lock:
                if self._per_uid[cred.uid] >= self.config.max_connections_per_uid:
                    over = True
                else:
                    over = False
                    self._per_uid[cred.uid] += 1
                    session = Session(
                        next(self._ids), peer, max_oneway=self.config.max_inflight, counters=self.counters
                    )
                    self._sessions[session.id] = session
            if over:
                self._refuse(
                    peer,
                    AdmissionError(
                        f"uid {cred.uid} already holds {self.config.max_connections_per_uid} connections "
                        "(server.max_connections_per_uid)"
                    ),
                )
                continue
            if peer.pidfd is not None:
                self._selector.register(peer.pidfd, selectors.EVENT_READ, session)
                os.write(self._wake_w, b"x")
            thread = threading.Thread(
                target=self._serve, args=(session,), name=f"tiermemd-session-{session.id}", daemon=True
            )
            thread.start()

    def _serve(self, session: Session) -> None:
        self.counters.accepted()
        try:
            session.serve(self.handlers, lambda: self.draining)
        finally:
            self.counters.disconnected(session.disconnect or DisconnectReason.CLIENT_CLOSED)
            self.forget_pidfd(session)
            session.peer.close()
            with self._lock:
                self._sessions.pop(session.id, None)
                self._per_uid[session.cred.uid] -= 1
                if self._per_uid[session.cred.uid] <= 0:
                    del self._per_uid[session.cred.uid]

    def _watch_loop(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    if not self._accepting and not self.sessions():
                        return
                    continue
                session: Session = key.data
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(key.fd)
                log.info("client pid %d of session %d exited", session.cred.pid, session.id)
                session.shutdown(f"client process {session.cred.pid} exited", DisconnectReason.CLIENT_EXITED)
                try:
                    self.on_client_exit(session)
                except Exception:
                    log.exception("aborting the work of session %d failed", session.id)

    def forget_pidfd(self, session: Session) -> None:
        if session.peer.pidfd is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(session.peer.pidfd)

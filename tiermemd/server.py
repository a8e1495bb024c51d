"""The daemon's socket side: accepting, admitting and serving connections.

Threading model (chosen by measurement, see ``benchmarks/bench_ipc.py``): one
thread per connection that talks, doing blocking ``recv`` -> handle -> ``send``.  A control
round trip then costs what a blocking Unix-socket echo costs (asyncio's
default loop adds ~4x to every request), connections are few (one per training
process), and a handler that waits for a step blocks only its own client.  CPU
work never runs on these threads: it goes to the ``CpuScheduler``.

- With ``server.accept_process`` (the node daemon's default), a process of its own,
  ``tiermemd.acceptor``, does the checks below for refused and silent peers and
  passes only connections that talk, over a SEQPACKET pair (``SCM_RIGHTS``); the
  accept thread then reads that channel, counts the refusals it reports and
  admits what it passes (``_channel_loop``), so a storm never takes the lock
  the session threads need.  Without it:
- The accept thread checks each peer's credentials (``SO_PEERCRED``) against the
  allowed uids/gids and the per-uid connection limit before serving it; a
  refused peer gets an ``AuthError``/``AdmissionError`` reply and is closed.
  A refused peer costs no thread: its socket lingers (read and dropped, so the
  refusal is not lost to a reset) in the watcher's selector for at most
  ``REFUSAL_LINGER_S``, at most ``MAX_LINGERING`` at a time; past
  ``EXPLAINED_REFUSALS_PER_S`` refusals of one uid a second, a refusal is a
  close, so a storm costs the accept thread as little as possible; refusals
  are logged once per uid and reason, then summarised with counts every
  ``REFUSAL_LOG_EVERY_S``.  An admitted peer costs no thread until it
  sends its first frame: its socket waits in the watcher's selector, and a
  peer that hangs up before a word (a storm) is ended there.  A peer that
  talks costs a thread (its stack is virtual memory; a few pages are
  resident) and a receive buffer of anonymous memory that is resident only
  where a frame touched it (``tiermem.net.frames``), so a storm of connections is bounded by
  ``server.max_connections_per_uid`` per uid (a session whose peer already
  hung up, its thread not yet ended, does not count) and costs little per connection
  (``benchmarks/bench_connections.py``).  The listen backlog is
  ``tiermemd.listener.LISTEN_BACKLOG`` and clients' connects wait for room in it.
- The watcher thread polls every talking session's pidfd: when a client process exits
  (even if a forked DataLoader worker still holds its socket), the session is
  shut down, which wakes its thread with end-of-stream, and the service aborts
  its queued work and releases its pins.  It wakes at least every
  ``HEARTBEAT_S`` and sends each session busy in a request for longer a
  heartbeat (``tiermem.net.frames.HEARTBEAT``, never blocking), unless that session or
  a shared worker thread is wedged (``tiermemd.health``): clients bound the
  daemon's silence, not the length of a request.
- Replies are sent with a send timeout (``server.send_timeout_s``): a client
  that never reads its replies cannot pin its session thread; the session is
  closed instead.  A client that waits for each reply (``Connection``) never
  has more than one queued, so the timeout never touches it.
- Error boundary (``Session.serve``): a ``TiermemError`` from a handler becomes
  an error reply and the session goes on; a frame that cannot be decoded gets
  an error reply, and when even its header is unreadable (too short, bad magic,
  a protocol version we do not speak) the session is closed after it; any other
  exception is logged with its traceback and closes that session only.  Error
  replies are clipped to what the wire allows, so a hostile request cannot
  provoke an error frame the client could not decode.
- Drain: once ``Server.draining`` is set, a request that arrives gets a
  ``DaemonStopping`` instead of being started, so the service waits only for
  the requests already running (``Session.busy``, which ends before the
  reply is sent: a reply stuck on a client that does not read delays nothing)
  before it frees memory.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import os
import select
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tiermem.core.config import ServerConfig
from tiermem.core.errors import AdmissionError, ConnectionClosed, DaemonStopping, ProtocolError, TiermemError
from tiermem.core.protocol import (
    DEFAULT_MAX_FRAME,
    FLAG_FDS,
    FLAG_MORE,
    FLAG_ONEWAY,
    HEADER_NBYTES,
    MAGIC,
    SUPPORTED_VERSIONS,
    Budget,
    Dropped,
    Frame,
    Joiner,
    Message,
    decode_frame,
    decode_message,
    encode_parts,
    peek_request_id,
)
from tiermem.net.frames import HEARTBEAT, PeerCred, peer_cred, set_send_timeout
from tiermemd import health
from tiermemd.admission import (
    ACCEPTOR_SILENCE_S,
    CONN,
    COUNTS,
    EXPLAINED_REFUSALS_PER_S,
    HELD,
    MAX_LINGERING,
    REFUSAL_LINGER_S,
    REFUSAL_LOG_EVERY_S,
    Policy,
    RefusalLog,
    TokenBuckets,
    error_frame,
    not_allowed,
    over_limit,
    send_refusal,
    uid_allowed,
)
from tiermemd.health import REGISTRY, Health
from tiermemd.listener import Listener, Peer
from tiermemd.serverstats import DisconnectReason, ServerCounters, ServerStats

__all__ = ["Handlers", "Reply", "Server", "Session", "SessionState", "header_readable"]

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
"""Heartbeat period to clients whose request runs longer than this; the watcher's longest sleep.  A client
therefore hears from a healthy daemon at least every ~1 s (``tiermem.client.connection.DEFAULT_TIMEOUT_S`` is 60 s)."""


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
    joiner: Joiner = field(default_factory=Joiner)
    """Joins the parts of a message longer than a frame (up to ``server.max_message`` bytes)."""
    close_reason: str = ""
    disconnect: DisconnectReason | None = None
    """Why the session ended (set with ``close_reason``; counted by the server)."""
    counters: ServerCounters | None = None
    """Where the session counts the protocol and authentication errors it answers."""
    beacon: health.Beacon | None = None
    """The progress of this session's thread (``tiermemd.health``): busy while it handles a request."""
    send_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """Orders a heartbeat (sent from the watcher thread) with the socket's close."""
    peer_closed: bool = False

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

    def heartbeat(self) -> bool:
        """Tell the client its request is still being worked on; never blocks.  False: not sent."""
        with self.send_lock:
            return not self.peer_closed and self.peer.frames.send_nowait(HEARTBEAT)

    def close_peer(self) -> None:
        with self.send_lock:
            self.peer_closed = True
            self.peer.close()

    def serve(self, handlers: Handlers, draining: Callable[[], bool] = lambda: False) -> None:
        """The session thread: receive, dispatch, reply, until the peer goes away.

        ``draining()`` true: requests are refused (``DaemonStopping``) instead of started.
        """
        why = "client closed the connection"
        reason = DisconnectReason.CLIENT_CLOSED
        health.bind(self.beacon)
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
                if self.beacon is not None:
                    self.beacon.enter()
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
                    if self.beacon is not None:
                        self.beacon.leave()
        except ConnectionClosed as exc:
            why = f"the reply could not be delivered: {exc}"
            reason = DisconnectReason.SEND_FAILED
        except Exception:
            log.exception("session %d (pid %d, uid %d) failed; closing it", self.id, self.cred.pid, self.cred.uid)
            why = "internal error (logged)"
            reason = DisconnectReason.INTERNAL_ERROR
        finally:
            self.end(handlers, why, reason)

    def end(self, handlers: Handlers, why: str, reason: DisconnectReason) -> None:
        """The session is over: its state, why, and the handlers told (once, from the thread that ends it)."""
        self.state = SessionState.CLOSED
        self.disconnect = self.disconnect or reason
        self.joiner.clear()  # an incomplete message's bytes go back to its user's budget
        handlers.session_closed(self, self.close_reason or why)

    def _refuse_draining(self, data: bytes) -> None:
        try:
            frame = decode_frame(data, max_frame=self.peer.frames.max_frame)
        except ProtocolError:
            return
        if not frame.flags & (FLAG_ONEWAY | FLAG_MORE):  # a request's last part: refuse it once
            self._send_error(frame.request_id, DaemonStopping(self.socket_path(), frame.type.name))

    def socket_path(self) -> str:
        """The path of the socket this session's client connected to (as the daemon bound it)."""
        try:
            name = self.peer.frames.sock.getsockname()
        except OSError:
            return "?"
        return name.decode(errors="replace") if isinstance(name, bytes) else str(name) or "?"

    def _handle(self, handlers: Handlers, data: bytes) -> bool:
        """Decode one frame; dispatch and answer what it completes (a message, or one in parts); False when the
        session must end (an unreadable header, too many one-way messages)."""
        try:
            frame = decode_frame(data, max_frame=self.peer.frames.max_frame)
        except ProtocolError as exc:
            self._send_error(peek_request_id(data) or 0, exc)
            return header_readable(data)
        for got in self.joiner.add(frame):
            if isinstance(got, Dropped):
                if got.oneway:
                    self.deferred_error = self.deferred_error or got.error
                else:
                    self._send_error(got.request_id, got.error)
            elif not self._handle_message(handlers, got):
                return False
        return True

    def _handle_message(self, handlers: Handlers, frame: Frame) -> bool:
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
        # a client receives frames of up to the protocol's default max_frame: a longer reply goes in parts
        parts = encode_parts(
            reply.message, frame.request_id, flags, part_nbytes=min(self.peer.frames.max_send, DEFAULT_MAX_FRAME)
        )
        self.busy = False  # the work is done: a drain need not wait for a client that does not read
        for i, out in enumerate(parts, 1):
            self.peer.send(out, reply.fds if i == len(parts) else ())
        return True

    def _send_error(self, request_id: int, exc: TiermemError) -> None:
        self.busy = False
        if self.counters is not None:
            self.counters.error_reply(exc)
        self.peer.send(error_frame(request_id, exc, self.peer.frames.max_frame))


class UserBudget(Budget):
    """A ``Budget`` shared by the session threads of one uid."""

    def __init__(self, limit: int, owner: str) -> None:
        super().__init__(limit, owner)
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        with self._lock:
            return super().take(nbytes)

    def give(self, nbytes: int) -> None:
        with self._lock:
            super().give(nbytes)


def header_readable(data: bytes) -> bool:
    """Whether a frame's header can be trusted enough to keep reading the stream after it."""
    return len(data) >= HEADER_NBYTES and data[:2] == MAGIC and data[2] in SUPPORTED_VERSIONS


@dataclass(frozen=True)
class _Silent:
    """In the watcher's selector: an admitted connection that has not sent its first frame."""

    session: Session


class Server:
    """Accepts connections on ``listener`` and runs a ``Session`` thread for each that sends a frame."""

    def __init__(
        self, listener: Listener, handlers: Handlers, config: ServerConfig, health: Health | None = None
    ) -> None:
        self.listener = listener
        self.handlers = handlers
        self._config = config
        self._acceptor: subprocess.Popen[bytes] | None = None
        self._channel: socket.socket | None = None
        self._counted = (0, 0)
        """The acceptor's refusal totals already added to the counters (disallowed uid, over the limit)."""
        self._acceptor_lock = threading.Lock()
        """Orders the acceptor's start (the channel thread, after a crash) with its stop (``stop_accepting``) and
        with a new listener (``replace_listener``)."""
        self._stopped_pids: set[int] = set()
        """Acceptors this server stopped itself (a SIGHUP's new policy, a stop): their end is no error."""
        self._ids = itertools.count(1)
        self._sessions: dict[int, Session] = {}
        self._per_uid: Counter[int] = Counter()
        self._budgets: dict[int, UserBudget] = {}
        """Per uid with a connection: the bytes its incomplete messages in parts may hold together."""
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
        self.health = REGISTRY if health is None else health
        """Beacons of the accept, watcher and session threads (``tiermemd.health``)."""
        self.refusals = RefusalLog(REFUSAL_LOG_EVERY_S)
        """Refused connections and failed token guesses, logged with counts."""
        self._lingering: dict[int, tuple[socket.socket, float]] = {}
        """Refused sockets by fd, with the time they are closed at the latest."""
        self._explain = TokenBuckets(EXPLAINED_REFUSALS_PER_S)
        """Refusals per uid and second that get their reason (a frame, a linger); the others are a close."""

    @property
    def config(self) -> ServerConfig:
        return self._config

    @config.setter
    def config(self, config: ServerConfig) -> None:
        """A new configuration (SIGHUP); an acceptor whose policy it changes is started again with it."""
        old, self._config = self._config, config
        if self._acceptor is not None and self._policy(old) != self._policy(config):
            self._stop_acceptor()  # the channel thread starts the next one with the new policy

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        accept = self._channel_loop if self._config.accept_process else self._accept_loop
        if self._config.accept_process:
            self._start_acceptor()
        for target, name in ((accept, "tiermemd-accept"), (self._watch_loop, "tiermemd-pidfds")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop_accepting(self) -> None:
        with self._acceptor_lock:
            self._accepting = False
        self._stop_acceptor()
        with contextlib.suppress(OSError):
            self.listener.sock.shutdown(socket.SHUT_RDWR)

    def replace_listener(self, listener: Listener) -> bool:
        """Accept on ``listener`` from now on (the socket path was bound again: ``tiermemd.socketkeeper``); the
        acceptor is started again on it.  False, changing nothing, once the server stopped accepting."""
        with self._acceptor_lock:
            if not self._accepting:
                return False
            old, self.listener = self.listener, listener
        if self._config.accept_process:
            self._stop_acceptor()  # the channel thread starts the next one, on the new listener
        with contextlib.suppress(OSError):
            old.sock.shutdown(socket.SHUT_RDWR)  # wakes an accept thread blocked on it
        old.close()
        return True

    # ----------------------------------------------------------------- the acceptor process

    def _policy(self, config: ServerConfig) -> str:
        return Policy(
            config.allowed_uids, config.allowed_gids, self._own_uid, config.max_connections_per_uid, config.max_frame
        ).to_json()

    def _start_acceptor(self) -> None:
        """Start ``tiermemd.acceptor`` on the listener, with a fresh channel (``daemon/acceptor.py``); not once
        the server stopped accepting."""
        with self._acceptor_lock:
            if self._accepting:
                self._spawn_acceptor()

    def _spawn_acceptor(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._acceptor = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tiermemd.acceptor",
                    "--listen-fd",
                    str(self.listener.fileno()),
                    "--channel-fd",
                    str(theirs.fileno()),
                    "--policy",
                    self._policy(self._config),
                ],
                pass_fds=(self.listener.fileno(), theirs.fileno()),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.settimeout(ACCEPTOR_SILENCE_S)  # its heartbeat comes every COUNTS_EVERY_S
        self._channel = ours
        self._counted = (0, 0)
        log.info("acceptor started (pid %d)", self._acceptor.pid)

    def _stop_acceptor(self) -> None:
        with self._acceptor_lock:
            acceptor = self._acceptor
            if acceptor is None:
                return
            self._stopped_pids.add(acceptor.pid)
        with contextlib.suppress(OSError):
            acceptor.terminate()
        try:
            acceptor.wait(5.0)
        except subprocess.TimeoutExpired:
            acceptor.kill()
            acceptor.wait()

    def _channel_loop(self) -> None:
        """The accept thread with an acceptor process: admit what it passes, count what it refused, and start
        it again if it ended while the daemon still accepts."""
        beacon = self.health.register("tiermemd-accept")
        try:
            while True:
                channel = self._channel
                if channel is None:
                    return
                try:
                    data, fds, _, _ = socket.recv_fds(channel, 64, 4)
                except TimeoutError:
                    self._kill_hung_acceptor()
                    data, fds = b"", []
                except OSError as exc:
                    data, fds = b"", []
                    log.warning("reading the acceptor's channel failed: %s", exc)
                if not data and not fds:  # the acceptor ended
                    self._acceptor_ended(channel)
                    time.sleep(0.2)  # a crash loop costs a restart every 0.2 s at most
                    self._start_acceptor()
                    if self._channel is None:
                        return  # stopped accepting
                    continue
                beacon.enter()
                try:
                    self._from_acceptor(data, fds)
                finally:
                    beacon.leave()
        finally:
            self.health.forget(beacon)

    def _kill_hung_acceptor(self) -> None:
        """The acceptor sent no heartbeat for ``ACCEPTOR_SILENCE_S``: connections wait behind it, so it goes."""
        with self._acceptor_lock:
            acceptor = self._acceptor
            if acceptor is None:
                return
            self._stopped_pids.add(acceptor.pid)  # this line says why it ends; no second one
        log.error(
            "the acceptor (pid %d) sent nothing for %.0f s (stopped or wedged); killing it and starting another",
            acceptor.pid,
            ACCEPTOR_SILENCE_S,
        )
        with contextlib.suppress(OSError):
            acceptor.kill()

    def _acceptor_ended(self, channel: socket.socket) -> None:
        acceptor, self._acceptor, self._channel = self._acceptor, None, None
        channel.close()
        if acceptor is None:
            return
        code = acceptor.wait()
        with self._acceptor_lock:
            stopped = acceptor.pid in self._stopped_pids
            self._stopped_pids.discard(acceptor.pid)
        if self._accepting and not stopped:
            log.error("the acceptor (pid %d) ended with status %s; starting it again", acceptor.pid, code)

    def _from_acceptor(self, data: bytes, fds: list[int]) -> None:
        if data.startswith(b"CNTS") and len(data) == COUNTS.size:
            _, auth, admission = COUNTS.unpack(data)
            self.counters.add_refused(auth - self._counted[0], admission - self._counted[1])
            self._counted = (auth, admission)
        for fd in fds:
            conn = socket.socket(fileno=fd)
            if data not in (CONN, HELD) or (data == HELD and not self._accepting):
                conn.close()  # a connection held silent by an acceptor stopped with the daemon: not served
                continue
            conn.setblocking(True)  # the acceptor's non-blocking mode came with the file (O_NONBLOCK is shared)
            try:
                cred = peer_cred(conn)
            except OSError:
                conn.close()
                continue
            try:
                self._admit(conn, cred, talking=data == CONN)  # a HELD one is watched here until it talks
            except Exception:
                log.exception("admitting a connection from pid %d failed; closing it", cred.pid)
                conn.close()

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
        self._close_lingering()

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
        return uid_allowed(cred, self.config.allowed_uids, self.config.allowed_gids, self._own_uid)

    def _refuse(self, conn: socket.socket, cred: PeerCred, exc: TiermemError, why: str) -> None:
        """Send the refusal, then let the socket linger in the watcher's selector, its input read and
        dropped until the client hangs up (at most ``REFUSAL_LINGER_S``): closing with its request unread
        would reset the connection, and the client would lose the frame that says why.  No thread, no
        buffer, no pidfd: a refused peer costs a socket for two seconds at most (none past
        ``MAX_LINGERING`` of them, when the refusal may be lost to a reset)."""
        self.counters.refused(exc)
        self.refusals.note(why, cred)
        if not self._explain.take(cred.uid, time.monotonic()):
            conn.close()  # a storm from this uid: past its explained refusals, a refusal is one close
            return
        send_refusal(conn, exc, self.listener.max_frame)
        with self._lock:
            keep = len(self._lingering) < MAX_LINGERING and self._accepting
            if keep:
                self._lingering[conn.fileno()] = (conn, time.monotonic() + REFUSAL_LINGER_S)
        if not keep:
            conn.close()
            return
        self._selector.register(conn.fileno(), selectors.EVENT_READ, conn)

    def _drop_refused(self, conn: socket.socket, *, hang_up: bool = False) -> None:
        """Read and drop what a refused peer sent; close it once it hung up (or ``hang_up``)."""
        eof = hang_up
        while not eof:
            try:
                eof = not conn.recv(16, socket.MSG_DONTWAIT)  # the rest of a packet is dropped
            except BlockingIOError:
                break
            except OSError:
                eof = True
        if eof:
            fd = conn.fileno()
            with self._lock:
                known = self._lingering.pop(fd, None) is not None
            if known:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(fd)
                conn.close()

    def _accept_loop(self) -> None:
        beacon = self.health.register("tiermemd-accept")
        try:
            while self._accepting:
                listener = self.listener
                try:
                    conn, cred = listener.accept_socket()
                except OSError as exc:
                    if not self._accepting:
                        return
                    if listener is not self.listener:
                        continue  # replaced (``replace_listener``): accept on the new one
                    log.warning("accept failed: %s", exc)
                    time.sleep(0.05)
                    continue
                beacon.enter()
                try:
                    self._admit(conn, cred)
                except Exception:
                    log.exception("admitting a connection from pid %d failed; closing it", cred.pid)
                    conn.close()
                finally:
                    beacon.leave()
        finally:
            self.health.forget(beacon)

    def _admit(self, conn: socket.socket, cred: PeerCred, *, talking: bool = False) -> None:
        """Admit or refuse a connection; ``talking``: its first frame is there (passed by the acceptor)."""
        if not self.allowed(cred):
            self._refuse(conn, cred, *not_allowed(cred))
            return
        with self._lock:
            held = self._per_uid[cred.uid]
            if held >= self.config.max_connections_per_uid:
                held -= self._hung_up(cred.uid)
            over = held >= self.config.max_connections_per_uid
            if not over:
                self._per_uid[cred.uid] += 1
        if over:
            self._refuse(conn, cred, *over_limit(cred, self.config.max_connections_per_uid))
            return
        try:
            peer = self.listener.peer(conn, cred, watch=False)
        except BaseException:
            with self._lock:
                self._forget_uid(cred.uid)
            raise
        with self._lock:
            session = Session(
                next(self._ids),
                peer,
                max_oneway=self.config.max_inflight,
                joiner=Joiner(self.config.max_message, self._budget(cred.uid)),
                counters=self.counters,
            )
            self._sessions[session.id] = session
        if talking:
            self._serve_thread(session)
            return
        try:
            # no thread, pidfd or beacon yet: the watcher gives them when the first frame is there, and ends
            # a session that hangs up before one (epoll sees a registration at once; other selectors are woken)
            self._selector.register(peer.fileno(), selectors.EVENT_READ, _Silent(session))
            if not isinstance(self._selector, selectors.EpollSelector):
                with contextlib.suppress(BlockingIOError):  # a full wake pipe: the watcher is awake already
                    os.write(self._wake_w, b"x")
        except BaseException:
            self._drop(session)  # nothing serves it: else its slot and its session stay forever
            raise

    def _first_frame(self, fd: int, session: Session) -> None:
        """A silent admitted connection became readable (watcher thread): a frame starts its session thread;
        a hang-up before any frame ends the session here, so a storm of connections costs no thread."""
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fd)
        try:
            ready = bool(session.peer.frames.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:  # woken for nothing: keep waiting
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.register(fd, selectors.EVENT_READ, _Silent(session))
            return
        except OSError:
            ready = False
        if not ready:
            self.counters.accepted()
            try:
                session.end(
                    self.handlers, "client closed the connection before a request", DisconnectReason.CLIENT_CLOSED
                )
            finally:
                self.counters.disconnected(session.disconnect or DisconnectReason.CLIENT_CLOSED)
                self._drop(session)
            return
        self._serve_thread(session)

    def _serve_thread(self, session: Session) -> None:
        """A session that talks: its send timeout, pidfd and beacon, and its thread."""
        try:
            peer, cred = session.peer, session.cred
            set_send_timeout(peer.frames.sock, self.config.send_timeout_s)
            peer.watch()
            if peer.pidfd is not None:
                self._selector.register(peer.pidfd, selectors.EVENT_READ, session)
            session.beacon = self.health.register(
                f"tiermemd-session-{session.id} (pid {cred.pid}, uid {cred.uid})", kind="session"
            )
            thread = threading.Thread(
                target=self._serve, args=(session,), name=f"tiermemd-session-{session.id}", daemon=True
            )
            thread.start()
        except BaseException:
            self._drop(session)
            raise

    def _hung_up(self, uid: int) -> int:
        """How many of ``uid``'s sessions have a peer that already hung up (under the lock).

        Their threads will see end-of-stream and end, but may not have yet: a client that closes a
        connection and opens the next one at once must not be refused for the one it closed.  One
        ``poll`` with zero timeout over that uid's sockets, only when the uid is at its limit.
        """
        poller = select.poll()
        closing = 0
        for session in self._sessions.values():
            if session.cred.uid != uid:
                continue
            if session.peer_closed or session.state is SessionState.CLOSED:
                closing += 1  # its thread is on its way out: closed its socket, not yet forgotten
                continue
            with contextlib.suppress(OSError, ValueError):
                poller.register(session.peer.fileno(), select.POLLRDHUP)
        try:
            events = poller.poll(0)
        except OSError:
            return closing
        return closing + sum(1 for _, mask in events if mask & (select.POLLRDHUP | select.POLLHUP | select.POLLERR))

    def _serve(self, session: Session) -> None:
        self.counters.accepted()
        try:
            session.serve(self.handlers, lambda: self.draining)
        finally:
            self.counters.disconnected(session.disconnect or DisconnectReason.CLIENT_CLOSED)
            self._drop(session)

    def _drop(self, session: Session) -> None:
        """Close an admitted session and give its slot back."""
        self.forget_pidfd(session)
        with contextlib.suppress(KeyError, ValueError, OSError):  # still silent: the watcher no longer waits for it
            key = self._selector.get_key(session.peer.fileno())
            if isinstance(key.data, _Silent):
                self._selector.unregister(key.fd)
        session.close_peer()
        if session.beacon is not None:
            self.health.forget(session.beacon)
        with self._lock:
            self._sessions.pop(session.id, None)
            self._forget_uid(session.cred.uid)

    def _budget(self, uid: int) -> UserBudget:
        """The budget of ``uid``'s incomplete messages (under the lock; kept while it has a connection)."""
        budget = self._budgets.get(uid)
        if budget is None:
            budget = self._budgets[uid] = UserBudget(self.config.max_message, f"uid {uid}")
        budget.limit = self.config.max_message  # a SIGHUP's new limit, from this connection on
        return budget

    def _forget_uid(self, uid: int) -> None:
        """One connection of ``uid`` fewer (under the lock)."""
        self._per_uid[uid] -= 1
        if self._per_uid[uid] <= 0:
            del self._per_uid[uid]
            self._budgets.pop(uid, None)

    def _watch_loop(self) -> None:
        beacon = self.health.register("tiermemd-pidfds")
        next_tick = time.monotonic()
        try:
            while True:
                events = self._selector.select(timeout=HEARTBEAT_S)
                beacon.enter()
                try:
                    for key, _ in events:
                        if not self._current(key):
                            continue  # its fd was closed by an earlier event of this batch (and maybe reused)
                        if key.data is None:
                            with contextlib.suppress(BlockingIOError):
                                os.read(self._wake_r, 4096)
                            if not self._accepting and not self.sessions():
                                return
                        elif isinstance(key.data, socket.socket):
                            self._drop_refused(key.data)
                        elif isinstance(key.data, _Silent):
                            self._first_frame(key.fd, key.data.session)
                        else:
                            self._client_exited(key.fd, key.data)
                    now = time.monotonic()
                    if now >= next_tick:
                        self._tick(now)
                        next_tick = now + HEARTBEAT_S
                finally:
                    beacon.leave()
        finally:
            self.health.forget(beacon)
            self._close_lingering()

    def _current(self, key: selectors.SelectorKey) -> bool:
        """Whether ``key``, from the batch ``select`` returned, is still registered: handling an earlier event of
        the batch may have closed its fd, and the accept thread registered a new socket under that number."""
        try:
            return self._selector.get_key(key.fd) is key
        except (KeyError, ValueError):
            return False

    def _client_exited(self, pidfd: int, session: Session) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(pidfd)
        log.info("client pid %d of session %d exited", session.cred.pid, session.id)
        session.shutdown(f"client process {session.cred.pid} exited", DisconnectReason.CLIENT_EXITED)
        try:
            self.on_client_exit(session)
        except Exception:
            log.exception("aborting the work of session %d failed", session.id)

    def _tick(self, now: float) -> None:
        """Once per ``HEARTBEAT_S``: heartbeats to long requests, lingering refusals ended, refusal counts."""
        workers_ok = self.health.workers_ok()
        for session in self.sessions():
            beacon = session.beacon
            if (
                workers_ok
                and session.busy
                and beacon is not None
                and beacon.busy_for() >= HEARTBEAT_S
                and not beacon.is_stalled()
            ):
                session.heartbeat()
        with self._lock:
            expired = [conn for conn, deadline in self._lingering.values() if deadline <= now]
        for conn in expired:
            self._drop_refused(conn, hang_up=True)
        self.refusals.flush(now)

    def _close_lingering(self) -> None:
        with self._lock:
            conns = [conn for conn, _ in self._lingering.values()]
        for conn in conns:
            self._drop_refused(conn, hang_up=True)

    def forget_pidfd(self, session: Session) -> None:
        if session.peer.pidfd is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(session.peer.pidfd)

"""The acceptor: a small process of its own that owns the daemon's accept queue.

A connection storm (a local user opening and closing connections as fast as
it can) used to be accepted, checked and refused by a thread of the daemon,
sharing its interpreter and its lock with the session threads that serve the
node's training processes: their round trips then waited behind the storm's
(``tests/chaos``: 3-12x the p99 of the same storm aimed at another daemon).
The acceptor takes that work out of the daemon's interpreter:

- it accepts, reads the peer's credentials (``SO_PEERCRED``) and refuses a
  uid the daemon does not allow, exactly as the daemon would (the same
  ``AuthError`` frame, a linger so the refusal is read, a plain close past
  ``EXPLAINED_REFUSALS_PER_S`` a uid, the same once-per-uid log lines);
- it holds an allowed connection until its first frame (at most
  ``server.max_connections_per_uid`` silent ones a uid; past it, the
  daemon's ``AdmissionError``), so a connection that hangs up without a word
  never reaches the daemon;
- it passes a connection that talks to the daemon (``SCM_RIGHTS`` over a
  ``SOCK_SEQPACKET`` pair), which admits it (the per-uid limit over its
  sessions, a thread, a pidfd) as it admitted any connection before;
- told to end (SIGTERM: the daemon restarts it with a new policy, or on a
  socket bound again), it hands the connections it still holds silent to
  the daemon (``HELD``), which watches them for their first frame itself: a
  client that connected and has not spoken yet (importing torch, building
  its model) keeps its connection.  An acceptor killed or crashed takes its
  silent connections with it; their clients see the daemon close them;
- it tells the daemon what it refused (a ``counts`` message before every
  connection it passes, and every ``COUNTS_EVERY_S``, changed or not: its
  heartbeat), so the daemon's STATS and metrics count refusals as before, in
  order: a client that was refused and then asks STATS sees its refusal
  counted.  A channel silent for ``ACCEPTOR_SILENCE_S`` means a hung
  acceptor (stopped, wedged): the daemon kills it and starts another.

It runs as ``python -m tiermemd.acceptor``: no torch, 16 MB, 0.07 s to start.
It ends when the daemon closes its end of the pair (or dies), or on SIGTERM.
The daemon starts it again when it ends unexpectedly, and restarts it with
the new policy when SIGHUP changes who may connect.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any

from tiermem.core.errors import TiermemError
from tiermem.net.frames import PeerCred, peer_cred
from tiermemd import admission

__all__ = ["Acceptor", "main"]

log = logging.getLogger("tiermemd.acceptor")

HAND_OVER_TIMEOUT_S = 2.0
"""How long one silent connection's hand-over may wait for room in the channel (the daemon waits 5 s for an
acceptor it stops)."""


class Acceptor:
    def __init__(self, listener: socket.socket, channel: socket.socket, policy: admission.Policy) -> None:
        self.listener = listener
        self.channel = channel
        self.policy = policy
        self.selector = selectors.DefaultSelector()
        self.refusals = admission.RefusalLog(admission.REFUSAL_LOG_EVERY_S)
        self.explain = admission.TokenBuckets(admission.EXPLAINED_REFUSALS_PER_S)
        self.silent: dict[int, tuple[socket.socket, PeerCred]] = {}
        self.per_uid: dict[int, int] = {}
        self.lingering: dict[int, tuple[socket.socket, float]] = {}
        self.refused_auth = 0
        self.refused_admission = 0
        self._counts_at = time.monotonic()
        self.running = True

    # ----------------------------------------------------------------- the loop

    def run(self) -> None:
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, "listener")
        self.selector.register(self.channel, selectors.EVENT_READ, "channel")
        while self.running:
            events = self.selector.select(timeout=admission.COUNTS_EVERY_S)
            for key, _ in events:
                if key.data == "listener":
                    self._accept_all()
                elif key.data == "channel":
                    if not self._channel_readable():
                        return
                elif key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        os.read(key.fd, 64)
                elif key.data == "linger":
                    self._drain_refused(key.fileobj)  # type: ignore[arg-type]
                else:
                    self._first_frame(key.fileobj)  # type: ignore[arg-type]
            now = time.monotonic()
            if now - self._counts_at >= admission.COUNTS_EVERY_S:
                self._flush_counts()
                self._end_lingering(now)
                self.refusals.flush(now)
        self._hand_over()

    def _channel_readable(self) -> bool:
        """The daemon sends nothing; readable means it closed its end (or died): the acceptor ends."""
        try:
            return bool(self.channel.recv(16, socket.MSG_DONTWAIT))
        except BlockingIOError:
            return True
        except OSError:
            return False

    # ----------------------------------------------------------------- accepting

    def _accept_all(self) -> None:
        for _ in range(1024):  # a batch, then the others' events get their turn
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                return
            try:
                cred = peer_cred(conn)
            except OSError:
                conn.close()
                continue
            self._admit(conn, cred)

    def _admit(self, conn: socket.socket, cred: PeerCred) -> None:
        policy = self.policy
        if not admission.uid_allowed(cred, policy.allowed_uids, policy.allowed_gids, policy.daemon_uid):
            self.refused_auth += 1
            self._refuse(conn, cred, *admission.not_allowed(cred))
            return
        if self.per_uid.get(cred.uid, 0) >= policy.max_per_uid:
            self.refused_admission += 1
            self._refuse(conn, cred, *admission.over_limit(cred, policy.max_per_uid))
            return
        conn.setblocking(False)
        self.silent[conn.fileno()] = (conn, cred)
        self.per_uid[cred.uid] = self.per_uid.get(cred.uid, 0) + 1
        self.selector.register(conn, selectors.EVENT_READ, "silent")

    def _hand_over(self) -> None:
        """Pass the connections still silent to the daemon (``HELD``), so they outlive this process; nothing
        to pass to once the daemon closed the channel."""
        with contextlib.suppress(OSError):
            self.channel.settimeout(HAND_OVER_TIMEOUT_S)  # the daemon's channel thread reads while it waits for us
        for conn, cred in list(self.silent.values()):
            self._forget_silent(conn)
            try:
                socket.send_fds(self.channel, [admission.HELD], [conn.fileno()])
            except OSError as exc:
                log.warning("handing a silent connection of pid %d to tiermemd failed: %s", cred.pid, exc)
            finally:
                conn.close()

    def _forget_silent(self, conn: socket.socket) -> PeerCred:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        _, cred = self.silent.pop(conn.fileno())
        left = self.per_uid[cred.uid] - 1
        if left:
            self.per_uid[cred.uid] = left
        else:
            del self.per_uid[cred.uid]
        return cred

    def _first_frame(self, conn: socket.socket) -> None:
        try:
            ready = bool(conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            return
        except OSError:
            ready = False
        self._forget_silent(conn)
        if not ready:  # hung up before a word
            conn.close()
            return
        self._flush_counts()  # the daemon counts refusals before it admits what came after them
        try:
            socket.send_fds(self.channel, [admission.CONN], [conn.fileno()])
        except OSError as exc:
            log.error("passing a connection to tiermemd failed (%s); ending", exc)
            self.running = False
        finally:
            conn.close()

    # ----------------------------------------------------------------- refusing

    def _refuse(self, conn: socket.socket, cred: PeerCred, exc: TiermemError, why: str) -> None:
        self.refusals.note(why, cred)
        if not self.explain.take(cred.uid, time.monotonic()) or len(self.lingering) >= admission.MAX_LINGERING:
            conn.close()  # a storm from this uid: past its explained refusals, a refusal is one close
            return
        admission.send_refusal(conn, exc, self.policy.max_frame)
        self.lingering[conn.fileno()] = (conn, time.monotonic() + admission.REFUSAL_LINGER_S)
        self.selector.register(conn, selectors.EVENT_READ, "linger")

    def _drain_refused(self, conn: socket.socket, *, hang_up: bool = False) -> None:
        eof = hang_up
        while not eof:
            try:
                eof = not conn.recv(16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:
                eof = True
        if eof and self.lingering.pop(conn.fileno(), None) is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn)
            conn.close()

    def _end_lingering(self, now: float) -> None:
        for conn, deadline in list(self.lingering.values()):
            if deadline <= now:
                self._drain_refused(conn, hang_up=True)

    def _flush_counts(self) -> None:
        self._counts_at = time.monotonic()
        counts = (self.refused_auth, self.refused_admission)
        try:  # unchanged counts too: the daemon takes a silent channel for a hung acceptor
            self.channel.send(admission.COUNTS.pack(b"CNTS", *counts))
        except BlockingIOError:
            pass  # the daemon is behind: the next flush carries the totals
        except OSError:
            self.running = False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="tiermemd's acceptor (started by tiermemd)")
    ap.add_argument("--listen-fd", type=int, required=True)
    ap.add_argument("--channel-fd", type=int, required=True)
    ap.add_argument("--policy", required=True, help="JSON (admission.Policy)")
    args = ap.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    acceptor = Acceptor(
        socket.socket(fileno=args.listen_fd),
        socket.socket(fileno=args.channel_fd),
        admission.Policy.from_json(args.policy),
    )

    def stop(*_: Any) -> None:
        acceptor.running = False

    # the signal's byte on a pipe in the selector ends its wait at once (a handler alone runs, and the
    # interrupted wait is resumed for the rest of its timeout)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    acceptor.selector.register(wake_r, selectors.EVENT_READ, "wake")
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the daemon's terminal is the daemon's to handle
    try:
        acceptor.run()
    finally:
        acceptor.refusals.flush()
    return 0


if __name__ == "__main__":
    os.environ.pop("NOTIFY_SOCKET", None)  # the daemon talks to systemd, not this child
    sys.exit(main())

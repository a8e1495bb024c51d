"""Admission: who may connect to the daemon, and how a refused peer is told.

Shared by the two places that accept connections: the daemon's accept thread
(``tiermemd.server``, without ``server.accept_process``) and the acceptor
process (``tiermemd.acceptor``, with it), so a peer is refused with the same
frame, the same linger and the same log lines by either.  Also the two
processes' channel: the acceptor's ``Policy`` (on its command line) and the
messages it sends the daemon (``CONN`` and ``HELD`` with a passed fd, ``COUNTS``).

It imports no more than the wire protocol needs, so the acceptor starts
small (see ``tiermemd.acceptor``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from tiermem.core.errors import AdmissionError, AuthError, ProtocolError, TiermemError
from tiermem.core.protocol import ErrorReply, encode_message
from tiermem.net.frames import PeerCred

__all__ = [
    "ACCEPTOR_SILENCE_S",
    "CONN",
    "COUNTS",
    "COUNTS_EVERY_S",
    "EXPLAINED_REFUSALS_PER_S",
    "HELD",
    "MAX_ERROR_CHARS",
    "MAX_LINGERING",
    "REFUSAL_LINGER_S",
    "REFUSAL_LOG_EVERY_S",
    "Policy",
    "RefusalLog",
    "TokenBuckets",
    "error_frame",
    "not_allowed",
    "over_limit",
    "send_refusal",
    "uid_allowed",
]

log = logging.getLogger(__name__)

REFUSAL_LINGER_S = 2.0
MAX_LINGERING = 512
"""Refused sockets kept lingering at once; past it a refused socket is closed at once."""
REFUSAL_LOG_EVERY_S = 10.0
EXPLAINED_REFUSALS_PER_S = 50.0
"""Refused connections per uid and second answered with the reason (a storm's others are just closed, so the
accept thread keeps draining the backlog for everyone else)."""
MAX_ERROR_CHARS = 16384
"""The wire limit on ``ERROR.message`` (docs/protocol.md, Limits); longer ones are clipped."""

# ----------------------------------------------------------------- the acceptor's channel

COUNTS_EVERY_S = 0.5
"""The acceptor sends ``COUNTS`` this often, changed or not: its heartbeat too."""
ACCEPTOR_SILENCE_S = 10.0
"""An acceptor whose channel stays silent this long is hung (stopped, wedged): the daemon kills it and starts
another, so connections do not wait in the backlog behind it."""
COUNTS = struct.Struct("<4sQQ")
"""The ``counts`` message: b"CNTS", refusals of a disallowed uid, refusals over the per-uid limit (totals)."""
CONN = b"CONN"
"""The message that carries a passed connection's fd: it sent its first frame."""
HELD = b"HELD"
"""The message that carries a connection that has not spoken yet, from an acceptor told to end (a new
policy, a rebound socket): the daemon watches it from then on, so its client keeps its connection."""


@dataclass(frozen=True)
class Policy:
    """Who may connect: what the daemon's ``server`` configuration says, as JSON on the command line."""

    allowed_uids: tuple[int, ...]
    allowed_gids: tuple[int, ...]
    daemon_uid: int
    max_per_uid: int
    max_frame: int

    def to_json(self) -> str:
        return json.dumps(
            {
                "allowed_uids": list(self.allowed_uids),
                "allowed_gids": list(self.allowed_gids),
                "daemon_uid": self.daemon_uid,
                "max_per_uid": self.max_per_uid,
                "max_frame": self.max_frame,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Policy:
        raw = json.loads(text)
        return cls(
            tuple(raw["allowed_uids"]),
            tuple(raw["allowed_gids"]),
            int(raw["daemon_uid"]),
            int(raw["max_per_uid"]),
            int(raw["max_frame"]),
        )


# ----------------------------------------------------------------- refusing a peer


def uid_allowed(cred: PeerCred, allowed_uids: tuple[int, ...], allowed_gids: tuple[int, ...], own_uid: int) -> bool:
    """Whether ``cred`` may use a daemon running as ``own_uid``: root, that uid, an allowed uid, or a member of
    an allowed gid."""
    if cred.uid in (0, own_uid) or cred.uid in allowed_uids:
        return True
    if not allowed_gids:
        return False
    groups = {cred.gid}
    with contextlib.suppress(KeyError):
        entry = pwd.getpwuid(cred.uid)
        groups.update(os.getgrouplist(entry.pw_name, entry.pw_gid))
    return bool(groups & set(allowed_gids))


def send_refusal(conn: socket.socket, exc: TiermemError, max_frame: int) -> None:
    """Send a refused peer why, never blocking, and end our side of the stream (the socket then lingers)."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(error_frame(0, exc, max_frame))
        conn.shutdown(socket.SHUT_WR)


def not_allowed(cred: PeerCred) -> tuple[AuthError, str]:
    """The refusal of a uid the daemon does not allow: the error its peer gets, and the log's reason."""
    return (
        AuthError(f"uid {cred.uid} is not allowed to use this tiermemd (server.allowed_uids/allowed_gids)"),
        "refused a connection: uid not allowed",
    )


def over_limit(cred: PeerCred, limit: int) -> tuple[AdmissionError, str]:
    """The refusal of a uid at ``server.max_connections_per_uid``: the error, and the log's reason."""
    return (
        AdmissionError(f"uid {cred.uid} already holds {limit} connections (server.max_connections_per_uid)"),
        "refused a connection: over server.max_connections_per_uid",
    )


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


class TokenBuckets:
    """One token bucket per key (``rate`` tokens a second, as many at most): ``take`` is False when empty.
    Bounded: past ``_MAX_KEYS`` keys the buckets start afresh."""

    _MAX_KEYS = 1024

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._buckets: dict[int, tuple[float, float]] = {}

    def take(self, key: int, now: float) -> bool:
        tokens, since = self._buckets.get(key, (self.rate, now))
        tokens = min(self.rate, tokens + (now - since) * self.rate)
        ok = tokens >= 1.0
        if len(self._buckets) >= self._MAX_KEYS and key not in self._buckets:
            self._buckets.clear()
        self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
        return ok


class RefusalLog:
    """Refused connections and failed token guesses, logged without a line each.

    The first of each (what, uid) is logged at once; the ones after it are counted and summarised in
    one line per ``every_s`` (``flush``).  Bounded: at most ``_MAX_KEYS`` kinds are remembered."""

    _MAX_KEYS = 1024

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: set[tuple[str, int]] = set()
        self._counts: Counter[tuple[str, int]] = Counter()
        self._since = clock()
        self.total = 0

    def note(self, what: str, cred: PeerCred, detail: str = "") -> None:
        key = (what, cred.uid)
        with self._lock:
            self.total += 1
            first = key not in self._seen
            if first:
                if len(self._seen) >= self._MAX_KEYS:
                    self._seen.clear()
                self._seen.add(key)
            else:
                self._counts[key] += 1
        if first:
            log.warning(
                "%s: pid %d uid %d gid %d%s (more of these are counted and logged every %.0fs)",
                what,
                cred.pid,
                cred.uid,
                cred.gid,
                f" ({detail})" if detail else "",
                self.every_s,
            )

    def flush(self, now: float | None = None) -> dict[tuple[str, int], int]:
        """Log (and return) the counts since the last summary, once ``every_s`` has passed."""
        now = self._clock() if now is None else now
        with self._lock:
            if now - self._since < self.every_s:
                return {}
            counts, self._counts = dict(self._counts), Counter()
            period, self._since = now - self._since, now
        if counts:
            log.warning(
                "in the last %.0fs: %s",
                period,
                "; ".join(f"{what} x{n} (uid {uid})" for (what, uid), n in sorted(counts.items())),
            )
        return counts

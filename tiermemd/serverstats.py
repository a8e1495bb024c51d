"""Counters of the socket side: connections, refusals, errors, and why sessions ended.

Owns ``ServerCounters`` (updated by the server, its sessions and the ATTACH
handler when a connection event happens: an accept, an attach, a refusal, an
error reply, a close; never per request) and its snapshot ``ServerStats``.  ``DisconnectReason`` is the
bounded set of reasons a session ends for, so that a metric labelled with it
has a fixed number of series.  Pure: no sockets.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Annotated

from tiermem.core.errors import AuthError, ProtocolError, TiermemError
from tiermem.core.figures import Family, counter, gauge

__all__ = ["DisconnectReason", "ServerCounters", "ServerStats"]


class DisconnectReason(enum.Enum):
    CLIENT_CLOSED = "client_closed"
    """The client closed its end (a clean exit, or a DETACH followed by close)."""
    CLIENT_EXITED = "client_exited"
    """The client's process exited (seen on its pidfd) while the connection was open."""
    SEND_FAILED = "send_failed"
    """The client went away while a reply was being sent."""
    PROTOCOL_ERROR = "protocol_error"
    """A frame whose header could not be read, or too many one-way messages without a request."""
    INTERNAL_ERROR = "internal_error"
    """A handler failed with something that is not a ``TiermemError`` (logged with its traceback)."""
    SHUTDOWN = "shutdown"
    """The daemon closed the session while draining."""


CLIENTS = Family("tiermem_clients", "Client connections being served.")
ATTACHES = Family("tiermem_attaches", "Successful ATTACH requests (new jobs and reattaches).")
REFUSED = Family("tiermem_connections_refused", "Connections refused at accept.")
AUTH_ERRORS = Family("tiermem_auth_errors", "Authentication failures: uids not allowed, wrong job tokens.")
PROTOCOL_ERRORS = Family(
    "tiermem_protocol_errors",
    "Frames refused with a protocol error (malformed, oversized, or not a request the session may send), "
    "each answered with an error.",
)
DISCONNECTS = Family("tiermem_disconnects", "Client sessions that ended, by reason.", label="reason")


@dataclass(frozen=True)
class ServerStats:
    sessions: Annotated[int, gauge(CLIENTS)]
    """Connections being served now."""
    accepted: int
    """Connections admitted since start."""
    attaches: Annotated[int, counter(ATTACHES)]
    """Successful ATTACHes (new jobs and reattaches)."""
    refused: Annotated[int, counter(REFUSED)]
    """Connections refused at accept (not allowed, or over ``server.max_connections_per_uid``)."""
    auth_errors: Annotated[int, counter(AUTH_ERRORS)]
    """``AuthError``s: refused uids at accept and failed job tokens."""
    protocol_errors: Annotated[int, counter(PROTOCOL_ERRORS)]
    """Frames refused as malformed (bad header, payload or field), each answered with an error."""
    disconnects: Annotated[tuple[tuple[DisconnectReason, int], ...], counter(DISCONNECTS)]
    """Sessions ended, per reason (every reason listed, zeros included)."""

    def disconnected(self, reason: DisconnectReason) -> int:
        return dict(self.disconnects).get(reason, 0)


class ServerCounters:
    """Thread-safe counters; the lock is taken per connection event, never per request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._accepted = 0
        self._attaches = 0
        self._refused = 0
        self._auth_errors = 0
        self._protocol_errors = 0
        self._disconnects = dict.fromkeys(DisconnectReason, 0)

    def accepted(self) -> None:
        with self._lock:
            self._accepted += 1

    def attached(self) -> None:
        with self._lock:
            self._attaches += 1

    def refused(self, exc: TiermemError) -> None:
        with self._lock:
            self._refused += 1
            self._auth_errors += 1 if isinstance(exc, AuthError) else 0

    def add_refused(self, auth: int, admission: int) -> None:
        """Refusals made by the acceptor process: ``auth`` of disallowed uids, ``admission`` over the limit."""
        with self._lock:
            self._refused += auth + admission
            self._auth_errors += auth

    def error_reply(self, exc: TiermemError) -> None:
        """An error answered to a request: counted when it is a protocol or an authentication error."""
        if isinstance(exc, ProtocolError):
            with self._lock:
                self._protocol_errors += 1
        elif isinstance(exc, AuthError):
            with self._lock:
                self._auth_errors += 1

    def disconnected(self, reason: DisconnectReason) -> None:
        with self._lock:
            self._disconnects[reason] += 1

    def stats(self, sessions: int) -> ServerStats:
        with self._lock:
            return ServerStats(
                sessions=sessions,
                accepted=self._accepted,
                attaches=self._attaches,
                refused=self._refused,
                auth_errors=self._auth_errors,
                protocol_errors=self._protocol_errors,
                disconnects=tuple(self._disconnects.items()),
            )

"""A bounded HTTP/1.1 endpoint for Prometheus scrapes: one thread, a connection cap, an idle timeout.

prometheus_client's own server starts a thread per connection and keeps it
while the peer is idle: 500 idle connections held 500 threads.  This one runs
every connection on one selector thread:

- at most ``max_connections`` are open; when one more arrives, the one idle
  longest that is not being answered is closed to make room (so idle peers
  cannot lock a scraper out), and only when every slot is mid-reply is the
  newcomer closed at once (the scraper retries on its next interval);
- a connection that has not completed its request, or not read its reply,
  for ``idle_timeout_s`` is closed;
- a request head is at most ``MAX_REQUEST_NBYTES``; a body is not read (GET
  and HEAD only), and every reply ends the connection (``Connection: close``).

``GET /metrics`` answers ``render()`` (rendered on the loop thread; a scrape
is a few milliseconds); ``/`` a one-line pointer; anything else 404, other
methods 405.  The socket binds to ``address`` (IPv4 or IPv6) with
SO_REUSEADDR; port 0 picks a free one (``port`` says which).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["MAX_REQUEST_NBYTES", "ScrapeServer"]

log = logging.getLogger(__name__)

MAX_REQUEST_NBYTES = 8192
_TEXT = "text/plain; charset=utf-8"
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 431: "Request Header Fields Too Large", 500: "Internal Server Error"}  # noqa: E501  # fmt: skip


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    last_active: float
    inbox: bytearray = field(default_factory=bytearray)
    outbox: memoryview | None = None


class ScrapeServer:
    """See the module docstring.  ``start()`` runs the loop thread; ``close()`` stops it and closes everything."""

    def __init__(
        self,
        address: str,
        port: int,
        render: Callable[[], bytes],
        *,
        content_type: str,
        max_connections: int = 16,
        idle_timeout_s: float = 10.0,
    ) -> None:
        if max_connections <= 0:
            raise ValueError(f"max_connections must be > 0, got {max_connections}")
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
        self._render = render
        self._content_type = content_type
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
        self._listener = socket.socket(family, kind, proto)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(sockaddr)
            self._listener.listen(64)
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            raise
        self.port: int = self._listener.getsockname()[1]
        self._conns: dict[int, _Conn] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._closing = False
        self._torn_down = False
        self._thread = threading.Thread(target=self._loop, name="tiermemd-metrics", daemon=True)
        self.refused = 0
        """Connections closed at accept because ``max_connections`` were open and all being answered."""
        self.evicted = 0
        """Idle connections closed to make room for a new one."""
        self.timed_out = 0
        """Connections closed for being idle ``idle_timeout_s``."""

    @property
    def connections(self) -> int:
        return len(self._conns)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        else:
            self._teardown()

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        try:
            while not self._closing:
                for key, events in self._selector.select(timeout=self._next_timeout()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj == self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 64)
                    else:
                        self._service(key.data, events)
                self._expire()
        except Exception:
            log.exception("the metrics endpoint failed; it stops serving")
        finally:
            self._teardown()

    def _next_timeout(self) -> float:
        if not self._conns:
            return 1.0
        oldest = min(c.last_active for c in self._conns.values())
        return max(0.0, min(1.0, oldest + self.idle_timeout_s - time.monotonic()))

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the listener stays, the peer waits in the backlog
                log.warning("metrics endpoint: accept failed: %s", exc)
                return
            if len(self._conns) >= self.max_connections:
                idle = [c for c in self._conns.values() if c.outbox is None]
                if not idle:
                    self.refused += 1
                    sock.close()
                    continue
                self.evicted += 1
                self._drop(min(idle, key=lambda c: c.last_active))
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic())
            self._conns[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _service(self, conn: _Conn, events: int) -> None:
        try:
            if events & selectors.EVENT_READ and conn.outbox is None:
                data = conn.sock.recv(4096)
                if not data:
                    self._drop(conn)
                    return
                conn.last_active = time.monotonic()
                conn.inbox += data
                head_end = conn.inbox.find(b"\r\n\r\n")
                if head_end >= 0:
                    self._respond(conn, bytes(conn.inbox[:head_end]))
                elif len(conn.inbox) > MAX_REQUEST_NBYTES:
                    self._reply(conn, 431, b"request head too large\n", "text/plain; charset=utf-8", head=False)
            if events & selectors.EVENT_WRITE and conn.outbox is not None:
                sent = conn.sock.send(conn.outbox)
                conn.last_active = time.monotonic()
                conn.outbox = conn.outbox[sent:]
                if not conn.outbox:
                    self._drop(conn)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)

    def _respond(self, conn: _Conn, head: bytes) -> None:
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self._reply(conn, 400, b"bad request line\n", "text/plain; charset=utf-8", head=False)
            return
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            self._reply(conn, 405, b"only GET and HEAD\n", "text/plain; charset=utf-8", head=False)
        elif target == "/metrics":
            try:
                body = self._render()
            except Exception:
                log.exception("rendering the metrics failed")
                self._reply(conn, 500, b"rendering the metrics failed (logged)\n", "text/plain", head=False)
                return
            self._reply(conn, 200, body, self._content_type, head=method == "HEAD")
        elif target == "/":
            self._reply(
                conn, 200, b"tiermemd: metrics at /metrics\n", "text/plain; charset=utf-8", head=method == "HEAD"
            )
        else:
            self._reply(conn, 404, b"not found; metrics are at /metrics\n", "text/plain; charset=utf-8", head=False)

    def _reply(self, conn: _Conn, status: int, body: bytes, content_type: str, *, head: bool) -> None:
        header = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode("ascii")
        conn.outbox = memoryview(header if head else header + body)
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)

    def _expire(self) -> None:
        deadline = time.monotonic() - self.idle_timeout_s
        for conn in [c for c in self._conns.values() if c.last_active < deadline]:
            self.timed_out += 1
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

    def _teardown(self) -> None:
        if self._torn_down:
            return
        self._torn_down = True
        for conn in list(self._conns.values()):
            self._drop(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._listener.close()
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

"""The bounded scrape endpoint over real TCP sockets: answers, limits, idle timeout, threads."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tiermemd.scrape import MAX_REQUEST_NBYTES, ScrapeServer

pytestmark = pytest.mark.timeout(120)

BODY = b"# TYPE x gauge\nx 1.0\n"


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[ScrapeServer]:
    opts = getattr(request, "param", {})
    s = ScrapeServer("127.0.0.1", 0, lambda: BODY, content_type="text/plain; version=0.0.4", **opts)
    s.start()
    try:
        yield s
    finally:
        s.close()


def get(port: int, method: str = "GET", path: str = "/metrics") -> tuple[int, bytes, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read(), dict(resp.getheaders())
    finally:
        conn.close()


def wait_until(predicate, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_metrics_root_404_405_and_head(server: ScrapeServer) -> None:
    status, body, headers = get(server.port)
    assert (status, body) == (200, BODY)
    assert headers["Content-Type"] == "text/plain; version=0.0.4" and headers["Connection"] == "close"
    assert get(server.port, path="/metrics?x=1")[0] == 200
    assert get(server.port, path="/")[0] == 200
    assert get(server.port, path="/other")[0] == 404
    assert get(server.port, method="POST")[0] == 405
    status, body, headers = get(server.port, method="HEAD")
    assert status == 200 and body == b"" and headers["Content-Length"] == str(len(BODY))


def test_an_oversized_request_head_is_refused(server: ScrapeServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (MAX_REQUEST_NBYTES + 10))
        assert s.recv(64).startswith(b"HTTP/1.1 431 ")


@pytest.mark.parametrize("server", [{"max_connections": 4}], indirect=True)
def test_at_the_cap_the_longest_idle_connection_makes_room(server: ScrapeServer) -> None:
    held: list[socket.socket] = []
    for n in range(1, 5):  # one at a time, so that their ages are in this order
        held.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        assert wait_until(lambda n=n: server.connections == n)
    try:
        assert get(server.port)[0] == 200  # a scrape gets in although idle peers hold every slot
        assert server.evicted == 1 and server.connections <= 4
        with contextlib.suppress(ConnectionResetError):  # the oldest was closed: end-of-stream or a reset
            assert held[0].recv(1) == b""
    finally:
        for s in held:
            s.close()
    assert wait_until(lambda: server.connections == 0)


@pytest.mark.parametrize("server", [{"idle_timeout_s": 0.3}], indirect=True)
def test_an_idle_connection_is_closed_after_the_timeout(server: ScrapeServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"GET /metr")  # half a request, then nothing
        assert s.recv(1) == b""
    assert server.timed_out == 1


@pytest.mark.parametrize("server", [{"max_connections": 1000}], indirect=True)
def test_many_idle_connections_cost_no_thread(server: ScrapeServer) -> None:
    threads = threading.active_count()
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(200)]
    try:
        assert wait_until(lambda: server.connections == 200)
        assert threading.active_count() == threads
        assert get(server.port)[0] == 200  # and a scrape still gets through
    finally:
        for s in held:
            s.close()


def test_close_stops_the_loop_and_frees_the_port() -> None:
    s = ScrapeServer("127.0.0.1", 0, lambda: BODY, content_type="text/plain")
    s.start()
    port = s.port
    s.close()
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="max_connections must be > 0"):
        ScrapeServer("127.0.0.1", 0, lambda: BODY, content_type="text/plain", max_connections=0)

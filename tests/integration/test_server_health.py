"""The server's heartbeats and the health registry, with a real listener and real client connections.

The handlers here stand in for the daemon's: one handles its request while
ticking its thread's beacon (a long request that makes progress), one blocks
without a tick (a wedged session), so the two outcomes can be told apart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
from local_server import serving

from tiermem.client.connection import Connection
from tiermem.core.errors import DaemonTimeout
from tiermem.core.protocol import Message, Ping, Pong, Stats
from tiermemd import health
from tiermemd.health import Health
from tiermemd.server import Reply, Server, Session


class Handlers:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.closed: list[str] = []

    def dispatch(self, session: Session, msg: Message) -> Reply | None:
        if isinstance(msg, Stats):  # wedged: no progress until released
            self.release.wait(30)
            return Reply(Pong())
        if isinstance(msg, Ping) and session.requests == 1:  # long, and making progress
            for _ in range(30):
                time.sleep(0.1)
                health.tick()
        return Reply(Pong())

    def session_closed(self, session: Session, why: str) -> None:
        self.closed.append(why)


@pytest.fixture
def served() -> Iterator[tuple[Server, Handlers, Health, str]]:
    registry = Health(stall_s=1.0)
    handlers = Handlers()
    with serving(handlers, registry, prefix="tmhealth-", accept_process=False) as (server, path):
        yield server, handlers, registry, path


def test_a_long_request_that_makes_progress_outlives_the_client_timeout_by_heartbeats(served) -> None:
    _, _, registry, path = served
    with Connection.open(path, timeout_s=1.5) as conn:
        t0 = time.monotonic()
        assert conn.request(Ping()) == Pong()  # 3 s of work against 1.5 s of allowed silence
        assert time.monotonic() - t0 >= 2.5
    assert registry.check()


def test_a_wedged_session_stops_its_heartbeats_fails_the_health_check_and_is_named(served, caplog) -> None:
    _, handlers, registry, path = served
    with caplog.at_level(logging.ERROR, logger="tiermemd.health"):
        with Connection.open(path, timeout_s=1.5) as conn, pytest.raises(DaemonTimeout) as info:
            conn.request(Stats())
        assert info.value.request == "STATS"
        assert not registry.check()
    wedged = [r.getMessage() for r in caplog.records if "wedged" in r.getMessage()]
    assert len(wedged) == 1 and "tiermemd-session-" in wedged[0]
    assert registry.workers_ok()  # a session: the shared workers are fine, other clients keep their heartbeats
    handlers.release.set()
    deadline = time.monotonic() + 10
    while not registry.check() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert registry.check()  # released: the session thread finished and idles (or ended)

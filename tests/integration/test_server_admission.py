"""Admission against ``server.max_connections_per_uid``, with a real listener and real connections.

The handler here stands in for the daemon's: a STATS request blocks until the
test releases it, so a session thread is busy and cannot see its client's
close until then, which is what a loaded daemon looks like for a moment.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiermem.config import ServerConfig
from tiermem.errors import AdmissionError
from tiermem.protocol import Message, Ping, Pong, Stats, encode_message
from tiermem.transport import Connection, Listener
from tiermemd.health import Health
from tiermemd.server import Reply, Server, Session

LIMIT = 2


class Handlers:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.busy = threading.Semaphore(0)

    def dispatch(self, session: Session, msg: Message) -> Reply | None:
        if isinstance(msg, Stats):
            self.busy.release()
            self.release.wait(30)
        return Reply(Pong())

    def session_closed(self, session: Session, why: str) -> None:
        pass


@pytest.fixture
def served() -> Iterator[tuple[Server, Handlers, str]]:
    where = tempfile.mkdtemp(prefix="tmadmit-")
    path = str(Path(where) / "s" / "tiermemd.sock")
    handlers = Handlers()
    config = ServerConfig(socket=path, max_connections_per_uid=LIMIT)
    server = Server(Listener.bind(path), handlers, config, Health(stall_s=30.0))
    server.start()
    try:
        yield server, handlers, path
    finally:
        handlers.release.set()
        server.stop_accepting()
        server.close_sessions("test over")
        server.close()
        shutil.rmtree(where, ignore_errors=True)


def _busy_connection(path: str, handlers: Handlers) -> socket.socket:
    """A raw connection whose session thread is inside a (blocked) request."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    sock.send(encode_message(Stats(), 1))
    assert handlers.busy.acquire(timeout=10), "the request never reached the handler"
    return sock


def test_a_busy_session_whose_client_hung_up_does_not_hold_a_slot(served) -> None:
    server, handlers, path = served
    socks = [_busy_connection(path, handlers) for _ in range(LIMIT)]
    with pytest.raises(AdmissionError, match="max_connections_per_uid"), Connection.open(path, timeout_s=5.0) as c:
        c.request(Ping())
    socks.pop().close()  # its session thread is still in the handler: it has not seen the close
    assert len(server.sessions()) == LIMIT
    with Connection.open(path, timeout_s=5.0) as conn:
        assert conn.request(Ping()) == Pong()
        # the hung-up one does not count, the live ones do: a second new connection is over the limit
        with (
            pytest.raises(AdmissionError, match="max_connections_per_uid"),
            Connection.open(path, timeout_s=5.0) as other,
        ):
            other.request(Ping())
    for sock in socks:
        sock.close()

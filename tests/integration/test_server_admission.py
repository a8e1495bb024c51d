"""Admission against ``server.max_connections_per_uid``, with a real listener and real connections.

The handler here stands in for the daemon's: a STATS request blocks until the
test releases it, so a session thread is busy and cannot see its client's
close until then, which is what a loaded daemon looks like for a moment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from local_server import serving

from tiermem.client.connection import Connection
from tiermem.core.errors import AdmissionError, DaemonStopping, DaemonUnavailable
from tiermem.core.protocol import Message, Ping, Pong, Stats, encode_message
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


@contextlib.contextmanager
def _serving(prefix: str, *, accept_process: bool) -> Iterator[tuple[Server, Handlers, str]]:
    handlers = Handlers()
    config = {"max_connections_per_uid": LIMIT, "accept_process": accept_process}
    with serving(handlers, Health(stall_s=30.0), prefix=prefix, **config) as (server, path):
        yield server, handlers, path


@pytest.fixture
def served() -> Iterator[tuple[Server, Handlers, str]]:
    with _serving("tmadmit-", accept_process=False) as s:
        yield s


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


def _session_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("tiermemd-session-"))


def _wait(cond, what: str, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_a_connection_costs_no_thread_until_it_sends_a_frame(served) -> None:
    server, _handlers, path = served
    silent = []
    for _ in range(LIMIT):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(path)
        silent.append(sock)
    _wait(lambda: len(server.sessions()) == LIMIT, "the silent connections to be admitted")
    time.sleep(0.2)
    assert _session_threads() == 0, "a connection that sent nothing got a thread"
    # the first frame starts its thread, and it is answered
    silent[0].send(encode_message(Ping(), 7))
    _wait(lambda: _session_threads() == 1, "the talking connection's thread")
    assert silent[0].recv(4096)
    # a silent one that hangs up is ended without ever getting a thread, and gives its slot back
    silent.pop().close()
    _wait(lambda: len(server.sessions()) == LIMIT - 1, "the hung-up silent session to end")
    assert _session_threads() == 1
    with Connection.open(path, timeout_s=5.0) as conn:
        assert conn.request(Ping()) == Pong()
    for sock in silent:
        sock.close()
    _wait(lambda: not server.sessions(), "every session to end")
    _wait(lambda: _session_threads() == 0, "the session threads to end")
    after = server.stats()
    # every admitted connection counted once as accepted and once as ended, silent or not
    assert after.accepted == sum(n for _, n in after.disconnects) == LIMIT + 1


def test_a_silent_connection_is_ended_when_the_server_closes_its_sessions(served) -> None:
    server, _handlers, path = served
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    _wait(lambda: len(server.sessions()) == 1, "the connection to be admitted")
    server.close_sessions("test over", timeout_s=5.0)
    assert not server.sessions()
    assert sock.recv(16) == b""  # end of stream: the daemon closed it
    sock.close()


# --------------------------------------------------------------------------- with the acceptor process


@pytest.fixture
def accepting() -> Iterator[tuple[Server, Handlers, str]]:
    """The same server with ``server.accept_process`` (a real ``tiermemd.acceptor`` child on the listener)."""
    with _serving("tmacc-", accept_process=True) as s:
        yield s


def _silent(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    return sock


def test_the_acceptor_holds_silent_connections_and_passes_the_ones_that_talk(accepting) -> None:
    server, _handlers, path = accepting
    assert server._acceptor is not None and server._acceptor.poll() is None
    silent = [_silent(path) for _ in range(LIMIT)]
    time.sleep(0.3)
    assert server.sessions() == [], "a connection that sent nothing reached the daemon"
    # past the uid's limit of silent connections the acceptor refuses, with the daemon's error
    with pytest.raises(AdmissionError, match="max_connections_per_uid"), Connection.open(path, timeout_s=5.0) as c:
        c.request(Ping())
    silent[0].send(encode_message(Ping(), 7))  # the first frame: passed to the daemon, which serves it
    assert silent[0].recv(4096)
    _wait(lambda: len(server.sessions()) == 1, "the talking connection's session")
    assert _session_threads() == 1
    for sock in silent:
        sock.close()
    _wait(lambda: not server.sessions(), "the session to end")
    # the refusal was counted, and before what came after it
    with Connection.open(path, timeout_s=5.0) as conn:
        assert conn.request(Ping()) == Pong()
        assert server.stats().refused == 1


def test_a_killed_acceptor_is_started_again(accepting) -> None:
    server, _handlers, path = accepting
    first = server._acceptor
    assert first is not None
    first.kill()
    _wait(lambda: server._acceptor is not None and server._acceptor is not first, "a new acceptor")
    with Connection.open(path, timeout_s=5.0) as conn:
        assert conn.request(Ping()) == Pong()


def test_a_new_policy_restarts_the_acceptor_with_it(accepting) -> None:
    server, _handlers, path = accepting
    first = server._acceptor
    assert first is not None
    server.config = dataclasses.replace(server.config, max_connections_per_uid=LIMIT + 2)
    _wait(lambda: server._acceptor is not None and server._acceptor is not first, "the acceptor with the new policy")
    silent = [_silent(path) for _ in range(LIMIT + 1)]  # one more than the old limit: not refused now
    with Connection.open(path, timeout_s=5.0) as conn:
        assert conn.request(Ping()) == Pong()
    for sock in silent:
        sock.close()
    unchanged = server._acceptor
    server.config = dataclasses.replace(server.config, send_timeout_s=3.0)  # not the acceptor's business
    time.sleep(0.3)
    assert server._acceptor is unchanged


def test_connections_held_silent_outlive_a_restart_of_the_acceptor(accepting) -> None:
    """A client that connected and has not spoken yet (importing torch, building its model) keeps its
    connection when a new policy (SIGHUP) or a rebound socket restarts the acceptor that held it."""
    server, _handlers, path = accepting
    first = server._acceptor
    assert first is not None
    waiting = [Connection.open(path, timeout_s=5.0) for _ in range(LIMIT)]
    time.sleep(0.3)
    assert server.sessions() == [], "a connection that sent nothing reached the daemon"
    server.config = dataclasses.replace(server.config, max_connections_per_uid=LIMIT + 1)
    _wait(lambda: server._acceptor is not None and server._acceptor is not first, "the acceptor with the new policy")
    assert _session_threads() == 0, "a handed-over connection got a thread before it spoke"
    for conn in waiting:
        assert conn.request(Ping()) == Pong()
    assert len(server.sessions()) == LIMIT
    assert _session_threads() == LIMIT
    # the new acceptor counts the daemon's sessions against the uid's new limit, as before
    with Connection.open(path, timeout_s=5.0) as conn:
        assert conn.request(Ping()) == Pong()
    for conn in waiting:
        conn.close()
    _wait(lambda: not server.sessions(), "the sessions to end")


def test_a_draining_server_refuses_a_request_with_daemon_stopping_naming_it(served) -> None:
    """A request that arrives while the daemon drains (SIGTERM) is refused unstarted, as a ``DaemonUnavailable``
    (what a daemon's restart raises otherwise), naming the socket, the request and where the state stands."""
    server, _handlers, path = served
    with Connection.open(path, timeout_s=5.0) as conn:
        assert conn.request(Ping()) == Pong()
        server.draining = True
        with pytest.raises(DaemonStopping) as caught:
            conn.request(Ping())
        assert isinstance(caught.value, DaemonUnavailable)
        assert (caught.value.path, caught.value.during) == (path, "PING")
        assert f"tiermemd at {path} is stopping" in str(caught.value) and "refused PING without starting it" in str(
            caught.value
        )
        assert "opt.token" in str(caught.value) and "state_dict()" in str(caught.value)
        server.draining = False
        assert conn.request(Ping()) == Pong(), "the refusal closed the connection"

"""Client timeouts, heartbeats, send timeouts, connects under a full backlog, and per-connection memory."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
from conftest import connection_pair

from tiermem.client.connection import DEFAULT_TIMEOUT_S, Connection, connect_socket
from tiermem.client.link import client_timeout
from tiermem.core.errors import ConfigError, ConnectionClosed, DaemonTimeout, DaemonUnavailable, InvalidArgument
from tiermem.core.protocol import Ping, Pong, decode_frame, encode_message
from tiermem.net.frames import HEARTBEAT, FrameSocket, set_send_timeout


@pytest.fixture
def pair() -> Iterator[tuple[Connection, FrameSocket]]:
    with connection_pair(timeout_s=0.3) as ends:
        yield ends


def test_a_silent_daemon_raises_daemon_timeout_naming_socket_request_and_wait(pair):
    conn, _server = pair
    started = time.monotonic()
    with pytest.raises(DaemonTimeout) as info:
        conn.request(Ping())
    waited = time.monotonic() - started
    assert (info.value.path, info.value.request, info.value.timeout_s) == ("<pair>", "PING", 0.3)
    assert "<pair>" in str(info.value) and "PING" in str(info.value) and "0.3s" in str(info.value)
    assert isinstance(info.value, DaemonUnavailable)
    assert waited < 5.0  # bounded: the wait ended (not a performance figure)
    assert conn.closed


def test_heartbeats_keep_a_long_request_alive_past_the_timeout(pair):
    conn, server = pair
    beats = 8  # 8 x 0.1 s of work: well past the client's 0.3 s of allowed silence

    def work() -> None:
        raw, _ = server.recv()
        for _ in range(beats):
            time.sleep(0.1)
            server.send(HEARTBEAT)
        server.send(encode_message(Pong(), decode_frame(raw).request_id))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    assert conn.request(Ping()) == Pong()
    thread.join(5)
    assert not conn.closed


def test_a_heartbeat_left_over_after_a_reply_is_skipped_by_the_next_request(pair):
    conn, server = pair

    def work() -> None:
        for _ in range(2):
            raw, _ = server.recv()
            server.send(encode_message(Pong(), decode_frame(raw).request_id))
            server.send(HEARTBEAT)  # raced the reply: the client reads it before the next one

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    assert conn.request(Ping()) == Pong()
    assert conn.request(Ping()) == Pong()
    thread.join(5)


def test_heartbeats_stop_and_the_timeout_fires(pair):
    conn, server = pair

    def work() -> None:
        server.recv()
        for _ in range(3):
            time.sleep(0.1)
            server.send(HEARTBEAT)
        # then nothing: a daemon wedged after a while

    threading.Thread(target=work, daemon=True).start()
    with pytest.raises(DaemonTimeout):
        conn.request(Ping())


def test_the_default_timeout_is_bounded_and_configurable():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        assert Connection(a).timeout_s == DEFAULT_TIMEOUT_S
    finally:
        a.close()
        b.close()
    assert client_timeout(None, {}) == DEFAULT_TIMEOUT_S
    assert client_timeout(None, {"TIERMEM_CLIENT_TIMEOUT_S": "7.5"}) == 7.5
    assert client_timeout(3.0, {"TIERMEM_CLIENT_TIMEOUT_S": "7.5"}) == 3.0
    assert client_timeout(None, {"TIERMEM_CLIENT_TIMEOUT_S": "inf"}) is None
    with pytest.raises(ConfigError, match=r"TIERMEM_CLIENT_TIMEOUT_S.*'soon'"):
        client_timeout(None, {"TIERMEM_CLIENT_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match="TIERMEM_CLIENT_TIMEOUT_S"):
        client_timeout(None, {"TIERMEM_CLIENT_TIMEOUT_S": "0"})
    with pytest.raises(InvalidArgument, match=r"timeout_s.*-1"):
        client_timeout(-1, {})
    c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with pytest.raises(InvalidArgument, match="timeout_s must be > 0"):
            Connection(c, timeout_s=0)
    finally:
        c.close()
        d.close()


def test_a_send_the_peer_never_reads_fails_after_the_send_timeout():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sender = FrameSocket(a, max_frame=64 * 1024, accept_fds=False)
    try:
        set_send_timeout(a, 0.2)
        frame = encode_message(Ping(), 1)
        with pytest.raises(ConnectionClosed, match="does not read"):
            for _ in range(1_000_000):  # b never reads: the queue fills, then the send times out
                sender.send(frame)
    finally:
        sender.close()
        b.close()


@pytest.fixture
def listen_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tmto-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_connect_to_a_full_backlog_waits_for_room_instead_of_failing_at_once(listen_dir):
    path = os.path.join(listen_dir, "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    queued = []
    try:
        for _ in range(3):  # fill the backlog (the kernel admits backlog + 1)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                s.close()
                break
            queued.append(s)
        accepted: list[socket.socket] = []

        def accept_later() -> None:
            time.sleep(0.3)
            for _ in range(len(queued) + 1):
                accepted.append(listener.accept()[0])

        thread = threading.Thread(target=accept_later, daemon=True)
        thread.start()
        sock = connect_socket(path, timeout_s=10.0)  # waits for the accept, does not fail with EAGAIN
        sock.close()
        thread.join(10)
        for s in accepted:
            s.close()
        with pytest.raises(DaemonUnavailable, match=r"backlog stayed full for 0\.2s"):
            for _ in range(4):  # nobody accepts now: the backlog fills again and the connect gives up
                queued.append(connect_socket(path, timeout_s=0.2))
    finally:
        for s in queued:
            s.close()
        listener.close()


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_an_idle_connection_does_not_hold_max_frame_of_resident_memory():
    count, max_frame = 64, 1 << 20
    pairs = []
    before = _rss_kib()
    try:
        for _ in range(count):
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pairs.append((FrameSocket(a, max_frame=max_frame, accept_fds=False), b))
        grown_kib = _rss_kib() - before
        # a max_frame buffer per connection would be 64 MiB resident; untouched anonymous pages are not
        assert grown_kib < count * max_frame // 1024 // 8, f"{grown_kib} KiB for {count} idle connections"
        frames, peer = pairs[0]
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 << 20)
        peer.send(b"x" * (512 * 1024))
        assert len(frames.recv()[0]) == 512 * 1024  # a large frame is received whole
    finally:
        for frames, b in pairs:
            frames.close()
            b.close()

"""Unix-socket transport against real second processes: fds, peer identity, pidfds, limits, errors."""

from __future__ import annotations

import array
import mmap
import os
import pwd
import select
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import connection_pair
from forked import Forked
from stats_samples import sample_reply

import tiermem
from tiermem.client.connection import Connection, connect_socket
from tiermem.client.link import connect
from tiermem.core.errors import (
    ConfigError,
    ConnectionClosed,
    DaemonGone,
    DaemonUnavailable,
    PoolExhausted,
    ProtocolError,
)
from tiermem.core.protocol import (
    FLAG_FDS,
    PROTOCOL_VERSION,
    Attach,
    AttachOk,
    ErrorReply,
    ParamGroup,
    Ping,
    Pong,
    Stats,
    StatsReply,
    decode_frame,
    decode_message,
    encode_message,
)
from tiermem.net.frames import FrameSocket, PeerCred
from tiermemd.listener import Listener, adopt_listener, bind_listener

IS_ROOT = os.geteuid() == 0


def as_nobody() -> dict[str, int]:
    """``Forked``'s arguments for a child that runs as user ``nobody``."""
    nobody = pwd.getpwnam("nobody")
    return {"uid": nobody.pw_uid, "gid": nobody.pw_gid}


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A directory a process that dropped to ``nobody`` can reach (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="tiermem-transport-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)  # subdirectories too: nothing is left in /tmp


@pytest.fixture
def listener(sock_dir: Path) -> Iterator[Listener]:
    path = sock_dir / "d" / "tiermemd.sock"
    lst = Listener.bind(str(path), mode=0o666)
    lst.sock.settimeout(20)
    yield lst
    lst.close(unlink=str(path))


def sock_path(lst: Listener) -> str:
    return str(lst.sock.getsockname())


def serve_one(peer: Any, reply: Any, fds: tuple[int, ...] = (), flags: int = 0) -> Any:
    frame = decode_frame(peer.recv())
    peer.send(encode_message(reply, frame.request_id, flags), fds)
    return decode_message(frame)


# --------------------------------------------------------------------------- fd passing


def client_maps_window(path: str) -> dict[str, Any]:
    with Connection.open(path, timeout_s=10) as conn:
        reply, fds = conn.request_fds(Attach(job_id="job", rank=0, world_size=1, window_nbytes=8192))
        assert isinstance(reply, AttachOk)
        (fd,) = fds
        with mmap.mmap(fd, reply.window_nbytes) as window:
            seen = bytes(window[:16])
            window[4096:4101] = b"hello"
        os.close(fd)
        return {"seen": seen.hex()}


def test_client_maps_memfd_sent_with_attach_ok_and_shares_bytes(listener: Listener):
    child = Forked(client_maps_window, sock_path(listener))
    peer = listener.accept()
    fd = os.memfd_create("tiermem-window", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 8192)
        os.pwrite(fd, b"window-bytes-123", 0)
        reply = AttachOk(job_token="t", window_id=1, window_nbytes=8192, alignment=4096, max_frame=1 << 20)
        serve_one(peer, reply, (fd,), FLAG_FDS)
        out = child.value()
        assert bytes.fromhex(out["seen"]) == b"window-bytes-123"
        assert os.pread(fd, 5, 4096) == b"hello"
    finally:
        os.close(fd)
        peer.close()


def client_counts_fds(path: str) -> dict[str, Any]:
    with Connection.open(path, timeout_s=10) as conn:
        before = len(os.listdir("/proc/self/fd"))
        try:
            conn.request(Ping())
        except ProtocolError as exc:
            return {"error": str(exc), "leaked": len(os.listdir("/proc/self/fd")) - before, "closed": conn.closed}
        return {"error": None}


def test_client_closes_fds_on_a_reply_that_should_not_carry_any(listener: Listener):
    child = Forked(client_counts_fds, sock_path(listener))
    peer = listener.accept()
    read_fd, write_fd = os.pipe()
    try:
        serve_one(peer, Pong(), (read_fd, write_fd), FLAG_FDS)
        out = child.value()
    finally:
        os.close(read_fd)
        os.close(write_fd)
        peer.close()
    assert out["error"] == "PONG reply carried 2 unexpected fd(s)"
    assert out["leaked"] <= 0
    assert out["closed"] is True


def client_sends_fds(path: str) -> str:
    sock = connect_socket(path)
    read_fd, write_fd = os.pipe()
    frame = encode_message(Ping(), 1)
    sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [read_fd, write_fd]))])
    sock.send(encode_message(Ping(), 2))
    # The daemon must have closed its copies: the read end sees EOF once ours is closed.
    os.close(write_fd)
    sock.recv(64)  # the server's "done" reply
    ready, _, _ = select.select([read_fd], [], [], 5)
    eof = bool(ready) and os.read(read_fd, 1) == b""
    return "eof" if eof else "still open"


def test_server_closes_and_reports_fds_sent_by_a_client(listener: Listener):
    child = Forked(client_sends_fds, sock_path(listener))
    peer = listener.accept()
    try:
        before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(ProtocolError, match=r"peer sent 2 file descriptor\(s\); they were closed"):
            peer.recv()
        assert set(os.listdir("/proc/self/fd")) <= before
        assert decode_frame(peer.recv()).request_id == 2  # the connection stays framed
        peer.send(encode_message(Pong(), 2))
        assert child.value() == "eof"
    finally:
        peer.close()


# --------------------------------------------------------------------------- identity


def client_connects_and_waits(path: str) -> dict[str, int]:
    with Connection.open(path, timeout_s=10) as conn:
        conn.request(Ping())
    return {"pid": os.getpid(), "uid": os.getuid(), "gid": os.getgid()}


def credentials_of_a_child(listener: Listener, **ids: int) -> tuple[PeerCred, int, dict[str, int]]:
    """A forked child (as ``ids``) connects and pings: the credentials the listener saw, its pid, its own ids."""
    child = Forked(client_connects_and_waits, sock_path(listener), **ids)
    peer = listener.accept()
    try:
        serve_one(peer, Pong())
        out = child.value()
    finally:
        peer.close()
    return peer.cred, child.pid, out


def test_peer_credentials_name_the_child_process(listener: Listener):
    cred, pid, out = credentials_of_a_child(listener)
    assert (cred.pid, cred.uid, cred.gid) == (pid, out["uid"], out["gid"])
    assert out["pid"] == pid


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root to run a child as another user")
def test_peer_credentials_of_another_user(listener: Listener):
    cred, pid, out = credentials_of_a_child(listener, **as_nobody())
    nobody = pwd.getpwnam("nobody")
    assert (cred.pid, cred.uid, cred.gid) == (pid, nobody.pw_uid, nobody.pw_gid)
    assert out["uid"] == nobody.pw_uid


def client_forks_worker_then_exits(path: str) -> int:
    sock = connect_socket(path)
    worker = os.fork()
    if worker == 0:  # a DataLoader-like worker keeps the inherited socket open, nothing else
        os.closerange(3, sock.fileno())
        os.closerange(sock.fileno() + 1, 4096)
        time.sleep(30)
        os._exit(0)
    sock.send(encode_message(Ping(), 1))
    return worker


def test_pidfd_turns_readable_when_client_dies_while_a_forked_worker_keeps_the_socket(listener: Listener):
    child = Forked(client_forks_worker_then_exits, sock_path(listener))
    peer = listener.accept()
    worker = 0
    try:
        assert peer.pidfd is not None
        assert peer.cred.pid == child.pid
        worker = child.value()  # the client has exited (and been reaped by us)
        ready, _, _ = select.select([peer.pidfd], [], [], 10)
        assert ready == [peer.pidfd]
        # The socket is not at EOF: the worker still holds it, so only the pidfd tells.
        assert decode_frame(peer.recv()).request_id == 1
        readable, _, _ = select.select([peer.fileno()], [], [], 0.05)
        assert readable == []
    finally:
        if worker:
            os.kill(worker, signal.SIGKILL)
        peer.close()


def client_connects_and_exits(path: str) -> int:
    connect_socket(path)
    return os.getpid()


def test_peer_that_died_before_accept_has_no_live_pidfd(listener: Listener):
    child = Forked(client_connects_and_exits, sock_path(listener))
    child.value()  # exited and reaped before the daemon accepts
    peer = listener.accept()
    try:
        assert peer.cred.pid == child.pid
        if peer.pidfd is not None:  # SO_PEERPIDFD may still name the dead process: then it is readable
            ready, _, _ = select.select([peer.pidfd], [], [], 5)
            assert ready == [peer.pidfd]
        with pytest.raises(ConnectionClosed):
            peer.recv()
    finally:
        peer.close()


def test_adopt_listener_takes_an_inherited_seqpacket_socket_only(sock_dir: Path):
    inherited = bind_listener(sock_dir / "activated.sock")
    adopted = adopt_listener(os.dup(inherited.fileno()))
    inherited.close()
    try:
        assert adopted.type == socket.SOCK_SEQPACKET
        with connect_socket(sock_dir / "activated.sock"):
            conn, _ = adopted.accept()
            conn.close()
    finally:
        adopted.close()
    stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with pytest.raises(ConfigError, match=r"inherited fd \d+ is not an AF_UNIX SOCK_SEQPACKET socket"):
            adopt_listener(stream.fileno())
    finally:
        stream.close()


# --------------------------------------------------------------------------- limits


def client_sends_big_then_small(path: str, nbytes: int) -> str:
    sock = connect_socket(path)
    frames = FrameSocket(sock, max_frame=1 << 20, accept_fds=True)
    big = encode_message(ErrorReply("InvalidArgument", "x" * nbytes), 1)
    frames.send(big)
    frames.send(encode_message(Ping(), 2))
    frames.recv()
    return "sent"


def test_oversize_frame_is_detected_and_discarded(sock_dir: Path):
    path = str(sock_dir / "small.sock")
    lst = Listener.bind(path, max_frame=4096)
    lst.sock.settimeout(20)
    child = Forked(client_sends_big_then_small, path, 10_000)
    peer = lst.accept()
    try:
        with pytest.raises(ProtocolError, match=r"oversize frame: 10\d\d\d bytes, max_frame is 4096; frame discarded"):
            peer.recv()
        assert decode_frame(peer.recv()).request_id == 2
        peer.send(encode_message(Pong(), 2))
        assert child.value() == "sent"
    finally:
        peer.close()
        lst.close(unlink=path)


def test_send_buffer_is_sized_for_a_max_frame_packet():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    wmem_max = int(Path("/proc/sys/net/core/wmem_max").read_text())
    try:
        sender = FrameSocket(a, max_frame=1 << 20, accept_fds=True)
        receiver = FrameSocket(b, max_frame=1 << 20, accept_fds=False)
        if sender.max_send < 1 << 20:
            assert not IS_ROOT or wmem_max < 1 << 20
            pytest.skip(f"kernel granted a {sender.max_send}-byte send limit (wmem_max {wmem_max})")
        data = encode_message(
            ErrorReply("InvalidArgument", "x" * ((1 << 20) - 100)), 1
        )  # a frame 32 bytes short of 1 MiB
        sender.send(data)
        assert receiver.recv() == (data, [])
        with pytest.raises(ProtocolError, match="exceeds the sendable maximum"):
            sender.send(data + b"x" * 64)
    finally:
        a.close()
        b.close()


# --------------------------------------------------------------------------- binding and connecting


def test_bind_creates_private_parent_and_sets_mode(sock_dir: Path):
    path = sock_dir / "new" / "sub" / "d.sock"
    sock = bind_listener(path, mode=0o600)
    try:
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        sock.close()
    shared = sock_dir / "shared" / "d.sock"
    old_umask = os.umask(0o077)  # a strict umask must not hide a shared socket's directory
    try:
        sock = bind_listener(shared)
    finally:
        os.umask(old_umask)
    try:
        # a group socket's directory gets group search and no more; the umask hides neither
        assert stat.S_IMODE(shared.parent.stat().st_mode) == 0o750
        assert stat.S_IMODE(shared.stat().st_mode) == 0o660
    finally:
        sock.close()


def test_bind_replaces_a_stale_socket_but_not_a_live_one_or_a_file(sock_dir: Path):
    path = sock_dir / "d.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens: stale
    live = bind_listener(path)
    try:
        with pytest.raises(ConfigError, match="another process is listening on"):
            bind_listener(path)
    finally:
        live.close()
    path.unlink()
    path.write_text("not a socket")
    with pytest.raises(ConfigError, match="exists and is not a socket; refusing to remove it"):
        bind_listener(path)
    assert path.read_text() == "not a socket"


def test_bind_to_unknown_group_is_a_config_error(sock_dir: Path):
    with pytest.raises(ConfigError, match="no group named 'no-such-group-x'"):
        bind_listener(sock_dir / "g.sock", group="no-such-group-x")


def test_connect_errors_name_path_and_reason(sock_dir: Path):
    missing = sock_dir / "missing.sock"
    with pytest.raises(DaemonUnavailable) as info:
        connect_socket(missing)
    assert info.value.path == str(missing)
    assert (
        str(info.value) == f"no tiermemd at {missing}: ENOENT: no socket file (is tiermemd running? is the path right?)"
    )

    stale = sock_dir / "stale.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(str(stale))
    sock.close()
    with pytest.raises(DaemonUnavailable, match="ECONNREFUSED: connection refused: a stale socket file"):
        connect_socket(stale)

    stream = sock_dir / "stream.sock"
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(stream))
    other.listen()
    try:
        with pytest.raises(DaemonUnavailable, match="EPROTOTYPE: the socket is not a SOCK_SEQPACKET socket"):
            connect_socket(stream)
    finally:
        other.close()


def client_connect_error(path: str) -> str:
    try:
        connect_socket(path)
    except DaemonUnavailable as exc:
        return str(exc)
    return "connected"


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="needs root to run a child as another user")
def test_connect_permission_error_names_path(sock_dir: Path):
    path = str(sock_dir / "private.sock")
    lst = Listener.bind(path, mode=0o600)
    try:
        message = Forked(client_connect_error, path, **as_nobody()).value()
    finally:
        lst.close(unlink=path)
    assert message == (
        f"no tiermemd at {path}: EACCES: permission denied (the socket's mode or group does not admit this user)"
    )


# --------------------------------------------------------------------------- the blocking client


@pytest.fixture
def pair() -> Iterator[tuple[Connection, FrameSocket]]:
    with connection_pair(timeout_s=10) as ends:
        yield ends


def serve_in_thread(server: FrameSocket, handle: Callable[[Any, int], bytes], count: int) -> threading.Thread:
    def loop() -> None:
        for _ in range(count):
            raw, _ = server.recv()
            frame = decode_frame(raw)
            server.send(handle(decode_message(frame), frame.request_id))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_error_reply_is_raised_as_the_same_type_and_connection_stays_usable(pair):
    conn, server = pair
    replies = iter([ErrorReply.from_exception(PoolExhausted(100, 10, 5)), Pong()])
    thread = serve_in_thread(server, lambda msg, rid: encode_message(next(replies), rid), 2)
    with pytest.raises(PoolExhausted) as info:
        conn.request(Ping())
    assert (info.value.requested, info.value.free, info.value.largest_free) == (100, 10, 5)
    assert conn.request(Ping()) == Pong()
    thread.join(5)


def test_a_reply_in_another_protocol_version_says_the_two_sides_are_different_releases(pair):
    """A node upgraded on one side only (a new trainer image, an old node service): the old daemon answers
    in its own version, which used to read "unsupported protocol version 9; this side supports version(s) 10"."""
    conn, server = pair
    old = bytearray(encode_message(ErrorReply.from_exception(ProtocolError("unsupported protocol version")), 1))
    old[2] = 9

    def handle(msg: Any, rid: int) -> bytes:
        return bytes(old)

    thread = serve_in_thread(server, handle, 1)
    with pytest.raises(ProtocolError) as info:
        conn.request(Ping())
    assert str(info.value) == (
        f"tiermemd at <pair> speaks protocol version 9, this client (tiermem {tiermem.__version__}) version "
        f"{PROTOCOL_VERSION}: they are different tiermem releases; install one for the node service and the trainers"
    )
    thread.join(5)


def test_error_with_request_id_zero_answers_the_request_in_flight(pair):
    conn, server = pair
    error = ProtocolError("oversize frame: 5000 bytes, max_frame is 4096; frame discarded")
    replies = iter([encode_message(ErrorReply.from_exception(error), 0), None])

    def handle(msg: Any, rid: int) -> bytes:
        out = next(replies)
        return out if out is not None else encode_message(Pong(), rid)

    thread = serve_in_thread(server, handle, 2)
    with pytest.raises(ProtocolError, match="oversize frame: 5000 bytes"):
        conn.request(Ping())
    assert not conn.closed
    assert conn.request(Ping()) == Pong()
    thread.join(5)


def test_wrong_reply_id_or_type_breaks_the_connection(pair):
    conn, server = pair
    thread = serve_in_thread(server, lambda msg, rid: encode_message(Pong(), rid + 1), 1)
    with pytest.raises(ProtocolError, match=r"reply for request 2 while waiting for 1"):
        conn.request(Ping())
    thread.join(5)
    assert conn.closed
    with pytest.raises(DaemonUnavailable, match="connection is closed"):
        conn.request(Ping())


def test_reply_of_the_wrong_type_is_refused(pair):
    conn, server = pair
    thread = serve_in_thread(server, lambda msg, rid: encode_message(Pong(), rid), 1)
    with pytest.raises(ProtocolError, match="STATS got a PONG reply, expected STATS_REPLY"):
        conn.request(Stats())
    thread.join(5)


def test_silent_daemon_times_out_and_closes(pair):
    conn, _server = pair
    with pytest.raises(DaemonUnavailable, match=r"no reply to PING and no heartbeat within 0.2s"):
        conn.request(Ping(), timeout_s=0.2)
    assert conn.closed


def test_daemon_hanging_up_is_daemon_unavailable(pair):
    conn, server = pair
    server.close()
    with pytest.raises(DaemonUnavailable, match="<pair>"):
        conn.request(Ping())


def test_a_node_daemon_that_closed_the_connection_is_named_by_its_socket_on_every_later_call(pair):
    conn, server = pair
    server.close()
    for _ in range(2):
        with pytest.raises(DaemonGone) as info:
            conn.request(Stats())
        assert str(info.value).startswith("the node daemon at <pair> closed the connection during STATS")
        assert (info.value.path, info.value.during, info.value.pid) == ("<pair>", "STATS", None)


def test_a_daemon_closing_while_a_reply_is_awaited_is_gone_too(pair):
    conn, server = pair

    def hang_up() -> None:
        server.recv()
        server.close()

    thread = threading.Thread(target=hang_up)
    thread.start()
    with pytest.raises(DaemonGone, match=r"^the node daemon at <pair> closed the connection during PING"):
        conn.request(Ping())
    thread.join(5)


def test_a_killed_private_daemon_is_named_with_its_pid_how_it_died_and_the_state_lost(tmp_path):
    """Before: "connection lost while sending: peer closed the connection: Broken pipe"."""
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "TIERMEM_SOCKET_PATH": str(tmp_path / "no-daemon.sock")}
    client = connect(env=env, pool_size=16 << 20)
    try:
        assert client.daemon is not None
        pid = client.daemon.process.pid
        client.stats()
        os.kill(pid, signal.SIGKILL)
        for _ in range(2):  # and every later call
            with pytest.raises(DaemonGone) as info:
                client.stats()
            assert (info.value.pid, info.value.exit_code, info.value.during) == (pid, -signal.SIGKILL, "STATS")
            assert str(info.value).startswith(
                f"the private tiermemd (pid {pid}, killed by SIGKILL, exit code -9) is gone, and with it the "
                "optimizer state it held"
            )
            assert "load the last checkpoint" in str(info.value)
    finally:
        client.close()


def test_a_private_daemon_reached_by_its_socket_is_named_as_private_when_it_stops(tmp_path):
    """A process that reached another's private daemon by its socket (the demo's runs, a node's other ranks)
    was told "the node daemon ... journalctl -u tiermemd", a service that does not exist there."""
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "TIERMEM_SOCKET_PATH": str(tmp_path / "no-daemon.sock")}
    owner = connect(env=env, pool_size=16 << 20)
    try:
        assert owner.daemon is not None
        socket_path = owner.daemon.socket
        other = connect(socket_path, embed=False)
        other.stats()
    finally:
        owner.close()  # stops the daemon under the other client
    with pytest.raises(DaemonGone) as info:
        other.stats()
    message = str(info.value)
    assert message.startswith(f"the private tiermemd at {socket_path} closed the connection during STATS")
    assert "journalctl" not in message and "load the last checkpoint" in message.lower()
    other.close()


def test_threads_share_one_connection(pair):
    conn, server = pair
    per_thread, threads = 200, 4

    def handle(msg: Any, rid: int) -> bytes:
        return encode_message(sample_reply(jobs=rid), rid)

    serve_in_thread(server, handle, per_thread * threads)
    seen: list[int] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(per_thread):
            reply = conn.request(Stats())
            assert isinstance(reply, StatsReply)
            with lock:
                seen.append(reply.node.jobs)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert sorted(seen) == list(range(1, per_thread * threads + 1))


def test_oneway_send_gets_no_reply_and_requests_must_expect_one(pair):
    from tiermem.core.protocol import FLAG_ONEWAY, BucketReady

    conn, server = pair
    conn.send_oneway(BucketReady(step=1, attempt=1, bucket=0, tensor_ids=(0,), groups=(ParamGroup(lr=0.1),)))
    frame = decode_frame(server.recv()[0])
    assert frame.flags & FLAG_ONEWAY
    with pytest.raises(ProtocolError, match="PING expects a reply"):
        conn.send_oneway(Ping())
    with pytest.raises(ProtocolError, match="BUCKET_READY is not a request that gets a reply"):
        conn.request(BucketReady(step=1, attempt=1, bucket=0, tensor_ids=(0,), groups=(ParamGroup(lr=0.1),)))

"""``SocketKeeper`` on real socket files in a private directory: what it sees, binds again and reports."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

from tiermem.core.errors import ConfigError
from tiermemd.listener import Listener
from tiermemd.socketkeeper import SocketKeeper, SocketSeen, identify, look


@pytest.fixture
def sock_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d


def keeper_of(path: str, replaced: list[Listener], *, accept: bool = True) -> tuple[SocketKeeper, Listener]:
    first = Listener.bind(path, mode=0o600)

    def replace(listener: Listener) -> bool:
        replaced.append(listener)
        return accept

    return SocketKeeper(path, identify(path), lambda: Listener.bind(path, mode=0o600), replace), first


def test_a_removed_socket_is_bound_again_and_handed_over(sock_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = str(sock_dir / "d.sock")
    replaced: list[Listener] = []
    keeper, first = keeper_of(path, replaced)
    assert keeper.check() is SocketSeen.OURS and keeper.owns() and not replaced
    os.unlink(path)
    assert look(path, keeper.ours) is SocketSeen.GONE and not keeper.owns()
    with caplog.at_level(logging.WARNING, logger="tiermemd.socketkeeper"):
        assert keeper.check() is SocketSeen.GONE
    assert len(replaced) == 1 and keeper.rebinds == 1 and "listening there again" in caplog.text
    assert keeper.check() is SocketSeen.OURS and keeper.owns()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.connect(path)  # the new listener is the one at the path
    conn, _ = replaced[0].sock.accept()
    conn.close()
    client.close()
    for listener in (first, *replaced):
        listener.close()


def test_another_socket_in_its_place_is_reported_once_and_kept(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(sock_dir / "d.sock")
    replaced: list[Listener] = []
    keeper, first = keeper_of(path, replaced)
    other = Listener.bind(str(sock_dir / "other.sock"), mode=0o600)
    os.rename(sock_dir / "other.sock", path)
    with caplog.at_level(logging.ERROR, logger="tiermemd.socketkeeper"):
        assert keeper.check() is SocketSeen.OTHER
        assert keeper.check() is SocketSeen.OTHER
    assert caplog.text.count("no longer names this daemon's socket") == 1
    assert not replaced and not keeper.owns() and identify(path) is not None
    os.unlink(path)  # freed: bound again
    assert keeper.check() is SocketSeen.GONE and len(replaced) == 1 and keeper.owns()
    for listener in (first, other, *replaced):
        listener.close()


def test_a_file_in_its_place_is_not_ours_either(sock_dir: Path) -> None:
    path = str(sock_dir / "d.sock")
    keeper, first = keeper_of(path, [])
    os.unlink(path)
    Path(path).write_text("not a socket")
    assert identify(path) is None and keeper.check() is SocketSeen.OTHER and Path(path).read_text() == "not a socket"
    first.close()


def test_a_bind_that_fails_is_reported_once_per_reason_and_tried_again(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(sock_dir / "d.sock")
    reasons = iter(["no room", "no room", "still no room"])

    def rebind() -> Listener:
        raise ConfigError("server.socket", next(reasons))

    keeper = SocketKeeper(path, None, rebind, lambda _listener: True)
    with caplog.at_level(logging.ERROR, logger="tiermemd.socketkeeper"):
        for _ in range(3):
            assert keeper.check() is SocketSeen.GONE
    assert caplog.text.count("cannot be bound again") == 2 and "still no room" in caplog.text
    assert keeper.rebinds == 0


def test_a_listener_the_server_no_longer_takes_is_closed(sock_dir: Path) -> None:
    path = str(sock_dir / "d.sock")
    replaced: list[Listener] = []
    keeper, first = keeper_of(path, replaced, accept=False)
    os.unlink(path)
    keeper.check()
    assert len(replaced) == 1 and replaced[0].sock.fileno() == -1 and keeper.rebinds == 0
    first.close()

from __future__ import annotations

import os
import socket
from pathlib import Path

from tiermemd.notify import Notifier


def _listener(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    return sock


def test_ready_stopping_and_watchdog_reach_the_notify_socket(tmp_path: Path) -> None:
    sock = _listener(tmp_path / "notify")
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "4000000"})
    assert notifier.enabled and notifier.watchdog_interval_s == 2.0
    assert notifier.ready("pool 1GiB locked")
    assert notifier.watchdog()
    assert notifier.stopping()
    got = [sock.recv(4096).decode() for _ in range(3)]
    assert got[0].splitlines() == ["READY=1", "STATUS=pool 1GiB locked", f"MAINPID={os.getpid()}"]
    assert got[1] == "WATCHDOG=1"
    assert got[2].splitlines()[0] == "STOPPING=1"
    notifier.close()
    sock.close()


def test_abstract_socket_address_is_supported() -> None:
    name = f"tiermem-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    assert Notifier({"NOTIFY_SOCKET": "@" + name}).status("hello")
    assert sock.recv(100) == b"STATUS=hello"
    sock.close()


def test_without_notify_socket_everything_is_a_noop() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.watchdog_interval_s is None
    assert notifier.ready("x") is False


def test_watchdog_for_another_pid_is_ignored() -> None:
    notifier = Notifier({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"})
    assert notifier.watchdog_interval_s is None


def test_send_failure_is_reported_not_raised(tmp_path: Path) -> None:
    assert Notifier({"NOTIFY_SOCKET": str(tmp_path / "missing")}).ready("x") is False

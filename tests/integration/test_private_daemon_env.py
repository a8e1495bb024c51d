"""A private tiermemd takes its trainer's environment except what is the trainer's alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiermem.client.link import EmbeddedDaemon
from tiermem.core.units import MiB

pytestmark = pytest.mark.timeout(120)


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if entry)


def test_a_private_daemon_does_not_inherit_how_its_trainers_openmp_workers_wait(monkeypatch) -> None:
    # a trainer tuned to spin: GOMP_SPINCOUNT would override the daemon's own passive policy
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "30000000000")
    monkeypatch.setenv("TIERMEM_SOCKET_PATH", "/nonexistent/tiermemd.sock")
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    daemon = EmbeddedDaemon(pool_size=64 * MiB)
    try:
        environ = _environ(daemon.process.pid)
    finally:
        daemon.stop()
    assert "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ
    assert "TIERMEM_SOCKET_PATH" not in environ
    assert environ["PYTHONHASHSEED"] == "7"  # the rest is inherited

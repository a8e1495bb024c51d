"""A private tiermemd takes its trainer's environment except what is the trainer's alone."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
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


def test_a_private_daemon_does_not_take_the_node_services_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer outside the node service's group gets a private daemon; it must not read the service's
    /etc/tiermem/tiermemd.toml (whose metrics port the service already serves, whose socket group and kernel
    cache are the service's): a node file naming a port in use would make it fail to start (exit 5)."""
    node = Path("/etc/tiermem/tiermemd.toml")
    if os.geteuid() != 0 or node.parent.exists():
        pytest.skip("needs root and a node without /etc/tiermem, which this test writes and removes")
    monkeypatch.delenv("TIERMEM_CONFIG", raising=False)  # as on a node: tiermemd's default is the node file
    with socket.socket() as busy:  # the port the node service serves its metrics on
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        node.parent.mkdir()
        try:
            node.write_text(f"[metrics]\nport = {port}\n\n[jobs]\nmax_jobs = 3\n")
            daemon = EmbeddedDaemon(pool_size=64 * MiB)
            try:
                cmdline = Path(f"/proc/{daemon.process.pid}/cmdline").read_bytes().split(b"\0")
                assert daemon.process.poll() is None
            finally:
                daemon.stop()
        finally:
            node.unlink(missing_ok=True)
            node.parent.rmdir()
    config = cmdline[cmdline.index(b"--config") + 1].decode()
    assert config.startswith(daemon.dir)  # its own settings file, in its private directory


def test_a_private_daemon_that_cannot_be_run_leaves_no_directory_behind(monkeypatch, tmp_path: Path) -> None:
    """The daemon's interpreter cannot be executed (here: it is not there): the error comes out, and the
    private directory made for it is gone, not left in the temp dir until a later sweep."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    with pytest.raises(FileNotFoundError):
        EmbeddedDaemon(pool_size=64 * MiB)
    assert list(tmp_path.iterdir()) == []

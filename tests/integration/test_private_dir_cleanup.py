"""A private tiermemd removes its directory (socket, state, swap) even when its trainer is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_env import child_env

pytestmark = pytest.mark.timeout(180)

TRAINER = """
import sys, torch, tiermem
model = torch.nn.Linear(64, 64)
opt = tiermem.OffloadAdam(model.parameters(), offload="nvme")
model(torch.randn(4, 64)).sum().backward()
opt.step()
daemon = opt.client.daemon
print(daemon.dir, daemon.process.pid, flush=True)
sys.stdin.read()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of the killed trainer is reaped by init; until then it counts as gone once it exited
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _trainer(tmp_path: Path, tmpdir: Path) -> tuple[subprocess.Popen[str], Path, int]:
    """``TRAINER`` with ``TMPDIR=tmpdir`` and no node daemon; its private daemon's directory and pid."""
    env = child_env()
    env.update(TMPDIR=str(tmpdir), TIERMEM_SOCKET_PATH=str(tmp_path / "none" / "tiermemd.sock"))
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert trainer.stdout is not None
    line = trainer.stdout.readline().split()
    if not line:
        trainer.kill()
        raise AssertionError(f"the trainer exited {trainer.wait()} before starting its daemon")
    return trainer, Path(line[0]), int(line[1])


def test_a_private_daemon_removes_its_directory_when_its_trainer_is_killed(tmp_path: Path) -> None:
    trainer, directory, daemon_pid = _trainer(tmp_path, tmp_path)
    try:
        assert directory.parent == tmp_path and (directory / "tiermemd.sock").exists()
        assert any((directory / "swap").iterdir())  # the NVMe state is in there
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
        deadline = time.monotonic() + 60
        while (directory.exists() or _alive(daemon_pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(daemon_pid), "the private daemon outlived its trainer"
        assert not directory.exists(), f"left behind: {sorted(p.name for p in directory.rglob('*'))}"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def test_a_temp_dir_too_deep_for_a_socket_puts_the_private_daemon_in_tmp(tmp_path: Path) -> None:
    """A batch scheduler's or a test runner's per-job ``TMPDIR`` can be deeper than AF_UNIX's 107 bytes allow
    for the socket: the private daemon failed to start ("choose a shorter server.socket", a setting the user
    never gave).  Its directory goes in /tmp instead, and is removed when the trainer ends."""
    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    trainer, directory, _ = _trainer(tmp_path, deep)
    try:
        assert directory.parent == Path("/tmp") and (directory / "tiermemd.sock").exists()
        trainer.communicate("", timeout=60)  # stdin closed: the trainer ends normally
        assert trainer.returncode == 0
        deadline = time.monotonic() + 60
        while directory.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not directory.exists(), f"{directory} outlived its trainer"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()

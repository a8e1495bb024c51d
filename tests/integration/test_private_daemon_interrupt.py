"""Ctrl-C in a terminal with a private tiermemd: SIGINT goes to the whole foreground process group, and the
daemon, a child of the trainer, used to be in it.  It stopped at once, so the trainer's ``except
KeyboardInterrupt`` that saves a checkpoint found its optimizer state gone (``DaemonGone``), and ``tiermem
demo`` ended in a traceback.  The daemon now runs in a session of its own: the trainer alone is interrupted,
saves, and its exit stops the daemon."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from child_env import child_env

pytestmark = pytest.mark.timeout(180)

TRAINER = """
import sys, torch, tiermem
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
opt = tiermem.OffloadAdam(model.parameters(), lr=1e-3, offload=sys.argv[2])
x, y = torch.randn(32, 64), torch.randn(32, 8)
step = 0
try:
    while True:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 3:
            print(opt.client.daemon.dir, opt.client.daemon.process.pid, flush=True)
except KeyboardInterrupt:
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, sys.argv[1])
    print("saved", step, flush=True)
"""


DEMO_ARGS = ("--runs", "offload-cpu", "--steps", "100000", "--quiet", "--no-plot", "--params", "2e5")
"""A demo that would train for long: the interrupt comes first."""


def _env(tmp_path: Path) -> dict[str, str]:
    env = child_env()
    env.update(TMPDIR=str(tmp_path), TIERMEM_SOCKET_PATH=str(tmp_path / "none" / "tiermemd.sock"))
    return env


def _interrupted(
    argv: list[str], tmp_path: Path, ready: Callable[[str], bool], settle_s: float
) -> tuple[int, str, str]:
    """Run ``argv`` as a shell runs a foreground job (a process group of its own, no node daemon), and press
    Ctrl-C (SIGINT to every process of the group) ``settle_s`` after it printed a line ``ready`` takes: (its
    exit code, that line, what it printed after it)."""
    proc = subprocess.Popen(
        argv,
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while not ready(line):
            assert line, f"{argv[1:3]} ended before it was ready"
            line = proc.stdout.readline()
        time.sleep(settle_s)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, line, out


def _daemon_line(line: str) -> bool:
    """The trainer's line naming its daemon's directory and pid (past the warning that no node daemon answers)."""
    words = line.split()
    return len(words) == 2 and words[1].isdigit()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_ctrl_c_leaves_the_private_daemon_to_the_trainers_checkpoint(tmp_path: Path, offload: str) -> None:
    checkpoint = tmp_path / "interrupted.pt"
    # a few more steps after the line: the interrupt lands anywhere in one
    code, started, out = _interrupted(
        [sys.executable, "-c", TRAINER, str(checkpoint), offload], tmp_path, _daemon_line, 0.3
    )
    directory, daemon_pid = Path(started.split()[0]), int(started.split()[1])
    assert code == 0, out[-3000:]
    assert "saved" in out and "DaemonGone" not in out, out[-3000:]
    saved = torch.load(checkpoint, weights_only=True)
    state = saved["opt"]["state"]
    assert sorted(state) == [0, 1, 2, 3]
    # the state is the trainer's at the interrupt: every param stepped alike, as often as the loop counted (one
    # more where the interrupt landed after a step, before the loop's count)
    steps = {float(entry["step"]) for entry in state.values()}
    assert len(steps) == 1 and steps.pop() - saved["step"] in (0, 1), (steps, saved["step"])
    assert all(entry["exp_avg_sq"].abs().sum() > 0 for entry in state.values())
    # the trainer's exit stopped its daemon and removed its directory
    deadline = time.monotonic() + 30
    while directory.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not directory.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(daemon_pid, 0)


def test_ctrl_c_ends_the_demo_with_130_and_no_traceback(tmp_path: Path) -> None:
    code, _, out = _interrupted(
        [sys.executable, "-m", "tiermem.client.cli", "demo", *DEMO_ARGS],
        tmp_path,
        lambda line: "starting an embedded tiermemd" in line,
        3.0,
    )
    # 130 from the CLI; or the default SIGINT disposition during the interpreter's shutdown (-2), seen once in 4
    # clean-clone runs after the message was printed: a shell reports 130 for both
    assert code in (130, -signal.SIGINT), (code, out[-3000:])
    assert "tiermem demo: interrupted" in out and "Traceback" not in out, out[-3000:]

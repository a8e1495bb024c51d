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


def _ctrl_c(proc: subprocess.Popen[str]) -> None:
    """What a terminal does on Ctrl-C: SIGINT to every process of the foreground group."""
    os.killpg(proc.pid, signal.SIGINT)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_ctrl_c_leaves_the_private_daemon_to_the_trainers_checkpoint(tmp_path: Path, offload: str) -> None:
    checkpoint = tmp_path / "interrupted.pt"
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(checkpoint), offload],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a group of its own, as a shell gives a foreground job
    )
    try:
        assert trainer.stdout is not None
        started: list[str] = []
        while not (len(started) == 2 and started[1].isdigit()):  # past the warning of no node daemon
            line = trainer.stdout.readline()
            assert line, "the trainer ended before training"
            started = line.split()
        directory, daemon_pid = Path(started[0]), int(started[1])
        time.sleep(0.3)  # a few more steps: the interrupt lands anywhere in one
        _ctrl_c(trainer)
        out, _ = trainer.communicate(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert trainer.returncode == 0, out[-3000:]
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
    demo = subprocess.Popen(
        [sys.executable, "-m", "tiermem.client.cli", "demo", *DEMO_ARGS],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        cwd=tmp_path,
    )
    try:
        assert demo.stdout is not None
        while "starting an embedded tiermemd" not in demo.stdout.readline():
            assert demo.poll() is None, "the demo ended before starting its daemon"
        time.sleep(3)
        _ctrl_c(demo)
        out, _ = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 130, out[-3000:]
    assert "tiermem demo: interrupted" in out and "Traceback" not in out, out[-3000:]

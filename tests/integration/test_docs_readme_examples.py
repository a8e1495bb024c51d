"""README.md's Python examples, run as written: each block is split into its examples (runs of lines between blank
lines), and each example runs on a fresh small model, followed by one training step with the optimizer it built,
in a subprocess with a private daemon.  What the README leaves to the reader (``model``, ``build_model``,
``init_weights``) is defined here, small; the distributed block runs as one gloo rank (its comment's
``"gloo" on the CPU``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from child_env import child_env

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

PRELUDE = textwrap.dedent(
    """
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)


    def build_model() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


    def init_weights(module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            nn.init.normal_(p, std=0.02)


    def one_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss), loss
    """
)


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def examples(block: str) -> tuple[str, list[str]]:
    """The block's head (its imports and set-up, up to the first blank line) and its examples."""
    head, *rest = [part.strip("\n") for part in re.split(r"\n\s*\n", block) if part.strip()]
    return head, rest


def script_for(block: str, *, distributed: bool) -> str:
    head, parts = examples(block)
    if distributed:
        head = head.replace('init_process_group("nccl")', 'init_process_group("gloo")')
        parts = [p.replace('init_process_group("nccl")', 'init_process_group("gloo")') for p in parts]
    lines = [PRELUDE, head]
    for i, part in enumerate(parts):
        if "init_process_group" in part:
            lines.append(part)
            continue
        body = part if "build_model()" in part else "model = build_model()\n" + part
        if "opt = " in body:  # the last optimizer the example made trains one step, then closes
            body += "\none_step(model, opt)\nif hasattr(opt, 'close'):\n    opt.close()"
        lines.append(f"\ndef example_{i}() -> None:\n" + textwrap.indent(body, "    "))
        lines.append(f"example_{i}()\nprint('example {i} ran', flush=True)\n")
    if distributed:
        lines.append("dist.destroy_process_group()\n")
    return "\n".join(lines)


def run_script(script: str, tmp_path: Path, env_extra: dict[str, str]) -> str:
    path = tmp_path / "example.py"
    path.write_text(script)
    env = child_env()
    env.update(TIERMEM_SOCKET_PATH=str(tmp_path / "no-node-daemon.sock"), PYTHONPATH=str(ROOT), **env_extra)
    proc = subprocess.run(
        [sys.executable, str(path)], check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"{script}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_the_readme_has_the_two_example_blocks() -> None:
    blocks = python_blocks()
    assert len(blocks) == 2
    assert "import tiermem.distributed" in blocks[1]


@pytest.mark.slow
def test_every_single_process_example_in_the_readme_runs(tmp_path: Path) -> None:
    block = python_blocks()[0]
    out = run_script(script_for(block, distributed=False), tmp_path, {})
    assert out.count("ran") == len(examples(block)[1])


@pytest.mark.slow
def test_every_distributed_example_in_the_readme_runs_as_one_gloo_rank(tmp_path: Path) -> None:
    block = python_blocks()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000), "RANK": "0", "WORLD_SIZE": "1"}
    out = run_script(script_for(block, distributed=True), tmp_path, env)
    n = len([p for p in examples(block)[1] if "init_process_group" not in p])
    assert out.count("ran") == n

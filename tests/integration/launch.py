"""The test side of ``scenarios.py``: one ``torchrun`` launch runs a module's scenarios against one daemon.

A module builds a ``Launch`` in a module-scoped fixture; each test asks for
its scenario with ``launch.check(name)``, which fails with the scenario's own
traceback (or the launch's output) when it did not finish.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from child_env import child_env

SCENARIOS = str(Path(__file__).with_name("scenarios.py"))


@dataclass
class Launch:
    """One ``torchrun --nproc-per-node N`` of ``worker`` over ``plan`` (``{name: args}``, run in that order)."""

    worker: str
    nproc: int
    plan: dict[str, list[str]]
    tmp: Path
    socket_path: str
    workers: dict[str, str] = field(default_factory=dict)
    """Scenarios of another worker file in this launch: name -> that file."""
    returncode: int | None = None
    output: str = ""

    def out(self, name: str) -> Path:
        """The ``--out`` path of scenario ``name``."""
        return self.tmp / name / "out"

    def run(self, timeout_s: float = 240.0) -> Launch:
        """Launch it; a launch still running after ``timeout_s`` is killed (below pytest's own 300 s, so the
        tests report the launch's output rather than a stack dump)."""
        plan = []
        for name, args in self.plan.items():
            self.out(name).parent.mkdir(parents=True, exist_ok=True)
            plan.append(
                [name, ["--out", str(self.out(name)), *args], *([self.workers[name]] if name in self.workers else [])]
            )
        plan_file = self.tmp / "plan.json"
        plan_file.write_text(json.dumps(plan))
        env = child_env()
        env.update(
            TIERMEM_SOCKET_PATH=self.socket_path,
            TIERMEM_NO_EMBED="1",
            TMPDIR=str(self.tmp),
            TIERMEM_SECRET_FILE=str(self.tmp / "job-secret"),  # the user's job secret, out of the home directory
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
             SCENARIOS, self.worker, str(plan_file)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,  # a launch that hangs is killed with its ranks, not only torchrun
        )  # fmt: skip
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            output = f"killed after {timeout_s} s:\n{output}"
        self.returncode = process.returncode
        self.output = output[-6000:]
        return self

    def check(self, name: str) -> Path:
        """``name``'s ``--out`` path, once it is known that the scenario ran to its end on every rank."""
        errors = sorted(self.tmp.glob(f"{name}.error.*"))
        if errors:
            raise AssertionError(f"scenario {name} failed:\n" + "\n".join(p.read_text()[-4000:] for p in errors))
        order = list(self.plan)
        failed = sorted({p.name.split(".error.")[0] for p in self.tmp.glob("*.error.*")}, key=order.index)
        if failed and order.index(failed[0]) < order.index(name):
            raise AssertionError(f"scenario {name} did not run: {failed[0]}, run before it, failed")
        if not failed and self.returncode != 0:
            raise AssertionError(f"the launch ended with {self.returncode}:\n{self.output}")
        return self.out(name)

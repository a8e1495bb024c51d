"""``tiermem doctor`` and ``tiermem status`` against a real daemon, against none, and as a user outside it.

The CLI runs as a subprocess without the test's ``TIERMEM_*`` (``run_tiermem_cli``); the run as another uid
is a forked child that dropped to ``nobody`` after this process imported what the doctor needs (the
interpreter may live where ``nobody`` cannot read).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from child_env import child_env
from conftest import DaemonProcess, run_tiermem_cli
from forked import Forked

from tiermem import __version__
from tiermem.core.protocol import PROTOCOL_VERSION

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running as nobody needs root")


def by_check(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for finding in report["findings"]:
        out.setdefault(finding["check"], []).append(finding)
    return out


def isolated(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No node settings file, this user's runtime directory and caches under ``tmp_path``."""
    return {"XDG_RUNTIME_DIR": str(tmp_path / "run"), "TIERMEM_CONFIG": str(_config(tmp_path)), **extra}


def _config(tmp_path: Path, swap: Path | None = None) -> Path:
    path = tmp_path / "node.toml"
    swap = swap or tmp_path / "swap"
    path.write_text(f'[swap]\ndirs = ["{swap}"]\n[server]\nstate_dir = "{tmp_path / "state"}"\n')
    return path


def test_doctor_reaches_a_real_daemon_and_reports_it(daemon: DaemonProcess, tmp_path: Path) -> None:
    done = run_tiermem_cli("doctor", "--socket", daemon.socket_path, "--json", env=isolated(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["can_train"] is True and report["socket"] == daemon.socket_path
    assert report["protocol"] == PROTOCOL_VERSION
    checks = by_check(report)
    (found,) = checks["daemon"]
    assert found["status"] == "ok"
    assert found["found"].startswith(f"tiermemd {__version__}, protocol {PROTOCOL_VERSION}, at {daemon.socket_path}")
    assert [f["status"] for f in checks["attach"]] == ["ok"]
    (pool,) = checks["pool"]
    assert pool["status"] == "ok" and "64MiB" in pool["found"]  # the fixture's pool
    assert [f["status"] for f in checks["swap"]] in (["ok"], ["warn"])  # tmp_path may lack O_DIRECT
    assert {f["status"] for f in report["findings"]} <= {"ok", "warn", "skip"}
    text = run_tiermem_cli("doctor", "--socket", daemon.socket_path, env=isolated(tmp_path))
    assert text.returncode == 0
    assert "This node can train through tiermem" in text.stdout and daemon.socket_path in text.stdout


def test_doctor_without_a_daemon_says_a_private_one_starts_or_fails_when_none_may(tmp_path: Path) -> None:
    done = run_tiermem_cli("doctor", "--json", env=isolated(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    (found,) = by_check(json.loads(done.stdout))["daemon"]
    assert found["status"] == "warn" and "starts a private daemon" in found["found"]
    assert str(tmp_path / "run" / "tiermem" / "tiermemd.sock") in found["found"]
    refused = run_tiermem_cli("doctor", "--json", env=isolated(tmp_path, TIERMEM_NO_EMBED="1"))
    assert refused.returncode == 1
    report = json.loads(refused.stdout)
    assert report["can_train"] is False and by_check(report)["daemon"][0]["status"] == "fail"
    named = run_tiermem_cli(
        "doctor", "--socket", str(tmp_path / "none.sock"), env=isolated(tmp_path, TIERMEM_NO_EMBED="1")
    )
    assert named.returncode == 1 and "This node cannot train through tiermem" in named.stdout
    assert "no socket file" in named.stdout


def test_the_help_lists_the_exit_codes() -> None:
    done = run_tiermem_cli("doctor", "--help")
    assert done.returncode == 0
    assert "exit codes: 0 the node can train" in done.stdout and "1 a check failed" in done.stdout


def test_status_without_a_daemon_says_so_in_one_line(tmp_path: Path) -> None:
    done = run_tiermem_cli("status", env=isolated(tmp_path, TIERMEM_NO_EMBED="1"))
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    per_user = str(tmp_path / "run" / "tiermem" / "tiermemd.sock")
    assert line.startswith("tiermem status: no tiermemd to show: nothing answers on ")
    assert line.count(per_user) == 1 and line.count("no tiermemd") == 1


def _doctor_as_nobody(socket_path: str, config: str) -> dict[str, Any]:
    from tiermem.client.doctor import exit_code, run_checks, to_json
    from tiermem.client.doctor_probe import gather

    facts = gather(socket_path=socket_path, config_path=config, timeout_s=10.0, env={"HOME": "/nonexistent"})
    findings = run_checks(facts)
    return to_json(facts, findings, exit_code(findings))


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user may search (pytest's own ``tmp_path`` sits in a 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="tiermem-doctor-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@needs_root
def test_doctor_as_a_user_the_daemon_refuses_with_a_read_only_swap_dir(daemon: DaemonProcess, open_dir: Path) -> None:
    import torch  # noqa: F401 - imported before the fork, as the doctor's facts need it

    import tiermem.client.doctor_probe
    import tiermem.client.link  # noqa: F401

    swap = open_dir / "readonly-swap"
    swap.mkdir(mode=0o500)
    os.chown(swap, NOBODY, NOBODY)
    config = _config(open_dir, swap)
    config.chmod(0o644)
    report = Forked(_doctor_as_nobody, daemon.socket_path, str(config), uid=NOBODY).value()
    assert report["user"]["uid"] == NOBODY and report["exit_code"] == 1 and report["can_train"] is False
    checks = by_check(report)
    (attach,) = checks["attach"]
    assert attach["status"] == "fail" and f"refuses uid {NOBODY} (nobody)" in attach["found"]
    assert "allowed_gids" in attach["fix"]
    (swap_finding,) = checks["swap"]
    assert swap_finding["status"] == "fail" and "not writable: Permission denied" in swap_finding["found"]


def test_doctor_runs_under_python_dash_o(tmp_path: Path) -> None:
    """No check hides in an assert: the report is the same without them."""
    env = child_env() | isolated(tmp_path)
    done = subprocess.run(
        [sys.executable, "-O", "-m", "tiermem.client.cli", "doctor", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["findings"]

"""The installed ``tiermemd`` program and the shipped systemd units, checked as real processes."""

from __future__ import annotations

import grp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from child_env import child_env

from tiermem.core.config import config_to_dict, load_config

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "systemd"
INSTALLED = Path(sys.executable).with_name("tiermemd")


def tiermemd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [str(INSTALLED)] if INSTALLED.exists() else [sys.executable, "-m", "tiermemd.main"]
    clean = child_env()
    return subprocess.run(
        [*command, *args], env={**clean, **(env or {})}, capture_output=True, text=True, timeout=120, check=False
    )


def test_help_exits_0_and_lists_the_exit_codes():
    done = tiermemd("--help")
    assert done.returncode == 0, done.stderr
    assert "--check-config" in done.stdout and "exit codes" in done.stdout


def test_the_shipped_example_config_passes_check_config():
    """It passes where the install made its socket group; elsewhere that group is what --check-config names."""
    done = tiermemd("--config", str(SYSTEMD / "tiermemd.toml"), "--check-config")
    try:
        grp.getgrnam("tiermem")
    except KeyError:
        assert done.returncode == 2, done.stderr
        assert "config server.socket_group: no group named 'tiermem'" in done.stderr
    else:
        assert done.returncode == 0, done.stderr


def test_check_config_names_what_a_start_would_fail_on_later(tmp_path):
    """Names on this node a start would otherwise fail on with exit 5, restarted in a loop by systemd."""
    cases = {
        "server.socket_group": f'[server]\nsocket = "{tmp_path}/s.sock"\nsocket_group = "no-such-group-here"\n',
        "server.socket": f'[server]\nsocket = "{tmp_path}/{"d" * 120}/s.sock"\n',
        "metrics.address": '[metrics]\nport = 9464\naddress = "no-such-host.invalid"\n',
    }
    for field, text in cases.items():
        config = tmp_path / "node.toml"
        config.write_text(text)
        for flags in (["--check-config"], []):  # the same before starting anything
            done = tiermemd("--config", str(config), *flags)
            assert done.returncode == 2, (field, done.stderr)
            assert f"config {field}:" in done.stderr, done.stderr


def test_an_invalid_config_exits_2_naming_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[jobs]\ngrace_period_s = "soon"\n')
    for flags in (["--check-config"], []):  # the same before starting anything
        done = tiermemd("--config", str(bad), *flags)
        assert done.returncode == 2
        assert "jobs.grace_period_s" in done.stderr


def test_print_config_is_toml_of_the_effective_settings(tmp_path):
    env = {"TIERMEM_SERVER_MAX_FRAME": "2MiB", "HOME": str(tmp_path)}
    done = tiermemd("--config", str(SYSTEMD / "tiermemd.toml"), "--pool-size", "3GiB", "--print-config", env=env)
    assert done.returncode == 0, done.stderr
    printed = tomllib.loads(done.stdout)
    effective = config_to_dict(load_config(SYSTEMD / "tiermemd.toml", env=env, overrides={"pool.size": "3GiB"}))
    assert printed == {
        s: {k: list(v) if isinstance(v, tuple) else v for k, v in t.items()} for s, t in effective.items()
    }
    assert printed["server"]["max_frame"] == 2 << 20


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_systemd_units_pass_systemd_analyze_verify(tmp_path):
    service = (SYSTEMD / "tiermemd.service").read_text()
    exec_lines = [line for line in service.splitlines() if line.startswith("ExecStart=")]
    assert len(exec_lines) == 1
    binary = INSTALLED if INSTALLED.exists() else Path(sys.executable)
    program, _, flags = exec_lines[0].removeprefix("ExecStart=").partition(" ")
    (tmp_path / "tiermemd.service").write_text(service.replace(exec_lines[0], f"ExecStart={binary} {flags}"))
    shutil.copy(SYSTEMD / "tiermemd.socket", tmp_path / "tiermemd.socket")

    def verify(*units: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["systemd-analyze", "verify", "--man=no", *units],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    done = verify("./tiermemd.socket", "./tiermemd.service")
    assert done.returncode == 0, done.stderr
    ours = [line for line in (done.stdout + done.stderr).splitlines() if "tiermemd" in line]
    assert ours == [], "systemd-analyze warned about the units"
    # the check has teeth: a unit whose program does not exist fails it
    (tmp_path / "broken.service").write_text(service.replace(program, "/nonexistent/tiermemd"))
    assert verify("./broken.service").returncode != 0

"""The shipped systemd units: ``systemd-analyze verify`` passes and ``security`` scores the service <= 3.0,
and they agree with each other, with the example settings and with docs/operating.md's install steps."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

UNITS = Path(__file__).resolve().parents[2] / "systemd"
OPERATING = UNITS.parent / "docs" / "operating.md"
ANALYZE = shutil.which("systemd-analyze")

needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def setting(unit: str, key: str) -> str:
    (value,) = re.findall(rf"^{key}=(.*)$", (UNITS / unit).read_text(), re.M)
    return value.strip()


def _copy(tmp_path: Path) -> Path:
    """The units with ExecStart pointing at this environment's tiermemd (verify checks it exists)."""
    exe = Path(sys.executable).with_name("tiermemd")
    if not exe.exists():
        exe = Path(shutil.which("true") or "/bin/true")
    for name in ("tiermemd.service", "tiermemd.socket"):
        text = (UNITS / name).read_text().replace("/opt/tiermem/bin/tiermemd", str(exe))
        (tmp_path / name).write_text(text)
    return tmp_path


@needs_analyze
def test_the_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    units = _copy(tmp_path)
    result = subprocess.run(
        [ANALYZE, "verify", str(units / "tiermemd.service"), str(units / "tiermemd.socket")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr + result.stdout


@needs_analyze
def test_the_service_scores_at_most_3_in_systemd_analyze_security(tmp_path: Path) -> None:
    units = _copy(tmp_path)
    result = subprocess.run(
        [ANALYZE, "security", "--offline=yes", "--no-pager", str(units / "tiermemd.service")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    found = re.search(r"Overall exposure level for tiermemd\.service: ([0-9.]+)", result.stdout + result.stderr)
    assert found, result.stdout[-2000:] + result.stderr[-2000:]
    assert float(found.group(1)) <= 3.0, result.stdout


def test_the_service_creates_its_runtime_directory_where_the_socket_lives() -> None:
    service = (UNITS / "tiermemd.service").read_text()
    socket_unit = (UNITS / "tiermemd.socket").read_text()
    assert re.search(r"^RuntimeDirectory=tiermem$", service, re.M)
    assert re.search(r"^ListenSequentialPacket=/run/tiermem/tiermemd\.sock$", socket_unit, re.M)
    from tiermem.client.link import NODE_SOCKET

    assert NODE_SOCKET == "/run/tiermem/tiermemd.sock"


def test_both_units_give_the_runtime_directory_one_mode() -> None:
    assert setting("tiermemd.service", "RuntimeDirectoryMode") == setting("tiermemd.socket", "DirectoryMode") == "0755"


def test_exec_start_runs_the_virtual_environment_the_install_steps_make() -> None:
    program = setting("tiermemd.service", "ExecStart").split()[0]
    venv = str(Path(program).parents[1])
    assert program == f"{venv}/bin/tiermemd" and not venv.startswith("/home")  # ProtectHome=yes
    steps = OPERATING.read_text()
    assert f"python3 -m venv {venv}\n" in steps and f"{venv}/bin/pip install ." in steps


def test_the_example_settings_keep_kernels_and_swap_where_the_service_may_write() -> None:
    settings = tomllib.loads((UNITS / "tiermemd.toml").read_text())
    state = "/var/lib/" + setting("tiermemd.service", "StateDirectory")
    writable = setting("tiermemd.service", "ReadWritePaths").split()
    for path in (settings["adam"]["cache_dir"], *settings["swap"]["dirs"], settings["server"]["state_dir"]):
        assert any(path == w or path.startswith(w + "/") for w in writable), path
        assert path == state or path.startswith(state + "/"), path  # kept across restarts, unlike PrivateTmp's /tmp
    assert settings["server"]["socket_group"] == setting("tiermemd.socket", "SocketGroup")
    assert settings["server"]["socket"] == setting("tiermemd.socket", "ListenSequentialPacket")

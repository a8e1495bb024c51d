"""The shipped systemd units: ``systemd-analyze verify`` passes and ``security`` scores the service <= 3.0."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "systemd"
ANALYZE = shutil.which("systemd-analyze")

pytestmark = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def _copy(tmp_path: Path) -> Path:
    """The units with ExecStart pointing at this environment's tiermemd (verify checks it exists)."""
    exe = Path(sys.executable).with_name("tiermemd")
    if not exe.exists():
        exe = Path(shutil.which("true") or "/bin/true")
    for name in ("tiermemd.service", "tiermemd.socket"):
        text = (UNITS / name).read_text().replace("/usr/local/bin/tiermemd", str(exe))
        (tmp_path / name).write_text(text)
    return tmp_path


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

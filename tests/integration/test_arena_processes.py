"""Arenas across processes: sharing by fd, no other way in, and mlock refused by RLIMIT_MEMLOCK."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_pool import NOBODY, child_pattern, parent_pattern

from tiermem.core.units import KiB, MiB
from tiermem.engine.pool import Arena

HELPER = Path(__file__).with_name("helpers_pool.py")
ROOT = Path(__file__).resolve().parents[2]

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a child as user nobody")


def run_helper(*args: object, pass_fds: tuple[int, ...] = ()) -> dict[str, object]:
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, str(HELPER), *map(str, args)],
        pass_fds=pass_fds,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"child exited {proc.returncode}: {proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_process_maps_the_passed_fd_and_shares_the_bytes() -> None:
    nbytes = 256 * KiB
    with Arena.create(nbytes, name="shared-test") as arena:
        arena.view(0, nbytes)[:] = parent_pattern(nbytes)
        out = run_helper("map", arena.fd, nbytes, pass_fds=(arena.fd,))
        assert out == {"saw_parent_bytes": True, "nbytes": nbytes, "sealed": True}
        assert bytes(arena.view(0, nbytes)) == child_pattern(nbytes)


def test_memfd_has_no_name_in_dev_shm() -> None:
    with Arena.create(64 * KiB, name="nameless-test") as arena:
        target = os.readlink(f"/proc/self/fd/{arena.fd}")
        assert target.startswith("/memfd:nameless-test")
        assert not any("nameless-test" in name for name in os.listdir("/dev/shm"))


@needs_root
def test_unprivileged_process_without_the_fd_cannot_reach_the_memory() -> None:
    with Arena.create(64 * KiB, name="private-test") as arena:
        out = run_helper("probe", os.getpid(), arena.fd)
    assert out["uid"] == NOBODY
    assert out["proc_fd"] == "PermissionError"
    assert out["proc_map_files"] == "PermissionError"
    assert not any("private-test" in name for name in out["dev_shm"])  # type: ignore[union-attr]


@needs_root
def test_mlock_refused_by_rlimit_warns_once_and_the_pool_still_works() -> None:
    limit, nbytes = 64 * KiB, 8 * MiB
    out = run_helper("mlock", limit, nbytes)
    assert out["uid"] == NOBODY
    assert out["locked"] is False
    assert out["arenas_locked"] == [False, False]
    assert out["refusal_limits"] == [limit, limit]
    assert out["capacity"] == nbytes
    assert out["intact"] is True
    warnings = out["warnings"]
    assert isinstance(warnings, list) and len(warnings) == 1
    assert "RLIMIT_MEMLOCK" in warnings[0] and "LimitMEMLOCK=infinity" in warnings[0]

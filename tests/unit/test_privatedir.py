"""Private daemon directories: removed once neither their client nor their daemon is alive."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiermem.net import privatedir


def _make(parent: Path, name: str) -> tuple[Path, int]:
    path = parent / f"{privatedir.PREFIX}{name}"
    path.mkdir(mode=0o700)
    (path / "tiermemd.sock").write_bytes(b"")
    fd = os.open(path / privatedir.LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    return path, fd


def test_a_directory_whose_lock_a_live_process_holds_is_kept_and_removed_once_it_is_gone(tmp_path: Path) -> None:
    path, fd = _make(tmp_path, "held")
    fcntl.flock(fd, fcntl.LOCK_EX)
    # a child inherits the lock (as the daemon does), and the parent lets go of its copy
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, pass_fds=(fd,)
    )
    os.close(fd)
    try:
        assert privatedir.sweep(str(tmp_path)) == []
        assert path.exists()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    assert privatedir.sweep(str(tmp_path)) == [str(path)]
    assert not path.exists()


def test_sweep_leaves_other_users_directories_symlinks_and_fresh_unlocked_ones(tmp_path: Path) -> None:
    fresh = tmp_path / f"{privatedir.PREFIX}fresh"
    fresh.mkdir(mode=0o700)  # being created right now: no lock file yet
    target, fd = _make(tmp_path, "target")
    os.close(fd)
    link = tmp_path / f"{privatedir.PREFIX}link"
    link.symlink_to(target)
    opened = tmp_path / f"{privatedir.PREFIX}open"
    opened.mkdir(mode=0o755)  # not private: not one create() made
    assert privatedir.sweep(str(tmp_path)) == [str(target)]
    assert fresh.exists() and link.is_symlink() and opened.exists()
    old = os.stat(fresh).st_mtime - privatedir.UNLOCKED_GRACE_S - 1
    os.utime(fresh, (old, old))
    assert privatedir.sweep(str(tmp_path)) == [str(fresh)]


def _tmpdir(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """``create()`` and ``parent_dir()`` under ``path`` (``tempfile`` asks ``TMPDIR`` again)."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", None)


def test_create_makes_a_private_locked_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tmpdir(monkeypatch, tmp_path)
    path, fd = privatedir.create()
    try:
        assert Path(path).parent == tmp_path and privatedir.is_private_dir(path)
        assert oct(os.stat(path).st_mode & 0o777) == "0o700"
        assert privatedir.sweep(str(tmp_path)) == []  # held by us
    finally:
        os.close(fd)
    assert privatedir.sweep(str(tmp_path)) == [path]


def test_a_sweep_while_a_directory_is_being_created_leaves_it_to_its_creator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks start their private daemons at once: one's sweep runs inside the other's ``create``, at
    its worst moment, after the lock file exists and before it is locked."""
    _tmpdir(monkeypatch, tmp_path)
    real_flock = fcntl.flock
    swept: list[list[str]] = []

    def flock_after_a_sweep(fd: int, op: int) -> None:
        if not swept:
            swept.append(privatedir.sweep(str(tmp_path)))  # the other rank's, before this lock is taken
        real_flock(fd, op)

    monkeypatch.setattr(privatedir.fcntl, "flock", flock_after_a_sweep)
    path, fd = privatedir.create()
    monkeypatch.setattr(privatedir.fcntl, "flock", real_flock)
    try:
        assert swept == [[]]
        assert privatedir.is_private_dir(path)
        assert privatedir.sweep(str(tmp_path)) == []  # held
    finally:
        os.close(fd)


_RACE = """
import sys
from tiermem.net import privatedir
for _ in range(int(sys.argv[1])):
    path, fd = privatedir.create()
    privatedir.sweep()
    assert privatedir.is_private_dir(path), path
    privatedir.remove(path)
    __import__("os").close(fd)
"""


def test_processes_creating_and_sweeping_at_once_never_take_each_others_directories(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    racers = [
        subprocess.Popen([sys.executable, "-c", _RACE, "150"], env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    errors = [p.communicate(timeout=120)[1] for p in racers]
    assert [p.returncode for p in racers] == [0] * 4, errors
    assert list(tmp_path.iterdir()) == []

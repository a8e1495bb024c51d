"""Real cgroup v1 children for tests that put a process under a limit: where this process may make one, and
one made with its settings and removed again (retried: a child's exit is accounted a moment after it)."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup")


def own_v1_cgroup(controller: str) -> Path | None:
    """This process's cgroup directory under v1's ``controller`` (``memory``, ``cpu``) when it is writable,
    so it can have children; else None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            directory = V1_ROOT / controllers / path.lstrip("/")
            if os.access(directory, os.W_OK):
                return directory
    return None


@contextlib.contextmanager
def scratch_cgroup(parent: Path, settings: Mapping[str, str]) -> Iterator[Path]:
    """A new child of ``parent`` with each ``settings`` file written, removed on exit."""
    group = parent / f"tiermem-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        for name, value in settings.items():
            (group / name).write_text(value)
        yield group
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:  # the child's exit is still being accounted
                time.sleep(0.1)

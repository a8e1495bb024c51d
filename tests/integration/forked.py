"""A function run in a forked child process, as this uid or another, its JSON-able result coming back by pipe.

The child writes one JSON object before ``os._exit``: ``{"ok": value}``, or
``{"error": type name, "message": str, "fields": the error's declared fields}``
when ``fn`` raised.  ``outcome()`` is that object; ``value()`` is ``value``
and fails the test with the child's error otherwise.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any


def become(uid: int, gid: int) -> None:
    """Drop this process to ``uid``/``gid`` with no supplementary groups (needs root)."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def error_fields(exc: BaseException) -> dict[str, Any]:
    """The values of the fields a typed error declares (``exc.fields``), by name."""
    return {name: getattr(exc, name, None) for name in getattr(exc, "fields", ())}


class Forked:
    """``fn(*args)`` in a forked child, as ``uid`` (group ``gid``, default ``uid``) when given."""

    def __init__(self, fn: Callable[..., Any], *args: Any, uid: int | None = None, gid: int | None = None) -> None:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(read_fd)
            code = 0
            try:
                if uid is not None:
                    become(uid, uid if gid is None else gid)
                out: Any = {"ok": fn(*args)}
            except BaseException as exc:
                out = {"error": type(exc).__name__, "message": str(exc), "fields": error_fields(exc)}
                code = 1
            try:
                os.write(write_fd, json.dumps(out).encode())
            finally:
                os._exit(code)
        os.close(write_fd)
        self.pid = pid
        self._read_fd = read_fd

    def outcome(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The child's JSON object once it has exited (and been reaped); a child still running is killed."""
        chunks = []
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                ready, _, _ = select.select([self._read_fd], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    os.kill(self.pid, signal.SIGKILL)
                    raise AssertionError("child timed out")
                chunk = os.read(self._read_fd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(self._read_fd)
            os.waitpid(self.pid, 0)
        return json.loads(b"".join(chunks) or b"{}")  # type: ignore[no-any-return]

    def value(self, timeout_s: float = 60.0) -> Any:
        """What ``fn`` returned; the child's error fails the test."""
        out = self.outcome(timeout_s)
        if "error" in out:
            raise AssertionError(f"child failed: {out['error']}: {out['message']}")
        return out["ok"]

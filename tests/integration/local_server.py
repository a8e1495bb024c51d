"""A real ``tiermemd.server.Server`` on a real listener in this process, with handlers a test supplies.

For the server's own behaviour (admission, heartbeats, health) without a
daemon around it: the socket lives in a fresh directory under the system's
temporary directory, removed at the end.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from tiermem.core.config import ServerConfig
from tiermemd.health import Health
from tiermemd.listener import Listener
from tiermemd.server import Handlers, Server


class ReleasableHandlers(Handlers, Protocol):
    release: threading.Event
    """Set at teardown, so a handler that holds a request until released lets its session go."""


@contextlib.contextmanager
def serving(
    handlers: ReleasableHandlers, registry: Health, *, prefix: str, **config: Any
) -> Iterator[tuple[Server, str]]:
    """(the started server, its socket path); ``config`` are ``ServerConfig`` fields besides the socket."""
    where = tempfile.mkdtemp(prefix=prefix)
    path = str(Path(where) / "s" / "tiermemd.sock")
    server = Server(Listener.bind(path), handlers, ServerConfig(socket=path, **config), registry)
    server.start()
    try:
        yield server, path
    finally:
        handlers.release.set()
        server.stop_accepting()
        server.close_sessions("test over")
        server.close()
        shutil.rmtree(where, ignore_errors=True)

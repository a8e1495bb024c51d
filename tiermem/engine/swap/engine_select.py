"""Choosing an I/O engine: ``open_engine(config, directories)``.

``swap.engine = "auto"`` takes libaio with O_DIRECT when the ``libaio``
package loads (it needs libaio.so.1: Debian's libaio1), a kernel AIO context
can be created, and every swap directory accepts O_DIRECT (tmpfs refuses it
with EINVAL); otherwise the thread engine.  The fallback and its reason are
logged once per reason.  ``"libaio"`` insists (``ConfigError`` with the reason
when it cannot work); ``"threads"`` always takes the thread engine.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from tiermem.core.config import DEFAULT_QUEUE_DEPTH, MAX_QUEUE_DEPTH, SwapConfig
from tiermem.core.errors import ConfigError
from tiermem.engine.swap.engine import IOEngine
from tiermem.engine.swap.engine_threads import ThreadEngine

try:  # loads libaio.so.1 through ctypes
    from tiermem.engine.swap.engine_libaio import LibaioEngine
except (ImportError, OSError) as _exc:
    LibaioEngine = None  # type: ignore[assignment,misc]
    _LIBAIO_MISSING: str | None = f"{_exc}"
else:
    _LIBAIO_MISSING = None

__all__ = ["direct_io_unsupported", "libaio_unavailable", "open_engine"]

log = logging.getLogger(__name__)
_logged: set[str] = set()
_logged_lock = threading.Lock()


def libaio_unavailable() -> str | None:
    """Why the libaio engine cannot load here, or None when it can."""
    if _LIBAIO_MISSING is None:
        return None
    return (
        f"the libaio package or libaio.so.1 is missing ({_LIBAIO_MISSING}); install libaio1 (apt) and the libaio "
        "Python package (pip)"
    )


def direct_io_unsupported(directory: str | os.PathLike[str]) -> str | None:
    """Why files in ``directory`` cannot be opened with O_DIRECT, or None when they can."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".tiermem-odirect-", dir=directory)
    os.close(fd)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return f"{directory} does not support O_DIRECT (tmpfs or similar)"
        return f"opening a file in {directory} with O_DIRECT failed: {exc.strerror}"
    else:
        os.close(fd)
    finally:
        os.unlink(probe)
    return None


def open_engine(config: SwapConfig, directories: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> IOEngine:
    """The engine ``config.engine`` asks for, able to serve files in every one of ``directories``."""
    dirs = [directories] if isinstance(directories, (str, os.PathLike)) else list(directories)
    threads = ThreadEngine(block_size=config.block_size, threads=config.threads) if config.engine == "threads" else None
    if threads is not None:
        return threads
    reason = libaio_unavailable()
    for d in dirs:
        reason = reason or direct_io_unsupported(d)
    if reason is None and LibaioEngine is not None:
        try:
            if config.queue_depth:
                return LibaioEngine(block_size=config.block_size, queue_depth=config.queue_depth)
            engine = LibaioEngine(block_size=config.block_size, queue_depth=MAX_QUEUE_DEPTH)
            engine.set_queue_depth(DEFAULT_QUEUE_DEPTH)  # until the swap device is measured
            return engine
        except OSError as exc:
            reason = (
                f"creating a kernel AIO context of depth {config.queue_depth or MAX_QUEUE_DEPTH} failed: {exc.strerror}"
            )
            if exc.errno == errno.EAGAIN:
                reason += " (raise fs.aio-max-nr or lower swap.queue_depth)"
    reason = reason or "unknown"
    if config.engine == "libaio":
        raise ConfigError("swap.engine", f'"libaio" cannot be used: {reason}; set swap.engine = "auto"')
    with _logged_lock:
        first = reason not in _logged
        _logged.add(reason)
    if first:
        log.warning("swap I/O uses the thread engine (buffered, no O_DIRECT): %s", reason)
    return ThreadEngine(block_size=config.block_size, threads=config.threads)

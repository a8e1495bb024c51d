"""Orphans: swap and job files found at start that no job owns; reported at once, removed after the grace period.

A daemon that was killed (or lost a job file: deleted, set aside as
``*.bad``) leaves swap files (``<store>.swap`` in each swap directory),
manifests (``<store>.manifest``, ``<store>.manifest.tmp``) and half-written
job files (``*.tmp``) that nothing will ever reopen.  At start ``scan`` lists
every such file whose store no restored job names, logs them (how many, how
many bytes, when they go), and ``sweep`` (called from the main loop) deletes
them once ``grace_period_s`` has passed: long enough for an operator to
repair a job file and restart, short enough that a node does not fill up.

A store of that name created meanwhile by a new job (the same uid and job id
again) takes its files over: ``forget`` drops them from the list, and the
NVMe placement wipes them before use, so a new job never sees a previous one's
bytes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from tiermem.core.units import format_size

__all__ = ["Orphans", "store_of"]

log = logging.getLogger(__name__)

_SUFFIXES = (".manifest.tmp", ".manifest", ".swap")


def store_of(path: Path) -> str | None:
    """The store name a swap-directory file belongs to, or None for a file that is not a store's."""
    for suffix in _SUFFIXES:
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            return path.name[: -len(suffix)]
    return None


class Orphans:
    def __init__(
        self,
        *,
        swap_dirs: Sequence[Path],
        jobs_dir: Path,
        grace_period_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.swap_dirs = list(swap_dirs)
        self.jobs_dir = jobs_dir
        self.grace_period_s = grace_period_s
        self._clock = clock
        self._due = 0.0
        self.pending: dict[str, list[Path]] = {}
        """store name (or the job file's name) -> its files, until they are removed or taken over."""
        self.removed_nbytes = 0
        self.removed_files = 0

    def scan(self, known: Iterable[str]) -> list[Path]:
        """Find the files of stores not in ``known`` (and cut-short job file writes); returns them."""
        known = set(known)
        found: dict[str, list[Path]] = {}
        for directory in self.swap_dirs:
            with contextlib.suppress(OSError):
                for path in sorted(directory.iterdir()):
                    name = store_of(path)
                    if name is not None and name not in known and path.is_file() and not path.is_symlink():
                        found.setdefault(name, []).append(path)
        with contextlib.suppress(OSError):
            for path in sorted(self.jobs_dir.glob("*.tmp")):
                if path.is_file() and not path.is_symlink():
                    found.setdefault(path.name, []).append(path)
        self.pending = found
        self._due = self._clock() + self.grace_period_s
        files = [p for paths in found.values() for p in paths]
        if files:
            nbytes = sum(_size(p) for p in files)
            log.warning(
                "found %d file(s), %s, that no job owns (left by a daemon that was killed, or whose job file is "
                "gone): %s; they are removed in %.0fs (jobs.grace_period_s)",
                len(files),
                format_size(nbytes),
                ", ".join(str(p) for p in files[:8]) + (" ..." if len(files) > 8 else ""),
                self.grace_period_s,
            )
        return files

    def forget(self, name: str) -> None:
        """A new store named ``name`` takes these files over (it wipes them itself)."""
        self.pending.pop(name, None)

    def sweep(self) -> list[Path]:
        """Remove the pending files once the grace period is over; returns what was removed."""
        if not self.pending or self._clock() < self._due:
            return []
        removed = []
        swept_nbytes = 0
        for paths in self.pending.values():
            for path in paths:
                nbytes = _size(path)
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    log.error("cannot remove the orphan file %s: %s", path, exc)
                    continue
                removed.append(path)
                swept_nbytes += nbytes
                self.removed_nbytes += nbytes
                self.removed_files += 1
        self.pending = {}
        if removed:
            log.info("removed %d orphan file(s) (%s)", len(removed), format_size(swept_nbytes))
        return removed


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0

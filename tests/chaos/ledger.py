"""What a daemon holds, taken before and after a chaos scenario: the scenario must leave it flat.

A ``Snapshot`` records the daemon's pool and swap bytes in use (from its
STATS), its open fds, RSS and threads (from ``/proc``), and the files under
the directories the scenario watches (state and swap directories, and the
daemon's socket directory).  ``settle`` polls until a snapshot is back to a
reference one (threads and sockets of finished clients take a moment to go),
and ``problems`` says what is not: every count equal, files equal, RSS within
a slack (the allocator keeps some of what it freed).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tiermem.client.connection import Connection
from tiermem.core.protocol import Stats

__all__ = ["Snapshot", "daemon_counters", "problems", "settle", "snapshot"]

RSS_SLACK = 48 << 20
"""RSS may stay this much above where it started (freed memory the allocator keeps, a warmed cache)."""


@dataclass(frozen=True)
class Snapshot:
    pool_used_nbytes: int
    swap_used_nbytes: int
    fds: int
    rss_nbytes: int
    threads: int
    files: frozenset[str]
    fd_targets: tuple[str, ...] = ()
    """What each open fd points at (``readlink``), so a leak says what leaked."""

    def figures(self) -> dict[str, int]:
        return {
            "pool_used_nbytes": self.pool_used_nbytes,
            "swap_used_nbytes": self.swap_used_nbytes,
            "fds": self.fds,
            "rss_nbytes": self.rss_nbytes,
            "threads": self.threads,
            "files": len(self.files),
        }


def daemon_counters(socket_path: str) -> tuple[int, int]:
    """(pool bytes in use, swap bytes in use) from the daemon's STATS."""
    with Connection.open(socket_path, timeout_s=30.0) as conn:
        reply = conn.request(Stats())
    node = getattr(reply, "node", None)
    if node is not None:
        return int(node.pool.used_nbytes), int(node.swap.used_nbytes)
    values = dict(reply.values)  # type: ignore[attr-defined]
    return int(values["pool_used_bytes"]), int(values.get("budget_swap_held_bytes", 0))


def _proc(pid: int) -> tuple[int, int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss = int(fields["VmRSS"].split()[0]) * 1024
    threads = int(fields["Threads"])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return fds, rss, threads


def _fd_targets(pid: int) -> tuple[str, ...]:
    targets = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            continue  # closed meanwhile
    return tuple(sorted(targets))


def _files(dirs: Iterable[Path]) -> frozenset[str]:
    found = set()
    for root in dirs:
        for dirpath, _dirnames, filenames in os.walk(root):
            found.update(os.path.join(dirpath, name) for name in filenames)
    return frozenset(found)


def snapshot(pid: int, socket_path: str, dirs: Iterable[Path] = ()) -> Snapshot:
    """The ledger of daemon ``pid`` now.

    /proc is read before the STATS connection is opened, and the snapshot returns once the daemon's
    side of that connection (socket, pidfd) is gone: its session thread sees the close
    asynchronously, and a busy machine would otherwise show a leak (or a loss) that is not one.
    """
    fds, rss, threads = _proc(pid)
    targets = _fd_targets(pid)
    pool, swap = daemon_counters(socket_path)
    _until_closed(pid, fds, threads)
    return Snapshot(pool, swap, fds, rss, threads, _files(dirs), targets)


def _until_closed(pid: int, fds: int, threads: int, timeout_s: float = 5.0) -> None:
    """Until the daemon holds no more fds and threads than before the STATS connection (its side of it,
    socket, pidfd and session thread, is gone), so the next snapshot's /proc read does not see it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now_fds, _, now_threads = _proc(pid)
        if now_fds <= fds and now_threads <= threads:
            return
        time.sleep(0.005)


def problems(before: Snapshot, after: Snapshot, rss_slack: int = RSS_SLACK) -> list[str]:
    """What differs between two snapshots (empty: the ledger is flat)."""
    out = []
    for name in ("pool_used_nbytes", "swap_used_nbytes", "fds", "threads"):
        if getattr(before, name) != getattr(after, name):
            out.append(f"{name}: {getattr(before, name)} -> {getattr(after, name)}")
    if before.fds != after.fds and before.fd_targets and after.fd_targets:
        gained = sorted(set(after.fd_targets) - set(before.fd_targets))
        lost = sorted(set(before.fd_targets) - set(after.fd_targets))
        out.append(f"fds gained {gained[:6]}, lost {lost[:6]}")
    if after.rss_nbytes > before.rss_nbytes + rss_slack:
        out.append(f"rss: {before.rss_nbytes >> 20} MiB -> {after.rss_nbytes >> 20} MiB")
    if before.files != after.files:
        added = sorted(after.files - before.files)[:5]
        removed = sorted(before.files - after.files)[:5]
        out.append(f"files: added {added}, removed {removed}")
    return out


def settle(take: Callable[[], Snapshot], like: Snapshot, timeout_s: float = 15.0) -> Snapshot:
    """Take snapshots until one is flat against ``like`` (or ``timeout_s`` passed); returns the last."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = take()
        if not problems(like, now) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)

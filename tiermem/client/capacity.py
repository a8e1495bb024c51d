"""What this node can hold: host memory (and its cgroup limit), free swap space, a running daemon's budget, GPU memory.

Thin readers of the kernel's files, ``statvfs`` and the daemon's STATS reply,
each returning bytes and a few words saying where the figure came from; the
arithmetic they feed is ``tiermem.core.estimate``.  The cgroup walk and its
memory figure are ``tiermem.core.cgroups``'s, which the daemon's start-up
check (``tiermemd.memfit``) reads too, so an estimate counts a cgroup as the
daemon will.  Paths are parameters so tests read files they wrote.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tiermem.core import cgroups
from tiermem.core.errors import DaemonUnavailable, TiermemError
from tiermem.core.estimate import NodeCapacity, format_gb
from tiermem.net import privatedir

if TYPE_CHECKING:
    from tiermem.core.protocol import StatsReply

__all__ = [
    "DaemonBudget",
    "cgroup_headroom",
    "daemon_budget",
    "free_disk",
    "gpu_memory",
    "host_available",
    "node_capacity",
    "probe_daemon",
    "read_meminfo",
    "training_swap_dirs",
]


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except (OSError, ValueError):
        return None


def read_meminfo(path: str | os.PathLike[str] = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` as bytes per field (``MemTotal``, ``MemAvailable``, ...)."""
    return cgroups.parse_meminfo(Path(path).read_text())


def cgroup_headroom(
    proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup", root: str | os.PathLike[str] = cgroups.ROOT
) -> tuple[int, str] | None:
    """Bytes this process's memory cgroup (and every ancestor) still allows, and which cgroup is the tightest.

    Counted as the daemon's start-up check counts it (``tiermem.core.cgroups``: v1 and v2, the hybrid layout,
    inactive page cache not in use); ``None`` when no level sets a limit or none is readable.
    """
    text = _read(os.fspath(proc_cgroup))
    if text is None:
        return None
    level = cgroups.tightest(cgroups.memory_limits(text, _read, os.fspath(root)))
    if level is None:
        return None
    return level.room_nbytes, f"cgroup {level.path} (limit {format_gb(level.limit_nbytes)})"


def host_available(
    meminfo: str | os.PathLike[str] = "/proc/meminfo",
    proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
    cgroup_root: str | os.PathLike[str] = cgroups.ROOT,
) -> tuple[int, str]:
    """Host memory a new daemon could take now: ``MemAvailable``, or the cgroup's headroom when that is less."""
    info = read_meminfo(meminfo)
    available = info.get("MemAvailable", info.get("MemFree", 0))
    source = f"MemAvailable, of {format_gb(info.get('MemTotal', 0))} in all"
    room = cgroup_headroom(proc_cgroup, cgroup_root)
    if room is not None and room[0] < available:
        return room[0], room[1]
    return available, source


def free_disk(dirs: Sequence[str | os.PathLike[str]]) -> tuple[int, str]:
    """Free bytes for swap files under ``dirs``, each filesystem counted once.

    A directory that does not exist yet is measured at its nearest existing ancestor (the daemon creates it).
    """
    seen: dict[int, int] = {}
    names: list[str] = []
    for d in dirs:
        path = Path(d).absolute()
        while not path.exists() and path != path.parent:
            path = path.parent
        st = os.stat(path)
        if st.st_dev in seen:
            continue
        vfs = os.statvfs(path)
        seen[st.st_dev] = vfs.f_bavail * vfs.f_frsize
        names.append(str(path))
    return sum(seen.values()), "free disk of " + ", ".join(names)


def training_swap_dirs(config_path: str | None, configured: Sequence[str]) -> list[str]:
    """Where a training run on this node would put its NVMe state when no daemon answers: the node settings'
    ``swap.dirs`` (``configured``) where a settings file is in place, as the node service will; with none, each
    trainer starts a private daemon, whose swap is in its directory under ``privatedir.parent_dir()``."""
    return list(configured) if config_path else [privatedir.parent_dir()]


@dataclass(frozen=True)
class DaemonBudget:
    """A running daemon's room for new state: its pool and swap budgets less what jobs hold."""

    socket: str
    pool_free_nbytes: int
    pool_capacity_nbytes: int
    swap_free_nbytes: int
    swap_capacity_nbytes: int


def daemon_budget(reply: StatsReply, socket: str) -> DaemonBudget:
    """The pool and swap budgets in the daemon's STATS reply (``Client.stats()``), less what jobs hold.

    Raises ``TiermemError`` when the reply carries no pool budget.
    """
    budgets = {b.resource: (b.capacity_nbytes, b.held_nbytes) for b in reply.node.budgets}
    if "pool" not in budgets:
        raise TiermemError(
            f"the STATS reply of tiermemd at {socket} has no pool budget (it lists "
            f"{', '.join(sorted(budgets)) or 'none'}); is the daemon of another tiermem version?"
        )
    pool_capacity, pool_held = budgets["pool"]
    swap_capacity, swap_held = budgets.get("swap", (0, 0))
    return DaemonBudget(
        socket=socket,
        pool_free_nbytes=max(0, pool_capacity - pool_held),
        pool_capacity_nbytes=pool_capacity,
        swap_free_nbytes=max(0, swap_capacity - swap_held),
        swap_capacity_nbytes=swap_capacity,
    )


def probe_daemon(socket_path: str | None = None, *, timeout_s: float = 5.0) -> DaemonBudget | None:
    """The budget of the daemon this user's client would use (``tiermem.client.link.connect``), or None if none runs.

    Never starts a private daemon.  A socket that fails the client's trust checks raises its ``UnsafePathError``.
    """
    from tiermem.client.link import connect

    try:
        client = connect(socket_path, embed=False, timeout_s=timeout_s)
    except DaemonUnavailable:
        return None
    try:
        return daemon_budget(client.stats(), client.socket_path)
    finally:
        client.close()


def gpu_memory() -> tuple[int, str] | None:
    """Total memory of the first CUDA device, when torch sees one."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return int(props.total_memory), f"cuda:0 {props.name}"


def node_capacity(
    *,
    swap_dirs: Sequence[str],
    daemon: DaemonBudget | None,
    gpu: tuple[int, str] | None,
) -> NodeCapacity:
    """This node's ``NodeCapacity``: the daemon's budgets where one runs, else free memory and disk."""
    host, host_from = host_available()
    if daemon is not None:
        pool: int | None = daemon.pool_free_nbytes
        pool_from = f"tiermemd at {daemon.socket} (pool {format_gb(daemon.pool_capacity_nbytes)})"
    else:
        pool, pool_from = None, "no daemon"
    if daemon is not None and daemon.swap_capacity_nbytes:
        nvme, nvme_from = daemon.swap_free_nbytes, f"tiermemd at {daemon.socket} (swap budget)"
    else:
        nvme, nvme_from = free_disk(swap_dirs)
    return NodeCapacity(
        gpu_nbytes=None if gpu is None else gpu[0],
        gpu_from="no CUDA device seen; give --gpu-memory" if gpu is None else gpu[1],
        host_nbytes=host,
        host_from=host_from,
        pool_nbytes=pool,
        pool_from=pool_from,
        nvme_nbytes=nvme,
        nvme_from=nvme_from,
    )

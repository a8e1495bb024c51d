"""Whether the pool (and the staging windows it may lock) fits the memory this daemon may use.

Checked at start-up, before a byte is allocated: a pool the node cannot hold
would otherwise be pre-faulted into the OOM killer (in a 3 GiB memory cgroup
the daemon died with no message).  The limits, each read from the kernel:

- the memory cgroup: cgroup v2 ``memory.max`` minus ``memory.current``, or v1
  ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes`` (inactive page
  cache, reclaimable, not counted as used), for the daemon's cgroup and every
  ancestor (the tightest wins; "max" and v1's near-2^63 mean no limit);
- the node's RAM: ``MemAvailable`` of ``/proc/meminfo`` (pre-faulting more
  than that pushes the node into reclaim and swap, or the OOM killer);
- ``RLIMIT_MEMLOCK`` when the memory will be locked: the pool and the windows
  (``jobs.window_budget``) are both ``mlock``ed.  A limit below the pool alone
  keeps the documented fallback (the pool runs unlocked, with a warning); a
  limit that admits the pool but not the pool plus its windows is refused,
  since the windows would then fail one by one at attach.  Root's
  CAP_IPC_LOCK ignores the limit.

``read_limits`` reads files (paths injectable for tests); ``check_fit`` is
pure and returns the refusal message with the numbers, or None; ``fit_pool``
resolves ``pool.size = 0`` (half of the tightest limit) and raises
``DoesNotFit`` with that message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
from dataclasses import dataclass
from pathlib import Path

from tiermem.core.config import PoolConfig
from tiermem.core.units import format_size

__all__ = ["DoesNotFit", "MemoryLimit", "cgroup_limits", "check_fit", "fit_pool", "memlock_limit", "read_limits"]

_UNLIMITED = 1 << 60
"""Cgroup v1 writes "no limit" as the largest page-aligned 63-bit value; anything above this is no limit."""


@dataclass(frozen=True)
class MemoryLimit:
    """How much more memory one limit lets this process take."""

    what: str
    """The limit, named so an operator can find it ("memory cgroup /sys/fs/cgroup/memory/job: limit 3GiB")."""
    room: int
    """Bytes still available under it."""
    fix: str
    """How to raise it."""


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(directory: Path, name: str) -> int:
    """One counter of the cgroup's ``memory.stat`` (0 when missing): inactive page cache is reclaimable."""
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_limits(proc_cgroup: str, cgroup_root: Path) -> list[MemoryLimit]:
    """The memory limits of the cgroup named in ``/proc/self/cgroup`` text and of its ancestors."""
    out: list[MemoryLimit] = []
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            base, limit_name, usage_name, fix = cgroup_root, "memory.max", "memory.current", "MemoryMax="
            cache_name = "inactive_file"
            if (cgroup_root / "unified").is_dir() and not (cgroup_root / "cgroup.controllers").exists():
                base = cgroup_root / "unified"  # hybrid layout: v2 mounted beside the v1 controllers
        elif "memory" in controllers.split(","):
            base = cgroup_root / "memory"
            limit_name, usage_name, fix = "memory.limit_in_bytes", "memory.usage_in_bytes", "MemoryLimit="
            cache_name = "total_inactive_file"
        else:
            continue
        node = Path(path.strip() or "/")
        while True:
            directory = base / str(node).lstrip("/")
            limit = _read_int(directory / limit_name)
            if limit is not None and limit < _UNLIMITED:
                usage = max(0, (_read_int(directory / usage_name) or 0) - _stat(directory, cache_name))
                out.append(
                    MemoryLimit(
                        what=(f"memory cgroup {directory}: limit {format_size(limit)}, {format_size(usage)} in use"),
                        room=max(0, limit - usage),
                        fix=f"raise the cgroup's limit ({fix} in the unit)",
                    )
                )
            if node == node.parent:
                break
            node = node.parent
    return out


def ram_limit(meminfo: str) -> MemoryLimit | None:
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
            return MemoryLimit(
                what=f"the node's available RAM (MemAvailable) {format_size(available)}",
                room=available,
                fix="free memory on the node",
            )
    return None


def memlock_limit() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes, or None when it does not bind (unlimited, or root's CAP_IPC_LOCK)."""
    if os.geteuid() == 0:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def read_limits(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> list[MemoryLimit]:
    """Every memory limit that applies to this process now (cgroups, RAM)."""
    limits: list[MemoryLimit] = []
    with contextlib.suppress(OSError):
        limits.extend(cgroup_limits((proc / "self" / "cgroup").read_text(), cgroup_root))
    try:
        ram = ram_limit((proc / "meminfo").read_text())
    except OSError:
        ram = None
    if ram is not None:
        limits.append(ram)
    return limits


def check_fit(
    *,
    pool_nbytes: int,
    window_nbytes: int,
    mlock: bool,
    limits: list[MemoryLimit],
    memlock: int | None,
) -> str | None:
    """None when ``pool_nbytes`` plus ``window_nbytes`` fits every limit; else the refusal, with the numbers."""
    need = pool_nbytes + window_nbytes
    asked = (
        f"pool.size {format_size(pool_nbytes)} plus {format_size(window_nbytes)} of staging windows "
        f"(jobs.window_budget) = {format_size(need)}"
    )
    for limit in sorted(limits, key=lambda lim: lim.room):
        if need > limit.room:
            return (
                f"{asked} does not fit {limit.what} ({format_size(limit.room)} left); "
                f"lower pool.size or jobs.window_budget, or {limit.fix}"
            )
    if mlock and memlock is not None and pool_nbytes <= memlock < need:
        return (
            f"{asked} would be locked, but RLIMIT_MEMLOCK is {format_size(memlock)} (the pool alone fits, its "
            "windows would fail at attach); set LimitMEMLOCK=infinity in the unit, lower jobs.window_budget, "
            "or set pool.mlock = false"
        )
    return None


class DoesNotFit(Exception):
    """The pool and its windows do not fit the memory the daemon may use (the message gives the numbers)."""


def fit_pool(pool: PoolConfig, window_nbytes: int, limits: list[MemoryLimit], memlock: int | None) -> PoolConfig:
    """``pool`` with its size resolved (``size = 0``: half of the tightest limit), once it is known to fit
    with ``window_nbytes`` of windows; else ``DoesNotFit``."""
    size = pool.size
    if size == 0 and limits:
        half = min(limit.room for limit in limits) // 2
        size = max(pool.alignment, half - half % pool.alignment)
    refusal = check_fit(pool_nbytes=size, window_nbytes=window_nbytes, mlock=pool.mlock, limits=limits, memlock=memlock)
    if refusal is not None:
        raise DoesNotFit(refusal)
    return dataclasses.replace(pool, size=size) if size else pool

"""Whether the pool (and the staging windows it may lock) fits the memory this daemon may use.

Checked at start-up, before a byte is allocated: a pool the node cannot hold
would otherwise be pre-faulted into the OOM killer (in a 3 GiB memory cgroup
the daemon died with no message).  The limits, each read from the kernel:

- the memory cgroup: cgroup v2 ``memory.max`` minus ``memory.current``, or v1
  ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes`` (inactive page
  cache, reclaimable, not counted as used), for the daemon's cgroup and every
  ancestor (the tightest wins; "max" and v1's near-2^63 mean no limit), as
  ``tiermem.core.cgroups`` reads them (``tiermem estimate`` reads the same);
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

from tiermem.core import cgroups
from tiermem.core.config import PoolConfig
from tiermem.core.units import format_size

__all__ = ["DoesNotFit", "MemoryLimit", "cgroup_limits", "check_fit", "fit_pool", "memlock_limit", "read_limits"]


@dataclass(frozen=True)
class MemoryLimit:
    """How much more memory one limit lets this process take."""

    what: str
    """The limit, named so an operator can find it ("memory cgroup /sys/fs/cgroup/memory/job: limit 3GiB")."""
    room: int
    """Bytes still available under it."""
    fix: str
    """How to raise it."""


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except (OSError, ValueError):
        return None


def cgroup_limits(proc_cgroup: str, cgroup_root: Path) -> list[MemoryLimit]:
    """The memory limits of the cgroup named in ``/proc/self/cgroup`` text and of its ancestors."""
    return [
        MemoryLimit(
            what=(
                f"memory cgroup {level.directory}: limit {format_size(level.limit_nbytes)}, "
                f"{format_size(level.usage_nbytes)} in use"
            ),
            room=level.room_nbytes,
            fix=f"raise the cgroup's limit ({level.unit_setting} in the unit)",
        )
        for level in cgroups.memory_limits(proc_cgroup, _read, str(cgroup_root))
    ]


def ram_limit(meminfo: str) -> MemoryLimit | None:
    """The node's ``MemAvailable``, from the text of ``/proc/meminfo``; None on a kernel that does not report it."""
    available = cgroups.parse_meminfo(meminfo).get("MemAvailable")
    if available is None:
        return None
    return MemoryLimit(
        what=f"the node's available RAM (MemAvailable) {format_size(available)}",
        room=available,
        fix="free memory on the node",
    )


def memlock_limit() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes, or None when it does not bind (unlimited, or root's CAP_IPC_LOCK)."""
    if os.geteuid() == 0:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def read_limits(proc: Path = Path("/proc"), cgroup_root: Path = Path(cgroups.ROOT)) -> list[MemoryLimit]:
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

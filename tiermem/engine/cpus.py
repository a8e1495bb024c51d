"""How many CPUs this process can really use: its affinity, capped by its cgroups' CPU quota.

The daemon's Adam update is split over ``adam.threads`` workers, 0 meaning
"as many as the node gives us".  The affinity mask alone overstates that
under systemd's ``CPUQuota=``, a container's CPU limit, or a Kubernetes pod's
``limits.cpu``: the process sees every core but may run only ``quota /
period`` of them per period.  Workers beyond that do not add speed; they make
the kernel throttle the whole process for the rest of each period, and the
update waits at its end for the throttled piece (on a 2-core node with a
1-CPU quota, two workers finish the update no sooner than one, and its tail
waits for the throttling to lift).

So the default is the affinity count, capped by the tightest quota of this
process's cgroup and each of its ancestors (cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), rounded down, at least 1.
Rounding down is the conservative choice: 2.5 CPUs of quota run two workers
that are never throttled, where three would be throttled every period.

``cpu_limit`` is pure (it reads through the ``read`` callable, and walks the
cgroups as ``tiermem.core.cgroups`` does), so the tests feed it the files of
any hierarchy; ``usable_cpus`` binds it to ``/proc`` and ``/sys/fs/cgroup``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

from tiermem.core import cgroups

__all__ = ["cpu_limit", "parse_cpu_max", "parse_v1_quota", "usable_cpus"]


def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 ``cpu.max`` (``"max 100000"``: none; ``"150000 100000"``: 1.5)."""
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    quota = int(fields[0])
    period = int(fields[1]) if len(fields) > 1 else 100_000
    return quota / period if quota > 0 and period > 0 else None


def parse_v1_quota(quota_text: str, period_text: str) -> float | None:
    """CPUs allowed by cgroup v1's ``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us``."""
    quota, period = int(quota_text.strip()), int(period_text.strip())
    return quota / period if quota > 0 and period > 0 else None


def cpu_limit(proc_cgroup: str, read: Callable[[str], str | None], root: str = cgroups.ROOT) -> float | None:
    """The tightest CPU quota over this process's cgroups and their ancestors, in CPUs; None when unlimited.

    ``proc_cgroup`` is the text of ``/proc/self/cgroup``; ``read(path)`` returns a file's text, or None
    where it cannot be read (no such controller mounted, a path outside this mount namespace)."""
    limits: list[float] = []
    for membership in cgroups.memberships(proc_cgroup):
        if membership.unified:
            for _, directory in cgroups.directories(membership, read, root):
                text = read(f"{directory}/cpu.max")
                value = parse_cpu_max(text) if text is not None else None
                if value is not None:
                    limits.append(value)
        elif "cpu" in membership.controllers:
            for _, directory in cgroups.directories(membership, read, root):
                quota, period = read(f"{directory}/cpu.cfs_quota_us"), read(f"{directory}/cpu.cfs_period_us")
                value = parse_v1_quota(quota, period) if quota is not None and period is not None else None
                if value is not None:
                    limits.append(value)
    return min(limits) if limits else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    """This process's affinity count, capped by its cgroups' CPU quota (rounded down), at least 1."""
    cpus = len(os.sched_getaffinity(0))
    own = _read("/proc/self/cgroup")
    try:
        limit = cpu_limit(own, _read) if own is not None else None
    except ValueError:  # a quota file this parser does not understand: the affinity stands
        limit = None
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return max(1, cpus)

"""This process's cgroups, and how much more memory they and the node let it take.

One home for three facts that ``tiermem estimate``, the daemon's start-up check
(``tiermemd.memfit``) and the CPU count (``tiermem.engine.cpus``) all need:

- the walk: ``/proc/self/cgroup`` names one cgroup per hierarchy
  (``ID:controllers:path``; cgroup v2's unified hierarchy is ``0::path``);
  each cgroup's directory is ``path`` under its hierarchy's mount, and every
  ancestor's limit applies too, so ``directories`` lists the cgroup and its
  ancestors, innermost first.  A v1 hierarchy is mounted at
  ``root/<controllers>`` (``/sys/fs/cgroup/cpu,cpuacct``); v2 at ``root``, or
  at ``root/unified`` on a hybrid host (v1 controllers with v2 beside them:
  no ``root/cgroup.controllers``, a ``root/unified/cgroup.controllers``).
- the memory figure: a level limits when its limit (v2 ``memory.max``, v1
  ``memory.limit_in_bytes``) reads below ``NO_LIMIT`` ("max" and v1's
  near-2^63 mean none).  In use is its usage (``memory.current``,
  ``memory.usage_in_bytes``) less the inactive page cache of its
  ``memory.stat`` (``inactive_file``, v1 ``total_inactive_file``), which the
  kernel reclaims before it OOM-kills; the room is the limit less that, at
  least 0.  Every hierarchy with a memory controller is read, every ancestor
  of each; the tightest room wins.
- ``/proc/meminfo`` as bytes per field.

Pure: files are read only through the ``read(path) -> str | None`` callable a
caller passes (None where a file cannot be read), so tests feed it any
hierarchy; ``tiermem.client.capacity`` and ``tiermemd.memfit`` bind it to the
real files and word the figures for their readers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath

__all__ = [
    "NO_LIMIT",
    "ROOT",
    "CgroupMemory",
    "Membership",
    "Read",
    "ancestors",
    "directories",
    "memberships",
    "memory_limits",
    "mount",
    "parse_meminfo",
    "tightest",
]

Read = Callable[[str], str | None]
"""A file's text, or None where it cannot be read (no such controller mounted, a path outside this namespace)."""

ROOT = "/sys/fs/cgroup"
"""Where the cgroup hierarchies are mounted."""

NO_LIMIT = 1 << 60
"""A memory limit at or above this is none: cgroup v1 writes "no limit" as the largest page-aligned 63-bit value."""


@dataclass(frozen=True)
class Membership:
    """One line of ``/proc/self/cgroup``: this process's cgroup in one hierarchy."""

    hierarchy: str
    """The hierarchy's ID ("0" for cgroup v2's unified hierarchy)."""
    controllers: tuple[str, ...]
    """The controllers bound to it (``("cpu", "cpuacct")``, ``("name=systemd",)``; empty for v2)."""
    path: str
    """The cgroup, from the hierarchy's root ("/system.slice/tiermemd.service")."""

    @property
    def unified(self) -> bool:
        """Whether this is cgroup v2's unified hierarchy."""
        return self.hierarchy == "0" and not self.controllers


def memberships(proc_cgroup: str) -> list[Membership]:
    """The hierarchies named in the text of ``/proc/self/cgroup``, in its order (malformed lines skipped)."""
    out = []
    for line in proc_cgroup.splitlines():
        hierarchy, sep1, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not hierarchy or not sep1 or not sep2:
            continue
        names = tuple(c for c in controllers.split(",") if c)
        out.append(Membership(hierarchy, names, path.strip() or "/"))
    return out


def ancestors(path: str) -> list[str]:
    """``/a/b`` -> ``["/a/b", "/a", "/"]``: a parent's limit caps its children's too."""
    p = PurePosixPath(path if path.startswith("/") else "/" + path)
    return [str(p), *(str(a) for a in p.parents)]


def mount(membership: Membership, read: Read, root: str = ROOT) -> str:
    """Where ``membership``'s hierarchy is mounted: ``root/<controllers>`` for v1; ``root`` for v2, or
    ``root/unified`` on a hybrid host."""
    if not membership.unified:
        return f"{root}/{','.join(membership.controllers)}"
    if read(f"{root}/cgroup.controllers") is None and read(f"{root}/unified/cgroup.controllers") is not None:
        return f"{root}/unified"
    return root


def directories(membership: Membership, read: Read, root: str = ROOT) -> list[tuple[str, str]]:
    """``(path, directory)`` of ``membership``'s cgroup and of each ancestor, innermost first."""
    base = mount(membership, read, root)
    return [(p, base + p.rstrip("/")) for p in ancestors(membership.path)]


@dataclass(frozen=True)
class CgroupMemory:
    """One cgroup level's memory limit and what it still allows."""

    path: str
    """The cgroup, from its hierarchy's root ("/jobs")."""
    directory: str
    """Its directory ("/sys/fs/cgroup/memory/jobs"), where an operator reads or raises the limit."""
    version: int
    """1 or 2: which cgroup version's files it was read from."""
    limit_nbytes: int
    """Its limit."""
    usage_nbytes: int
    """Memory charged to it, less the reclaimable inactive page cache."""

    @property
    def room_nbytes(self) -> int:
        """Bytes it still lets its processes take."""
        return max(0, self.limit_nbytes - self.usage_nbytes)

    @property
    def unit_setting(self) -> str:
        """The systemd unit setting that raises it."""
        return "MemoryMax=" if self.version == 2 else "MemoryLimit="


_FILES = {
    2: ("memory.max", "memory.current", "inactive_file"),
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}
"""Per cgroup version: the limit file, the usage file, and the ``memory.stat`` key of reclaimable cache."""


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:  # "max", or something this reader does not understand: no limit
        return None


def _stat(text: str | None, key: str) -> int:
    """One counter of a ``memory.stat`` text, 0 when missing or unreadable."""
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _int(value) or 0
    return 0


def memory_limits(proc_cgroup: str, read: Read, root: str = ROOT) -> list[CgroupMemory]:
    """Every level that limits this process's memory: its cgroup and each ancestor, in every hierarchy with a
    memory controller, innermost first.  ``proc_cgroup`` is the text of ``/proc/self/cgroup``."""
    out = []
    for membership in memberships(proc_cgroup):
        if membership.unified:
            version = 2
        elif "memory" in membership.controllers:
            version = 1
        else:
            continue
        limit_file, usage_file, cache_key = _FILES[version]
        for path, directory in directories(membership, read, root):
            limit = _int(read(f"{directory}/{limit_file}"))
            if limit is None or limit >= NO_LIMIT:
                continue
            charged = _int(read(f"{directory}/{usage_file}")) or 0
            usage = max(0, charged - _stat(read(f"{directory}/memory.stat"), cache_key))
            out.append(CgroupMemory(path, directory, version, limit, usage))
    return out


def tightest(limits: list[CgroupMemory]) -> CgroupMemory | None:
    """The level with the least room (the innermost of equals), or None when nothing limits."""
    return min(limits, key=lambda level: level.room_nbytes, default=None)


def parse_meminfo(text: str) -> dict[str, int]:
    """The text of ``/proc/meminfo`` as bytes per field (``MemTotal``, ``MemAvailable``, ...; counts as is)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if not fields or not fields[0].isdigit():
            continue
        scale = 1024 if fields[1:] == ["kB"] else 1
        out[name.strip()] = int(fields[0]) * scale
    return out

"""What ``tiermem doctor`` knows about a node: plain records, filled by ``tiermem.client.doctor_probe``.

Pure: the records, and the readings of them that both the gathering and the checks need (who may
search a directory or write a socket by its mode, what a unit's ``ReadWritePaths=`` covers, why a
socket is out of reach).  The checks are ``tiermem.client.doctor``'s, so that a unit test builds any
node it likes (a refused uid, a read-only swap directory, a GPU that does not pin) out of these and
runs the checks on it.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field

__all__ = [
    "CONNECTED",
    "ConfigFacts",
    "Entry",
    "Facts",
    "KernelFacts",
    "Reach",
    "SocketProbe",
    "SwapDirFacts",
    "TorchFacts",
    "User",
    "describe",
    "is_under",
    "owner",
    "permits",
    "read_write_paths",
    "unreachable",
]


class Reach(enum.Enum):
    """What became of one socket a trainer would try."""

    ANSWERED = "answered"
    MISSING = "missing"
    NO_ACCESS = "no access"
    """The file system keeps this user out: the directory's search or the socket's write permission."""
    NOT_LISTENING = "not listening"
    UNTRUSTED = "untrusted"
    """Its directory, file or listener is not the expected uid's (``tiermem.net.sockpath``)."""
    REFUSED = "refused"
    """The daemon refused this uid (``server.allowed_uids`` / ``allowed_gids``)."""
    INCOMPATIBLE = "incompatible"
    BROKEN = "broken"


@dataclass(frozen=True)
class Entry:
    """What ``lstat`` says about a path (``missing``; ``unknown`` when it could not be asked)."""

    path: str
    mode: int = 0
    uid: int = -1
    gid: int = -1
    missing: bool = False
    unknown: str = ""
    owner_name: str = ""
    group_name: str = ""


@dataclass(frozen=True)
class User:
    uid: int
    name: str
    gids: frozenset[int]
    group_names: dict[int, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"uid {self.uid} ({self.name})"

    def group(self, gid: int) -> str:
        name = self.group_names.get(gid)
        return f"{gid} ({name})" if name else str(gid)


@dataclass(frozen=True)
class SocketProbe:
    path: str
    whose: str
    """Whose daemon it must be ("the node's tiermemd")."""
    explicit: bool
    """Named by ``--socket`` or ``$TIERMEM_SOCKET_PATH``: trainers use it or fail."""
    reach: Reach
    detail: str = ""
    directory: Entry | None = None
    socket: Entry | None = None
    version: str = ""
    pool_nbytes: int = 0
    locked_nbytes: int = 0


@dataclass(frozen=True)
class ConfigFacts:
    path: str | None
    """The settings file read (None: no node settings; a private daemon's defaults)."""
    error: str = ""
    socket: str = ""
    socket_group: str = ""
    allowed_uids: tuple[int, ...] = ()
    allowed_gids: tuple[int, ...] = ()
    pool_nbytes: int = 0
    """``pool.size`` resolved (0: half of the memory available)."""
    mlock: bool = True
    engine: str = "auto"
    cache_dir: str = ""
    metrics_port: int = 0
    metrics_address: str = "127.0.0.1"


@dataclass(frozen=True)
class SwapDirFacts:
    path: str
    entry: Entry
    probed: bool
    """This user could probe it (its owner, or root); else it is the daemon user's to use."""
    write_error: str = ""
    direct_io_error: str = ""
    free_nbytes: int | None = None
    covered: bool | None = None
    """Inside the installed unit's ``ReadWritePaths=`` (None: no unit installed)."""


@dataclass(frozen=True)
class KernelFacts:
    compiler: str
    """The C compiler's path ("": none)."""
    caches: tuple[tuple[str, str], ...]
    """This user's kernel cache directories, in the order a build tries them, each with why it cannot be used
    ("": it can)."""
    lowbit_built: str
    """The compressed-moment kernel built for this host in one of them ("": not built)."""
    inductor_dir: str
    inductor_error: str
    lowbit_error: str = ""
    """Why the kernel's caches could not be looked at ("": they were)."""
    daemon: tuple[tuple[str, str], ...] | None = None
    """(kernel, state) the node daemon's metrics show; None: not asked (``daemon_why``)."""
    daemon_why: str = ""
    unit_installed: bool = False
    cache_covered: bool | None = None


@dataclass(frozen=True)
class TorchFacts:
    version: str
    """"": torch does not import (``error``)."""
    error: str = ""
    cuda: str = ""
    """torch's CUDA version ("": a CPU build)."""
    devices: tuple[str, ...] = ()
    pin_error: str | None = None
    """None: not tried (no GPU); "": a window registered with cudaHostRegister and copied to the GPU."""


@dataclass(frozen=True)
class Facts:
    version: str
    protocol: int
    user: User
    embed: bool
    """Trainers may start a private daemon (``TIERMEM_NO_EMBED`` unset)."""
    sockets: tuple[SocketProbe, ...]
    sockets_error: str
    config: ConfigFacts
    swap_dirs: tuple[SwapDirFacts, ...]
    libaio_error: str
    aio_context_error: str
    memlock_nbytes: int | None
    """This process's soft ``RLIMIT_MEMLOCK`` (None: unlimited)."""
    cap_ipc_lock: bool
    available_nbytes: int
    kernels: KernelFacts
    torch: TorchFacts


# --------------------------------------------------------------------------- pure readings of the records
# (used by the gathering to classify what it found, and by the checks)


def read_write_paths(unit_text: str) -> tuple[str, ...]:
    """The paths a unit's ``ReadWritePaths=`` lines leave writable (an empty assignment resets the list; a
    leading ``-`` or ``+`` is dropped)."""
    paths: list[str] = []
    for line in unit_text.splitlines():
        key, sep, value = line.strip().partition("=")
        if not sep or key.strip() != "ReadWritePaths":
            continue
        if not value.strip():
            paths.clear()
        paths += [p.lstrip("-+") for p in value.split()]
    return tuple(paths)


def is_under(path: str, base: str) -> bool:
    """Whether ``path`` is ``base`` or inside it (both made absolute, not resolved)."""
    path, base = os.path.abspath(path), os.path.abspath(base)
    return os.path.commonpath([path, base]) == base


def permits(entry: Entry, user: User, bit: int) -> bool:
    """Whether ``user`` has ``bit`` (0o2 write, 0o1 search) on ``entry`` by its mode (root: always)."""
    if user.uid == 0:
        return True
    if entry.uid == user.uid:
        return bool(entry.mode & (bit << 6))
    if entry.gid in user.gids:
        return bool(entry.mode & (bit << 3))
    return bool(entry.mode & bit)


def describe(entry: Entry, user: User) -> str:
    """``mode 0660, owner 999 (tiermem), group 999 (tiermem)``."""
    group = f"{entry.gid} ({entry.group_name})" if entry.group_name else user.group(entry.gid)
    return f"mode {entry.mode & 0o7777:04o}, owner {owner(entry)}, group {group}"


def owner(entry: Entry) -> str:
    return f"{entry.uid} ({entry.owner_name})" if entry.owner_name else str(entry.uid)


def unreachable(directory: Entry, sock: Entry, user: User, reason: str) -> tuple[Reach, str]:
    """Why a socket that connect(2) could not reach is out of reach, from the modes on the way."""
    if directory.missing:
        return Reach.MISSING, f"no directory {directory.path}"
    if not directory.unknown and not permits(directory, user, 0o1):
        return Reach.NO_ACCESS, f"{directory.path} ({describe(directory, user)}) is not searchable by {user.label}"
    if sock.missing:
        return Reach.MISSING, "no socket file"
    if not sock.unknown and not permits(sock, user, 0o2):
        return Reach.NO_ACCESS, f"the socket ({describe(sock, user)}) admits neither {user.label} nor its groups"
    return Reach.NOT_LISTENING, reason


CONNECTED = (Reach.ANSWERED, Reach.REFUSED, Reach.INCOMPATIBLE, Reach.BROKEN)
"""A trainer connected there and goes no further: that daemon is the one it uses, or fails with."""

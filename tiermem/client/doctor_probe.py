"""The facts ``tiermem doctor`` checks: the node read once, as the user who runs it.

The doctor's one effectful part; nothing here judges (``tiermem.client.doctor``
does, from the ``tiermem.client.doctor_facts`` records ``gather`` returns).
Every probe is bounded and leaves nothing behind: a daemon gets one STATS
request on a connection of its own; a swap directory a temporary file,
removed; a GPU a 2 MiB shared window, registered with CUDA, copied once and
unregistered.  A probe that cannot run says why in its fact instead of
raising.
"""

from __future__ import annotations

import contextlib
import grp
import mmap
import os
import pwd
import resource
import shutil
import tempfile
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from tiermem import __version__
from tiermem.client import doctor_facts as facts
from tiermem.client.doctor_facts import CONNECTED, is_under, read_write_paths, unreachable
from tiermem.core.errors import AuthError, DaemonUnavailable, ProtocolError, TiermemError, UnsafePathError
from tiermem.net.sockpath import Trust

__all__ = ["UNIT_PATHS", "gather", "probe_sockets"]

UNIT_PATHS = (
    "/etc/systemd/system/tiermemd.service",
    "/usr/local/lib/systemd/system/tiermemd.service",
    "/usr/lib/systemd/system/tiermemd.service",
    "/lib/systemd/system/tiermemd.service",
)
"""Where an installed unit is found, in systemd's order (drop-ins beside the first one found are read too)."""
_CAP_IPC_LOCK = 14
_PIN_NBYTES = 2 << 20


def gather(
    *, socket_path: str | None, config_path: str | None, timeout_s: float, env: Mapping[str, str]
) -> facts.Facts:
    """Everything the checks need, read now."""
    from tiermem.client.capacity import host_available, training_swap_dirs
    from tiermem.core.protocol import PROTOCOL_VERSION

    user = gather_user()
    config = gather_config(config_path, env)
    rw_paths = installed_read_write_paths()
    sockets, sockets_error = probe_sockets(socket_path, env, user, timeout_s)
    libaio_error, aio_context_error = gather_aio()
    memlock, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    settings = config.path if not config.error else None
    swap_dirs = training_swap_dirs(settings, config_swap_dirs(config_path, env) if settings else ())
    return facts.Facts(
        version=__version__,
        protocol=PROTOCOL_VERSION,
        user=user,
        embed=env.get("TIERMEM_NO_EMBED", "") not in ("1", "true", "yes"),
        sockets=sockets,
        sockets_error=sockets_error,
        config=config,
        swap_dirs=tuple(probe_swap_dir(d, user, rw_paths) for d in swap_dirs),
        libaio_error=libaio_error,
        aio_context_error=aio_context_error,
        memlock_nbytes=None if memlock == resource.RLIM_INFINITY else memlock,
        cap_ipc_lock=has_cap_ipc_lock(),
        available_nbytes=host_available()[0],
        kernels=gather_kernels(config, rw_paths, env, timeout_s),
        torch=gather_torch(),
    )


# --------------------------------------------------------------------------- who, and with what settings


def gather_user() -> facts.User:
    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    gids = frozenset({os.getegid(), *os.getgroups()})
    names = {}
    for gid in gids:
        with contextlib.suppress(KeyError):
            names[gid] = grp.getgrgid(gid).gr_name
    return facts.User(uid, name, gids, names)


def gather_config(config_path: str | None, env: Mapping[str, str]) -> facts.ConfigFacts:
    """The node's settings as ``tiermemd`` would read them (the file, then ``TIERMEM_*``)."""
    from tiermem.client.estimate_cli import node_config_path
    from tiermem.core.config import load_config

    path = node_config_path(config_path, env)
    if path is None:
        return facts.ConfigFacts(None)
    try:
        config = load_config(path, env=env)
    except TiermemError as exc:
        return facts.ConfigFacts(path, error=str(exc))
    server = config.server
    return facts.ConfigFacts(
        path,
        socket=server.socket,
        socket_group=server.socket_group,
        allowed_uids=tuple(server.allowed_uids),
        allowed_gids=tuple(server.allowed_gids),
        pool_nbytes=config.pool.size,
        mlock=config.pool.mlock,
        engine=config.swap.engine,
        cache_dir=config.adam.cache_dir,
        metrics_port=config.metrics.port,
        metrics_address=config.metrics.address,
    )


def config_swap_dirs(config_path: str | None, env: Mapping[str, str]) -> list[str]:
    from tiermem.client.estimate_cli import node_config_path
    from tiermem.core.config import load_config

    return list(load_config(node_config_path(config_path, env), env=env).swap.dirs)


# --------------------------------------------------------------------------- daemons


def entry_of(path: str) -> facts.Entry:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return facts.Entry(path, missing=True)
    except OSError as exc:
        return facts.Entry(path, unknown=f"cannot look: {exc.strerror}")
    owner = group = ""
    with contextlib.suppress(KeyError):
        owner = pwd.getpwuid(st.st_uid).pw_name
    with contextlib.suppress(KeyError):
        group = grp.getgrgid(st.st_gid).gr_name
    return facts.Entry(path, st.st_mode, st.st_uid, st.st_gid, owner_name=owner, group_name=group)


def probe_sockets(
    socket_path: str | None, env: Mapping[str, str], user: facts.User, timeout_s: float
) -> tuple[tuple[facts.SocketProbe, ...], str]:
    """Each socket a trainer would try (``tiermem.client.link.connect``'s order), up to the first it connects
    to; or why the sockets cannot be told."""
    try:
        from tiermem.client.link import candidate_sockets

        candidates = candidate_sockets(socket_path, env)
    except (ImportError, OSError, TiermemError) as exc:
        return (), f"{type(exc).__name__}: {exc}"
    probes: list[facts.SocketProbe] = []
    for candidate in candidates:
        probes.append(probe_socket(candidate.path, candidate.trust, candidate.explicit, user, timeout_s))
        if probes[-1].reach in CONNECTED:
            break
    return tuple(probes), ""


def probe_socket(path: str, trust: Trust, explicit: bool, user: facts.User, timeout_s: float) -> facts.SocketProbe:
    """One STATS request to the daemon at ``path`` (only if it is ``trust``'s), or why there was none."""
    from tiermem.client.connection import Connection, connect_trusted
    from tiermem.core.protocol import Stats, StatsReply

    directory = entry_of(os.path.dirname(os.path.abspath(path)))
    sock_entry = entry_of(path)
    whose = "named by --socket or TIERMEM_SOCKET_PATH" if explicit else trust.what
    base = facts.SocketProbe(path, whose, explicit, facts.Reach.BROKEN, directory=directory, socket=sock_entry)
    try:
        sock = connect_trusted(path, trust, timeout_s=min(timeout_s, 5.0))
    except UnsafePathError as exc:
        return replace(base, reach=facts.Reach.UNTRUSTED, detail=str(exc))
    except DaemonUnavailable as exc:
        reach, detail = unreachable(directory, sock_entry, user, str(exc).removeprefix(f"no tiermemd at {path}: "))
        return replace(base, reach=reach, detail=detail)
    conn = Connection(sock, path=path, timeout_s=timeout_s)
    try:
        reply = conn.request(Stats())
    except AuthError as exc:
        return replace(base, reach=facts.Reach.REFUSED, detail=str(exc))
    except ProtocolError as exc:
        return replace(base, reach=facts.Reach.INCOMPATIBLE, detail=str(exc))
    except TiermemError as exc:
        return replace(base, reach=facts.Reach.BROKEN, detail=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    if not isinstance(reply, StatsReply):
        return replace(base, reach=facts.Reach.BROKEN, detail=f"STATS answered with {reply.TYPE.name}")
    pool = reply.node.pool
    return replace(
        base,
        reach=facts.Reach.ANSWERED,
        version=reply.node.version,
        pool_nbytes=pool.capacity_nbytes,
        locked_nbytes=pool.locked_nbytes,
    )


# --------------------------------------------------------------------------- swap, memory, I/O engine


def installed_read_write_paths() -> tuple[str, ...] | None:
    """``ReadWritePaths=`` of the installed ``tiermemd.service`` and its drop-ins (None: no unit installed)."""
    for unit in UNIT_PATHS:
        try:
            text = Path(unit).read_text()
        except OSError:
            continue
        dropins = sorted(Path(f"/etc/systemd/system/{Path(unit).name}.d").glob("*.conf"))
        for conf in dropins:
            with contextlib.suppress(OSError):
                text += "\n" + conf.read_text()
        return read_write_paths(text)
    return None


def _nearest_existing(path: str) -> str:
    here = os.path.abspath(path)
    while not os.path.exists(here) and here != os.path.dirname(here):
        here = os.path.dirname(here)
    return here


def _free_nbytes(path: str) -> int | None:
    try:
        vfs = os.statvfs(_nearest_existing(path))
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize


def probe_swap_dir(path: str, user: facts.User, rw_paths: Sequence[str] | None) -> facts.SwapDirFacts:
    """Whether this user can write ``path`` and open files there with O_DIRECT (probed only as its owner or
    root: another user's directory is its daemon's to probe), and its free space."""
    from tiermem.engine.swap.engine_select import direct_io_unsupported

    entry = entry_of(path)
    covered = None if rw_paths is None else any(is_under(path, p) for p in rw_paths)
    base = facts.SwapDirFacts(path, entry, probed=False, free_nbytes=_free_nbytes(path), covered=covered)
    if entry.unknown:
        return base
    if entry.missing:
        parent = entry_of(_nearest_existing(path))
        if user.uid not in (0, parent.uid):
            return base
        writable = os.access(parent.path, os.W_OK)
        return replace(base, probed=True, write_error="" if writable else f"{parent.path} is not writable")
    if user.uid not in (0, entry.uid):
        return base
    try:
        fd, probe = tempfile.mkstemp(prefix=".tiermem-doctor-", dir=path)
    except OSError as exc:
        return replace(base, probed=True, write_error=exc.strerror or str(exc))
    os.close(fd)
    os.unlink(probe)
    try:
        direct = direct_io_unsupported(path) or ""
    except OSError as exc:
        direct = f"O_DIRECT probe failed: {exc.strerror}"
    return replace(base, probed=True, direct_io_error=direct)


def gather_aio() -> tuple[str, str]:
    """(why libaio does not load, why a kernel AIO context of the daemon's depth does not open); "" where fine."""
    from tiermem.core.config import MAX_QUEUE_DEPTH
    from tiermem.engine.swap.engine_select import libaio_unavailable

    missing = libaio_unavailable()
    if missing:
        return missing, ""
    from tiermem.engine.swap.engine_libaio import LibaioEngine

    try:
        engine = LibaioEngine(block_size=1 << 20, queue_depth=MAX_QUEUE_DEPTH, reaper_thread=False)
    except OSError as exc:
        return "", f"creating a kernel AIO context of depth {MAX_QUEUE_DEPTH} failed: {exc.strerror}"
    engine.close()
    return "", ""


def has_cap_ipc_lock(status: str = "/proc/self/status") -> bool:
    """Whether this process holds CAP_IPC_LOCK (mlock beyond RLIMIT_MEMLOCK)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(status).read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    return False


# --------------------------------------------------------------------------- kernels, torch, CUDA


def _dir_problem(path: str) -> str:
    """Why this user cannot keep kernels in ``path`` ("" when it can: its own, closed to others, writable,
    or missing with a writable ancestor)."""
    entry = entry_of(path)
    if entry.unknown:
        return entry.unknown
    if entry.missing:
        return "" if os.access(_nearest_existing(path), os.W_OK) else "missing, and cannot be created"
    if entry.uid != os.geteuid():
        return f"owned by uid {entry.uid}, not this user"
    if entry.mode & 0o022:
        return f"writable by others (mode {entry.mode & 0o7777:04o}): a kernel there is not loaded"
    if not os.access(path, os.W_OK):
        return "not writable"
    return ""


def gather_kernels(
    config: facts.ConfigFacts, rw_paths: Sequence[str] | None, env: Mapping[str, str], timeout_s: float
) -> facts.KernelFacts:
    compiler = shutil.which(env.get("CC") or "cc") or ""
    lowbit_built: str | None = ""
    caches: tuple[str, ...] = ()
    lowbit_error = ""
    try:
        from tiermem.engine.optim.lowbit_native import built_lowbit_library, cache_directories

        caches = cache_directories(None)
        lowbit_built = built_lowbit_library(None) if compiler else ""
    except (ImportError, OSError) as exc:
        lowbit_error = f"{type(exc).__name__}: {exc}"
    inductor_dir = env.get("TORCHINDUCTOR_CACHE_DIR", "")
    if not inductor_dir:
        with contextlib.suppress(Exception):
            from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_default

            inductor_dir = inductor_default()
    daemon, why = None, ""
    if config.path and not config.error:
        if config.metrics_port:
            daemon, why = scrape_kernels(config.metrics_address, config.metrics_port, timeout_s)
        else:
            why = f"metrics.port is 0 in {config.path}: its tiermem_kernel_state is not served"
    covered = None
    if rw_paths is not None and config.cache_dir:
        covered = any(is_under(config.cache_dir, p) for p in rw_paths)
    return facts.KernelFacts(
        compiler=compiler,
        caches=tuple((d, _dir_problem(d)) for d in caches),
        lowbit_built=lowbit_built or "",
        lowbit_error=lowbit_error,
        inductor_dir=inductor_dir,
        inductor_error=_dir_problem(inductor_dir) if inductor_dir else "",
        daemon=daemon,
        daemon_why=why,
        unit_installed=rw_paths is not None,
        cache_covered=covered,
    )


def scrape_kernels(address: str, port: int, timeout_s: float) -> tuple[tuple[tuple[str, str], ...] | None, str]:
    """(kernel, state) pairs the daemon's ``tiermem_kernel_state`` sets to 1, or None and why not."""
    from prometheus_client.parser import text_string_to_metric_families

    host = "127.0.0.1" if address in ("", "0.0.0.0") else address  # noqa: S104 - the daemon's bind address
    url = f"http://{host}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            text = resp.read().decode()
    except Exception as exc:  # refused, timed out, not HTTP: the finding says so
        return None, f"cannot read {url}: {exc}"
    found = []
    for family in text_string_to_metric_families(text):
        if family.name == "tiermem_kernel_state":
            found += [(s.labels["kernel"], s.labels["state"]) for s in family.samples if s.value == 1]
    return tuple(found), ""


def gather_torch() -> facts.TorchFacts:
    try:
        import torch
    except Exception as exc:  # a broken install raises anything
        return facts.TorchFacts("", error=f"{type(exc).__name__}: {exc}")
    cuda = torch.version.cuda or ""
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = tuple(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(count))
    except Exception as exc:  # a driver that breaks under the query
        return facts.TorchFacts(
            torch.__version__, cuda=cuda, devices=("cuda",), pin_error=f"{type(exc).__name__}: {exc}"
        )
    return facts.TorchFacts(torch.__version__, cuda=cuda, devices=devices, pin_error=pin_window() if devices else None)


def pin_window(nbytes: int = _PIN_NBYTES) -> str:
    """Pin a shared-memory window as trainers pin theirs, copy it to the GPU, unpin: "" when all worked."""
    import torch

    from tiermem.engine.pool.pinning import CudaPinner

    pinner = CudaPinner()
    fd = os.memfd_create("tiermem-doctor", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as window:
            host = torch.frombuffer(window, dtype=torch.uint8)
            try:
                host.fill_(1)
                pinned = pinner.register(host.data_ptr(), nbytes)
                if not pinned.registered:
                    return pinned.reason
                try:
                    copied = int(host.to("cuda", non_blocking=True).sum().item())
                finally:
                    pinner.unregister(host.data_ptr())
                return "" if copied == nbytes else f"the copy to the GPU read {copied} of {nbytes} bytes"
            except Exception as exc:  # a CUDA error of any kind is the finding
                return f"{type(exc).__name__}: {exc}"
            finally:
                del host
    finally:
        os.close(fd)

"""Typed, validated configuration.

One frozen, keyword-only dataclass per component, each field documented where
it is declared.  Components receive their own section, never the whole config.

``load_config`` is the one loader: it reads the TOML file, then ``TIERMEM_*``
environment overrides (``TIERMEM_POOL_SIZE=8GiB`` sets ``pool.size``), then
explicit overrides from command-line flags (``{"pool.size": "8GiB"}``).  Every
value is converted and checked once, here; a bad one raises ``ConfigError``
naming the field ("pool.size") and what is wrong.  Nothing else in tiermem
reads the environment for settings.

Sizes accept strings such as "8GiB" (see ``tiermem.core.units``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiermem.core.errors import ConfigError
from tiermem.core.units import PAGE_SIZE, MiB, parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "AdamConfig",
    "DaemonConfig",
    "JobLimits",
    "MetricsConfig",
    "PoolConfig",
    "ServerConfig",
    "SwapConfig",
    "config_to_dict",
    "default_runtime_dir",
    "default_state_dir",
    "load_config",
]

SIZE = {"kind": "size"}


def _size(default: int) -> Any:
    return field(default=default, metadata=SIZE)


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """The daemon's host-memory pool."""

    size: int = _size(0)
    """Total bytes of host memory the pool holds; 0 picks half of the available memory."""
    arena_size: int = _size(1 << 30)
    """Largest single shared-memory segment; the pool is split into arenas of at most this."""
    mlock: bool = True
    """Lock pool memory with mlock; when RLIMIT_MEMLOCK refuses, warn and run unlocked."""
    alignment: int = PAGE_SIZE
    """Alignment of every block in bytes (a power of two, at least 4096 for O_DIRECT)."""

    def __post_init__(self) -> None:
        _check_nonneg("pool.size", self.size)
        _check_positive("pool.arena_size", self.arena_size)
        if self.alignment < PAGE_SIZE or self.alignment & (self.alignment - 1):
            raise ConfigError("pool.alignment", f"must be a power of two >= 4096, got {self.alignment}")
        if self.arena_size % self.alignment:
            raise ConfigError(
                "pool.arena_size", f"must be a multiple of pool.alignment ({self.alignment}), got {self.arena_size}"
            )


MAX_QUEUE_DEPTH = 128
"""Slots of the libaio engine's kernel context; a measured or configured queue depth uses up to this many."""
DEFAULT_QUEUE_DEPTH = 32
"""The queue depth before (or without) a probe of the swap device."""


@dataclass(frozen=True, kw_only=True)
class SwapConfig:
    """The NVMe tier: swap directories and the I/O engine."""

    dirs: tuple[str, ...] = ()
    """Swap directories, typically one per NVMe device; data is striped across them. Empty: under the state dir."""
    engine: str = "auto"
    """I/O engine: "auto" (libaio with O_DIRECT where it works, else threads), "libaio" or "threads"."""
    block_size: int = _size(1 * MiB)
    """Size of one I/O request; larger transfers are split into blocks of this size."""
    queue_depth: int = 0
    """Requests in flight per engine; 0 = measured: a short probe of the swap device when the first job is
    placed on NVMe (up to 128; 32 until then)."""
    cache_chunks: int = 0
    """Guaranteed chunk cache of an NVMe-placed rank, in state chunks; 0 = sized from the probe (enough to keep
    the disk's queue full) within the job's pool room."""
    prefetch_depth: int = 0
    """State chunks an NVMe-placed rank reads ahead; 0 = sized from the probe and the measured update time."""
    borrow: bool = True
    """NVMe-placed chunk caches may borrow free pool memory above their guaranteed size, up to all of their
    state (within the job's pool quota); the pool takes it back when another allocation needs it."""
    threads: int = 4
    """Worker threads of the thread-pool engine."""
    fsync: bool = True
    """fsync data and manifests before a write counts as committed."""
    stripe_size: int = _size(1 * MiB)
    """With several swap directories, objects are dealt over them in stripes of this size."""

    def __post_init__(self) -> None:
        if self.engine not in ("auto", "libaio", "threads"):
            raise ConfigError("swap.engine", f'must be "auto", "libaio" or "threads", got {self.engine!r}')
        if self.block_size < PAGE_SIZE or self.block_size % PAGE_SIZE:
            raise ConfigError("swap.block_size", f"must be a positive multiple of 4KiB, got {self.block_size}")
        for name in ("queue_depth", "cache_chunks", "prefetch_depth"):
            if getattr(self, name) < 0:
                raise ConfigError(f"swap.{name}", f"must be >= 0 (0 = measured), got {getattr(self, name)}")
        if self.queue_depth > MAX_QUEUE_DEPTH:
            raise ConfigError("swap.queue_depth", f"must be at most {MAX_QUEUE_DEPTH}, got {self.queue_depth}")
        if 0 < self.cache_chunks < 3:
            raise ConfigError("swap.cache_chunks", f"must be 0 (measured) or >= 3, got {self.cache_chunks}")
        if self.cache_chunks and self.prefetch_depth > self.cache_chunks - 2:
            raise ConfigError(
                "swap.prefetch_depth",
                f"must leave room for one chunk updated and one written back in swap.cache_chunks "
                f"({self.cache_chunks}): at most {self.cache_chunks - 2}, got {self.prefetch_depth}",
            )
        _check_positive("swap.threads", self.threads)
        if self.stripe_size < PAGE_SIZE or self.stripe_size % PAGE_SIZE:
            raise ConfigError("swap.stripe_size", f"must be a positive multiple of 4KiB, got {self.stripe_size}")


@dataclass(frozen=True, kw_only=True)
class AdamConfig:
    """The CPU Adam engine."""

    threads: int = 0
    """Threads for the update; 0 uses the CPUs this process can get: its affinity, capped by its cgroups'
    CPU quota (systemd's CPUQuota=, a container's CPU limit), rounded down."""
    chunk_numel: int = 1 << 22
    """Elements updated per chunk (the unit of pipelining and of fair sharing between jobs)."""
    compile: bool = True
    """Compile the single-pass update with torch.compile (inductor C++); False runs the eager fallback."""
    cache_dir: str = ""
    """Inductor's compile cache (TORCHINDUCTOR_CACHE_DIR) for the Adam kernels; empty keeps torch's default."""
    warmup: tuple[str, ...] = ()
    """Job dtypes (float32, float16, bfloat16) whose compiled kernel is built at start, before the daemon is
    ready, instead of at the first update that needs it (seconds, while that step waits): fp16/bf16 jobs, and
    fp32 jobs that clip or loss-scale, whose scaled updates then run it (about 1.2x faster than torch's fused
    kernel, which they run otherwise, compiling nothing)."""

    def __post_init__(self) -> None:
        _check_nonneg("adam.threads", self.threads)
        _check_positive("adam.chunk_numel", self.chunk_numel)
        unknown = [d for d in self.warmup if d not in WARMUP_DTYPES]
        if unknown:
            raise ConfigError("adam.warmup", f"unknown dtype {unknown[0]!r}; expected some of {list(WARMUP_DTYPES)}")


WARMUP_DTYPES = ("float32", "float16", "bfloat16")
"""The job dtypes ``adam.warmup`` takes."""


@dataclass(frozen=True, kw_only=True)
class JobLimits:
    """Per-job quotas and limits."""

    window_size: int = _size(2 * 1024 * 1024)
    """Staging window of a rank whose client asks for no particular size.  State transfer (``state_dict``,
    ``load_state_dict``) moves through it piece by piece: it never grows with the model."""
    max_window: int = _size(0)
    """Largest staging window one job may ask for; 0 allows up to the pool's free space."""
    max_jobs: int = 64
    """Jobs that may be attached at once."""
    max_jobs_per_uid: int = 0
    """Jobs one uid may hold at once, so that one user cannot fill ``max_jobs`` for everyone; 0 means half of
    ``max_jobs`` (rounded up)."""
    max_pool: int = _size(0)
    """Pool bytes one job may hold (its CPU-tier state and NVMe chunk cache); 0 allows the whole pool."""
    max_swap: int = _size(0)
    """Swap bytes one job may hold; 0 allows all the swap directories' free space."""
    window_budget: int = _size(0)
    """Total bytes of staging windows (each one locked in memory) all jobs together may hold; 0 means
    ``max_jobs`` windows of ``window_size``.  Checked with the pool against the memory the daemon may use at
    start-up.  ``offload_params`` grows a paged job's window to up to 64 MiB (one request per submodule), at
    most half of the budget then free, so later jobs still find room; size it for the paged jobs a node runs."""
    storage_budget: int = _size(0)
    """Total bytes of shared tensor storage (the trainers' params and grads, which live in shared memory
    the daemon updates in place) all jobs together may hold; 0 means the node's physical memory."""
    grace_period_s: float = 300.0
    """How long a job whose clients all died keeps its state for a reattach with its token; also how long
    swap and job files that no job owns, found at start, are kept before they are removed."""
    commit_every: int = 0
    """Commit the state of NVMe-placed ranks every this many steps (swap data synced, manifest and job file
    written), so a daemon killed without a clean stop loses at most this many steps; 0 commits at shutdown
    only.  What a restart lost is reported either way (the reattach reply carries the step the state is at)."""

    def __post_init__(self) -> None:
        _check_nonneg("jobs.max_window", self.max_window)
        _check_nonneg("jobs.window_budget", self.window_budget)
        _check_nonneg("jobs.storage_budget", self.storage_budget)
        _check_positive("jobs.window_size", self.window_size)
        _check_nonneg("jobs.max_pool", self.max_pool)
        _check_nonneg("jobs.max_swap", self.max_swap)
        _check_positive("jobs.max_jobs", self.max_jobs)
        _check_nonneg("jobs.max_jobs_per_uid", self.max_jobs_per_uid)
        _check_nonneg("jobs.commit_every", self.commit_every)
        if self.grace_period_s < 0:
            raise ConfigError("jobs.grace_period_s", f"must be >= 0, got {self.grace_period_s}")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The Unix socket and who may use it."""

    socket: str = ""
    """Socket path; empty: <runtime dir>/tiermemd.sock."""
    state_dir: str = ""
    """Where manifests (and, by default, swap files) live; empty: a per-user state directory."""
    socket_mode: int = 0o660
    """Permission bits of the socket file."""
    socket_group: str = ""
    """Group that owns the socket file; empty keeps the daemon's group."""
    allowed_uids: tuple[int, ...] = ()
    """Uids that may attach; empty: only the daemon's own uid (and root)."""
    allowed_gids: tuple[int, ...] = ()
    """Gids whose members may attach."""
    max_frame: int = _size(1 * MiB)
    """Largest frame accepted on the socket; a longer message comes in parts of this size."""
    max_message: int = _size(64 * MiB)
    """Largest message a client may send in parts (a REGISTER costs about 83 bytes a tensor), and what one
    user's connections together may make the daemon hold in messages not yet whole."""
    max_inflight: int = 4096
    """One-way messages (BUCKET_READY, one per gradient bucket) a connection may send between two requests;
    a client past it is disconnected (tiermem's clients read it from ATTACH_OK and send a PING first).
    Requests themselves are answered one at a time per connection."""
    max_connections_per_uid: int = 256
    """Connections one uid may hold open."""
    send_timeout_s: float = 10.0
    """How long a reply may wait for room on a client's socket before the session is closed (a client that
    sends requests without reading their replies).  A client that reads each reply never waits."""
    accept_process: bool = True
    """Accept in a process of its own (``tiermemd.acceptor``): it refuses disallowed uids and holds connections
    until their first frame, so a connection storm costs the daemon's interpreter nothing.  Private daemons
    (one user, a 0700 directory) accept in a thread instead."""
    stall_timeout_s: float = 120.0
    """A worker thread (a session handling a request, the CPU scheduler, a rank's pipeline, the pidfd
    watcher) busy this long without progress is wedged: it is logged by name, the systemd watchdog is no
    longer fed, and heartbeats to clients waiting on it stop (their timeout fires)."""

    def __post_init__(self) -> None:
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError("server.socket_mode", f"must be permission bits like 0o660, got {self.socket_mode!r}")
        if self.max_frame < 4096:
            raise ConfigError("server.max_frame", f"must be at least 4KiB, got {self.max_frame}")
        if self.max_message < self.max_frame:
            raise ConfigError(
                "server.max_message", f"must be at least server.max_frame ({self.max_frame}), got {self.max_message}"
            )
        _check_positive("server.max_inflight", self.max_inflight)
        _check_positive("server.max_connections_per_uid", self.max_connections_per_uid)
        if not self.send_timeout_s > 0:
            raise ConfigError("server.send_timeout_s", f"must be > 0 seconds, got {self.send_timeout_s}")
        if not self.stall_timeout_s > 0:
            raise ConfigError("server.stall_timeout_s", f"must be > 0 seconds, got {self.stall_timeout_s}")


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """The Prometheus endpoint."""

    port: int = 0
    """TCP port serving /metrics; 0 disables the endpoint."""
    address: str = "127.0.0.1"
    """Address the endpoint binds to (loopback by default: the figures are the node's, not the world's)."""
    job_labels: bool = False
    """Export per-job series labelled ``tiermem_job`` with the job ids (which every reader of the endpoint then
    sees); off: only node totals, no job id leaves the daemon."""
    max_connections: int = 16
    """Scrape connections served at once; at the cap the longest idle one is closed to make room for a new one."""
    idle_timeout_s: float = 10.0
    """A scrape connection that has not sent its request (or read its reply) for this long is closed."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("metrics.port", f"must be 0..65535, got {self.port}")
        _check_positive("metrics.max_connections", self.max_connections)
        if not self.idle_timeout_s > 0:
            raise ConfigError("metrics.idle_timeout_s", f"must be > 0 seconds, got {self.idle_timeout_s}")


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Everything tiermemd reads, one section per component."""

    pool: PoolConfig = field(default_factory=PoolConfig)
    swap: SwapConfig = field(default_factory=SwapConfig)
    adam: AdamConfig = field(default_factory=AdamConfig)
    jobs: JobLimits = field(default_factory=JobLimits)
    server: ServerConfig = field(default_factory=ServerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


def default_runtime_dir(env: Mapping[str, str], uid: int | None = None) -> Path:
    """Where a single user's daemon keeps its socket: $XDG_RUNTIME_DIR/tiermem, else /tmp/tiermem-<uid>."""
    uid = os.getuid() if uid is None else uid
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "tiermem"
    return Path("/tmp") / f"tiermem-{uid}"  # noqa: S108 - created 0700 by its owner, checked by both sides


def default_state_dir(env: Mapping[str, str], uid: int | None = None) -> Path:
    """Where a single user's daemon keeps manifests and swap: $XDG_STATE_HOME/tiermem or ~/.local/state/tiermem."""
    xdg = env.get("XDG_STATE_HOME")
    if xdg:
        return Path(xdg) / "tiermem"
    home = env.get("HOME")
    if home:
        return Path(home) / ".local" / "state" / "tiermem"
    return default_runtime_dir(env, uid) / "state"


# --------------------------------------------------------------------------- loading


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> DaemonConfig:
    """Build a ``DaemonConfig`` from a TOML file, ``TIERMEM_*`` variables and flag overrides.

    Later sources win.  ``env`` defaults to ``os.environ``.  Unknown sections or
    keys are errors (a typo must not silently fall back to a default).  Empty
    socket and state paths are resolved to the per-user defaults.
    """
    env = os.environ if env is None else env
    merged: dict[str, dict[str, Any]] = {}
    if path is not None:
        merged = _read_toml(Path(path))
    for name, value in env.items():
        if not name.startswith("TIERMEM_") or name in _ENV_IGNORED:
            continue
        dotted = _env_to_dotted(name)
        if dotted is None:
            raise ConfigError(name, "unknown setting; names look like TIERMEM_POOL_SIZE (section_field)")
        section, key = dotted.split(".", 1)
        merged.setdefault(section, {})[key] = value
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        merged.setdefault(section, {})[key] = value
    config = _build(merged)
    return _resolve_paths(config, env)


_ENV_IGNORED = frozenset(
    {
        "TIERMEM_CONFIG",
        "TIERMEM_SOCKET_PATH",
        "TIERMEM_NO_EMBED",
        "TIERMEM_DAEMON_USER",
        "TIERMEM_CLIENT_TIMEOUT_S",
        "TIERMEM_SECRET_FILE",
    }
)
"""Variables the client reads (``tiermem.client.link``; ``TIERMEM_SECRET_FILE``: the distributed job
secret, ``tiermem.client.distributed.identity``), not daemon settings: a daemon started in the same
environment (an embedded one) must not refuse them."""


def _read_toml(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("--config", f"file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", f"{path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from None
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(section, f"expected a [{section}] table in {path}, found a value")
    return dict(data)


def _section_types() -> dict[str, type]:
    return {f.name: typing.get_type_hints(DaemonConfig)[f.name] for f in dataclasses.fields(DaemonConfig)}


def _env_to_dotted(name: str) -> str | None:
    rest = name[len("TIERMEM_") :].lower()
    for section, cls in _section_types().items():
        prefix = section + "_"
        if rest.startswith(prefix):
            key = rest[len(prefix) :]
            if key in {f.name for f in dataclasses.fields(cls)}:
                return f"{section}.{key}"
    return None


def _build(merged: Mapping[str, Mapping[str, Any]]) -> DaemonConfig:
    sections = _section_types()
    for section in merged:
        if section not in sections:
            raise ConfigError(section, f"unknown section; known sections: {', '.join(sorted(sections))}")
    built: dict[str, Any] = {}
    for section, cls in sections.items():
        values = merged.get(section, {})
        hints = typing.get_type_hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, raw in values.items():
            if key not in known:
                raise ConfigError(f"{section}.{key}", f"unknown setting; [{section}] takes {', '.join(sorted(known))}")
            kwargs[key] = _convert(f"{section}.{key}", raw, hints[key], known[key].metadata)
        built[section] = cls(**kwargs)
    return DaemonConfig(**built)


def _convert(name: str, raw: Any, hint: Any, metadata: Mapping[str, Any]) -> Any:
    try:
        if metadata.get("kind") == "size":
            return parse_size(raw)
        if hint is bool:
            return _to_bool(raw)
        if hint is int:
            return _to_int(raw)
        if hint is float:
            if isinstance(raw, bool):
                raise ValueError(f"expected a number, got {raw!r}")
            return float(raw)
        if hint is str:
            if not isinstance(raw, str):
                raise ValueError(f"expected a string, got {raw!r}")
            return raw
        origin = typing.get_origin(hint)
        if origin is tuple:
            (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
            items = raw.split(",") if isinstance(raw, str) else raw
            if not isinstance(items, (list, tuple)):
                raise ValueError(f"expected a list, got {raw!r}")
            return tuple(_convert(name, x.strip() if isinstance(x, str) else x, item, {}) for x in items if x != "")
        if origin in (typing.Union, types.UnionType):
            raise ValueError(f"unsupported type {hint}")
    except ValueError as exc:
        raise ConfigError(name, str(exc)) from None
    raise ConfigError(name, f"unsupported type {hint}")  # pragma: no cover - a programming error


def _to_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(raw, str) and raw.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


def _to_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError(f"expected an integer, got {raw!r}")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        try:
            return int(raw.strip(), 0)
        except ValueError:
            pass
    raise ValueError(f"expected an integer, got {raw!r}")


def _resolve_paths(config: DaemonConfig, env: Mapping[str, str]) -> DaemonConfig:
    server = config.server
    if not server.socket:
        server = dataclasses.replace(server, socket=str(default_runtime_dir(env) / "tiermemd.sock"))
    if not server.state_dir:
        server = dataclasses.replace(server, state_dir=str(default_state_dir(env)))
    swap = config.swap
    if not swap.dirs:
        swap = dataclasses.replace(swap, dirs=(str(Path(server.state_dir) / "swap"),))
    return dataclasses.replace(config, server=server, swap=swap)


def config_to_dict(config: DaemonConfig) -> dict[str, dict[str, Any]]:
    """The config as plain TOML-able tables (for ``--print-config``)."""
    return {f.name: dataclasses.asdict(getattr(config, f.name)) for f in dataclasses.fields(config)}


def _check_positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(name, f"must be > 0, got {value}")


def _check_nonneg(name: str, value: int) -> None:
    if value < 0:
        raise ConfigError(name, f"must be >= 0, got {value}")

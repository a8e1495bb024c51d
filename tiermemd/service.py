"""The service: builds the parts in order, runs the main loop, shuts down cleanly.

Start-up order (each failure exits with its documented code, see ``main``):
pool (allocated, pre-faulted, locked: exit 3) -> swap directories (exit 4) ->
socket (exit 5) -> READY=1.  systemd therefore sees the service ready only once
its memory is really there.

The main thread runs one loop (gunicorn's shape): signal handlers only put the
signal number in a queue; the loop takes signals, reclaims jobs whose grace
period ended, and feeds the systemd watchdog while no worker thread is wedged
(``tiermemd.health``).  SIGTERM/SIGINT drain: stop
accepting, let every session finish the request it is in (bounded by
``DRAIN_TIMEOUT_S``; requests that arrive meanwhile are refused), close the
sessions, release all memory, exit 0.  SIGHUP re-reads the settings from the
sources they came from at start-up (``--config`` file or ``TIERMEM_CONFIG``,
the environment, the flags) and applies those that can change live (the grace
period, the job limit, the allowed uids/gids, the per-uid connection limit);
the others need a restart and are reported as such.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import queue
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from tiermem.core.config import DaemonConfig, config_to_dict, load_config
from tiermem.core.errors import ConfigError, TiermemError, UnsafePathError
from tiermem.core.modes import Placement
from tiermem.core.statekeys import StateFormat
from tiermem.core.units import format_size
from tiermem.engine.pool import BufferPool
from tiermem.engine.swap import open_engine
from tiermem.engine.tiers import PoolShares
from tiermem.net.sockpath import SecureDir, Trust, remove_socket, uid_label
from tiermemd import health, memfit
from tiermemd.durability import Durability, SwapDirsChanged
from tiermemd.exits import EXIT_DATA_LOST, EXIT_INTERNAL, EXIT_OK, EXIT_RESOURCES, EXIT_SOCKET, EXIT_SWAP
from tiermemd.jobs import Job, JobTable
from tiermemd.ledger import Ledger, Resource
from tiermemd.listener import Listener, adopt_listener
from tiermemd.metrics import serve_metrics
from tiermemd.notify import Notifier
from tiermemd.nvme import store_name
from tiermemd.orphans import Orphans
from tiermemd.persist import load_job_files, remove_job_file
from tiermemd.rank import AdamKernel, RankOptimizer
from tiermemd.scheduler import CpuScheduler
from tiermemd.server import Server
from tiermemd.socketkeeper import SocketKeeper, identify
from tiermemd.state import CpuStateChunks, StateChunks
from tiermemd.stats import RetiredRanks

__all__ = ["DRAIN_TIMEOUT_S", "Service", "run_service"]

log = logging.getLogger("tiermemd")

DRAIN_TIMEOUT_S = 30.0
_LOOP_TICK_S = 0.5
_SD_LISTEN_FDS_START = 3


class StartupError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


RELOADED = frozenset(
    {
        "jobs.commit_every",
        "jobs.grace_period_s",
        "jobs.max_jobs",
        "jobs.max_jobs_per_uid",
        *(f"server.{k}" for k in ("allowed_uids", "allowed_gids", "max_connections_per_uid")),
        *(f"server.{k}" for k in ("max_inflight", "max_message", "send_timeout_s")),  # for new connections
    }
)
"""The settings a SIGHUP applies (``Service.reload``); a change to any other waits for a restart."""


def restart_only_changes(running: DaemonConfig, fresh: DaemonConfig) -> list[str]:
    """``key (old -> new)`` for each setting ``fresh`` changes that a SIGHUP does not apply."""
    old, new = config_to_dict(running), config_to_dict(fresh)
    return [
        f"{section}.{key} ({old[section][key]!r} -> {value!r})"
        for section, values in new.items()
        for key, value in values.items()
        if value != old[section][key] and f"{section}.{key}" not in RELOADED
    ]


def lock_dirs(dirs: list[Path]) -> list[int]:
    """Lock ``dirs`` (each once, however named) for this daemon: a second daemon given the same state or swap
    directory would take this one's live swap files for orphans and remove them, and restore its jobs as its
    own.  An ``flock`` of the directory itself, so nothing is added to it; it goes with the process."""
    fds: list[int] = []
    for directory in dict.fromkeys(d.resolve() for d in dirs):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _flock_holder(os.fstat(fd))
            for held in [fd, *fds]:
                os.close(held)
            raise StartupError(
                EXIT_SWAP,
                f"{directory} is in use by another tiermemd (pid {holder}); give each daemon its own "
                "server.state_dir and swap.dirs",
            ) from None
        fds.append(fd)
    return fds


def _flock_holder(st: os.stat_result) -> str:
    """The pid holding an flock of the file ``st`` describes, from ``/proc/locks`` ('unknown' if not found)."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with contextlib.suppress(OSError), open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if "FLOCK" in fields and dev in fields:
                return fields[fields.index(dev) - 1]
    return "unknown"


class Service:
    """Owns every long-lived part of the daemon."""

    def __init__(
        self,
        config: DaemonConfig,
        env: Mapping[str, str],
        kernel: AdamKernel | None = None,
        reload_config: Callable[[], DaemonConfig] | None = None,
    ) -> None:
        """``reload_config`` reads the settings again for SIGHUP (default: ``TIERMEM_CONFIG`` and ``env``)."""

        self.config = config
        self.env = env
        self.reload_config = reload_config or (lambda: load_config(env.get("TIERMEM_CONFIG"), env=env))
        self.draining = False
        self.parent_pid: int | None = None
        """Drain once this process is no longer our parent (``--exit-with-parent``): the loop checks each tick."""
        self.notifier = Notifier(env)
        self.signals: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.window_budget = config.jobs.window_budget or config.jobs.max_jobs * config.jobs.window_size
        """Bytes of staging windows (each ``mlock``ed) all jobs together may hold."""
        try:
            pool_config = memfit.fit_pool(config.pool, self.window_budget, memfit.read_limits(), memfit.memlock_limit())
        except memfit.DoesNotFit as exc:
            raise StartupError(EXIT_RESOURCES, f"cannot start: {exc}") from None
        try:
            self.shares = PoolShares()
            """The pool's last resort: takes back memory the NVMe tier's managers borrowed above their floors."""
            self.pool = BufferPool.from_config(pool_config, evict=self.shares.evict)
        except (TiermemError, OSError) as exc:
            raise StartupError(EXIT_RESOURCES, f"cannot allocate the pool: {exc}") from exc
        try:
            self.swap_dirs = [self._prepare_dir(Path(d), "swap.dirs") for d in config.swap.dirs]
            self._prepare_dir(Path(config.server.state_dir), "server.state_dir")
        except StartupError:
            self.pool.close()
            raise
        try:
            self.dir_locks = lock_dirs([*self.swap_dirs, Path(config.server.state_dir)])
        except StartupError:
            self.pool.close()
            raise
        try:
            self.io_engine = open_engine(config.swap, self.swap_dirs)
        except ConfigError as exc:
            self.pool.close()
            raise StartupError(EXIT_SWAP, str(exc)) from exc
        from tiermemd.nvme import SwapDevice

        self.swap_device = SwapDevice(self.swap_dirs, self.io_engine, config.swap)
        """Measured (once, lazily) when the first rank is placed on NVMe: sizes queue depth and caches."""
        window_budget = self.window_budget
        self.ledger = Ledger(
            {
                Resource.POOL: self.pool.capacity,
                Resource.WINDOW: window_budget,
                Resource.SWAP: self._swap_capacity(),
                Resource.STORAGE: config.jobs.storage_budget
                or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
            }
        )
        self.jobs = JobTable(
            grace_period_s=config.jobs.grace_period_s,
            max_jobs=config.jobs.max_jobs,
            max_jobs_per_uid=config.jobs.max_jobs_per_uid,
        )
        self.jobs_dir = Path(config.server.state_dir) / "jobs"
        self.durability = Durability(
            jobs_dir=self.jobs_dir, swap_dirs=self.swap_dirs, commit_every=config.jobs.commit_every
        )
        try:  # before anything listens: reordered swap.dirs stop the start here
            self._restore_jobs()
        except SwapDirsChanged as exc:
            self.pool.close()
            raise StartupError(EXIT_SWAP, str(exc)) from exc
        self.health = health.REGISTRY
        """Progress of the worker threads: feeds the watchdog and the clients' heartbeats."""
        self.health.stall_s = config.server.stall_timeout_s
        self.listening_on = config.server.socket
        """The socket clients reach: the configured path, or the one the service manager passed."""
        self.scheduler = CpuScheduler()
        self.retired = RetiredRanks()
        """The last figures of ranks that ended (the node's counters never go down)."""
        if kernel is None:
            from tiermemd.kernel import default_kernel

            kernel = default_kernel(config.adam)
        self.kernel = kernel
        from tiermemd.handlers import Handlers

        self.handlers = Handlers(self)
        try:
            self.listener = self._listen()
        except (ConfigError, UnsafePathError) as exc:
            self.scheduler.close()
            self.pool.close()
            raise StartupError(EXIT_SOCKET, str(exc)) from exc
        self.server = Server(self.listener, self.handlers, config.server, self.health)
        self.server.on_client_exit = self.handlers.abort
        self.socket_keeper: SocketKeeper | None = None
        """Binds the socket path again if its file is removed (none under socket activation)."""
        if not self.activated:
            path = config.server.socket
            self.socket_keeper = SocketKeeper(path, identify(path), self._bind, self.server.replace_listener)
        try:
            self.metrics = serve_metrics(self)
        except OSError as exc:
            self.server.close()
            self.scheduler.close()
            self.pool.close()
            raise StartupError(
                EXIT_SOCKET, f"cannot serve metrics on {config.metrics.address}:{config.metrics.port}: {exc}"
            ) from exc
        self.orphans = Orphans(
            swap_dirs=self.swap_dirs, jobs_dir=self.jobs_dir, grace_period_s=config.jobs.grace_period_s
        )
        self.orphans.scan(store_name(j.job_id, r, j.owner_uid) for j in self.jobs.jobs() for r in j.restored)

    # ----------------------------------------------------------------- start-up helpers

    @staticmethod
    def _prepare_dir(path: Path, setting: str) -> Path:
        """Create (mode 0700) or check a state or swap directory: one nobody else can change, then a write probe.
        ``setting`` names where it was configured, for the ``StartupError`` a failure raises."""
        uid = os.geteuid()
        fix = f"remove it, or create it as {uid_label(uid)} with mode 0700"
        try:
            SecureDir.open(path, Trust.of(uid, what="this tiermemd"), create=True, fix=fix).close()
            probe = path / f".tiermemd-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except UnsafePathError as exc:
            raise StartupError(EXIT_SWAP, str(exc)) from exc
        except OSError as exc:
            raise StartupError(EXIT_SWAP, f"{setting} {path} unusable: {_dir_problem(exc)}; fix {setting}") from exc
        return path

    def _swap_capacity(self) -> int:
        total = 0
        for d in self.swap_dirs:
            st = os.statvfs(d)
            total += st.f_bavail * st.f_frsize
        return total

    @property
    def activated(self) -> bool:
        """The service manager passed the listening socket (socket activation): the path is its."""
        env = self.env
        return env.get("LISTEN_PID") == str(os.getpid()) and int(env.get("LISTEN_FDS", "0") or 0) >= 1

    def _listen(self) -> Listener:
        if self.activated:
            sock = adopt_listener(_SD_LISTEN_FDS_START)
            name = sock.getsockname()
            where = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            self.listening_on = f"{where or '(unnamed)'} (fd {_SD_LISTEN_FDS_START}, passed by the service manager)"
            log.info("using the socket passed by the service manager: %s", self.listening_on)
            return Listener(sock, max_frame=self.config.server.max_frame)
        self.listening_on = self.config.server.socket
        return self._bind()

    def _bind(self) -> Listener:
        """The listener at ``server.socket`` (at start, and again when its file was removed: ``SocketKeeper``)."""
        server = self.config.server
        return Listener.bind(
            server.socket, mode=server.socket_mode, group=server.socket_group or None, max_frame=server.max_frame
        )

    # ----------------------------------------------------------------- restart

    def _restore_jobs(self) -> None:
        """Bring back the jobs a previous daemon persisted (their NVMe state waits in the swap stores)."""
        for record in self.durability.restore(load_job_files(self.jobs_dir)):
            try:
                self.jobs.restore(
                    job_id=record.job_id,
                    owner_uid=record.owner_uid,
                    token=record.token,
                    world_size=record.world_size,
                    ranks={r.rank: r for r in record.ranks},
                )
            except TiermemError as exc:
                log.error("cannot restore job %r: %s", record.job_id, exc)
                continue
            log.info(
                "restored job %r (%d rank(s), last step %s) from its job file; waiting %.0fs for its token",
                record.job_id,
                len(record.ranks),
                ", ".join(str(r.last_step) for r in record.ranks),
                self.jobs.grace_period_s,
            )

    # ----------------------------------------------------------------- state and reclaim

    def cpu_state_nbytes(self, numel: int, fmt: StateFormat) -> int:
        """Pool bytes of a rank's state of ``numel`` elements in ``fmt`` held in the pool (the ``cpu``
        placement), chunked as this daemon chunks it: what registration weighs and what it reserves."""
        return fmt.nbytes(numel, fmt.chunk_numel(self.config.adam.chunk_numel))

    def state_factory(self, job: Job, rank: int, placement: Placement) -> Callable[[int, StateFormat], StateChunks]:
        def make(numel: int, fmt: StateFormat) -> StateChunks:
            if placement is Placement.CPU:
                nbytes = self.cpu_state_nbytes(numel, fmt)
                self.ledger.reserve(job.key, Resource.POOL, nbytes)
                try:
                    return CpuStateChunks(
                        self.pool,
                        numel,
                        self.config.adam.chunk_numel,
                        owner=f"{job.job_id}/{rank}",
                        keys=fmt.keys,
                        state_dtype=fmt.state_dtype,
                    )
                except BaseException:
                    self.ledger.release(job.key, Resource.POOL, nbytes)
                    raise
            from tiermemd.nvme import make_nvme_state

            reopened = getattr(job.ranks.get(rank), "restored", None) is not None
            if not reopened:
                self.orphans.forget(store_name(job.job_id, rank, job.owner_uid))
            return make_nvme_state(self, job, rank, numel, fmt, require_stored=reopened)

        return make

    def reclaim(self, jobs: list[Job], *, keep_swap: bool = False) -> None:
        """Free everything the given (already RECLAIMED) jobs held: state zeroed, windows closed, budgets
        returned; swap files and job files deleted unless ``keep_swap`` (a shutdown that persisted them)."""
        for job in jobs:
            self.durability.forget(job)
            for rank in list(job.ranks.values()):
                if isinstance(rank, RankOptimizer):
                    rank.close_pipeline()
                    self.retired.add(rank.stats())  # the node's counters keep what this rank did
                    rank.close(keep_swap=keep_swap)
                    rank.window.close()
            job.ranks.clear()
            if not keep_swap:
                from tiermemd.nvme import remove_store

                for rank_no in job.restored:
                    remove_store(self, job, rank_no)
                remove_job_file(self.jobs_dir, job.job_id, job.owner_uid)
            job.restored.clear()
            self.scheduler.forget_prefix(f"{job.job_id}/")
            held = self.ledger.release_all(job.key)
            log.info(
                "reclaimed job %r of uid %d (%s)",
                job.job_id,
                job.owner_uid,
                ", ".join(f"{r.value} {format_size(n)}" for r, n in held.items()) or "nothing held",
            )

    # ----------------------------------------------------------------- the main loop

    def install_signals(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda n, _f: self.signals.put(n))

    def serve_forever(self) -> None:
        self.server.start()
        if self.socket_keeper is not None:
            self.socket_keeper.start()
        if self.pool.locked:
            locked = "locked"
        elif not self.config.pool.mlock:
            locked = "not locked (pool.mlock = false)"
        else:
            locked = "NOT locked (see the RLIMIT_MEMLOCK warning)"
        status = f"pool {format_size(self.pool.capacity)} {locked}; listening on {self.listening_on}"
        log.info("ready: %s", status)
        self.notifier.ready(status)
        watchdog_every = self.notifier.watchdog_interval_s
        last_watchdog = 0.0
        while True:
            try:
                signum = self.signals.get(timeout=_LOOP_TICK_S)
            except queue.Empty:
                signum = None
            if signum in (signal.SIGTERM, signal.SIGINT):
                log.info("received %s: draining", signal.Signals(signum).name)
                break
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.info("parent process %d exited (--exit-with-parent): draining", self.parent_pid)
                break
            if signum == signal.SIGHUP:
                self.reload()
            self.orphans.sweep()
            expired = self.jobs.expire()
            if expired:
                self.reclaim(expired)
            now = time.monotonic()
            healthy = self.health.check()  # logs a wedged thread by name, once
            if watchdog_every is not None and now - last_watchdog >= watchdog_every and healthy:
                self.notifier.watchdog()  # fed only while every worker thread moves or is idle
                last_watchdog = now
        self.shutdown()

    def reload(self) -> None:
        self.notifier.reloading()
        try:
            fresh = self.reload_config()
        except ConfigError as exc:
            log.error("SIGHUP: new settings are invalid, keeping the old ones: %s", exc)
            self.notifier.ready("reload refused: invalid settings")
            return
        self.jobs.grace_period_s = fresh.jobs.grace_period_s
        self.jobs.max_jobs = fresh.jobs.max_jobs
        self.jobs.max_jobs_per_uid = fresh.jobs.max_jobs_per_uid
        self.durability.set_commit_every(fresh.jobs.commit_every)
        self.server.config = fresh.server
        log.info("SIGHUP: reloaded %s (other settings take effect on restart)", ", ".join(sorted(RELOADED)))
        pending = restart_only_changes(self.config, fresh)
        if pending:
            log.warning("SIGHUP: changed, but applied only by a restart: %s", "; ".join(pending))
        self.notifier.ready("reloaded")

    def shutdown(self) -> None:
        self.draining = True
        self.server.draining = True
        self.notifier.stopping("draining")
        self.server.stop_accepting()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while any(s.busy for s in self.server.sessions()) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.server.close_sessions("tiermemd is shutting down")
        self.server.close()
        if self.metrics is not None:
            self.metrics.close()
        keeper = self.socket_keeper
        if keeper is not None:
            keeper.stop()
            if not keeper.owns():
                log.warning("left %s in place: it is not this daemon's socket any more", keeper.path)
            else:
                try:
                    remove_socket(keeper.path)
                except (OSError, UnsafePathError) as exc:
                    log.warning("left the socket file %s in place: %s", keeper.path, exc)
        self.persist_and_reclaim()
        self.scheduler.close()
        self.io_engine.close()
        self.pool.close()
        for fd in self.dir_locks:
            os.close(fd)
        self.notifier.close()
        log.info("stopped")

    def persist_and_reclaim(self) -> None:
        """At shutdown: jobs with NVMe state are written out to be reopened by the next daemon."""
        jobs = self.jobs.reclaim_all()
        kept = [job for job in jobs if self.durability.persist_job(job)]
        self.reclaim(kept, keep_swap=True)
        self.reclaim([job for job in jobs if job not in kept])


def run_service(
    config: DaemonConfig,
    env: Mapping[str, str],
    reload_config: Callable[[], DaemonConfig] | None = None,
    parent_pid: int | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (or until process ``parent_pid`` exits); returns the process exit code."""

    try:
        service = Service(config, env, reload_config=reload_config)
    except StartupError as exc:
        log.error("%s", exc)
        return exc.code
    service.parent_pid = parent_pid
    service.install_signals()
    try:
        service.serve_forever()
    except Exception:
        log.exception("tiermemd failed")
        return EXIT_INTERNAL
    if service.durability.failed:
        log.error(
            "stopped, but the state of %d rank(s) could not be committed; the next start serves their last "
            "commits (see above)",
            len(service.durability.failed),
        )
        return EXIT_DATA_LOST
    return EXIT_OK


def _dir_problem(exc: OSError) -> str:
    """What an ``OSError`` of creating or writing in a directory means, in words (a path component that is a
    file says so; mkdir reports it as "File exists" or "Not a directory")."""
    where = exc.filename
    if exc.errno in (errno.EEXIST, errno.ENOTDIR) and where is not None:
        blocker = Path(os.fsdecode(where))
        while not blocker.exists() and blocker != blocker.parent:
            blocker = blocker.parent
        if blocker.exists() and not blocker.is_dir():
            return f"{blocker} is not a directory"
    return f"{exc.strerror or exc}" + (f": {os.fsdecode(where)}" if where is not None else "")

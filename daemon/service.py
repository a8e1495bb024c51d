"""The service: builds the parts in order, runs the main loop, shuts down cleanly.

Start-up order (each failure exits with its documented code, see ``main``):
pool (allocated, pre-faulted, locked: exit 3) -> swap directories (exit 4) ->
socket (exit 5) -> READY=1.  systemd therefore sees the service ready only once
its memory is really there.

The main thread runs one loop (gunicorn's shape): signal handlers only put the
signal number in a queue; the loop takes signals, reclaims jobs whose grace
period ended, and feeds the systemd watchdog.  SIGTERM/SIGINT drain: stop
accepting, let every session finish the request it is in (bounded by
``DRAIN_TIMEOUT_S``), close the sessions, release all memory, exit 0.  SIGHUP
re-reads the settings that can change live (the grace period, the job limit,
the allowed uids/gids); the others need a restart and are reported as such.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from tiermem.config import DaemonConfig, load_config
from tiermem.errors import ConfigError, TiermemError
from tiermem.pool import BufferPool
from tiermem.swap import open_engine
from tiermem.transport import Listener, adopt_listener
from tiermem.units import format_size
from tiermemd.jobs import Job, JobTable
from tiermemd.ledger import Ledger, Resource
from tiermemd.notify import Notifier
from tiermemd.rank import AdamKernel, RankOptimizer
from tiermemd.scheduler import CpuScheduler
from tiermemd.server import Server
from tiermemd.state import STATE_BYTES_PER_ELEMENT, CpuStateChunks, StateChunks

__all__ = ["DRAIN_TIMEOUT_S", "Service", "run_service"]

log = logging.getLogger("tiermemd")

DRAIN_TIMEOUT_S = 30.0
_LOOP_TICK_S = 0.5
_SD_LISTEN_FDS_START = 3


class StartupError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Service:
    """Owns every long-lived part of the daemon."""

    def __init__(self, config: DaemonConfig, env: Mapping[str, str], kernel: AdamKernel | None = None) -> None:
        from tiermemd.main import EXIT_RESOURCES, EXIT_SOCKET, EXIT_SWAP

        self.config = config
        self.env = env
        self.draining = False
        self.notifier = Notifier(env)
        self.signals: queue.SimpleQueue[int] = queue.SimpleQueue()
        try:
            self.pool = BufferPool.from_config(config.pool)
        except (TiermemError, OSError) as exc:
            raise StartupError(EXIT_RESOURCES, f"cannot allocate the pool: {exc}") from exc
        try:
            self.swap_dirs = [self._prepare_dir(Path(d)) for d in config.swap.dirs]
            self._prepare_dir(Path(config.server.state_dir))
        except OSError as exc:
            self.pool.close()
            raise StartupError(EXIT_SWAP, f"swap directory unusable: {exc}") from exc
        try:
            self.io_engine = open_engine(config.swap, self.swap_dirs)
        except ConfigError as exc:
            self.pool.close()
            raise StartupError(EXIT_SWAP, str(exc)) from exc
        window_budget = config.jobs.window_budget or self.pool.capacity
        self.ledger = Ledger(
            {
                Resource.POOL: self.pool.capacity,
                Resource.WINDOW: window_budget,
                Resource.SWAP: self._swap_capacity(),
            }
        )
        self.jobs = JobTable(grace_period_s=config.jobs.grace_period_s, max_jobs=config.jobs.max_jobs)
        self.scheduler = CpuScheduler()
        if kernel is None:
            from tiermemd.kernel import default_kernel

            kernel = default_kernel(config.adam)
        self.kernel = kernel
        from tiermemd.handlers import Handlers

        self.handlers = Handlers(self)
        try:
            self.listener = self._listen()
        except ConfigError as exc:
            self.scheduler.close()
            self.pool.close()
            raise StartupError(EXIT_SOCKET, str(exc)) from exc
        self.server = Server(self.listener, self.handlers, config.server)
        self.server.on_client_exit = self.handlers.abort

    # ----------------------------------------------------------------- start-up helpers

    @staticmethod
    def _prepare_dir(path: Path) -> Path:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        probe = path / f".tiermemd-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return path

    def _swap_capacity(self) -> int:
        total = 0
        for d in self.swap_dirs:
            st = os.statvfs(d)
            total += st.f_bavail * st.f_frsize
        return total

    def _listen(self) -> Listener:
        env = self.env
        if env.get("LISTEN_PID") == str(os.getpid()) and int(env.get("LISTEN_FDS", "0") or 0) >= 1:
            log.info("using the socket passed by the service manager")
            return Listener(adopt_listener(_SD_LISTEN_FDS_START), max_frame=self.config.server.max_frame)
        server = self.config.server
        return Listener.bind(
            server.socket, mode=server.socket_mode, group=server.socket_group or None, max_frame=server.max_frame
        )

    # ----------------------------------------------------------------- state and reclaim

    def state_factory(self, job: Job, rank: int, placement: str) -> Callable[[int], StateChunks]:
        def make(numel: int) -> StateChunks:
            nbytes = numel * STATE_BYTES_PER_ELEMENT
            if placement == "cpu":
                self.ledger.reserve(job.job_id, Resource.POOL, nbytes)
                try:
                    return CpuStateChunks(self.pool, numel, self.config.adam.chunk_numel, owner=f"{job.job_id}/{rank}")
                except BaseException:
                    self.ledger.release(job.job_id, Resource.POOL, nbytes)
                    raise
            from tiermemd.nvme import make_nvme_state

            return make_nvme_state(self, job, rank, numel)

        return make

    def reclaim(self, jobs: list[Job]) -> None:
        """Free everything the given (already RECLAIMED) jobs held: state zeroed, windows closed, budgets returned."""
        for job in jobs:
            for rank in list(job.ranks.values()):
                if isinstance(rank, RankOptimizer):
                    rank.close()
                    rank.window.close()
            job.ranks.clear()
            self.scheduler.forget_prefix(f"{job.job_id}/")
            held = self.ledger.release_all(job.job_id)
            log.info(
                "reclaimed job %r (%s)",
                job.job_id,
                ", ".join(f"{r.value} {format_size(n)}" for r, n in held.items()) or "nothing held",
            )

    def node_stats(self) -> dict[str, float]:
        pool = self.pool.stats()
        out: dict[str, float] = {
            "pool_capacity_bytes": pool.capacity,
            "pool_used_bytes": pool.used,
            "pool_free_bytes": pool.free,
            "pool_largest_free_bytes": pool.largest_free,
            "pool_fragmentation": pool.fragmentation,
            "pool_blocks": pool.blocks,
            "pool_compactions": pool.compactions,
            "pool_bytes_moved": pool.bytes_moved,
            "pool_locked": float(self.pool.locked),
            "jobs": len(self.jobs.jobs()),
            "sessions": len(self.server.sessions()),
            "scheduler_queued": self.scheduler.queued,
        }
        for resource, figures in self.ledger.snapshot().items():
            out[f"budget_{resource}_capacity_bytes"] = figures["capacity"]
            out[f"budget_{resource}_held_bytes"] = figures["held"]
        return out

    # ----------------------------------------------------------------- the main loop

    def install_signals(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda n, _f: self.signals.put(n))

    def serve_forever(self) -> None:
        self.server.start()
        locked = "locked" if self.pool.locked else "NOT locked (see the RLIMIT_MEMLOCK warning)"
        status = f"pool {format_size(self.pool.capacity)} {locked}; listening on {self.config.server.socket}"
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
            if signum == signal.SIGHUP:
                self.reload()
            expired = self.jobs.expire()
            if expired:
                self.reclaim(expired)
            now = time.monotonic()
            if watchdog_every is not None and now - last_watchdog >= watchdog_every:
                self.notifier.watchdog()
                last_watchdog = now
        self.shutdown()

    def reload(self) -> None:
        self.notifier.reloading()
        path = self.env.get("TIERMEM_CONFIG")
        try:
            fresh = load_config(path, env=self.env)
        except ConfigError as exc:
            log.error("SIGHUP: new settings are invalid, keeping the old ones: %s", exc)
            self.notifier.ready("reload refused: invalid settings")
            return
        self.jobs.grace_period_s = fresh.jobs.grace_period_s
        self.jobs.max_jobs = fresh.jobs.max_jobs
        self.server.config = fresh.server
        log.info(
            "SIGHUP: reloaded jobs.grace_period_s, jobs.max_jobs, server.allowed_uids/gids "
            "(other settings take effect on restart)"
        )
        self.notifier.ready("reloaded")

    def shutdown(self) -> None:
        self.draining = True
        self.notifier.stopping("draining")
        self.server.stop_accepting()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while any(s.busy for s in self.server.sessions()) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.server.close_sessions("tiermemd is shutting down")
        self.server.close()
        with contextlib.suppress(FileNotFoundError):
            if not self.env.get("LISTEN_FDS"):
                os.unlink(self.config.server.socket)
        self.persist_and_reclaim()
        self.scheduler.close()
        self.io_engine.close()
        self.pool.close()
        self.notifier.close()
        log.info("stopped")

    def persist_and_reclaim(self) -> None:
        jobs = self.jobs.reclaim_all()
        for job in jobs:
            for rank in job.ranks.values():
                persist = getattr(getattr(rank, "state", None), "persist", None)
                if persist is not None:
                    persist()
        self.reclaim(jobs)


def run_service(config: DaemonConfig, env: Mapping[str, str]) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    from tiermemd.main import EXIT_INTERNAL, EXIT_OK

    try:
        service = Service(config, env)
    except StartupError as exc:
        log.error("%s", exc)
        return exc.code
    service.install_signals()
    try:
        service.serve_forever()
    except Exception:
        log.exception("tiermemd failed")
        return EXIT_INTERNAL
    return EXIT_OK

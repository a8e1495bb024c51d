"""The client library: find (or start) the node's tiermemd, attach, and talk to it.

``connect()`` looks for a daemon in this order: the ``socket`` argument,
``$TIERMEM_SOCKET_PATH``, the node installation's ``/run/tiermem/tiermemd.sock``,
then the per-user default (``$XDG_RUNTIME_DIR/tiermem/tiermemd.sock``, else
``/tmp/tiermem-<uid>/tiermemd.sock``).  It connects only to a daemon of the
expected uid (``tiermem.net.sockpath``): root or the node's service user (the user
named by ``$TIERMEM_DAEMON_USER``, else ``tiermem`` where it exists) for the
node path; root or the user itself for the per-user path and a private daemon;
root, the user itself or the service user for a path the caller names, unless
``daemon_uid=`` names another.  A
candidate found untrusted is skipped with a warning (a socket the caller named
raises ``UnsafePathError``).  When none answers and ``embed`` allows it (the
default unless ``TIERMEM_NO_EMBED=1``), it starts a private ``tiermemd`` for
this process tree: a real child process on a socket in a private directory
(``tempfile.mkdtemp``: created 0700 by this user, checked like any other),
which the child reports ready through the sd_notify protocol once its pool is
allocated, and which is stopped (SIGTERM, then waited for) when the client
closes or the process exits; the child's ``--exit-with-parent`` stops it if
this process dies first.  The child runs in a session of its own, so a
terminal's Ctrl-C interrupts the trainer only: an ``except KeyboardInterrupt``
that saves ``opt.state_dict()`` still finds the daemon and its state.  The
child's ``--private-dir`` removes the directory when it stops
(``tiermem.net.privatedir``: a directory whose processes were all killed is
removed by the next private daemon's start).  A private daemon that dies (or
closes the connection) fails the next request with ``DaemonGone`` naming its
pid and exit status, and saying that its state, CPU and NVMe tier alike, went
with it (``EmbeddedDaemon.gone``).

Every reply wait is bounded by a timeout of the daemon's *silence* (see
``tiermem.net.frames``: the daemon sends heartbeats while it works on a
request, so long requests are not cut short): ``timeout_s=`` of ``connect``,
else ``$TIERMEM_CLIENT_TIMEOUT_S`` (seconds; ``inf`` waits forever), else
``DEFAULT_TIMEOUT_S`` (60 s).  Past it a request raises ``DaemonTimeout``
naming the socket, the request and the time waited.

A ``Client`` is one connection.  After ``attach`` it maps the job's window
(the memfd the daemon sends) and exposes it as a ``torch.uint8`` tensor; all
bulk data moves through that window, never through the socket.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import mmap
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiermem.client.connection import DEFAULT_TIMEOUT_S, Connection, connect_trusted
from tiermem.core import protocol
from tiermem.core.closing import Closing
from tiermem.core.config import default_runtime_dir
from tiermem.core.errors import (
    ConfigError,
    DaemonGone,
    DaemonUnavailable,
    InvalidArgument,
    InvalidState,
    ProtocolError,
    TiermemError,
    UnsafePathError,
)
from tiermem.core.modes import Exchange
from tiermem.core.units import GiB, format_size
from tiermem.net import privatedir
from tiermem.net.sockpath import SocketCandidate, Trust, socket_candidates

__all__ = ["DEFAULT_TIMEOUT_S", "AttachInfo", "Client", "EmbeddedDaemon", "client_timeout", "connect"]

log = logging.getLogger(__name__)

_NOT_INHERITED = ("TIERMEM_", "NOTIFY_SOCKET", "LISTEN_", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""Environment a private daemon does not take from its trainer: tiermem's own settings, systemd's, and how
the trainer's OpenMP workers wait (libgomp's ``GOMP_SPINCOUNT`` overrides ``OMP_WAIT_POLICY``, so a trainer
tuned to spin would make the daemon, which runs passive beside it, spin too)."""
NODE_SOCKET = "/run/tiermem/tiermemd.sock"
NODE_SERVICE_USER = "tiermem"
"""The user the shipped unit runs the node daemon as (``User=`` in ``systemd/tiermemd.service``)."""
GONE_WAIT_S = 2.0
"""How long a client that found its private daemon's connection closed waits for the child's exit status (a
daemon stopping cleanly closes its sessions before it exits)."""


@dataclass(frozen=True)
class AttachInfo:
    job_id: str
    rank: int
    token: str
    window_id: int
    window_nbytes: int
    reattached: bool
    state_step: int = 0
    """The step the rank's state is at (0: none yet)."""
    state_from: str = "new"
    """Where it comes from: ``new``, ``live``, ``shutdown`` or ``commit`` (see ``ATTACH_OK``)."""


class EmbeddedDaemon:
    """A private tiermemd child process for this process tree."""

    def __init__(
        self,
        *,
        pool_size: int,
        swap_dir: str | None = None,
        settings: Mapping[str, Any] | None = None,
        extra_args: Sequence[str] = (),
        ready_timeout_s: float = 120.0,
    ) -> None:
        """``settings``: dotted config keys for the daemon (``{"adam.chunk_numel": 65536}``)."""
        privatedir.sweep()  # directories of private daemons killed with their trainers
        # created 0700 by this user (connect() checks it); the lock is held while this process or the daemon lives
        self.dir, self._lock_fd = privatedir.create()
        # always a settings file of its own: with none, tiermemd reads the node's /etc/tiermem/tiermemd.toml,
        # whose metrics port, kernel cache and socket group are the node service's (the private daemon of a
        # user outside the service's group would fail to start on its port)
        config_path = os.path.join(self.dir, "tiermemd.toml")
        Path(config_path).write_text(_settings_toml(settings or {}))
        self.socket = os.path.join(self.dir, privatedir.SOCKET_NAME)
        notify_path = os.path.join(self.dir, "notify")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        notify.bind(notify_path)
        args = [
            sys.executable,
            "-m",
            "tiermemd.main",
            "--socket",
            self.socket,
            "--pool-size",
            str(pool_size),
            "--state-dir",
            os.path.join(self.dir, "state"),
            "--swap-dir",
            swap_dir or os.path.join(self.dir, "swap"),
            "--exit-with-parent",
            "--private-dir",
            self.dir,
            "--config",
            config_path,
            *extra_args,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith(_NOT_INHERITED)}
        env["NOTIFY_SOCKET"] = notify_path
        env["TIERMEM_JOBS_GRACE_PERIOD_S"] = "5"
        env["TIERMEM_SERVER_ACCEPT_PROCESS"] = "false"  # one user in a 0700 directory: nobody to storm it
        self.log_path = os.path.join(self.dir, "tiermemd.log")
        log_file = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it
        try:
            self.process = subprocess.Popen(
                args,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                pass_fds=(self._lock_fd,),
                # its own session: a terminal's Ctrl-C (SIGINT to the foreground process group) reaches the
                # trainer alone, whose KeyboardInterrupt handler may still save a checkpoint from this daemon;
                # the trainer's close or exit stops it, --exit-with-parent its death
                start_new_session=True,
            )
        except BaseException:  # no daemon (the interpreter could not be run): nothing to keep the directory for
            notify.close()
            privatedir.remove(self.dir)
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise
        finally:
            log_file.close()
        try:
            self._wait_ready(notify, ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        finally:
            notify.close()
        atexit.register(self.stop)

    @property
    def trust(self) -> Trust:
        """Whose the daemon's socket must be: this user's (or root's)."""
        return Trust.of(os.geteuid(), what="this process's private tiermemd")

    def _wait_ready(self, notify: socket.socket, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        notify.settimeout(0.2)
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                if b"READY=1" in notify.recv(4096):
                    return
            if self.process.poll() is not None:
                raise DaemonUnavailable(
                    self.socket, f"the embedded tiermemd exited with code {self.process.returncode}: {self._tail()}"
                )
        raise DaemonUnavailable(self.socket, f"the embedded tiermemd was not ready after {timeout_s}s: {self._tail()}")

    def _tail(self) -> str:
        with contextlib.suppress(OSError):
            return Path(self.log_path).read_text(errors="replace")[-2000:].strip()
        return ""

    def gone(self, during: str) -> DaemonGone:
        """The error for a connection this daemon closed during ``during`` (a request): its pid and how it
        ended, waited for up to ``GONE_WAIT_S``, and the end of its log when it exited with a failure."""
        try:
            code: int | None = self.process.wait(GONE_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        return DaemonGone(
            self.socket,
            during,
            pid=self.process.pid,
            exit_code=code,
            ended=exit_status(code) if code is not None else "",
            log_path=self.log_path,
            log_tail=self._tail()[-600:] if code is not None and code > 0 else "",
        )

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the daemon and wait; returns its exit code."""
        atexit.unregister(self.stop)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        privatedir.remove(self.dir)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        return self.process.returncode


def _private_gone(path: str) -> Callable[[str], DaemonGone] | None:
    """For a socket in a private daemon's directory (one another process started: the demo's, a node's first
    rank's), the ``DaemonGone`` that says so, not the node service's; None for any other socket."""
    if not privatedir.is_private_dir(os.path.dirname(path)):
        return None
    return lambda during: DaemonGone(path, during, private=True)


def exit_status(code: int) -> str:
    """How a child ended, from its ``subprocess`` return code: ``stopped, exit code 0``, ``exit code 3``,
    ``killed by SIGKILL, exit code -9``."""
    if code == 0:
        return "stopped, exit code 0"
    if code > 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"killed by {name}, exit code {code}"


def _settings_toml(settings: Mapping[str, Any]) -> str:
    tables: dict[str, dict[str, Any]] = {}
    for dotted, value in settings.items():
        section, _, key = dotted.partition(".")
        tables.setdefault(section, {})[key] = value
    lines = []
    for section, values in tables.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {json.dumps(value)}" for key, value in values.items())
    return "\n".join(lines) + "\n"


def candidate_sockets(
    socket_path: str | None, env: Mapping[str, str], *, daemon_uid: int | None = None
) -> list[SocketCandidate]:
    """The sockets ``connect`` tries, in order, each with the uids its daemon must run as."""
    return socket_candidates(
        explicit=socket_path or env.get("TIERMEM_SOCKET_PATH") or None,
        node_path=NODE_SOCKET,
        per_user_path=str(default_runtime_dir(env) / "tiermemd.sock"),
        uid=os.geteuid(),
        service_uids=_service_uids(env),
        daemon_uid=daemon_uid,
    )


def client_timeout(timeout_s: float | None, env: Mapping[str, str]) -> float | None:
    """The reply timeout of a client: ``timeout_s``, else ``$TIERMEM_CLIENT_TIMEOUT_S``, else the default.

    Returns None for "wait forever" (``math.inf``, or "inf" in the environment)."""
    source = "timeout_s"
    value: object = timeout_s
    if value is None:
        raw = env.get("TIERMEM_CLIENT_TIMEOUT_S", "").strip()
        if not raw:
            return DEFAULT_TIMEOUT_S
        source = "TIERMEM_CLIENT_TIMEOUT_S"
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(source, f"expected seconds (a number > 0, or inf), got {raw!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        problem = f"expected seconds (a number > 0, or inf to wait forever), got {value!r}"
        if source == "timeout_s":
            raise InvalidArgument(f"timeout_s: {problem}")
        raise ConfigError(source, problem)
    return None if value == float("inf") else float(value)


def _service_uids(env: Mapping[str, str]) -> list[int]:
    """The node daemon's uid: ``$TIERMEM_DAEMON_USER`` (a name or a number), else the shipped unit's user."""
    named = env.get("TIERMEM_DAEMON_USER", "").strip()
    if named.isdigit():
        return [int(named)]
    try:
        return [pwd.getpwnam(named or NODE_SERVICE_USER).pw_uid]
    except KeyError:
        if named:
            raise ConfigError("TIERMEM_DAEMON_USER", f"no user named {named!r} on this node") from None
        return []  # no service user: only root's daemon is trusted on the node path


class Client(Closing):
    """One connection to tiermemd (and, after ``attach``, the job's mapped window)."""

    def __init__(self, conn: Connection, *, socket_path: str, daemon: EmbeddedDaemon | None = None) -> None:
        self.conn = conn
        self.socket_path = socket_path
        self.daemon = daemon
        self.info: AttachInfo | None = None
        self._mmap: mmap.mmap | None = None
        self.window: torch.Tensor = torch.empty(0, dtype=torch.uint8)
        """The staging window (bounded; state transfer goes through it)."""
        self.storage: torch.Tensor = torch.empty(0, dtype=torch.uint8)
        """The shared storage of the registered params and grads (mapped at ``register``), as one tensor."""
        self._storage_map: memoryview | None = None
        self.peers_linger_s = 0.0
        """With an embedded daemon that other processes use too (the private daemon of a node's ranks): how
        long ``close`` waits for their connections to end before it stops the daemon under them."""

    # ----------------------------------------------------------------- session

    def attach(
        self,
        job_id: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        window_nbytes: int,
        token: str | None = None,
        create: bool = False,
    ) -> AttachInfo:
        """``create``: ``token`` was agreed by the job's ranks; the first of them to attach creates the job."""
        reply, fds = self.conn.request_fds(
            protocol.Attach(
                job_id=job_id,
                rank=rank,
                world_size=world_size,
                window_nbytes=window_nbytes,
                token=token,
                create=create,
            )
        )
        if not isinstance(reply, protocol.AttachOk) or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"expected ATTACH_OK with one window fd, got {type(reply).__name__} with {len(fds)}")
        try:
            self._mmap = mmap.mmap(fds[0], reply.window_nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fds[0])
        self.window = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.info = AttachInfo(
            job_id,
            rank,
            reply.job_token,
            reply.window_id,
            reply.window_nbytes,
            reply.reattached,
            reply.state_step,
            reply.state_from,
        )
        return self.info

    def register(
        self,
        tensors: Sequence[protocol.TensorSpec],
        groups: Sequence[protocol.ParamGroup],
        *,
        grad_buffers: int = 1,
        exchange: Exchange | str = Exchange.SHARED,
        grads_in_state: bool = False,
        state_dtype: str = "fp32",
    ) -> protocol.RegisterOk:
        """Register the tensors; the daemon's plan comes back and, with the shared exchange, its shared storage
        is mapped as ``storage``.  ``state_dtype``: how the daemon stores the moments (``fp32``, ``bf16``,
        ``int8``); ``exchange``: an ``Exchange`` or its wire spelling."""
        exchange = Exchange.parse(exchange, "exchange")
        reply, fds = self.conn.request_fds(
            protocol.Register(tuple(tensors), tuple(groups), grad_buffers, exchange, grads_in_state, state_dtype)
        )
        want = 1 if exchange is Exchange.SHARED else 0
        if not isinstance(reply, protocol.RegisterOk) or len(fds) != want:
            for fd in fds:
                os.close(fd)
            raise ProtocolError(
                f"expected REGISTER_OK with {want} storage fd(s), got {type(reply).__name__} with {len(fds)}"
            )
        if not fds:
            return reply
        try:
            storage = mmap.mmap(fds[0], reply.storage_nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fds[0])
        # the tensors' views keep the mapping alive after the client closes (the model keeps its params)
        self._storage_map = memoryview(storage)
        self.storage = torch.frombuffer(self._storage_map, dtype=torch.uint8)
        return reply

    def storage_tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the shared storage from ``offset`` as a uint8 tensor with a torch storage of its own.

        Model params and grads are bound to these, never to views of ``storage``: checkpoint writers
        (``safetensors``, ``accelerate``, ``torch.save``) treat views of one storage as tied tensors and keep
        one of them (or write the whole storage per tensor).  Each storage here is its own object over its own
        bytes of the mapping, so every tensor is saved alone, at its own size.
        """
        if self._storage_map is None:
            raise InvalidState("no shared storage is mapped: register with the shared exchange first")
        if offset < 0 or nbytes < 0 or offset + nbytes > len(self._storage_map):
            raise InvalidArgument(
                f"bytes [{offset}, {offset + nbytes}) lie outside the shared storage of {len(self._storage_map)} bytes"
            )
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._storage_map[offset : offset + nbytes], dtype=torch.uint8)

    def bucket_ready(
        self,
        step: int,
        attempt: int,
        bucket: int,
        tensor_ids: Sequence[int],
        groups: Sequence[protocol.ParamGroup],
        grad_buffer: int = 0,
    ) -> None:
        """Tell the daemon a bucket's grads are final: it updates them now (the overlapped update)."""
        self.conn.send_oneway(
            protocol.BucketReady(
                step=step,
                attempt=attempt,
                bucket=bucket,
                tensor_ids=tuple(tensor_ids),
                grad_buffer=grad_buffer,
                groups=tuple(groups),
            )
        )

    def abort(self, step: int, attempt: int) -> protocol.Aborted:
        reply = self.conn.request(protocol.Abort(step=step, attempt=attempt))
        if not isinstance(reply, protocol.Aborted):
            raise ProtocolError(f"expected ABORTED, got {type(reply).__name__}")
        return reply

    def reset_state(self, tensor_ids: Sequence[int] = ()) -> None:
        self.conn.request(protocol.StateReset(tensor_ids=tuple(tensor_ids)))

    def grad_norm(self, tensor_ids: Sequence[int] = (), *, grad_buffer: int = 0) -> protocol.GradNormReply:
        """The daemon's statistics of the rank's grads now in ``grad_buffer`` (of ``tensor_ids``; empty: all)."""
        reply = self.conn.request(protocol.GradNorm(tensor_ids=tuple(tensor_ids), grad_buffer=grad_buffer))
        if not isinstance(reply, protocol.GradNormReply):
            raise ProtocolError(f"expected GRAD_NORM_REPLY, got {type(reply).__name__}")
        return reply

    def step(self, msg: protocol.Step) -> protocol.StepDone:
        reply = self.conn.request(msg)
        if not isinstance(reply, protocol.StepDone):
            raise ProtocolError(f"expected STEP_DONE, got {type(reply).__name__}")
        return reply

    def fetch_params(self, tensor_ids: Sequence[int] = ()) -> int:
        """Have the daemon write current params into their slots; returns the step they are from."""
        reply = self.conn.request(protocol.FetchParams(step=0, tensor_ids=tuple(tensor_ids)))
        return int(reply.step)  # type: ignore[attr-defined]

    def read_state(self, tensor_id: int, key: str, offset: int, dest: protocol.MemRef) -> protocol.StateChunk:
        reply = self.conn.request(protocol.StateRead(tensor_id=tensor_id, key=key, offset=offset, dest=dest))
        if not isinstance(reply, protocol.StateChunk):
            raise ProtocolError(f"expected STATE_CHUNK, got {type(reply).__name__}")
        return reply

    def write_state(
        self, tensor_id: int, key: str, offset: int, src: protocol.MemRef, step: int, *, accumulate: bool = False
    ) -> None:
        self.conn.request(
            protocol.StateWrite(tensor_id=tensor_id, key=key, offset=offset, src=src, step=step, accumulate=accumulate)
        )

    def stats(self) -> protocol.StatsReply:
        """The daemon's figures: the node, the jobs this uid may see, and this connection's rank (once attached)."""
        reply = self.conn.request(protocol.Stats())
        if not isinstance(reply, protocol.StatsReply):
            raise ProtocolError(f"expected STATS_REPLY, got {type(reply).__name__}")
        return reply

    def request(self, msg: protocol.Message) -> protocol.Message:
        return self.conn.request(msg)

    def detach(self, *, keep_state: bool = False) -> None:
        self.conn.request(protocol.Detach(keep_state=keep_state))
        self._unmap()

    def _unmap(self) -> None:
        self.window = torch.empty(0, dtype=torch.uint8)
        self.storage = torch.empty(0, dtype=torch.uint8)
        self._storage_map = None
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    def close(self) -> None:
        if self.daemon is not None and self.peers_linger_s > 0:
            self._wait_for_peers(self.peers_linger_s)
        self.conn.close()
        self._unmap()
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None

    def _wait_for_peers(self, limit_s: float) -> None:
        """Until this is the daemon's last connection (the other ranks detached and closed), at most ``limit_s``."""
        deadline = time.monotonic() + limit_s
        others = 0
        while True:
            try:
                others = self.stats().node.server.sessions - 1
            except TiermemError:
                return  # the daemon or this connection is gone already: nothing to wait for
            if others <= 0:
                return
            if time.monotonic() >= deadline:
                log.warning(
                    "stopping the private tiermemd with %d other connection(s) still open after %.0f s "
                    "(their ranks will see it gone)",
                    others,
                    limit_s,
                )
                return
            time.sleep(0.02)


def connect(
    socket_path: str | None = None,
    *,
    embed: bool | None = None,
    pool_size: int = 1 * GiB,
    swap_dir: str | None = None,
    settings: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    daemon_uid: int | None = None,
) -> Client:
    """Connect to the node's tiermemd, or start a private one (see the module docstring).

    ``timeout_s``: the longest the daemon may stay silent during a request (see ``client_timeout``).
    ``pool_size``, ``swap_dir`` and ``settings`` (dotted config keys) apply only to a private daemon.
    ``daemon_uid``: the uid the daemon at ``socket_path`` (or ``$TIERMEM_SOCKET_PATH``, or the node
    path) runs as, when it is neither root, this user nor the node service's user.  Raises
    ``UnsafePathError`` when a socket named by the caller is not that daemon's, or when every candidate
    was refused and no private daemon may be started.
    """
    env = os.environ if env is None else env
    timeout_s = client_timeout(timeout_s, env)
    if embed is None:
        embed = env.get("TIERMEM_NO_EMBED", "") not in ("1", "true", "yes")
    tried: list[str] = []
    refused: list[UnsafePathError] = []
    candidates = candidate_sockets(socket_path, env, daemon_uid=daemon_uid)
    for candidate in candidates:
        try:
            sock = connect_trusted(candidate.path, candidate.trust)
        except UnsafePathError as exc:
            if candidate.explicit:
                raise
            log.warning("not using %s: %s", candidate.path, exc)
            refused.append(exc)
            tried.append(str(exc))
        except DaemonUnavailable as exc:
            tried.append(str(exc))
        else:
            gone = _private_gone(candidate.path)
            conn = Connection(sock, path=candidate.path, timeout_s=timeout_s, gone=gone)
            return Client(conn, socket_path=candidate.path)
    if refused and not embed:
        raise refused[0]
    if not embed or socket_path:
        raise DaemonUnavailable(
            socket_path or candidate_sockets(None, env)[-1].path,
            "; ".join(tried) + (" (starting a private daemon is disabled)" if not embed else ""),
        )
    # a socket the environment names, or a node socket file nobody answers on: a service meant to run here is
    # down, and the fall-back is worth a line on stderr (logging's last resort prints warnings)
    down = [c.path for c in candidates if c.explicit or os.path.exists(c.path)]
    if down:
        log.warning(
            "no tiermemd answers at %s (%s); starting a private one with a %s pool: this process's optimizer "
            "state lives and dies with it. Start the node's service, or set TIERMEM_NO_EMBED=1 to fail instead",
            " or ".join(down),
            "; ".join(tried),
            format_size(pool_size),
        )
    else:
        log.info(
            "no tiermemd found (%s); starting a private one with a %s pool", "; ".join(tried), format_size(pool_size)
        )
    daemon = EmbeddedDaemon(pool_size=pool_size, swap_dir=swap_dir, settings=settings)
    try:
        sock = connect_trusted(daemon.socket, daemon.trust)
        conn = Connection(sock, path=daemon.socket, timeout_s=timeout_s, gone=daemon.gone)
        return Client(conn, socket_path=daemon.socket, daemon=daemon)
    except BaseException:
        daemon.stop()
        raise

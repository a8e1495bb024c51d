"""Fixtures for the tiermemd integration tests: a real daemon process, real client processes.

``start_daemon`` runs ``python -m tiermemd.main --config <toml>`` with its own
socket, state and swap directories, a small pool and a short grace period, and
returns once the daemon said READY=1 on a NOTIFY_SOCKET of the test's own (a
``NotifyRecorder`` keeps every datagram it sends).  The socket lives in a
world-readable directory of its own with mode 0666, so a child running as
another uid reaches the daemon's own admission check rather than a filesystem
permission error.

Fixtures:
- ``daemon``: one daemon shared by the session (tests that use it leave no job behind);
- ``daemon_factory``: start more daemons with other settings, stopped at teardown;
- ``run_client``: start ``daemon_client.py`` as a client process;
- ``offload``, ``tier``, ``no_daemon``: the ``OffloadAdam`` tests' private daemon (one a module), tiers,
  and no daemon at all;
- ``one_rank_group``: a one-rank gloo process group;
- ``libaio``, ``swap_dir``: a real libaio engine and a directory on this disk for swap files;
- ``run_daemon_to_exit``: a daemon that is expected to fail at start-up, run to its exit.

Adam runs eagerly in the test daemons (``adam.compile = false``): compiling
the kernels costs tens of seconds per daemon on these machines, and the eager
path computes the same update.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from child_env import child_env

from tiermem.client.connection import Connection
from tiermem.core.protocol import ErrorReply, Frame, NodeReport, Stats, StatsReply, decode_frame, decode_message
from tiermem.net.frames import FrameSocket
from tiermemd.main import to_toml

if TYPE_CHECKING:
    from offload_helpers import OffloadDaemon

    from tiermem.client.link import Client
    from tiermem.engine.pool import BufferPool
    from tiermem.engine.swap.engine_libaio import LibaioEngine
    from tiermem.engine.swap.store import SwapStore

CLIENT_SCRIPT = Path(__file__).with_name("daemon_client.py")
GRACE_PERIOD_S = 3.0
POOL_SIZE = "64MiB"
MAX_FRAME = 64 * 1024
MAX_CONNECTIONS_PER_UID = 12


class NotifyRecorder:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET; records every message."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, OSError):
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._cond:
                self.messages.append((time.monotonic(), fields))
                self._cond.notify_all()

    def wait_for(self, key: str, timeout_s: float, value: str = "1", after: int = 0) -> tuple[int, dict[str, str]]:
        """The first message (index >= ``after``) that sets ``key=value``; fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for i, (_, fields) in enumerate(self.messages[after:], start=after):
                    if fields.get(key) == value:
                        return i, fields
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {key}={value} within {timeout_s}s; got {self.messages}")
                self._cond.wait(left)

    def count(self, key: str) -> int:
        with self._cond:
            return sum(1 for _, fields in self.messages if key in fields)

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close()


@dataclass
class DaemonProcess:
    process: subprocess.Popen[bytes]
    socket_path: str
    config_path: Path
    root: Path
    log_path: Path
    notify: NotifyRecorder
    socket_dir: str
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def connection(self, timeout_s: float = 60.0) -> Connection:
        return Connection.open(self.socket_path, timeout_s=timeout_s)

    def client(self, timeout_s: float = 60.0) -> Client:
        from tiermem.client.link import Client  # imports torch: only for the tests that use it

        return Client(self.connection(timeout_s), socket_path=self.socket_path)

    def stats(self) -> NodeReport:
        """The node's figures from a STATS request on a fresh connection."""
        with self.connection() as conn:
            reply = conn.request(Stats())
        assert isinstance(reply, StatsReply)
        return reply.node

    def wait_stats(self, predicate: Callable[[NodeReport], bool], timeout_s: float) -> NodeReport:
        """Poll STATS until ``predicate`` holds; returns the last figures either way."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if predicate(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send ``sig`` (once) and wait for the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.wait_exit(timeout_s)

    def wait_exit(self, timeout_s: float = 60.0) -> int:
        """Wait for the daemon to exit by itself (a second SIGTERM during interpreter exit would kill it)."""
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"tiermemd did not exit within {timeout_s}s:\n{self.log_text()[-3000:]}") from None
        return self.process.returncode

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        self.notify.close()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def daemon_settings(root: Path, socket_path: str, overrides: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    settings: dict[str, dict[str, Any]] = {
        "pool": {"size": POOL_SIZE, "arena_size": POOL_SIZE},
        # sizes of the NVMe tier fixed and no borrowing: an NVMe job's state larger than 6 chunks pages every step
        "swap": {
            "dirs": [str(root / "swap")],
            "engine": "threads",
            "fsync": False,
            "cache_chunks": 6,
            "prefetch_depth": 2,
            "borrow": False,
        },
        "adam": {"threads": 2, "compile": False, "chunk_numel": 1 << 18},
        "jobs": {"grace_period_s": GRACE_PERIOD_S, "max_jobs": 16},
        "server": {
            "socket": socket_path,
            "state_dir": str(root / "state"),
            "socket_mode": 0o666,
            "max_frame": MAX_FRAME,
            "max_connections_per_uid": MAX_CONNECTIONS_PER_UID,
        },
    }
    for section, values in (overrides or {}).items():
        settings.setdefault(section, {}).update(values)
    return settings


def start_daemon(
    root: Path,
    overrides: dict[str, dict[str, Any]] | None = None,
    *,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 120.0,
) -> DaemonProcess:
    """Start tiermemd with settings under ``root`` and wait for READY=1."""
    root.mkdir(parents=True, exist_ok=True)
    socket_dir = tempfile.mkdtemp(prefix="tmd-")
    os.chmod(socket_dir, 0o755)
    socket_path = os.path.join(socket_dir, "tiermemd.sock")
    settings = daemon_settings(root, socket_path, overrides)
    config_path = root / "tiermemd.toml"
    config_path.write_text(to_toml(settings))
    notify = NotifyRecorder(os.path.join(socket_dir, "notify"))
    daemon_env = child_env("NOTIFY_SOCKET", "LISTEN_")
    daemon_env.update({"NOTIFY_SOCKET": notify.path, "PYTHONUNBUFFERED": "1"})
    daemon_env.update(env or {})
    log_path = root / "tiermemd.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tiermemd.main", "--config", str(config_path), "--exit-with-parent"],
            env=daemon_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    daemon = DaemonProcess(process, socket_path, config_path, root, log_path, notify, socket_dir, settings)
    deadline = time.monotonic() + ready_timeout_s
    while True:
        try:
            notify.wait_for("READY", 0.2)
            return daemon
        except AssertionError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            daemon.cleanup()
            raise RuntimeError(f"tiermemd did not become ready (exit {process.poll()}):\n{daemon.log_text()[-3000:]}")


def run_daemon_to_exit(
    root: Path, socket_path: str, overrides: dict[str, dict[str, Any]] | None = None, **run_kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Run tiermemd in the foreground with ``start_daemon``'s settings (no NOTIFY_SOCKET) and wait for it to exit.

    For start-up failures: the test asserts on the exit code and stderr.  ``run_kwargs`` go to ``subprocess.run``."""
    config = root / "tiermemd.toml"
    config.write_text(to_toml(daemon_settings(root, socket_path, overrides)))
    env = child_env("NOTIFY_SOCKET", "LISTEN_")
    return subprocess.run(
        [sys.executable, "-m", "tiermemd.main", "--config", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        **run_kwargs,
    )


def run_tiermem_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``tiermem ARGS`` (``python -m tiermem.client.cli``) without the test's ``TIERMEM_*``, plus ``env``."""
    clean = child_env()
    return subprocess.run(
        [sys.executable, "-m", "tiermem.client.cli", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon shared by the tests that leave it as they found it; teardown checks a clean exit (0)."""
    d = start_daemon(tmp_path_factory.mktemp("tiermemd"))
    try:
        yield d
        code = d.stop()
        assert code == 0, f"tiermemd exited with {code}:\n{d.log_text()[-3000:]}"
    finally:
        d.cleanup()


LOG_TAIL_CHARS = 6000


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that ran against a daemon of these fixtures reports the tail of each one's log: what the
    daemon saw (a closed session and why, an acceptor restarted) is what a flaky failure needs."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "setup" or not report.failed:
        return
    funcargs = getattr(item, "funcargs", {})
    daemons = [funcargs["daemon"]] if isinstance(funcargs.get("daemon"), DaemonProcess) else []
    daemons += getattr(funcargs.get("daemon_factory"), "started", [])
    for d in daemons:
        with contextlib.suppress(OSError):
            report.sections.append((f"tiermemd log {d.log_path} (tail)", d.log_text()[-LOG_TAIL_CHARS:]))


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def start(overrides: dict[str, dict[str, Any]] | None = None, **kwargs: Any) -> DaemonProcess:
        d = start_daemon(tmp_path / f"tiermemd{len(started)}", overrides, **kwargs)
        started.append(d)
        return d

    start.started = started  # type: ignore[attr-defined]  # for the failure report's logs
    yield start
    for d in started:
        d.cleanup()


@pytest.fixture
def libaio() -> Iterator[LibaioEngine]:
    """A real libaio engine (256 KiB blocks, queue depth 16), closed at teardown."""
    from tiermem.engine.swap.engine_libaio import LibaioEngine  # loads libaio: only for the tests that use it

    engine = LibaioEngine(block_size=256 * 1024, queue_depth=16)
    yield engine
    engine.close()


@pytest.fixture
def pool_and_store(swap_dir: Path) -> Iterator[tuple[BufferPool, SwapStore]]:
    """What an NVMe-placed rank's state is made over: an 8 MiB pool and a 64 MiB swap store on its own libaio
    engine (256 KiB blocks, queue depth 8)."""
    from tiermem.engine.pool import BufferPool
    from tiermem.engine.swap.engine_libaio import LibaioEngine
    from tiermem.engine.swap.store import SwapStore

    engine = LibaioEngine(block_size=256 * 1024, queue_depth=8)
    pool = BufferPool.create(8 << 20, arena_size=8 << 20, mlock=False)
    store = SwapStore.open([swap_dir], "rank", engine, 64 << 20)
    yield pool, store
    store.close(remove=True)
    pool.close()
    engine.close()


@pytest.fixture
def swap_dir() -> Iterator[Path]:
    """A fresh directory on this disk (``/var/tmp``: O_DIRECT works there, unlike tmpfs), removed at teardown."""
    with tempfile.TemporaryDirectory(prefix="tiermem-swap-", dir="/var/tmp") as d:
        yield Path(d)


@contextlib.contextmanager
def connection_pair(timeout_s: float) -> Iterator[tuple[Connection, FrameSocket]]:
    """A client ``Connection`` (path ``<pair>``) and the daemon's end of it, a ``FrameSocket``: a socketpair."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn = Connection(a, path="<pair>", timeout_s=timeout_s)
    server = FrameSocket(b, accept_fds=False)
    try:
        yield conn, server
    finally:
        conn.close()
        server.close()


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group in the test process (file rendezvous under ``tmp_path``)."""
    import torch.distributed as dist  # imports torch: only for the tests that use it

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def offload(request: pytest.FixtureRequest) -> Iterator[OffloadDaemon]:
    """One private tiermemd for an ``OffloadAdam`` test module (``offload_helpers.offload_daemon``); a module
    changes its settings or pool size with ``OFFLOAD_DAEMON = {"settings": {...}, "pool_size": ...}``."""
    from offload_helpers import offload_daemon  # imports torch: only for the modules that use it

    with offload_daemon(**getattr(request.module, "OFFLOAD_DAEMON", {})) as daemon:
        yield daemon


@pytest.fixture(params=["cpu", "nvme"])
def tier(request: pytest.FixtureRequest) -> str:
    """The ``offload=`` tier of an ``OffloadAdam``: each test that takes it runs on both."""
    return str(request.param)


@pytest.fixture
def no_daemon(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No daemon can be reached or started: a construction that tried would fail with a connection error."""
    monkeypatch.setenv("TIERMEM_NO_EMBED", "1")
    monkeypatch.setenv("TIERMEM_SOCKET_PATH", os.path.join(tmp_path, "no-daemon.sock"))


class RawConn:
    """A bare SEQPACKET connection to the daemon: send any bytes (and fds), read whatever comes back."""

    def __init__(self, path: str, timeout_s: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)

    def send(self, data: bytes, fds: list[int] | None = None) -> bool:
        """False when the daemon already closed the connection."""
        try:
            if fds:
                self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                self.sock.send(data)
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    def recv(self) -> Frame | None:
        """The next frame from the daemon (it must decode), or None at end of stream; times out as configured."""
        try:
            data = self.sock.recv(1 << 20)
        except ConnectionResetError:
            # The daemon closed while our frame sat unread in its queue: Linux reports ECONNRESET once,
            # before the frames it sent us first; they are still there to read.
            try:
                data = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except OSError:
                return None
        if not data:
            return None
        return decode_frame(data, max_frame=1 << 20)

    def request(self, data: bytes) -> Frame | None:
        """Send, then read the answer; a frame the daemon sent before it closed is still read."""
        self.send(data)
        return self.recv()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def error_of(frame: Frame | None) -> tuple[int, str, str]:
    """(request id, error type, message) of an ERROR frame."""
    assert frame is not None, "expected an ERROR frame, the connection was closed"
    msg = decode_message(frame)
    assert isinstance(msg, ErrorReply), f"expected an ERROR frame, got {msg}"
    return frame.request_id, msg.kind, msg.message


@dataclass
class ClientProcess:
    process: subprocess.Popen[str]
    progress_path: Path

    def progress(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.progress_path.read_text())  # type: ignore[no-any-return]
        except (FileNotFoundError, ValueError):
            return None

    def wait_pending(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Wait until a step's request is about to go out (the daemon is most likely inside that step next)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            prog = self.progress()
            if prog is not None and prog.get("pending") is not None:
                return prog
            time.sleep(0.001)
        raise AssertionError(f"client sent no step within {timeout_s}s")

    def wait_step(self, step: int, timeout_s: float = 60.0) -> dict[str, Any]:
        """Wait until the client reports ``step`` done (fails if it exits first)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            prog = self.progress()
            if prog is not None and prog["step"] >= step:
                return prog
            if self.process.poll() is not None:
                out, err = self.process.communicate()
                raise AssertionError(f"client exited with {self.process.returncode}:\n{out}\n{err}")
            time.sleep(0.02)
        raise AssertionError(f"client did not reach step {step} within {timeout_s}s (at {self.progress()})")

    def result(self, timeout_s: float = 120.0, *, ok: bool = True) -> dict[str, Any]:
        """The client's JSON summary; with ``ok`` it must have exited 0 (else 0 or 3: a typed error)."""
        out, err = self.process.communicate(timeout=timeout_s)
        allowed = (0,) if ok else (0, 3)
        assert self.process.returncode in allowed, f"client failed ({self.process.returncode}):\n{out}\n{err}"
        return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture
def run_client(tmp_path: Path) -> Iterator[Callable[..., ClientProcess]]:
    """Start ``daemon_client.py <cmd> --socket S ...``; killed at teardown if still running."""
    started: list[ClientProcess] = []

    def run(cmd: str, daemon: DaemonProcess, *args: str, stdin: int | None = None) -> ClientProcess:
        progress = tmp_path / f"client{len(started)}.json"
        extra = ["--progress", str(progress)] if cmd == "train" and "--progress" not in args else []
        process = subprocess.Popen(
            [sys.executable, str(CLIENT_SCRIPT), cmd, "--socket", daemon.socket_path, *extra, *args],
            stdin=stdin if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        client = ClientProcess(process, Path(args[args.index("--progress") + 1]) if "--progress" in args else progress)
        started.append(client)
        return client

    yield run
    for c in started:
        if c.process.poll() is None:
            c.process.kill()
        c.process.communicate()

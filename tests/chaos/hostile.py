"""Chaos scenarios of hostile and broken clients against a real tiermemd (quick in tests, long in the soak).

Each scenario takes a running ``ChaosDaemon`` and its size, and returns its
figures (a dict, printed by the caller); it raises ``AssertionError`` when the
daemon misbehaved (a crash, a request of the well-behaved client that failed,
a connect refused while the daemon had room).  The caller checks the ledger
(``ledger.py``) before and after.

- ``hostile_frames``: frames mutated from valid ones (header fields, lengths,
  types, flags, payload bytes, JSON shapes), sent over several connections;
  every one must be answered with an error (or, when even its header is
  unreadable, the connection closed after one), never a crash.
- ``slow_frames``: connections that dribble truncated frames (a header that
  announces more than follows), or connect and never send, while a
  well-behaved client works.
- ``connection_storm``: a second process opens and closes connections as fast
  as it can, as an allowed uid or as one the daemon refuses; meanwhile a
  well-behaved client round-trips PINGs (its p50/p99 against a baseline taken
  just before) and opens fresh connections (each must succeed).
- ``unread_replies``: a client pipelines requests and never reads a reply;
  its session is closed once a reply finds no room for ``server.send_timeout_s``
  (the thread is not pinned), and the client finds the end of the stream
  after the replies that did fit.
- ``stopped_daemon``: SIGSTOP; a request in flight, a new request and a new
  connection's request all end with ``DaemonTimeout`` within the client's
  timeout; SIGCONT and the daemon serves again.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from child_env import child_env

from tiermem.client.connection import Connection
from tiermem.core.errors import DaemonTimeout
from tiermem.core.protocol import (
    HEADER_NBYTES,
    Attach,
    Detach,
    MemRef,
    ParamGroup,
    Ping,
    Pong,
    StateRead,
    Stats,
    Step,
    decode_frame,
    encode_message,
)
from tiermemd.main import to_toml

__all__ = [
    "ChaosDaemon",
    "connection_storm",
    "hostile_frames",
    "mutate",
    "slow_frames",
    "stopped_daemon",
    "unread_replies",
]

ALLOWED_UID = 65534
"""The storms' uids: nobody, which the storm daemons allow, and one no daemon allows."""
REFUSED_UID = 65533


@dataclass
class ChaosDaemon:
    """A tiermemd child on a socket any uid can reach (so a refused uid meets the daemon's own check)."""

    root: Path
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    socket_dir: str = ""

    @property
    def socket_path(self) -> str:
        return os.path.join(self.socket_dir, "tiermemd.sock")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def log_path(self) -> Path:
        return self.root / "tiermemd.log"

    @property
    def watched(self) -> list[Path]:
        return [self.root / "state", self.root / "swap", Path(self.socket_dir)]

    def start(self) -> ChaosDaemon:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.socket_dir:  # a restart gets a fresh directory; the old one goes now (it was left behind)
            shutil.rmtree(self.socket_dir, ignore_errors=True)
        self.socket_dir = tempfile.mkdtemp(prefix="tmchaos-")
        os.chmod(self.socket_dir, 0o755)
        settings: dict[str, dict[str, Any]] = {
            "pool": {"size": "64MiB", "arena_size": "64MiB"},
            "swap": {"dirs": [str(self.root / "swap")], "engine": "threads", "fsync": False},
            "adam": {"threads": 1, "compile": False, "chunk_numel": 1 << 16},
            "jobs": {"grace_period_s": 2.0, "max_jobs": 16},
            "server": {
                "socket": self.socket_path,
                "state_dir": str(self.root / "state"),
                "socket_mode": 0o666,
                "max_frame": 64 * 1024,
                "max_connections_per_uid": 64,
                "allowed_uids": [ALLOWED_UID],
                "send_timeout_s": 1.0,
            },
        }
        for section, values in self.overrides.items():
            settings.setdefault(section, {}).update(values)
        (self.root / "tiermemd.toml").write_text(to_toml(settings))
        notify_path = os.path.join(self.socket_dir, "notify")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(notify_path)
        notify.settimeout(0.2)
        env = child_env("NOTIFY_SOCKET", "LISTEN_")
        env.update({"NOTIFY_SOCKET": notify_path, "PYTHONUNBUFFERED": "1"})
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tiermemd.main", "--config", str(self.root / "tiermemd.toml")],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    if b"READY=1" in notify.recv(4096):
                        return self
                if self.process.poll() is not None:
                    break
            raise RuntimeError(f"tiermemd did not start:\n{self.log_text()[-3000:]}")
        finally:
            notify.close()
            os.unlink(notify_path)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> int:
        """SIGTERM and wait; the exit code."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"tiermemd did not stop on SIGTERM:\n{self.log_text()[-3000:]}") from None

    def cleanup(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


@contextlib.contextmanager
def running_daemon(root: Path, overrides: dict[str, dict[str, Any]] | None = None) -> Iterator[ChaosDaemon]:
    """A started ``ChaosDaemon``; a body that finishes leaves it to stop cleanly (exit 0), checked here."""
    daemon = ChaosDaemon(root, overrides=overrides or {}).start()
    try:
        yield daemon
        assert daemon.stop() == 0, daemon.log_text()[-3000:]
    finally:
        daemon.cleanup()


def _round_trips(path: str, seconds: float) -> list[float]:
    times = []
    with Connection.open(path, timeout_s=30.0) as conn:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            if conn.request(Ping()) != Pong():
                raise AssertionError("PING got something else than PONG")
            times.append(time.perf_counter() - t0)
    return times


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --------------------------------------------------------------------------- hostile frames


def _corpus() -> list[bytes]:
    ref = MemRef(window=1, offset=0, length=4096)
    messages = [
        Ping(),
        Stats(),
        Attach(job_id="chaos", rank=0, world_size=1, window_nbytes=4096),
        Step(step=3, attempt=3, groups=(ParamGroup(lr=1e-3, weight_decay=0.1),), loss_scale=1.0, max_grad_norm=1.0),
        StateRead(tensor_id=0, key="exp_avg", offset=0, dest=ref),
        Detach(keep_state=False),
    ]
    return [encode_message(m, i + 1) for i, m in enumerate(messages)]


def mutate(frame: bytes, rng: random.Random) -> bytes:
    """One hostile variant of a valid frame."""
    data = bytearray(frame)
    kind = rng.randrange(9)
    if kind == 0 and len(data) > HEADER_NBYTES:  # flip bytes of the payload
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(HEADER_NBYTES, len(data))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # flip header bytes (magic, version, type, flags, reserved, id, length)
        data[rng.randrange(HEADER_NBYTES)] = rng.randrange(256)
    elif kind == 2:  # truncate
        del data[rng.randrange(len(data)) :]
    elif kind == 3:  # trailing garbage
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif kind == 4:  # a payload length that lies
        data[12:16] = rng.choice([0, 1, len(data), 0xFFFFFFFF, rng.randrange(1 << 32)]).to_bytes(4, "little")
    elif kind == 5:  # unknown type or flags
        data[3] = rng.randrange(256)
        data[4:6] = rng.randrange(1 << 16).to_bytes(2, "little")
    elif kind == 6:  # JSON shapes: nesting, huge numbers, wrong types, non-UTF-8
        payload = rng.choice(
            [
                b"[" * 5000,
                b'{"job_id": ' + b"9" * 5000 + b"}",
                b'{"job_id": {"a": [1, 2, {"b": null}]}, "rank": "zero"}',
                b"\xff\xfe\x00garbage",
                json.dumps({"tensor_id": -1, "key": "x" * 300, "offset": 2**70}).encode(),
            ]
        )
        data = bytearray(data[:12]) + len(payload).to_bytes(4, "little") + payload
    elif kind == 7:  # random bytes of random length
        data = bytearray(rng.randbytes(rng.randrange(0, 256)))
    else:  # a valid frame with a zero or reused request id
        data[8:12] = rng.choice([0, 1, 0xFFFFFFFF]).to_bytes(4, "little")
    return bytes(data)


def hostile_frames(daemon: ChaosDaemon, count: int, *, seed: int = 0, connections: int = 4) -> dict[str, Any]:
    """``count`` hostile frames over ``connections`` parallel connections; each answered or closed after."""
    rng = random.Random(seed)
    corpus = _corpus()
    frames = [mutate(rng.choice(corpus), rng) for _ in range(count)]
    tally = {"sent": 0, "answered": 0, "one_way": 0, "closed_after": 0, "reconnects": 0}
    lock = threading.Lock()
    failures: list[str] = []

    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(30.0)
        sock.connect(daemon.socket_path)
        return sock

    def run(share: list[bytes]) -> None:
        sock = connect()
        counts = dict.fromkeys(tally, 0)
        try:
            for data in share:
                counts["sent"] += 1
                sync_id = 0x7FFF0000 + counts["sent"] % 0xFFFF  # a PING after each frame: one-way ones get no reply
                try:
                    sock.send(data)
                    sock.send(encode_message(Ping(), sync_id))
                except (BrokenPipeError, ConnectionResetError):
                    counts["closed_after"] += 1
                    sock.close()
                    sock = connect()
                    counts["reconnects"] += 1
                    continue
                answered = False
                while True:
                    try:
                        reply = sock.recv(1 << 17)
                    except ConnectionResetError:
                        reply = b""
                    if not reply:
                        counts["closed_after"] += 1
                        sock.close()
                        sock = connect()
                        counts["reconnects"] += 1
                        break
                    frame = decode_frame(reply, max_frame=1 << 17)  # the daemon's answer always decodes
                    if frame.request_id == sync_id and frame.type.name in ("PONG", "ERROR"):
                        if frame.type.name == "ERROR" or answered:
                            counts["answered"] += 1  # answered, or a one-way frame's error given to the PING
                        else:
                            counts["one_way"] += 1
                        break
                    if frame.type.name not in ("ERROR", "PONG", "STATS_REPLY", "ATTACH_OK", "OK"):
                        failures.append(f"unexpected {frame.type.name} reply")
                    answered = True
                if answered and frame.type.name == "ATTACH_OK":  # a frame that stayed valid: leave the job again
                    sock.close()
                    sock = connect()
                    counts["reconnects"] += 1
        except Exception as exc:
            failures.append(repr(exc))
        finally:
            sock.close()
            with lock:
                for key, value in counts.items():
                    tally[key] += value

    started = time.monotonic()
    threads = [threading.Thread(target=run, args=(frames[i::connections],)) for i in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    if failures:
        raise AssertionError(f"{len(failures)} connection(s) failed: {failures[:3]}")
    if not daemon.alive():
        raise AssertionError(f"tiermemd died under hostile frames:\n{daemon.log_text()[-3000:]}")
    if tally["sent"] != count:
        raise AssertionError(f"sent {tally['sent']} of {count} frames")
    _round_trips(daemon.socket_path, 0.2)  # still serving
    return {**tally, "frames": count, "seconds": round(elapsed, 2), "frames_per_s": round(count / elapsed)}


# --------------------------------------------------------------------------- slow and partial frames


def slow_frames(daemon: ChaosDaemon, seconds: float, *, dribblers: int = 8, silent: int = 8) -> dict[str, Any]:
    """Connections that dribble truncated frames or say nothing, while a well-behaved client works."""
    stop = threading.Event()
    sent = [0]
    errors_back = [0]
    lock = threading.Lock()

    def dribble() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(10.0)
        sock.connect(daemon.socket_path)
        lying = bytearray(encode_message(Stats(), 9) + b'{"a"')
        lying[12:16] = (1000).to_bytes(4, "little")  # a header announcing 1000 payload bytes; 4 follow
        with sock:
            while not stop.is_set():
                try:
                    sock.send(bytes(lying))
                    reply = sock.recv(1 << 17)
                except OSError:
                    return
                with lock:
                    sent[0] += 1
                    errors_back[0] += bool(reply)
                if not reply:
                    return
                stop.wait(0.05)

    quiet = []
    for _ in range(silent):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(daemon.socket_path)
        quiet.append(sock)
    threads = [threading.Thread(target=dribble) for _ in range(dribblers)]
    for t in threads:
        t.start()
    try:
        times = _round_trips(daemon.socket_path, seconds)
    finally:
        stop.set()
        for t in threads:
            t.join()
        for sock in quiet:
            sock.close()
    if not daemon.alive():
        raise AssertionError(f"tiermemd died under slow frames:\n{daemon.log_text()[-3000:]}")
    return {
        "partial_frames": sent[0],
        "answered": errors_back[0],
        "silent_connections": silent,
        "good_requests": len(times),
        "good_p50_us": round(statistics.median(times) * 1e6, 1),
        "good_p99_us": round(_p(times, 0.99) * 1e6, 1),
    }


# --------------------------------------------------------------------------- connection storms


def _storm(path: str, seconds: float, hold: int) -> tuple[int, int]:
    """Open ``hold`` connections as fast as possible, close them, again until ``seconds`` passed."""
    attempts = failures = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        socks = []
        for _ in range(hold):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.setblocking(False)
            attempts += 1
            try:
                sock.connect(path)
                socks.append(sock)
            except OSError:
                failures += 1
                sock.close()
        for sock in socks:
            sock.close()
    return attempts, failures


def _fork_storm(path: str, seconds: float, hold: int, uid: int, nice: int = 0) -> tuple[int, int]:
    """Run ``_storm`` in a forked child as ``uid`` (no exec: the interpreter may be unreadable to ``uid``);
    returns the child's pid and the read end of the pipe its figures come back on."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: sockets and time only, then _exit
        code = 1
        try:
            os.close(read_end)
            os.nice(nice)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            attempts, failures = _storm(path, seconds, hold)
            os.write(write_end, f"{attempts} {failures}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    return pid, read_end


def _storm_result(pid: int, read_end: int) -> tuple[int, int]:
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0 or not text:
        raise AssertionError(f"the storm process failed (status {status})")
    attempts, failures = text.split()
    return int(attempts), int(failures)


def _under_storm(
    victim: str, target: str, seconds: float, hold: int, uid: int, nice: int, stormers: int
) -> list[float]:
    """The well-behaved client's round trips to ``victim`` while ``target`` is stormed."""
    stormers_ = [_fork_storm(target, seconds, hold, uid, nice) for _ in range(stormers)]
    try:
        return _round_trips(victim, seconds)
    finally:
        for pid, read_end in stormers_:
            _storm_result(pid, read_end)


def connection_storm(
    daemon: ChaosDaemon,
    seconds: float,
    *,
    uid: int,
    hold: int = 200,
    stormers: int = 2,
    nice: int = 0,
    control: ChaosDaemon | None = None,
) -> dict[str, Any]:
    """Storm the daemon from ``stormers`` processes running as ``uid`` (allowed or not: the daemon decides),
    at CPU priority ``nice`` (0: the same as the daemon's).

    The well-behaved client's p99 is given against two baselines: the idle machine, and, with ``control``
    (a second daemon), the same storm aimed at ``control`` instead, which loads the machine's cores exactly
    as much (the stormers, the kernel's connects, a daemon's accept thread) but not this daemon: the
    ratio to it is what being the storm's target costs this daemon's clients."""
    baseline = _round_trips(daemon.socket_path, min(2.0, seconds))
    controlled = (
        _under_storm(daemon.socket_path, control.socket_path, seconds, hold, uid, nice, stormers)
        if control is not None
        else None
    )
    stormers_ = [_fork_storm(daemon.socket_path, seconds, hold, uid, nice) for _ in range(stormers)]
    stop = threading.Event()
    connect_times: list[float] = []
    connect_failures: list[str] = []

    def fresh_connections() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:  # a fresh connection of the well-behaved client: the storm must not refuse it
                with Connection.open(daemon.socket_path, timeout_s=30.0) as fresh:
                    fresh.request(Ping())
            except Exception as exc:
                connect_failures.append(repr(exc))
            connect_times.append(time.perf_counter() - t0)
            stop.wait(0.05)

    connector = threading.Thread(target=fresh_connections)
    connector.start()
    try:
        times = _round_trips(daemon.socket_path, seconds)
    finally:
        stop.set()
        connector.join()
        results = [_storm_result(pid, read_end) for pid, read_end in stormers_]
    attempts = sum(a for a, _ in results)
    storm_failures = sum(f for _, f in results)
    if not daemon.alive():
        raise AssertionError(f"tiermemd died in a connection storm:\n{daemon.log_text()[-3000:]}")
    if connect_failures:
        raise AssertionError(
            f"{len(connect_failures)} of {len(connect_times)} connects of the well-behaved client failed: "
            f"{connect_failures[:3]}"
        )
    base_p99, storm_p99 = _p(baseline, 0.99), _p(times, 0.99)
    versus: dict[str, Any] = {}
    if controlled is not None:
        control_p99 = _p(controlled, 0.99)
        versus = {"control_p99_us": round(control_p99 * 1e6, 1), "p99_vs_control": round(storm_p99 / control_p99, 2)}
    return {
        "storm_uid": uid,
        "storm_nice": nice,
        "storm_connects": attempts,
        "storm_connects_failed": storm_failures,
        "good_requests": len(times),
        "good_fresh_connects": len(connect_times),
        "good_connect_p50_ms": round(statistics.median(connect_times) * 1e3, 2),
        "good_connect_max_ms": round(max(connect_times) * 1e3, 2),
        "baseline_p50_us": round(statistics.median(baseline) * 1e6, 1),
        "baseline_p99_us": round(base_p99 * 1e6, 1),
        "storm_p50_us": round(statistics.median(times) * 1e6, 1),
        "storm_p99_us": round(storm_p99 * 1e6, 1),
        "p99_ratio": round(storm_p99 / base_p99, 2),
        **versus,
    }


# --------------------------------------------------------------------------- a stopped daemon


def _wait_stopped(pid: int) -> None:
    """Until the kernel shows ``pid`` stopped (a signal is delivered asynchronously)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def stopped_daemon(daemon: ChaosDaemon, *, timeout_s: float = 1.5) -> dict[str, Any]:
    """SIGSTOP the daemon: every request ends with ``DaemonTimeout`` within the timeout; SIGCONT: it serves."""
    conn = Connection.open(daemon.socket_path, timeout_s=timeout_s)
    waits: dict[str, float] = {}
    try:
        conn.request(Ping())
        os.kill(daemon.pid, signal.SIGSTOP)
        _wait_stopped(daemon.pid)
        try:
            for name in ("open connection", "new connection"):
                if name == "new connection":
                    conn = Connection.open(daemon.socket_path, timeout_s=timeout_s)  # queued in the backlog
                t0 = time.monotonic()
                try:
                    conn.request(Ping())
                except DaemonTimeout as exc:
                    waits[name] = time.monotonic() - t0
                    if exc.request != "PING" or exc.path != daemon.socket_path:
                        raise AssertionError(f"DaemonTimeout names {exc.path} / {exc.request}") from None
                else:
                    raise AssertionError("a request to a stopped daemon was answered")
                conn.close()
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
    finally:
        conn.close()
    after = _round_trips(daemon.socket_path, 0.2)
    for name, waited in waits.items():
        if waited > timeout_s + 5.0:
            raise AssertionError(f"{name}: the client waited {waited:.1f}s, past its {timeout_s}s timeout")
    return {
        "timeout_s": timeout_s,
        **{f"waited_s ({name})": round(w, 2) for name, w in waits.items()},
        "requests_after_sigcont": len(after),
    }


# --------------------------------------------------------------------------- a client that never reads


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def unread_replies(daemon: ChaosDaemon, *, requests: int = 50_000) -> dict[str, Any]:
    """Pipeline PINGs without reading: the daemon closes that session (no pinned thread), others go on."""
    before = _threads(daemon.pid)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(daemon.socket_path)
    sock.settimeout(2.0)
    sent = 0
    with contextlib.suppress(OSError):  # the daemon stops reading once its reply is stuck: our send times out
        for i in range(1, requests + 1):
            sock.send(encode_message(Ping(), i))
            sent += 1
    started = time.monotonic()
    deadline = started + 60
    while _threads(daemon.pid) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    closed_after = time.monotonic() - started
    pinned = _threads(daemon.pid) > before
    _round_trips(daemon.socket_path, 0.2)  # others are served meanwhile
    replies = 0
    sock.settimeout(5.0)
    with contextlib.suppress(OSError):
        while sock.recv(1 << 16):
            replies += 1
    sock.close()
    if pinned:
        raise AssertionError(f"the session of a client that does not read holds a thread after {closed_after:.1f}s")
    return {"requests_sent": sent, "replies_read_after": replies, "session_closed_after_s": round(closed_after, 2)}

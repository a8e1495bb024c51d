"""What connections cost the daemon: memory and threads per connection, control latency, drain time.

Each case runs against a real ``tiermemd`` child (64 MiB pool, eager Adam) and,
with ``--baseline-src DIR`` (a source tree of another revision, e.g. from
``git archive``), against that revision's daemon too, side by side in the same
run, so ratios compare the two on the same machine state:

- ``burst``: ``--connections`` (default 1000) connections opened as fast as
  possible by one process of an allowed uid, all held open (those beyond
  ``server.max_connections_per_uid`` are refused by the daemon), then closed.
  The daemon's RSS, threads and fds before, while held, and ``--settle-s``
  after the close; connects that failed (the backlog was full).
- ``ping``: PING round trips through ``tiermem.net.frames.Connection``, p50/p99
  (the ``tiermemd PING`` row of ``bench_ipc.py``), the two daemons alternating
  in rounds.
- ``drain``: a client pipelines ``--unread`` PINGs and never reads a reply,
  then the daemon gets SIGTERM: seconds until it exited, against a SIGTERM
  with only an idle client.

    .venv/bin/python benchmarks/bench_connections.py [--baseline-src DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tiermem.client.connection import Connection
from tiermem.core.protocol import Ping, encode_message

REPO = Path(__file__).resolve().parent.parent


class Daemon:
    """A tiermemd child from the source tree ``src`` (None: this checkout), on a socket of its own."""

    def __init__(self, label: str, src: Path | None, settings: dict[str, dict[str, Any]] | None = None) -> None:
        from tiermemd.main import to_toml

        self.label = label
        self.root = Path(tempfile.mkdtemp(prefix="tmbench-"))
        os.chmod(self.root, 0o755)
        self.socket = str(self.root / "sock" / "tiermemd.sock")
        config: dict[str, dict[str, Any]] = {
            "pool": {"size": "64MiB", "arena_size": "64MiB"},
            "swap": {"dirs": [str(self.root / "swap")], "engine": "threads", "fsync": False},
            "adam": {"threads": 1, "compile": False},
            "server": {"socket": self.socket, "state_dir": str(self.root / "state"), "socket_mode": 0o666},
        }
        for section, values in (settings or {}).items():
            config.setdefault(section, {}).update(values)
        (self.root / "tiermemd.toml").write_text(to_toml(config))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TIERMEM_", "NOTIFY_SOCKET", "LISTEN_"))}
        if src is not None:
            paths = self.root / "pythonpath"
            paths.mkdir()
            (paths / "tiermem").symlink_to(src / "tiermem")
            (paths / "tiermemd").symlink_to(src / "daemon")
            env["PYTHONPATH"] = str(paths)
        self.env = dict(env)
        """The environment of this revision's processes (its clients speak its protocol version)."""
        notify_path = str(self.root / "notify")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(notify_path)
        notify.settimeout(0.5)
        env["NOTIFY_SOCKET"] = notify_path
        self.log = open(self.root / "tiermemd.log", "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tiermemd.main", "--config", str(self.root / "tiermemd.toml")],
            cwd=self.root,  # not the checkout: ``-m`` puts the working directory first on sys.path
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
        )
        deadline = time.monotonic() + 120
        try:
            while time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    if b"READY=1" in notify.recv(4096):
                        return
                if self.process.poll() is not None:
                    break
            raise RuntimeError(f"{label} tiermemd did not start: {(self.root / 'tiermemd.log').read_text()[-2000:]}")
        finally:
            notify.close()

    def figures(self) -> dict[str, float]:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        values = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {
            "rss_mib": int(values["VmRSS"].split()[0]) / 1024,
            "threads": int(values["Threads"]),
            "fds": len(os.listdir(f"/proc/{self.process.pid}/fd")),
        }

    def stop(self, sig: int = signal.SIGTERM) -> float:
        """Signal the daemon and wait; returns the seconds until it exited."""
        start = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        took = time.monotonic() - start
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)
        return took


def burst(daemon: Daemon, count: int, settle_s: float) -> dict[str, Any]:
    before = daemon.figures()
    socks: list[socket.socket] = []
    failed = 0
    started = time.monotonic()
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(5.0)
        try:
            sock.connect(daemon.socket)
        except OSError:
            failed += 1
            sock.close()
            continue
        socks.append(sock)
    connect_s = time.monotonic() - started
    time.sleep(1.0)
    held = daemon.figures()
    for sock in socks:
        sock.close()
    time.sleep(settle_s)
    after = daemon.figures()
    return {
        "daemon": daemon.label,
        "connections": count,
        "connect_failed": failed,
        "connect_s": connect_s,
        **{f"before_{k}": v for k, v in before.items()},
        **{f"held_{k}": v for k, v in held.items()},
        **{f"after_{k}": v for k, v in after.items()},
    }


def worker(daemon: Daemon, *args: str) -> Any:
    """Run this script's client side as ``daemon``'s revision (its own library and protocol)."""
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *args, daemon.socket],
        cwd=daemon.root,
        env=daemon.env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def ping_worker(path: str, requests: int) -> list[float]:
    with Connection.open(path, timeout_s=60.0) as conn:
        for _ in range(100):
            conn.request(Ping())
        times = []
        for _ in range(requests):
            t0 = time.perf_counter()
            conn.request(Ping())
            times.append(time.perf_counter() - t0)
    return times


def unread_worker(path: str, count: int) -> int:
    """Pipeline ``count`` PINGs without reading a reply; then stay connected (until killed)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    sock.settimeout(2.0)
    sent = 0
    with contextlib.suppress(OSError):
        for i in range(1, count + 1):
            sock.send(encode_message(Ping(), i))
            sent += 1
    print(json.dumps(sent), flush=True)
    time.sleep(3600)
    return sent


def ping_rounds(daemons: list[Daemon], requests: int, rounds: int) -> list[dict[str, Any]]:
    samples: dict[str, list[float]] = {d.label: [] for d in daemons}
    for _ in range(rounds):
        for d in daemons:
            samples[d.label].extend(worker(d, "--ping-worker", str(requests)))
    out = []
    for label, values in samples.items():
        values.sort()
        out.append(
            {
                "daemon": label,
                "requests": len(values),
                "p50_us": statistics.median(values) * 1e6,
                "p99_us": values[int(0.99 * (len(values) - 1))] * 1e6,
            }
        )
    return out


def drain(label: str, src: Path | None, unread: int) -> dict[str, Any]:
    idle = Daemon(label, src)
    try:
        worker(idle, "--ping-worker", "10")
    finally:
        idle_s = idle.stop()
    busy = Daemon(label, src)
    client: subprocess.Popen[str] | None = None
    try:
        client = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--unread-worker", str(unread), busy.socket],
            cwd=busy.root,
            env=busy.env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert client.stdout is not None
        sent = json.loads(client.stdout.readline())
        time.sleep(0.5)
    finally:
        busy_s = busy.stop()
        if client is not None:
            client.kill()
            client.wait()
    return {"daemon": label, "idle_client_s": idle_s, "unread_client_s": busy_s, "pings_sent": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-src", metavar="DIR", help="source tree of the revision to compare against")
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--settle-s", type=float, default=3.0, help="wait after closing the burst")
    parser.add_argument("--requests", type=int, default=2000, help="PINGs per daemon and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--unread", type=int, default=2000, help="PINGs the non-reading client sends")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--ping-worker", type=int, metavar="N", help=argparse.SUPPRESS)
    parser.add_argument("--unread-worker", type=int, metavar="N", help=argparse.SUPPRESS)
    parser.add_argument("socket", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ping_worker:
        print(json.dumps(ping_worker(args.socket, args.ping_worker)))
        return
    if args.unread_worker:
        unread_worker(args.socket, args.unread_worker)
        return
    sources: list[tuple[str, Path | None]] = [("this", None)]
    if args.baseline_src:
        sources.insert(0, ("baseline", Path(args.baseline_src).resolve()))
    results: dict[str, Any] = {"burst": [], "ping": [], "drain": []}
    daemons = [Daemon(label, src) for label, src in sources]
    try:
        results["ping"] = ping_rounds(daemons, args.requests, args.rounds)
        for d in daemons:
            results["burst"].append(burst(d, args.connections, args.settle_s))
    finally:
        for d in daemons:
            d.stop()
    for label, src in sources:
        results["drain"].append(drain(label, src, args.unread))

    print("burst of connections (daemon RSS MiB / threads / fds)")
    print(f"{'daemon':<10}{'failed':>8}{'before':>22}{'held':>22}{'after':>22}")
    for row in results["burst"]:
        cells = [
            f"{row[p + '_rss_mib']:.0f} / {row[p + '_threads']} / {row[p + '_fds']}"
            for p in ("before", "held", "after")
        ]
        print(f"{row['daemon']:<10}{row['connect_failed']:>8}" + "".join(f"{c:>22}" for c in cells))
    print("\nPING round trip (us)")
    for row in results["ping"]:
        print(f"{row['daemon']:<10} p50 {row['p50_us']:7.1f}  p99 {row['p99_us']:7.1f}  ({row['requests']} requests)")
    if len(results["ping"]) == 2:
        base, this = results["ping"]
        results["ping_ratio_p50"] = this["p50_us"] / base["p50_us"]
        results["ping_ratio_p99"] = this["p99_us"] / base["p99_us"]
        print(f"this / baseline: p50 {results['ping_ratio_p50']:.2f}x, p99 {results['ping_ratio_p99']:.2f}x")
    print("\nSIGTERM to exit (s)")
    for row in results["drain"]:
        print(
            f"{row['daemon']:<10} idle client {row['idle_client_s']:.2f}  "
            f"client not reading {row['pings_sent']} replies {row['unread_client_s']:.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

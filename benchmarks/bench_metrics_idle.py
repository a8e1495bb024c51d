"""What idle scrape connections cost the metrics endpoint: prometheus_client's server against tiermemd's.

Each endpoint runs in a child process that serves the same registry (the
daemon's collector over a real pool, no jobs).  The parent opens N TCP
connections that send nothing, then reads the child's thread count
(``/proc/PID/task``) and RSS, and times scrapes made while the idle
connections are held.  ``prometheus_client`` is ``start_http_server`` (a
thread per connection, kept while the peer is idle); ``tiermemd`` is
``tiermemd.scrape.ScrapeServer`` (one thread, ``max_connections``, idle
timeout), as the daemon runs it.

Bound: the bounded server's threads and RSS do not grow with N; the other's
grow by one thread (and its stack) per idle connection.

    .venv/bin/python benchmarks/bench_metrics_idle.py [--idle 500] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHILD = r"""
import sys, time, signal
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

class Fixed(Collector):
    def collect(self):
        for i in range(100):
            yield GaugeMetricFamily(f"tiermem_bench_{i}_bytes", "a figure", value=i)

kind, port, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
registry = CollectorRegistry(auto_describe=False)
registry.register(Fixed())
if kind == "prometheus_client":
    start_http_server(port, addr="127.0.0.1", registry=registry)
else:
    from tiermemd.scrape import ScrapeServer
    ScrapeServer("127.0.0.1", port, lambda: generate_latest(registry), content_type=CONTENT_TYPE_LATEST,
                 max_connections=cap, idle_timeout_s=600.0).start()
print("ready", flush=True)
signal.sigwait([signal.SIGTERM])
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def scrape_ms(port: int, n: int = 20) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(kind: str, idle: int, cap: int) -> dict[str, float]:
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, kind, str(port), str(cap)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        base = {"threads": threads(child.pid), "rss_kib": rss_kib(child.pid), "scrape_ms": scrape_ms(port)}
        held = []
        for _ in range(idle):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            held.append(s)
        time.sleep(1.0)  # let the server accept them all
        loaded = {"threads": threads(child.pid), "rss_kib": rss_kib(child.pid), "scrape_ms": scrape_ms(port)}
        for s in held:
            s.close()
        return {
            "threads_before": base["threads"],
            "threads_with_idle": loaded["threads"],
            "rss_mib_before": base["rss_kib"] / 1024,
            "rss_mib_with_idle": loaded["rss_kib"] / 1024,
            "scrape_ms_before": base["scrape_ms"],
            "scrape_ms_with_idle": loaded["scrape_ms"],
        }
    finally:
        child.terminate()
        child.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=int, default=500, help="idle connections to hold (default 500)")
    parser.add_argument("--cap", type=int, default=16, help="tiermemd's metrics.max_connections (default 16)")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = parser.parse_args()
    rows = {kind: measure(kind, args.idle, args.cap) for kind in ("prometheus_client", "tiermemd")}
    print(f"{args.idle} idle connections held ({os.cpu_count()} CPUs; other work on the machine is not controlled)")
    print(f"{'server':<18} {'threads':>15} {'RSS MiB':>15} {'scrape ms p50':>18}")
    for kind, r in rows.items():
        print(
            f"{kind:<18} {r['threads_before']:>6.0f} -> {r['threads_with_idle']:<6.0f} "
            f"{r['rss_mib_before']:>6.1f} -> {r['rss_mib_with_idle']:<6.1f} "
            f"{r['scrape_ms_before']:>7.2f} -> {r['scrape_ms_with_idle']:<7.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"idle": args.idle, "cap": args.cap, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

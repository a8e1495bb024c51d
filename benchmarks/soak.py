"""Soak: several jobs, random trainer kills and daemon kills with restarts, for N minutes; the ledger ends flat.

What it measures: that a daemon under a long run of crashes leaks nothing
and computes nothing wrong.  One daemon (``tests/chaos/hostile.ChaosDaemon``,
NVMe state committed every ``COMMIT_EVERY`` steps) runs rounds of scenarios
picked at random by weight until the time is up:

- ``client_kills`` (``tests/chaos/kills.py``): ``KILLS_PER_ROUND`` trainers
  SIGKILLed at random points (some with a forked child keeping the socket)
  while two survivor jobs train; each survivor's final params must equal,
  bitwise, the same job run again without chaos;
- ``daemon_kill``: the daemon is SIGKILLed mid-training and restarted; the
  client gets an error at once, the job comes back at its last commit (the
  restart says so, the client is told the step), and its result equals an
  uninterrupted run.
- ``hostile_frames``, ``slow_frames``, ``connection_storm``, ``sigstop``,
  ``unread_replies`` (``tests/chaos/hostile.py``): 10^5 mutated frames a round,
  truncated frames dribbled and silent connections beside a well-behaved
  client, a connection storm from an allowed or a refused uid (root only), a
  SIGSTOPped daemon (clients get ``DaemonTimeout``), a client that never reads
  its replies; each prints its figures (p50/p99 against a baseline, waits).

Scenarios are functions ``fn(daemon, rng) -> dict of figures``; another
scenario is added with ``SCENARIOS["name"] = (weight, fn)`` (before ``main``
runs, e.g. from a wrapper script).  After every round the daemon's ledger
(pool and swap bytes in use, fds, threads, RSS, files) is compared with the
one taken when that daemon process was fresh (after a warm-up job); the run
fails if any round leaves it changed or any job's result differs.

    python benchmarks/soak.py --minutes 20 --json benchmarks/results/soak.json

The bound is zero: leaked bytes, fds, threads, files and wrong results must
all be 0.  Prints a table per scenario and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHAOS = Path(__file__).resolve().parents[1] / "tests" / "chaos"
sys.path.insert(0, str(CHAOS))

from hostile import (  # noqa: E402
    ALLOWED_UID,
    REFUSED_UID,
    ChaosDaemon,
    connection_storm,
    hostile_frames,
    slow_frames,
    stopped_daemon,
    unread_replies,
)
from kills import client_kills, daemon_kill, run_survivor  # noqa: E402
from ledger import Snapshot, problems, settle, snapshot  # noqa: E402

COMMIT_EVERY = 4
GRACE_S = 3.0
KILLS_PER_ROUND = 40

Scenario = Callable[[ChaosDaemon, random.Random], dict[str, Any]]


def _client_kills(daemon: ChaosDaemon, rng: random.Random) -> dict[str, Any]:
    figures = client_kills(daemon, KILLS_PER_ROUND, seed=rng.randrange(1 << 20))
    figures["wrong_results"] = figures["survivors"] - figures["survivors_equal_to_uninterrupted"]
    return figures


def _daemon_kill(daemon: ChaosDaemon, rng: random.Random) -> dict[str, Any]:
    before = rng.randint(COMMIT_EVERY, 4 * COMMIT_EVERY)
    figures = daemon_kill(daemon, commit_every=COMMIT_EVERY, steps_before=before, steps_after=rng.randint(1, 8))
    figures["wrong_results"] = 0 if figures["equal_to_uninterrupted"] else 1
    figures["daemon_restarts"] = 1
    return figures


def _hostile_frames(daemon: ChaosDaemon, rng: random.Random) -> dict[str, Any]:
    return {**hostile_frames(daemon, HOSTILE_FRAMES_PER_ROUND, seed=rng.randrange(1 << 20)), "wrong_results": 0}


def _slow_frames(daemon: ChaosDaemon, rng: random.Random) -> dict[str, Any]:
    return {**slow_frames(daemon, 10.0), "wrong_results": 0}


_CONTROL: list[ChaosDaemon] = []
"""The storms' control target, a second daemon made when the soak starts (``connection_storm``)."""


def _storm(daemon: ChaosDaemon, rng: random.Random) -> dict[str, Any]:
    if os.geteuid() != 0:  # running the storm as another uid needs root
        return {"skipped": 1, "wrong_results": 0}
    uid = rng.choice([ALLOWED_UID, REFUSED_UID])
    control = _CONTROL[0] if _CONTROL else None
    return {**connection_storm(daemon, 10.0, uid=uid, control=control), "wrong_results": 0}


def _sigstop(daemon: ChaosDaemon, rng: random.Random) -> dict[str, Any]:
    return {**stopped_daemon(daemon, timeout_s=2.0), "wrong_results": 0}


def _unread(daemon: ChaosDaemon, rng: random.Random) -> dict[str, Any]:
    return {**unread_replies(daemon), "wrong_results": 0}


HOSTILE_FRAMES_PER_ROUND = 200_000
"""Hostile frames per round of ``hostile_frames``: a 20-minute soak runs about six such rounds, so it sends
over 10^6 (at 100,000 a round one sent 600,000)."""

SCENARIOS: dict[str, tuple[float, Scenario]] = {
    "client_kills": (3.0, _client_kills),
    "daemon_kill": (1.0, _daemon_kill),
    "hostile_frames": (1.0, _hostile_frames),
    "slow_frames": (0.5, _slow_frames),
    "connection_storm": (0.5, _storm),
    "sigstop": (0.5, _sigstop),
    "unread_replies": (0.5, _unread),
}


def _baseline(daemon: ChaosDaemon) -> Snapshot:
    """The ledger of a fresh daemon process, after one NVMe job started its lasting workers."""
    run_survivor(daemon.socket_path, "warm-up", 0, 2)
    take = lambda: snapshot(daemon.pid, daemon.socket_path, daemon.watched)  # noqa: E731
    prev = take()
    for _ in range(60):
        time.sleep(1.0)
        now = take()
        if not problems(prev, now):
            return now
        prev = now
    return prev


def soak(minutes: float, seed: int, root: Path) -> dict[str, Any]:
    rng = random.Random(seed)
    overrides: dict[str, dict[str, Any]] = {
        "jobs": {
            "grace_period_s": GRACE_S,
            "max_jobs": 64,
            "max_jobs_per_uid": 64,
            "window_size": "64KiB",
            "commit_every": COMMIT_EVERY,
        },
        "swap": {"fsync": False, "threads": 1},
    }
    daemon = ChaosDaemon(root, overrides=overrides).start()
    _CONTROL[:] = [ChaosDaemon(root / "control").start()]
    totals: dict[str, dict[str, float]] = {}
    rounds: list[dict[str, Any]] = []
    ledger_problems: list[str] = []
    errors: list[str] = []
    started = time.monotonic()
    try:
        baseline, pid = _baseline(daemon), daemon.pid
        names = list(SCENARIOS)
        weights = [SCENARIOS[n][0] for n in names]
        while time.monotonic() - started < minutes * 60:
            name = rng.choices(names, weights)[0]
            t0 = time.monotonic()
            try:
                figures = SCENARIOS[name][1](daemon, rng)
            except Exception as exc:  # a failed round is a finding: count it, keep the daemon going
                errors.append(f"round {len(rounds)} ({name}): {type(exc).__name__}: {exc}"[:2000])
                print(f"round {len(rounds)} ({name}) failed: {exc!r}", flush=True)
                if not daemon.alive():
                    daemon.start()
                figures = {"wrong_results": 0, "round_errors": 1}
            if daemon.pid != pid:  # restarted: a new process, a new baseline
                baseline, pid = _baseline(daemon), daemon.pid
            take = lambda: snapshot(daemon.pid, daemon.socket_path, daemon.watched)  # noqa: E731
            after = settle(take, baseline, timeout_s=30.0 + 4 * GRACE_S)
            # fewer fds or threads than at the baseline is not a leak (a lazily opened one closed again)
            found = [
                p
                for p in problems(baseline, after)
                if not (
                    p.startswith(("fds:", "threads:"))
                    and getattr(after, p.split(":")[0]) < getattr(baseline, p.split(":")[0])
                )
            ]
            ledger_problems += [f"round {len(rounds)} ({name}): {p}" for p in found]
            figures.update(
                seconds=round(time.monotonic() - t0, 1),
                rss_delta_nbytes=after.rss_nbytes - baseline.rss_nbytes,
                fd_delta=after.fds - baseline.fds,
                thread_delta=after.threads - baseline.threads,
                leaked_pool_nbytes=after.pool_used_nbytes - baseline.pool_used_nbytes,
                leaked_swap_nbytes=after.swap_used_nbytes - baseline.swap_used_nbytes,
                files_left=len(after.files ^ baseline.files),
            )
            rounds.append({"scenario": name, **figures})
            total = totals.setdefault(name, {})
            total["rounds"] = total.get("rounds", 0) + 1
            for key, value in figures.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
                elif isinstance(value, bool):
                    total[key] = total.get(key, 0) + int(value)
            print(f"[{(time.monotonic() - started) / 60:5.1f} min] {name}: {json.dumps(figures)}", flush=True)
        code = daemon.stop()
    finally:
        daemon.cleanup()
        for control in _CONTROL:
            control.stop()
            control.cleanup()
        _CONTROL.clear()
    return {
        "minutes": round((time.monotonic() - started) / 60, 2),
        "seed": seed,
        "rounds": len(rounds),
        "totals": totals,
        "ledger_problems": ledger_problems,
        "round_errors": errors,
        "final_exit_code": code,
        "per_round": rounds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="how long to run (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    parser.add_argument(
        "--root", metavar="DIR", help="keep the daemon's state, swap and log here (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    if args.root:
        result = soak(args.minutes, args.seed, Path(args.root))
    else:
        with tempfile.TemporaryDirectory(prefix="tiermem-soak-") as tmp:
            result = soak(args.minutes, args.seed, Path(tmp))
    print(f"\nsoak: {result['minutes']} min, {result['rounds']} rounds, seed {result['seed']}")
    keys = sorted({k for t in result["totals"].values() for k in t})
    print("| scenario | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, total in result["totals"].items():
        print(f"| {name} | " + " | ".join(f"{total.get(k, 0):g}" for k in keys) + " |")
    wrong = sum(t.get("wrong_results", 0) for t in result["totals"].values())
    print(f"ledger problems: {len(result['ledger_problems'])}; wrong results: {wrong:g}")
    for line in result["ledger_problems"][:20]:
        print("  " + line)
    print(f"failed rounds: {len(result['round_errors'])}")
    for line in result["round_errors"][:20]:
        print("  " + line)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    ok = not result["ledger_problems"] and not result["round_errors"] and not wrong
    return 0 if ok and result["final_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

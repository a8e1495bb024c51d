"""Many ranks, one daemon: the Adam update of 1, 2 and 4 ranks sharing a node, against one CPU Adam per rank.

The same global model (``--numel`` fp32 params) is sharded ZeRO-2 style over
``torchrun --nproc-per-node N`` ranks (gloo), N = 1, 2, 4, in one run:

- ``tiermem``: every rank's shard is updated by one tiermemd (a private daemon
  started here, shared by the ranks through ``TIERMEM_SOCKET_PATH``), whose
  scheduler runs one update at a time over its threads (threads <= cores);
- ``peer``: every rank updates its own shard in process with
  ``torch.optim.AdamW(fused=True)`` on every core, DeepSpeed's layout (one
  CPU Adam per rank, each sized for the whole machine), so N ranks run N
  updates of ``cores`` threads each at once.

Per step, medians after ``--warmup`` (all ranks start a step together, after
a barrier; a step's figure is its span over the ranks, from the first rank's
start to the last rank's end on the machine's monotonic clock):

- ``update``: tiermem: the time of the daemon's update of the shards (the
  ``OffloadAdam.step`` inside ``ShardedOffloadAdam.step``, between two
  barriers, so that no rank copies its slice in or out for the step beside the
  update of the others: that is in ``step``); peer: ``opt.step()``;
- ``step``: tiermem's whole ``ShardedOffloadAdam.step`` (reduce-scatter,
  statistics, update, all-gather);
- ``daemon cpu``: the daemon process's CPU time per step (all its threads, from ``schedstat``).

Goal: at 4 ranks, tiermem's update <= 1.1x its 1-rank update for the same
total params (the daemon does not oversubscribe the cores), and below the
peer layout's.

OpenMP's wait policy decides much of the peer's figure, so it runs twice:
with the default (libgomp's workers spin for a while after each parallel
region, DeepSpeed's case: N ranks' spinning workers oversubscribe the cores)
and with ``OMP_WAIT_POLICY=PASSIVE`` (``passive``).  tiermem's ranks run with
``PASSIVE``, the README's setting for trainers that use a daemon (their
spinning workers would take the cores the daemon's update needs).

    .venv/bin/python benchmarks/bench_ranks.py [--numel 16M] [--ranks 1,2,4] [--steps 8] [--chunk 4M] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tiermem.client import EmbeddedDaemon
from tiermem.units import GiB

WORKER = str(Path(__file__).with_name("ranks_worker.py"))


def _count(text: str) -> int:
    """``16M`` -> 16_000_000 (decimal, as param counts are quoted)."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _run(
    mode: str, ranks: int, numel: int, args: argparse.Namespace, daemon: EmbeddedDaemon | None, omp_wait: str
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if omp_wait:
            env["OMP_WAIT_POLICY"] = omp_wait
        if daemon is not None:
            env["TIERMEM_SOCKET_PATH"] = daemon.socket
            env["TIERMEM_NO_EMBED"] = "1"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", WORKER,
            "--mode", mode, "--numel", str(numel), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--out", out,
        ]  # fmt: skip
        if daemon is not None:
            cmd += ["--daemon-pid", str(daemon.process.pid)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{mode} with {ranks} ranks failed:\n{done.stderr[-4000:]}")
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", default="16M", help="total params of the model (fp32)")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chunk", default="", help="the daemon's adam.chunk_numel (its task size), e.g. 16M")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args()
    numel = _count(args.numel)
    counts = [int(n) for n in args.ranks.split(",")]
    rows = []
    settings = {"adam.chunk_numel": _count(args.chunk)} if args.chunk else None
    daemon = EmbeddedDaemon(pool_size=max(1 * GiB, numel * 10), settings=settings)
    try:
        for n in counts:
            tiermem = _run("tiermem", n, numel, args, daemon, "PASSIVE")  # the README's setting for trainers
            peer = _run("peer", n, numel, args, None, "")  # DeepSpeed's: the OpenMP default, workers spin
            tuned = _run("peer", n, numel, args, None, "PASSIVE")  # the peer given tiermem's setting too
            rows.append({"ranks": n, "tiermem": tiermem, "peer": peer, "peer_passive": tuned})
    finally:
        daemon.stop()
    base = rows[0]["tiermem"]["update_ms"]
    print(f"{numel / 1e6:.1f}M fp32 params, {os.cpu_count()} cores; medians of {args.steps} steps")
    head = f"{'ranks':>5} {'update ms':>10} {'x 1 rank':>9} {'step ms':>9} {'daemon cpu ms':>14} {'peer ms':>9}"
    print(head + f" {'peer/tiermem':>13} {'passive ms':>11} {'passive/tiermem':>16}")
    for row in rows:
        t, p, q = row["tiermem"], row["peer"], row["peer_passive"]
        row["update_vs_one_rank"] = t["update_ms"] / base
        row["peer_vs_tiermem"] = p["update_ms"] / t["update_ms"]
        row["peer_passive_vs_tiermem"] = q["update_ms"] / t["update_ms"]
        cpu = f"{t['daemon_cpu_ms']:.1f}" if t["daemon_cpu_ms"] is not None else "-"
        print(
            f"{row['ranks']:>5} {t['update_ms']:>10.1f} {row['update_vs_one_rank']:>9.2f} {t['step_ms']:>9.1f} "
            f"{cpu:>14} {p['update_ms']:>9.1f} {row['peer_vs_tiermem']:>13.2f} {q['update_ms']:>11.1f} "
            f"{row['peer_passive_vs_tiermem']:>16.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "numel": numel, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

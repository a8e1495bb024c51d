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
- ``daemon cpu``: the daemon process's CPU time per step (all its threads, from ``schedstat``);
- ``daemon span``: the update as the daemon ran it: its scheduler's busy
  period (STATS ``adam.busy_period_s``: from the first task started on an
  idle executor to the last one ended with none queued; the ranks' STEPs
  arrive together, so one period per update), which leaves out the trainer
  processes' own wake-ups and sends.  Four trainers and the daemon on two
  cores make those slow and noisy here; on a node with a core per rank they
  are not on the update's cores.  ``daemon x 1`` is its paired ratio.

Goal: at 4 ranks, tiermem's update <= 1.1x its 1-rank update for the same
total params (the daemon does not oversubscribe the cores), and below the
peer layout's.

Two 1-rank baselines.  ``x 1 rank`` is paired: inside every launch of N > 1
ranks, each step also runs the 1-rank update of the same model (rank 0 alone
updates all of it, a job of one rank on the same daemon, while the others
wait in a barrier), in alternating order, and the figure is the ratio of the
two medians.  ``x launch`` divides by the 1-rank launch's figure instead; it
compares runs a minute apart, and this machine's memory bandwidth drifts by
15-25% between launches (the same update took 19 ms in one launch and 24 ms
in the next), which swamps a 5% difference.

OpenMP's wait policy decides much of the peer's figure, so it runs twice:
with the default (libgomp's workers spin for a while after each parallel
region, DeepSpeed's case: N ranks' spinning workers oversubscribe the cores)
and with ``OMP_WAIT_POLICY=PASSIVE`` (``passive``).  tiermem's ranks run with
``PASSIVE``, the README's setting for trainers that use a daemon (their
spinning workers would take the cores the daemon's update needs).

``--daemon-cpus 0`` pins the daemon to those CPUs (its update then uses as
many threads) and the ranks to the others, so no trainer process runs on the
update's cores: what is left of ``x 1 rank`` is the daemon's own cost per
rank (its session threads share its cores).  On two cores this separates the
four trainers' own CPU (their STEPs, replies and barriers, about 0.4 ms per
extra rank) from the scheduling.

``--threads T`` sets the daemon's ``adam.threads`` (default: one per core
it may use).  One thread leaves a core to the trainers' wake-ups, but on two
cores it is slower at 4 ranks, not faster (16M: 1.20x against 1.08x with
two threads, the 1-rank update 17.0 against 12.4 ms).

``--rounds R`` runs the whole sequence (every rank count, every mode) R
times, interleaved: a figure is the median over the rounds, and each ratio is
taken within its round, so the machine's drift between rounds stays out of it.

    .venv/bin/python benchmarks/bench_ranks.py [--numel 16M] [--ranks 1,2,4] [--steps 8] [--rounds 3]
        [--chunk 4M] [--threads T] [--daemon-cpus C] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tiermem.client.link import EmbeddedDaemon
from tiermem.core.units import GiB

WORKER = str(Path(__file__).with_name("ranks_worker.py"))


def _count(text: str) -> int:
    """``16M`` -> 16_000_000 (decimal, as param counts are quoted)."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def add_run_args(ap: argparse.ArgumentParser, *, numel: str, ranks: str) -> None:
    """The arguments of a benchmark that launches ranks with ``_run`` (which reads ``--steps`` and ``--warmup``)."""
    ap.add_argument("--numel", default=numel, help="total params of the model (fp32)")
    ap.add_argument("--ranks", default=ranks)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)


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
        cmd += getattr(args, "extra", [])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{mode} with {ranks} ranks failed:\n{done.stderr[-4000:]}")
        return json.loads(Path(out).read_text())


def _cpus(text: str) -> set[int]:
    """``0,2-3`` -> {0, 2, 3}."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap, numel="16M", ranks="1,2,4")
    ap.add_argument("--rounds", type=int, default=1, help="run every rank count and mode this many times, interleaved")
    ap.add_argument("--no-peer", action="store_true", help="tiermem only (its paired 1-rank ratio needs no peer)")
    ap.add_argument("--chunk", default="", help="the daemon's adam.chunk_numel (its task size), e.g. 16M")
    ap.add_argument("--threads", type=int, default=0, help="the daemon's adam.threads (0: one per core it may use)")
    ap.add_argument("--daemon-cpus", default="", help="the daemon on these CPUs (0,1 or 0-1), the ranks on the rest")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    numel = _count(args.numel)
    counts = [int(n) for n in args.ranks.split(",")]
    settings: dict[str, int] = {"adam.chunk_numel": _count(args.chunk)} if args.chunk else {}
    if args.threads:
        settings["adam.threads"] = args.threads
    everything = os.sched_getaffinity(0)
    pinned = _cpus(args.daemon_cpus) if args.daemon_cpus else set()
    if pinned and (not pinned < everything):
        ap.error(f"--daemon-cpus must be a proper subset of this process's CPUs {sorted(everything)}")
    if pinned:
        os.sched_setaffinity(0, pinned)  # the daemon (and every thread it starts) inherits it
    daemon = EmbeddedDaemon(pool_size=max(1 * GiB, numel * 10), settings=settings or None)
    ranks_cpus = everything - pinned if pinned else everything
    runs: list[dict[int, dict[str, dict]]] = []
    try:
        for _ in range(args.rounds):
            this: dict[int, dict[str, dict]] = {}
            for n in counts:
                os.sched_setaffinity(0, ranks_cpus)  # torchrun and its ranks inherit it
                this[n] = {"tiermem": _run("tiermem", n, numel, args, daemon, "PASSIVE")}  # the README's setting
                os.sched_setaffinity(0, everything)  # the peer layout has no daemon: every core is its own
                if not args.no_peer:
                    this[n]["peer"] = _run("peer", n, numel, args, None, "")  # DeepSpeed's: OpenMP's default, spinning
                    this[n]["peer_passive"] = _run("peer", n, numel, args, None, "PASSIVE")  # given tiermem's too
            runs.append(this)
    finally:
        daemon.stop()
    rows = [_row(n, [r[n] for r in runs], [r[counts[0]]["tiermem"]["update_ms"] for r in runs]) for n in counts]
    layout = f"; daemon on CPUs {sorted(pinned)}, ranks on {sorted(everything - pinned)}" if pinned else ""
    print(f"{numel / 1e6:.1f}M fp32 params, {os.cpu_count()} cores{layout}; {args.steps} steps, {args.rounds} rounds")
    head = f"{'ranks':>5} {'update ms':>10} {'paired 1-rank ms':>17} {'x 1 rank':>9} {'(rounds)':>10}"
    head += f" {'daemon span ms':>15} {'daemon x 1':>11} {'(rounds)':>10}"
    head += f" {'x launch':>9} {'step ms':>9} {'daemon cpu ms':>14} {'peer ms':>8} {'peer/tiermem':>13}"
    print(head + f" {'passive ms':>11} {'passive/tiermem':>16}")
    for row in rows:
        paired = row["update_vs_single_rounds"]
        spread = f"{min(paired):.2f}-{max(paired):.2f}" if paired else "-"
        single = f"{row['single_ms']:.1f}" if row["single_ms"] is not None else "-"
        spans = row["daemon_vs_single_rounds"]
        span_spread = f"{min(spans):.2f}-{max(spans):.2f}" if spans else "-"
        span = f"{row['daemon_span_ms']:.1f}" if row["daemon_span_ms"] is not None else "-"
        span_ratio = f"{row['daemon_vs_single']:.2f}" if row["daemon_vs_single"] is not None else "1.00"
        ratio = f"{row['update_vs_single']:.2f}" if row["update_vs_single"] is not None else "1.00"
        cpu, peer, vs, tuned, tuned_vs = (
            "-" if row[k] is None else f"{row[k]:.{d}f}"
            for k, d in (
                ("daemon_cpu_ms", 1),
                ("peer_ms", 1),
                ("peer_vs_tiermem", 2),
                ("peer_passive_ms", 1),
                ("peer_passive_vs_tiermem", 2),
            )
        )
        print(
            f"{row['ranks']:>5} {row['update_ms']:>10.1f} {single:>17} {ratio:>9} {spread:>10} "
            f"{span:>15} {span_ratio:>11} {span_spread:>10} {row['update_vs_one_rank']:>9.2f} "
            f"{row['step_ms']:>9.1f} {cpu:>14} {peer:>8} {vs:>13} {tuned:>11} {tuned_vs:>16}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "numel": numel, "rows": rows}, indent=2))


def _versus(rounds: list[dict[str, dict]], mode: str) -> dict:
    if not all(mode in r for r in rounds):
        return {f"{mode}_ms": None, f"{mode}_vs_tiermem": None}
    return {
        f"{mode}_ms": _median([r[mode]["update_ms"] for r in rounds]),
        f"{mode}_vs_tiermem": _median([r[mode]["update_ms"] / r["tiermem"]["update_ms"] for r in rounds]),
    }


def _row(ranks: int, rounds: list[dict[str, dict]], base_ms: list[float]) -> dict:
    """One rank count over the rounds: medians of the rounds' medians; each ratio is taken within a round (the
    1-rank update of the same round), so a drift of the machine between rounds does not enter it."""
    tiermem = [r["tiermem"] for r in rounds]
    ratios = [t["update_ms"] / b for t, b in zip(tiermem, base_ms, strict=True)]
    cpu = [t["daemon_cpu_ms"] for t in tiermem if t["daemon_cpu_ms"] is not None]
    paired = [t["vs_single"] for t in tiermem if t.get("vs_single") is not None]
    singles = [t["single_ms"] for t in tiermem if t.get("single_ms") is not None]
    spans = [t["daemon_span_ms"] for t in tiermem if t.get("daemon_span_ms") is not None]
    span_ratios = [t["daemon_vs_single"] for t in tiermem if t.get("daemon_vs_single") is not None]
    return {
        "ranks": ranks,
        "update_ms": _median([t["update_ms"] for t in tiermem]),
        "step_ms": _median([t["step_ms"] for t in tiermem]),
        "daemon_cpu_ms": _median(cpu) if cpu else None,
        "start_skew_ms": _median([t["start_skew_ms"] for t in tiermem]),
        "update_vs_one_rank": _median(ratios),
        "update_vs_one_rank_rounds": ratios,
        "single_ms": _median(singles) if singles else None,
        "update_vs_single": _median(paired) if paired else None,
        "update_vs_single_rounds": paired,
        "daemon_span_ms": _median(spans) if spans else None,
        "daemon_periods": _median([t["daemon_periods"] for t in tiermem if t.get("daemon_periods") is not None] or [0]),
        "daemon_vs_single": _median(span_ratios) if span_ratios else None,
        "daemon_vs_single_rounds": span_ratios,
        **_versus(rounds, "peer"),
        **_versus(rounds, "peer_passive"),
        "rounds": rounds,
    }


if __name__ == "__main__":
    main()

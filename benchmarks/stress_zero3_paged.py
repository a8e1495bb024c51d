"""Stress of whole torchrun launches of ZeRO-3 paged at its defaults, with the CPU kept busy: none may hang.

What it measures: how many of ``--launches`` launches of
``zero3_paged_stress_worker.py`` (``ShardedPagedAdam`` at its defaults:
``prefetch=2``, NVMe offload through the node's private daemon, a GPT of 4
layers of width 256 within a 16 MiB budget) finish, how many fail (and with
``RankLost``: a collective that waited past its limit), and how many hang
(still running after ``--timeout-s``, then killed).  ``--busy N`` processes
spin on the CPU meanwhile, so the ranks' threads are scheduled late and in
varying orders.  The bound is zero hangs and zero failures.  Every launch
keeps its output in ``--keep`` (by default a temporary directory, removed after
a run where every launch finished).

    python benchmarks/stress_zero3_paged.py --launches 20 [--ranks 2] [--busy 2] [--timeout-s 240]
        [--keep DIR] [--json out.json]

To measure another revision, run it with that revision's tree first on
``PYTHONPATH`` (the worker uses only ``ShardedPagedAdam``'s long-standing
arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKER = str(Path(__file__).with_name("zero3_paged_stress_worker.py"))


def launch(index: int, ranks: int, keep: Path, timeout_s: float) -> dict[str, Any]:
    where = keep / f"launch-{index:03d}"
    where.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    env["TMPDIR"] = str(where)  # the private daemon's directory, beside the launch's output
    env["TIERMEM_SECRET_FILE"] = str(where / "job-secret")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(keep / "inductor")  # the daemons' compiled Adam, built once
    started = time.monotonic()
    with open(where / "output.txt", "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", WORKER,
             "--out", str(where / "result.json")],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            code: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: torchrun and its ranks
            process.wait()
            code = None
    output = (where / "output.txt").read_text(errors="replace")
    outcome = "hung" if code is None else "finished" if code == 0 and (where / "result.json").exists() else "failed"
    result = json.loads((where / "result.json").read_text()) if outcome == "finished" else {}
    return {
        "launch": index,
        "outcome": outcome,
        "rank_lost": "RankLost" in output,
        "returncode": code,
        "seconds": round(time.monotonic() - started, 1),
        "collectives": result.get("collectives"),
        "output": str(where / "output.txt"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--busy", type=int, default=2, help="processes spinning on the CPU during the launches")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="a launch still running then has hung")
    ap.add_argument("--keep", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    keep = args.keep or Path(tempfile.mkdtemp(prefix="stress-zero3-"))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    runs = []
    try:
        for i in range(args.launches):
            run = launch(i, args.ranks, keep, args.timeout_s)
            runs.append(run)
            print(f"launch {i:3d}: {run['outcome']:8s} {run['seconds']:6.1f} s"
                  f"{'  RankLost' if run['rank_lost'] else ''}  {run['collectives'] or ''}", flush=True)  # fmt: skip
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    counts = {k: sum(r["outcome"] == k for r in runs) for k in ("finished", "failed", "hung")}
    summary = {"launches": len(runs), "ranks": args.ranks, "busy": args.busy, **counts, "runs": runs}
    passed = counts["finished"] == len(runs)
    kept = args.keep is not None or not passed  # a temporary directory of a clean run goes; a failed one's stays
    print(f"{len(runs)} launches at {args.ranks} ranks, {args.busy} busy processes: {counts['finished']} finished, "
          f"{counts['failed']} failed ({sum(r['rank_lost'] for r in runs)} with RankLost), {counts['hung']} hung"
          + (f"; outputs in {keep}" if kept else ""))  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))
    if not kept:
        shutil.rmtree(keep, ignore_errors=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

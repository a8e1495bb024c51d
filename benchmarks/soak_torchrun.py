"""Soak of whole torchrun launches: a user's ZeRO-2 script, launched again and again, must end 0 every time.

What it measures: how often a complete ``torchrun`` launch of a plain
training script (``user_zero2_worker.py``: private node daemons, a schedule,
a clip, a checkpoint and resume into a new job mid-way, and a normal
interpreter exit with no ``os._exit``) fails, and whether its result is
right.  Launches alternate between ``--ranks`` counts and tiers, one after
another, ``--parallel`` at a time.  Every launch keeps its whole output in
``--keep`` (the default: a temporary directory, kept when a launch failed),
so a rare failure at close or at exit can be read afterwards.  The bound is
zero: failed launches and results further than ``TOLERANCE`` from
``torch.optim.AdamW`` must both be 0.

    python benchmarks/soak_torchrun.py --launches 40 [--ranks 2,4] [--tiers cpu,nvme] [--parallel 1]
        [--keep DIR] [--optimizer torch] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

WORKER = str(Path(__file__).with_name("user_zero2_worker.py"))
TOLERANCE = 1e-5  # fp32, the reduce-scatter sums the ranks' rows in another order: measured 2e-7 to 1.4e-6


def _launch(index: int, ranks: int, tier: str, keep: Path, optimizer: str) -> dict[str, Any]:
    where = keep / f"launch-{index:04d}-{ranks}r-{tier}"
    where.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    env["TMPDIR"] = str(where)  # the private daemons' directories, beside the launch's output
    env["TIERMEM_SECRET_FILE"] = str(where / "job-secret")
    started = time.monotonic()
    with open(where / "output.txt", "wb") as out:
        code = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", WORKER,
             "--tier", tier, "--dir", str(where), "--optimizer", optimizer],
            env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600, check=False,
        ).returncode  # fmt: skip
    result_path = where / "result.json"
    diff = json.loads(result_path.read_text())["param_diff"] if result_path.exists() else None
    return {
        "launch": index,
        "ranks": ranks,
        "tier": tier,
        "returncode": code,
        "param_diff": diff,
        "seconds": round(time.monotonic() - started, 1),
        "output": str(where / "output.txt"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=40)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--tiers", default="cpu,nvme")
    ap.add_argument("--parallel", type=int, default=1, help="launches at once")
    ap.add_argument("--keep", default="", help="keep every launch's output here (default: only failed ones)")
    ap.add_argument(
        "--optimizer",
        choices=["tiermem", "torch"],
        default="tiermem",
        help="torch: the control without tiermem (the worker's DDP-style AdamW; results not compared)",
    )
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    if args.launches < 1 or args.parallel < 1:
        ap.error("--launches and --parallel must be >= 1")
    plan = list(
        itertools.islice(
            itertools.cycle(itertools.product([int(r) for r in args.ranks.split(",")], args.tiers.split(","))),
            args.launches,
        )
    )
    keep = Path(args.keep or tempfile.mkdtemp(prefix="tiermem-soak-torchrun-"))
    with ThreadPoolExecutor(args.parallel) as pool:
        runs = list(pool.map(lambda item: _launch(item[0], *item[1], keep, args.optimizer), enumerate(plan)))
    failed = [r for r in runs if r["returncode"] != 0]
    checked = args.optimizer == "tiermem"
    wrong = [
        r for r in runs if checked and r["returncode"] == 0 and (r["param_diff"] is None or r["param_diff"] > TOLERANCE)
    ]
    print(f"{'ranks':>5} {'tier':>5} {'launches':>9} {'failed':>7} {'wrong':>6} {'worst diff':>11} {'median s':>9}")
    for (ranks, tier), group in itertools.groupby(sorted(runs, key=lambda r: (r["ranks"], r["tier"])),
                                                  key=lambda r: (r["ranks"], r["tier"])):  # fmt: skip
        rows = list(group)
        diffs = [r["param_diff"] for r in rows if r["param_diff"] is not None]
        seconds = sorted(r["seconds"] for r in rows)
        bad = (sum(r in failed for r in rows), sum(r in wrong for r in rows))
        worst, median_s = (max(diffs) if diffs else float("nan")), seconds[len(seconds) // 2]
        print(f"{ranks:>5} {tier:>5} {len(rows):>9} {bad[0]:>7} {bad[1]:>6} {worst:>11.1e} {median_s:>9.1f}")
    for r in failed + wrong:
        print(f"launch {r['launch']} ({r['ranks']} ranks, {r['tier']}): exit {r['returncode']}, "
              f"diff {r['param_diff']}; output: {r['output']}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    if not args.keep and not failed and not wrong:
        shutil.rmtree(keep, ignore_errors=True)
    elif not args.keep:  # kept for a look at what went wrong; say where, and that it is the reader's to remove
        print(f"the launches' directories are kept in {keep} (remove it when done)")
    return 1 if failed or wrong else 0


if __name__ == "__main__":
    sys.exit(main())

"""ZeRO-2 training steps with the reduce-scatter during backward (``overlap_comm=True``) against after it.

``torchrun --nproc-per-node N`` ranks (gloo), N from ``--ranks``, share one
tiermemd; each trains an MLP of 8 square layers (``--numel`` fp32 params in
all, ``--batch`` rows per rank) through ``ShardedOffloadAdam``, twice over:
one model with ``overlap_comm`` off and its twin with it on, alternating step
by step in one launch (so the machine's drift between launches stays out of
the ratio).  A step is forward, backward, ``step()`` and ``zero_grad()``, its
figure the span over the ranks (first start to last end, after a barrier);
medians after ``--warmup``.

On a machine whose cores the ranks' backward already fills, the overlapped
collectives compete with it for the same cores; the figure to expect a gain
from is one with cores (or a NIC and NCCL) to spare.

    .venv/bin/python benchmarks/bench_overlap.py [--numel 32M] [--ranks 2,4] [--steps 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench_ranks import _count, _run, add_run_args

from tiermem.client.link import EmbeddedDaemon
from tiermem.core.units import GiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap, numel="32M", ranks="2,4")
    ap.add_argument("--batch", type=int, default=32, help="rows per rank")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args()
    args.extra = ["--batch", str(args.batch)]
    numel = _count(args.numel)
    daemon = EmbeddedDaemon(pool_size=max(1 * GiB, numel * 24))
    rows = []
    try:
        for n in (int(r) for r in args.ranks.split(",")):
            rows.append(_run("overlap", n, numel, args, daemon, "PASSIVE"))
    finally:
        daemon.stop()
    print(f"{numel / 1e6:.1f}M fp32 params, {os.cpu_count()} cores; medians of {args.steps} steps")
    print(f"{'ranks':>5} {'after backward ms':>18} {'during backward ms':>19} {'during/after':>13}")
    for row in rows:
        row["on_vs_off"] = row["on_ms"] / row["off_ms"]
        print(f"{row['ranks']:>5} {row['off_ms']:>18.1f} {row['on_ms']:>19.1f} {row['on_vs_off']:>13.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

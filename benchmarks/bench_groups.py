"""The CPU tier's step by how its params are grouped; torch's fused AdamW on the same groups beside it.

A model of ``--layers`` ``Linear(--width, --width)`` (two tensors each) trains
through ``OffloadAdam`` (a private daemon, CPU tier) and through
``torch.optim.AdamW(fused=True)``, with its params in:

- ``one``: one param group;
- ``per-param``: a group per param, all with one lr (what a recipe that builds
  its groups param by param makes);
- ``per-layer-lr``: a group per layer, each with its own lr (layer-wise lr
  decay): as many distinct hyper-parameters as layers.

Each figure is the median ``opt.step()`` time over ``--steps`` steps after
``--warmup`` (the two optimizers alternate step by step, so drift stays out of
the ratio); the forward and backward are not counted.  The last column is
OffloadAdam's time over AdamW's for the same grouping.

    .venv/bin/python benchmarks/bench_groups.py [--layers 1000] [--width 32] [--steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tiermem

LR = 1e-3

GROUPINGS: dict[str, Callable[[nn.Sequential], list[dict[str, Any]]]] = {
    "one": lambda m: [{"params": list(m.parameters())}],
    "per-param": lambda m: [{"params": [p]} for p in m.parameters()],
    "per-layer-lr": lambda m: [{"params": list(layer.parameters()), "lr": LR * 0.999**i} for i, layer in enumerate(m)],
}


def step_times(model: nn.Sequential, opt: torch.optim.Optimizer, x: torch.Tensor, times: list[float]) -> None:
    model(x).square().mean().backward()
    start = time.perf_counter()
    opt.step()
    times.append(time.perf_counter() - start)
    opt.zero_grad()


def run(grouping: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    ours = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    theirs = copy.deepcopy(ours)
    offload = tiermem.OffloadAdam(GROUPINGS[grouping](ours), lr=LR, offload="cpu")
    fused = torch.optim.AdamW(GROUPINGS[grouping](theirs), lr=LR, fused=True)
    x = torch.randn(4, args.width)
    times: dict[str, list[float]] = {"offload": [], "adamw": []}
    try:
        for _ in range(args.warmup + args.steps):
            step_times(ours, offload, x, times["offload"])
            step_times(theirs, fused, x, times["adamw"])
        with torch.no_grad():
            diff = max(float((p - q).abs().max()) for p, q in zip(ours.parameters(), theirs.parameters(), strict=True))
    finally:
        offload.close()
    ms = {k: 1e3 * statistics.median(v[args.warmup :]) for k, v in times.items()}
    return {
        "grouping": grouping,
        "groups": len(offload.param_groups),
        "tensors": 2 * args.layers,
        "offload_ms": ms["offload"],
        "adamw_ms": ms["adamw"],
        "ratio": ms["offload"] / ms["adamw"],
        "max_param_diff": diff,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1000)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--groupings", default=",".join(GROUPINGS), help="which groupings, comma-separated")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args()
    rows = [run(g, args) for g in args.groupings.split(",")]
    print(f"{args.layers} x Linear({args.width}, {args.width}), {os.cpu_count()} cores; medians of {args.steps} steps")
    print(f"{'grouping':>13} {'groups':>7} {'OffloadAdam ms':>15} {'AdamW ms':>9} {'ratio':>7} {'max diff':>9}")
    for r in rows:
        print(
            f"{r['grouping']:>13} {r['groups']:>7} {r['offload_ms']:>15.1f} {r['adamw_ms']:>9.1f} "
            f"{r['ratio']:>7.2f} {r['max_param_diff']:>9.1e}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

"""What clipping a step of accumulated grads costs ZeRO-3 paged: the daemon's GRAD_NORM beside the step.

``ShardedPagedAdam`` over ``--layers`` ``Linear(--width, --width)`` (fp32), one
rank (gloo), CPU tier of a private daemon, each step over ``--micro`` backward
passes (gradient accumulation).  After several passes a rank's figures of its
reduced grads are each pass's, and the norm of their sum exists only in the
daemon, where the passes were added: with ``max_grad_norm`` the step asks the
daemon for it (one GRAD_NORM request, a pass over the rank's grads there).

Three optimizers over copies of the model alternate step by step, so drift
stays out of the ratios:

- ``no clip``: ``max_grad_norm=None``; before each step the benchmark times
  one GRAD_NORM by hand (``OffloadAdam.held_grad_stats``), which the step
  does not repeat;
- ``clip 1e9``: a clip that never binds (coefficient 1), whose step asks for
  the norm itself: the cost of the norm alone;
- ``clip 1.0``: a clip that binds at every step here: the daemon's update
  then scales the grads, which its fused fp32 path does not (it runs the
  compiled kernel), whatever the grads' origin.

Figures: the medians over ``--steps`` steps after ``--warmup`` of
``opt.step()`` and of the GRAD_NORM alone, and the clipped step over the
unclipped one.  Neither timing counts the forward and backward, nor the wait
for the last grad pushes of the backward (both drain them first).

    .venv/bin/python benchmarks/bench_accumulated_clip.py [--layers 8] [--width 2048] [--micro 2]
        [--steps 10] [--warmup 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=2, help="backward passes a step")
    ap.add_argument("--batch", type=int, default=8, help="rows a backward pass")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from tiermem.client.distributed import ShardedPagedAdam

    rendezvous = Path(os.environ["TMPDIR"]) / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    clips = {"no clip": None, "clip 1e9": 1e9, "clip 1.0": 1.0}
    models = {name: model if clip is None else copy.deepcopy(model) for name, clip in clips.items()}
    params = sum(p.numel() for p in model.parameters())
    layer_nbytes = args.width * (args.width + 1) * 4
    budget = f"{3 * layer_nbytes >> 20}MiB"  # three layers' params
    window = 2 * layer_nbytes + (1 << 20)  # a submodule's fetch or push in one request
    opts = {
        name: ShardedPagedAdam(
            m, lr=1e-4, offload="cpu", device_budget=budget, max_grad_norm=clips[name], window_nbytes=window
        )
        for name, m in models.items()
    }
    steps: dict[str, list[float]] = {name: [] for name in models}
    grad_norm: list[float] = []
    try:
        for step in range(args.warmup + args.steps):
            x = torch.randn(args.micro * args.batch, args.width, generator=torch.Generator().manual_seed(step))
            for name, m in models.items():
                for part in x.chunk(args.micro):
                    m(part).square().mean().backward()
                opt = opts[name]
                opt.inner.feed.check()  # the last pushes of backward land first, out of both timings
                if name == "no clip":
                    started = time.perf_counter()
                    opt.inner.held_grad_stats()
                    grad_norm.append(time.perf_counter() - started)
                started = time.perf_counter()
                opt.step()
                steps[name].append(time.perf_counter() - started)
                opt.zero_grad()
    finally:
        for opt in opts.values():
            opt.close()
        dist.destroy_process_group()
    median = {name: statistics.median(times[args.warmup :]) * 1e3 for name, times in steps.items()}
    norm_ms = statistics.median(grad_norm[args.warmup :]) * 1e3
    print(
        f"ShardedPagedAdam, 1 rank, CPU tier: {args.layers} x Linear({args.width}, {args.width}), "
        f"{params / 1e6:.1f}M params, {args.micro} backward passes a step; medians of {args.steps} steps"
    )
    head = f"{'GRAD_NORM ms':>13} " + " ".join(f"{'step ms, ' + name:>19}" for name in models)
    head += f" {'1e9 / no clip':>14} {'1.0 / no clip':>14}"
    print(head)
    print("-" * len(head))
    ratios = {name: median[name] / median["no clip"] for name in ("clip 1e9", "clip 1.0")}
    row = f"{norm_ms:>13.1f} " + " ".join(f"{median[name]:>19.1f}" for name in models)
    print(row + f" {ratios['clip 1e9']:>14.2f} {ratios['clip 1.0']:>14.2f}")
    if args.json:
        result = {"layers": args.layers, "width": args.width, "micro": args.micro, "params": params,
                  "grad_norm_ms": norm_ms, "step_ms": median, "over_no_clip": ratios}  # fmt: skip
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as where:  # the private daemon's directory, the job secret, the rendezvous
        os.environ["TMPDIR"] = where
        os.environ["TIERMEM_SECRET_FILE"] = str(Path(where) / "job-secret")
        sys.exit(main())

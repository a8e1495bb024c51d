"""One rank of ``bench_ranks.py``, started by ``torchrun`` (gloo); see that script for what is measured.

``--mode tiermem``: the rank's shard of ``--numel`` fp32 params is updated by
the node's tiermemd through ``ShardedOffloadAdam``.  ``--mode peer``: the rank
updates its shard itself with ``torch.optim.AdamW(fused=True)`` using every
core (``torch.set_num_threads(os.cpu_count())``), as DeepSpeed's per-rank CPU
Adam does.  Every step starts after a barrier; a step's update time is its
span on the node's one monotonic clock, from the first rank's start to the
last rank's end (a rank's own duration would hide the time it waited to be
scheduled at all, which is most of what oversubscription costs).  Rank 0
writes the medians as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

TENSORS = 8


def _cpu_s(pid: int) -> float:
    """CPU time of every thread of ``pid`` (``schedstat``: nanoseconds, not clock ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def _span(start: float, end: float, skews: list[float] | None = None) -> float:
    """From the earliest ``start`` to the latest ``end`` over the ranks (``time.monotonic``: one clock for
    every process of the machine); ``skews`` gets the spread of the starts (latest minus earliest)."""
    t = torch.tensor([-start, end, start], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if skews is not None:
        skews.append(float(t[2] + t[0]))
    return float(t[1] + t[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["tiermem", "peer"], required=True)
    ap.add_argument("--numel", type=int, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--daemon-pid", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    updates, steps, cpu, skews = [], [], [], []
    if args.mode == "peer":
        torch.set_num_threads(os.cpu_count() or 1)
        shard = torch.nn.Parameter(torch.randn(args.numel // world))
        shard.grad = torch.randn_like(shard)
        opt: torch.optim.Optimizer = torch.optim.AdamW([shard], lr=1e-3, fused=True)
        for i in range(args.warmup + args.steps):
            dist.barrier()
            t0 = time.monotonic()
            opt.step()
            dt = _span(t0, time.monotonic(), skews if i >= args.warmup else None)
            if i >= args.warmup:
                updates.append(dt)
                steps.append(dt)
    else:
        from tiermem.distributed import ShardedOffloadAdam

        params = [torch.nn.Parameter(torch.randn(args.numel // TENSORS)) for _ in range(TENSORS)]
        sharded = ShardedOffloadAdam(params, lr=1e-3, offload="cpu")
        inner = sharded.inner
        assert inner is not None
        inner_step = inner.step
        box = {"start": 0.0, "end": 0.0}

        def timed_step() -> None:
            dist.barrier()  # every rank has handed its slice over: the update alone, not a rank's copying beside it
            box["start"] = time.monotonic()
            inner_step()
            box["end"] = time.monotonic()
            dist.barrier()  # ranks done first wait here, not in the all-gather's copies beside the others' update

        inner.step = timed_step  # type: ignore[method-assign]
        for i in range(args.warmup + args.steps):
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            dist.barrier()
            c0 = _cpu_s(args.daemon_pid) if rank == 0 and args.daemon_pid else 0.0
            t0 = time.monotonic()
            sharded.step()
            step_s = _span(t0, time.monotonic())
            update_s = _span(box["start"], box["end"], skews if i >= args.warmup else None)
            if i >= args.warmup:
                updates.append(update_s)
                steps.append(step_s)
                if rank == 0 and args.daemon_pid:
                    cpu.append(_cpu_s(args.daemon_pid) - c0)
        sharded.close()
    if rank == 0:
        result = {
            "mode": args.mode,
            "ranks": world,
            "numel": args.numel,
            "update_ms": statistics.median(updates) * 1e3,
            "step_ms": statistics.median(steps) * 1e3,
            "daemon_cpu_ms": statistics.median(cpu) * 1e3 if cpu else None,
            "start_skew_ms": statistics.median(skews) * 1e3,
        }
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

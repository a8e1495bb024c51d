"""One rank of ``bench_ranks.py``, started by ``torchrun`` (gloo); see that script for what is measured.

``--mode tiermem``: the rank's shard of ``--numel`` fp32 params is updated by
the node's tiermemd through ``ShardedOffloadAdam``; with more than one rank,
every step is paired with the 1-rank update of the same model in the same
launch (rank 0 alone updates all of it through an ``OffloadAdam``, a job of
its own on the same daemon, while the others wait), in alternating order, so
the ratio of the two compares updates seconds apart, not launches minutes
apart (the machine's memory bandwidth drifts by 15-25% between launches).  ``--mode peer``: the rank
updates its shard itself with ``torch.optim.AdamW(fused=True)`` using every
core (``torch.set_num_threads(os.cpu_count())``), as DeepSpeed's per-rank CPU
Adam does.  Every step starts after a barrier; a step's update time is its
span on the node's one monotonic clock, from the first rank's start to the
last rank's end (a rank's own duration would hide the time it waited to be
scheduled at all, which is most of what oversubscription costs).  Beside it,
rank 0 reads the daemon's scheduler figures (STATS) before and after each
update: its busy period (from the first task started on an idle executor to
the last one ended with none queued) is the update as the daemon ran it,
without the trainers' own wake-ups and sends, which four trainer processes on
two cores make slow and noisy.  Rank 0 writes the medians as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
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


class _Scheduler:
    """The daemon's busy periods across one update, read through ``client`` (STATS; rank 0 only)."""

    def __init__(self, client: object | None) -> None:
        self.client = client
        self.spans: list[float] = []
        self.periods: list[int] = []
        self._before: tuple[int, float] | None = None

    def _read(self) -> tuple[int, float]:
        adam = self.client.stats().node.adam  # type: ignore[attr-defined]
        return adam.busy_periods, adam.busy_period_s

    def before(self) -> None:
        if self.client is not None:
            self._before = self._read()

    def after(self, keep: bool) -> None:
        if self.client is None or self._before is None:
            return
        for _ in range(200):  # the executor closes its period just after the update's last task completed
            periods, seconds = self._read()
            if periods > self._before[0]:
                break
            time.sleep(0.001)
        if keep:
            self.periods.append(periods - self._before[0])
            self.spans.append(seconds - self._before[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["tiermem", "peer", "overlap"], required=True)
    ap.add_argument("--batch", type=int, default=32, help="--mode overlap: rows per rank")
    ap.add_argument("--numel", type=int, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--daemon-pid", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    updates, steps, cpu, skews, singles = [], [], [], [], []
    daemon_figures: dict[str, float | None] = {}
    if args.mode == "overlap":
        _overlap(args, rank, world)
        return
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
        from tiermem import OffloadAdam
        from tiermem.client.distributed import ShardedOffloadAdam

        params = [torch.nn.Parameter(torch.randn(args.numel // TENSORS)) for _ in range(TENSORS)]
        sharded = ShardedOffloadAdam(params, lr=1e-3, offload="cpu")
        inner = sharded.inner
        assert inner is not None
        inner_step = inner.step
        box = {"start": 0.0, "end": 0.0, "keep": False}
        sched = _Scheduler(inner.client if rank == 0 else None)

        def timed_step() -> None:
            sched.before()
            dist.barrier()  # every rank has handed its slice over: the update alone, not a rank's copying beside it
            box["start"] = time.monotonic()
            inner_step()
            box["end"] = time.monotonic()
            dist.barrier()  # ranks done first wait here, not in the all-gather's copies beside the others' update
            sched.after(bool(box["keep"]))

        inner.step = timed_step  # type: ignore[method-assign]
        # the 1-rank update of the same model, paired step by step in this launch: rank 0 alone updates all of
        # it (a job of one rank on the same daemon) while the other ranks wait in a barrier
        whole: list[torch.nn.Parameter] = []
        single: OffloadAdam | None = None
        if world > 1 and rank == 0:
            whole = [torch.nn.Parameter(p.detach().clone()) for p in params]
            single = OffloadAdam(whole, lr=1e-3, offload="cpu")
        single_sched = _Scheduler(single.client if single is not None else None)

        def sharded_update(i: int) -> None:
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            dist.barrier()
            c0 = _cpu_s(args.daemon_pid) if rank == 0 and args.daemon_pid else 0.0
            box["keep"] = i >= args.warmup
            t0 = time.monotonic()
            sharded.step()
            step_s = _span(t0, time.monotonic())
            update_s = _span(box["start"], box["end"], skews if i >= args.warmup else None)
            if i >= args.warmup:
                updates.append(update_s)
                steps.append(step_s)
                if rank == 0 and args.daemon_pid:
                    cpu.append(_cpu_s(args.daemon_pid) - c0)

        def single_update(i: int) -> None:
            for p in whole:  # in place: the grads stay in the daemon's shared storage, as backward lands them
                if p.grad is None:
                    p.grad = torch.full_like(p, 1e-3)
                else:
                    p.grad.fill_(1e-3)
            single_sched.before()
            dist.barrier()
            t0 = time.monotonic()
            if single is not None:
                single.step()
            dt = _span(t0, time.monotonic())
            single_sched.after(i >= args.warmup)
            dist.barrier()
            if i >= args.warmup:
                singles.append(dt)

        for i in range(args.warmup + args.steps):
            if world == 1:
                sharded_update(i)
            elif i % 2:  # the order flips every step: neither update always runs second
                sharded_update(i)
                single_update(i)
            else:
                single_update(i)
                sharded_update(i)
        if single is not None:
            single.close()
        sharded.close()
        daemon_figures = {
            "daemon_span_ms": statistics.median(sched.spans) * 1e3 if sched.spans else None,
            "daemon_periods": statistics.median(sched.periods) if sched.periods else None,
            "single_daemon_span_ms": statistics.median(single_sched.spans) * 1e3 if single_sched.spans else None,
        }
    if rank == 0:
        result = {
            "mode": args.mode,
            "ranks": world,
            "numel": args.numel,
            "update_ms": statistics.median(updates) * 1e3,
            "step_ms": statistics.median(steps) * 1e3,
            "daemon_cpu_ms": statistics.median(cpu) * 1e3 if cpu else None,
            "start_skew_ms": statistics.median(skews) * 1e3,
            "single_ms": statistics.median(singles) * 1e3 if singles else None,
            "vs_single": statistics.median(updates) / statistics.median(singles) if singles else None,
            **daemon_figures,
        }
        span, single_span = result.get("daemon_span_ms"), result.get("single_daemon_span_ms")
        result["daemon_vs_single"] = span / single_span if span and single_span else None
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _overlap(args: argparse.Namespace, rank: int, world: int) -> None:
    """Whole training steps (forward, backward, ``step()``) of one MLP with ``overlap_comm`` off and of its
    twin with it on, alternating per step; rank 0 writes each one's median span."""
    from tiermem.client.distributed import ShardedOffloadAdam

    layers = 8
    dim = int((args.numel / layers) ** 0.5)
    models, opts = [], []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])
        models.append(model)
        opts.append(ShardedOffloadAdam(model.parameters(), lr=1e-4, offload="cpu", overlap_comm=overlap))
    x = torch.randn(args.batch, dim)
    spans: list[list[float]] = [[], []]
    for i in range(args.warmup + args.steps):
        for which in (0, 1) if i % 2 else (1, 0):
            dist.barrier()
            t0 = time.monotonic()
            models[which](x).square().mean().backward()
            opts[which].step()
            opts[which].zero_grad()
            dt = _span(t0, time.monotonic())
            if i >= args.warmup:
                spans[which].append(dt)
    for opt in opts:
        opt.close()
    if rank == 0:
        off, on = (statistics.median(v) * 1e3 for v in spans)
        result = {"mode": "overlap", "ranks": world, "numel": layers * dim * dim, "off_ms": off, "on_ms": on}
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # the figures are written: leave without interpreter finalization, in which torch's gloo once aborted a
    # rank that had already destroyed its process group (SIGABRT, "terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

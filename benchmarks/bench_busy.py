"""The CPU tier's training step beside busy neighbours, against torch AdamW under the same neighbours.

A real node runs dataloader workers, tokenizers and other ranks beside the
daemon.  This runs the demo GPT's step with ``torch.optim.AdamW(fused=True)``
and with ``OffloadAdam(offload="cpu")`` (a private tiermemd), interleaved in
turns as ``bench_train_step`` does, with 0, 1 and 2 neighbour processes
running: each neighbour is a separate Python process looping over torch ops
(a matmul and an elementwise pass) on ``--neighbour-threads`` threads of its
own (1 by default, as torch's dataloader workers run), started before the
mode's first step and killed after its last.

Per size and neighbour count: each mode's median step, its slowdown against
the same mode with no neighbours, and ``busy ratio``: the CPU tier's slowdown
over AdamW's.  The goal is ``busy ratio`` <= 1.3 with one and with two
neighbours: the daemon may not suffer from a neighbour much more than torch's
own optimizer does.

The same from the steps' means (``mean ratio``).  Beside another training job
(``--neighbour-kind train``) the trainer's and the neighbour's OpenMP teams,
both spinning at libgomp's default, lock into a fast or a slow phase for
seconds at a time: one step takes 1.4 s or 4.8 s (100M, batch 1), whatever
runs in the trainer, AdamW, the CPU tier or no optimizer at all.  A median
over such steps follows whichever phase most of a mode's steps fell in; the
mean is the throughput a user gets.  ``--with-none`` adds the trainer's own
forward and backward with no optimizer (``none``) as a third mode, the floor
both others stand on; ``--block-steps 2`` alternates the modes every counted
step, so that each sees both phases.

    .venv/bin/python benchmarks/bench_busy.py [--sizes 16M,100M] [--neighbours 0,1,2] [--steps 8] \\
        [--json benchmarks/results/busy.json]

Run it on an otherwise quiet machine: the neighbours are the only load it means to measure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_train_step import measure, parse_count, private_daemon

from tiermem.client.demo.model import GPTConfig
from tiermem.core.units import GiB, align_up


class MLP(torch.nn.Module):
    """``--model mlp``: ``layers`` square linear layers of width ``width`` with GELUs between, a regression
    loss; forward and backward are cheap beside the optimizer's step, unlike the GPT at batch 8."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            *[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.body(x), y)


def mlp_shape(target: int, layers: int = 4) -> tuple[int, int]:
    """(width, layers) of an ``MLP`` with about ``target`` params (widths a multiple of 128)."""
    width = max(128, round((target / layers) ** 0.5 / 128) * 128)
    return width, layers


NEIGHBOUR = """
import os, sys, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(384, 384)
b = torch.randn(384, 384)
x = torch.randn(1 << 20)
print("ready", flush=True)
while True:
    c = a @ b
    x = torch.tanh(x) * 1.0001
"""
"""A neighbour: torch ops on its own threads, forever (a dataloader worker's kind of load)."""

TRAINER = """
import sys, torch
from tiermem.client.demo.model import GPT, GPTConfig
torch.set_num_threads(int(sys.argv[1]))
cfg = GPTConfig.for_params(16_000_000)
model = GPT(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
print("ready", flush=True)
while True:
    model(x, x).backward()
    opt.step()
    opt.zero_grad()
"""
"""``--neighbour-kind train``: another training job (the 16M demo GPT with torch AdamW) on its own threads."""


def start_neighbours(count: int, threads: int, kind: str = "ops") -> list[subprocess.Popen[bytes]]:
    procs = []
    for _ in range(count):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        p = subprocess.Popen(
            [sys.executable, "-c", NEIGHBOUR if kind == "ops" else TRAINER, str(threads)],
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        procs.append(p)
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline().strip() != b"ready":
            stop_neighbours(procs)
            raise RuntimeError(f"a neighbour process exited before starting (exit code {p.poll()})")
    time.sleep(0.5)  # let them reach their steady state
    return procs


def stop_neighbours(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def run_size(args: argparse.Namespace, name: str, cfg: GPTConfig) -> list[dict[str, Any]]:
    make_model = make_batch = None
    n = cfg.num_params()
    if args.model == "mlp":
        width, layers = mlp_shape(parse_count(name))
        n = layers * (width * width + width)

        def make_model() -> torch.nn.Module:
            return MLP(width, layers)

        def make_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(args.batch, width, generator=g), torch.randn(args.batch, width, generator=g)

    pool = align_up(int(8 * n * 1.1) + 256 * 2**20, GiB)
    rows = []
    with private_daemon(pool, compile_adam=True) as client:
        for count in args.neighbours:
            procs = start_neighbours(count, args.neighbour_threads, args.neighbour_kind)
            try:
                t0 = time.perf_counter()
                medians = measure(
                    cfg,
                    ["torch", "cpu", "none"] if args.with_none else ["torch", "cpu"],
                    client.socket_path,
                    steps=args.steps,
                    warmup=args.warmup,
                    block=args.block_steps,
                    sequential=False,
                    batch=args.batch,
                    make_model=make_model,
                    make_batch=make_batch,
                )
                wall = time.perf_counter() - t0
            finally:
                stop_neighbours(procs)
            load = os.getloadavg()[0]
            rows.append(
                {
                    "size": name,
                    "model": args.model,
                    "params": n,
                    "neighbours": count,
                    "neighbour_kind": args.neighbour_kind,
                    "neighbour_threads": args.neighbour_threads,
                    "adamw_step_s": medians["torch"]["step_s"],
                    "cpu_step_s": medians["cpu"]["step_s"],
                    "cpu_fwd_bwd_s": medians["cpu"]["fwd_bwd_s"],
                    "cpu_opt_step_s": medians["cpu"]["opt_step_s"],
                    "cpu_daemon_update_s": medians["cpu"].get("d_rank_update_s"),
                    "cpu_wait_s": medians["cpu"].get("wait_s"),
                    "adamw_opt_step_s": medians["torch"]["opt_step_s"],
                    "adamw_step_mean_s": medians["torch"]["mean_step_s"],
                    "cpu_step_mean_s": medians["cpu"]["mean_step_s"],
                    **(
                        {"none_step_s": medians["none"]["step_s"], "none_step_mean_s": medians["none"]["mean_step_s"]}
                        if "none" in medians
                        else {}
                    ),
                    "wall_s": wall,
                    "loadavg_1m_after": load,
                }
            )
            print(
                f"  {name} neighbours={count}: adamw {rows[-1]['adamw_step_s'] * 1e3:.1f} ms, "
                f"cpu tier {rows[-1]['cpu_step_s'] * 1e3:.1f} ms ({wall:.0f} s)",
                flush=True,
            )
    base = {r["size"]: r for r in rows if r["neighbours"] == 0}
    for r in rows:
        b = base.get(r["size"])
        if b is None:
            continue
        r["adamw_slowdown"] = r["adamw_step_s"] / b["adamw_step_s"]
        r["cpu_slowdown"] = r["cpu_step_s"] / b["cpu_step_s"]
        r["busy_ratio"] = r["cpu_slowdown"] / r["adamw_slowdown"]
        r["adamw_slowdown_mean"] = r["adamw_step_mean_s"] / b["adamw_step_mean_s"]
        r["cpu_slowdown_mean"] = r["cpu_step_mean_s"] / b["cpu_step_mean_s"]
        r["busy_ratio_mean"] = r["cpu_slowdown_mean"] / r["adamw_slowdown_mean"]
        if "none_step_mean_s" in b:
            r["none_slowdown_mean"] = r["none_step_mean_s"] / b["none_step_mean_s"]
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'size':>6} {'nbrs':>4} {'adamw ms':>9} {'slowdown':>9} {'cpu tier ms':>12} {'slowdown':>9} "
        f"{'busy ratio':>11} {'opt.step ms':>12} {'d.update ms':>12} {'mean: adamw':>12} {'cpu tier':>9} "
        f"{'none':>6} {'ratio':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:

        def x(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]:.2f}x" if key in r else "-"

        upd = r.get("cpu_daemon_update_s")
        print(
            f"{r['size']:>6} {r['neighbours']:>4} {r['adamw_step_s'] * 1e3:>9.1f} {x('adamw_slowdown'):>9} "
            f"{r['cpu_step_s'] * 1e3:>12.1f} {x('cpu_slowdown'):>9} {x('busy_ratio'):>11} "
            f"{r['cpu_opt_step_s'] * 1e3:>12.1f} {('-' if upd is None else f'{upd * 1e3:.1f}'):>12} "
            f"{x('adamw_slowdown_mean'):>12} {x('cpu_slowdown_mean'):>9} {x('none_slowdown_mean'):>6} "
            f"{x('busy_ratio_mean'):>6}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16M,100M", help="target parameter counts, comma separated")
    ap.add_argument("--neighbours", default="0,1,2", help="neighbour process counts, comma separated (0 first)")
    ap.add_argument("--neighbour-threads", type=int, default=1, help="torch threads of each neighbour (1)")
    ap.add_argument(
        "--neighbour-kind",
        choices=("ops", "train"),
        default="ops",
        help="ops: a loop of torch ops (default); train: another training job (16M GPT, torch AdamW)",
    )
    ap.add_argument("--with-none", action="store_true", help="a third mode: forward and backward only, no optimizer")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per mode and setting")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--block-steps", type=int, default=3, help="steps per mode per turn")
    ap.add_argument("--model", choices=("gpt", "mlp"), default="gpt", help="the demo GPT (default) or an MLP")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    args.neighbours = [int(x) for x in args.neighbours.split(",")]
    if args.neighbours[0] != 0:
        ap.error("--neighbours must start with 0: the slowdowns are against the run with none")
    rows: list[dict[str, Any]] = []
    for name in args.sizes.split(","):
        cfg = GPTConfig.for_params(parse_count(name), block_size=args.seq)
        print(f"{name}: {args.model}", flush=True)
        rows += run_size(args, name, cfg)
        if args.json:
            write_json(args, rows)
    print()
    print_table(rows)
    if args.json:
        write_json(args, rows)
    return 0


def write_json(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    doc = {
        "benchmark": "bench_busy",
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
        "commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())

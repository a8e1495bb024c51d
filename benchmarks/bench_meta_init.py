"""A ZeRO-3 paged model made on the meta device against one built on the host: the trainer's peak memory.

``ShardedPagedAdam`` over a stack of ``--layers`` ``Linear(--width, --width)``
(fp32), one rank (gloo), state on the NVMe tier of a private daemon, pager
budget ``--budget``.  Each way runs in a process of its own (a fresh peak):

- ``host``: the model is built on the host, then the optimizer shards it
  (rank 0's values broadcast, each shard copied to the daemon);
- ``meta``: the model is made on the meta device; the optimizer
  materializes one submodule at a time, runs its ``reset_parameters()``,
  writes its shard to the daemon and releases it.

Figures: the trainer's peak RSS (``VmHWM``) over its RSS before the model
(``construction``), after one training step (``after a step``), and the
seconds the construction took.  The daemon is another process and is not
counted (its pool and swap are the same in both ways).  Goal: ``meta``'s
construction peak stays near the largest submodule plus the pager's budget,
not the model.

    .venv/bin/python benchmarks/bench_meta_init.py [--layers 8 --width 4096 --budget 160MiB] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

MIB = 1 << 20


def _kib(field: str) -> int:
    return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0])


def child(way: str, layers: int, width: int, budget: str, port: int) -> dict[str, float]:
    """One way, in this process: the peaks (MiB) and the construction's seconds."""
    import torch
    import torch.distributed as dist

    from tiermem.client.distributed import ShardedPagedAdam

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    before = _kib("VmHWM")
    t0 = time.perf_counter()
    if way == "meta":
        with torch.device("meta"):
            model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    else:
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    params = sum(p.numel() for p in model.parameters())
    opt = ShardedPagedAdam(model, device_budget=budget, offload="nvme", lr=1e-3)
    seconds = time.perf_counter() - t0
    built = _kib("VmHWM")
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    stepped = _kib("VmHWM")
    opt.close()
    dist.destroy_process_group()
    return {
        "params": params,
        "model_mib": params * 4 / MIB,
        "construction_mib": (built - before) / 1024,
        "after_step_mib": (stepped - before) / 1024,
        "seconds": seconds,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--budget", default="160MiB", help="the pager's device_budget")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--child", choices=["host", "meta"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.width, args.budget, args.port)))
        return 0
    rows = {}
    for way in ("host", "meta"):
        cmd = [sys.executable, __file__, "--child", way, "--layers", str(args.layers), "--width", str(args.width)]
        cmd += ["--budget", args.budget, "--port", str(_free_port())]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
        rows[way] = json.loads(done.stdout.strip().splitlines()[-1])
    params = rows["host"]["params"]
    print(f"ShardedPagedAdam, 1 rank, NVMe tier, budget {args.budget}: {args.layers} x Linear({args.width}, "
          f"{args.width}), {params / 1e6:.0f}M params ({rows['host']['model_mib']:.0f} MiB fp32)")  # fmt: skip
    head = f"{'way':<6} {'construction MiB':>17} {'x model':>8} {'after a step MiB':>17} {'seconds':>8}"
    print(head)
    print("-" * len(head))
    for way, r in rows.items():
        ratio = r["construction_mib"] / r["model_mib"]
        print(
            f"{way:<6} {r['construction_mib']:>17.0f} {ratio:>8.2f} {r['after_step_mib']:>17.0f} {r['seconds']:>8.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"layers": args.layers, "width": args.width, "budget": args.budget,
                                               "rows": rows}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

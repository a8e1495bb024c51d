"""One rank of ``stress_zero3_paged.py``: ZeRO-3 paged at its defaults, as a user first launches it.

A GPT of 4 layers of width 256 (the demo's ``GPT``, 3.2M params, 12 MiB as
fp32) trains ``--steps`` steps with ``ShardedPagedAdam`` at its defaults
(``prefetch=2``, NVMe offload through the node's private daemon) within a
``device_budget`` of 16 MiB, each rank on its own random tokens.  Rank 0
writes, as JSON, the losses and the steps' collectives.  The script ends as
a user's does: ``close()``, ``destroy_process_group()``, a normal exit.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from tiermem.client.demo.model import GPT, GPTConfig
from tiermem.client.distributed import ShardedPagedAdam


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=64))
    opt = ShardedPagedAdam(model, lr=3e-4, device_budget="16MiB")
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(args.steps):
        x = torch.randint(0, 256, (4, 64), generator=g)
        loss = model(x, torch.roll(x, -1, dims=1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    counts = dict(getattr(getattr(opt, "schedule", None), "last_counts", {}))  # absent before the schedule
    opt.close()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "collectives": counts}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One rank of ``soak_torchrun.py``: a ZeRO-2 training script written the way a torch user writes one.

An embedding MLP trained with ``ShardedOffloadAdam`` (weight decay, a global
clip) under a LambdaLR schedule; at ``--resume-at`` every rank saves the model,
its optimizer shard and the scheduler, closes the optimizer, and a new model
and optimizer (another job) load the files, the optimizer before the model.
The process then ends as a user's script does: ``close()``,
``destroy_process_group()`` and a normal interpreter exit (no ``os._exit``).
Rank 0 writes, as JSON, the largest difference of the final params from
``torch.optim.AdamW`` + ``clip_grad_norm_`` trained in one process on the
same global batches.

``--optimizer torch`` is the control without tiermem: the same script with
each rank all-reducing the grads itself (DDP's mean) into
``torch.optim.AdamW`` after ``clip_grad_norm_``, the same checkpoint, resume
and exit (its resumed run does not restore AdamW's state bit for bit, so its
params are not compared).
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.distributed as dist
from torch import nn

ROWS_PER_RANK = 8


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 32), nn.Flatten(), nn.Linear(32 * 8, 64), nn.GELU(), nn.Linear(64, 64))


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 64, (ROWS_PER_RANK * world, 8), generator=g)
    return x, torch.randint(0, 64, (ROWS_PER_RANK * world,), generator=g)


def schedule(step: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * min(step, 20) / 20))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--resume-at", type=int, default=10)
    ap.add_argument("--tier", default="cpu")
    ap.add_argument("--dir", required=True, help="checkpoints and the result go here")
    ap.add_argument("--optimizer", choices=["tiermem", "torch"], default="tiermem")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def optimizer(model: nn.Module, job_id: str | None = None) -> torch.optim.Optimizer:
        if args.optimizer == "torch":
            return _ReducingAdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        from tiermem.client.distributed import ShardedOffloadAdam  # the control never imports tiermem

        return ShardedOffloadAdam(
            model.parameters(), lr=3e-3, weight_decay=0.1, max_grad_norm=1.0, offload=args.tier, job_id=job_id
        )

    model = build()
    opt = optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ckpt = os.path.join(args.dir, f"ckpt.{rank}.pt")
    for step in range(args.steps):
        if step == args.resume_at:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, ckpt)
            opt.close()  # type: ignore[attr-defined]
            model = build()
            opt = optimizer(model, job_id=f"resumed-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
            # the scheduler is made before the loads, as torch needs: made after them, its first step() would
            # set the lr from the loaded initial_lr and the resumed step would run at schedule(0)'s lr
            sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
            saved = torch.load(ckpt)
            opt.load_state_dict(saved["opt"])  # before the model's: the order must not matter
            model.load_state_dict(saved["model"])
            sched.load_state_dict(saved["sched"])
        x, y = batch(step, world)
        mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    if rank == 0 and args.optimizer == "tiermem":
        ref = build()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, schedule)
        for step in range(args.steps):
            x, y = batch(step, world)
            nn.functional.cross_entropy(ref(x), y).backward()
            nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step()
        diff = max(
            float((a.detach() - b.detach()).abs().max())
            for a, b in zip(model.parameters(), ref.parameters(), strict=True)
        )
        with open(os.path.join(args.dir, "result.json"), "w") as f:
            json.dump({"param_diff": diff, "ranks": world, "tier": args.tier}, f)
    opt.close()  # type: ignore[attr-defined]
    dist.destroy_process_group()


class _ReducingAdamW(torch.optim.AdamW):
    """The control: DDP's mean of the grads, a global clip and AdamW, all in this process."""

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in params:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        nn.utils.clip_grad_norm_(params, 1.0)
        return super().step(closure)

    def close(self) -> None:
        pass


if __name__ == "__main__":
    main()

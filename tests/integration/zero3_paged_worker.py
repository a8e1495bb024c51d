"""One rank of ``test_zero3_paged.py`` under ``torchrun`` (gloo): ZeRO-3 with param paging.

A small MLP with odd sizes (so shards are padded) trains with
``ShardedPagedAdam`` (two param groups: no weight decay and half the learning
rate on the biases; clipping by the global norm, a StepLR schedule), each
rank on its slice of the global batch.  Rank 0 writes, as JSON: the model's
``state_dict()`` after the steps (gathered from the ranks' daemons), the same
model trained in one process with ``torch.optim.AdamW`` + ``clip_grad_norm_``
on the whole batch, both norms per step, what the modules held between
steps, the pager's peak against its budget, and the clipped norm of one more
step over two backward passes (gradient accumulation), with its reference.  ``--kill-step K``: the last rank dies by
SIGKILL after the forward of step K; the others write what they caught (a
``RankLost``, and where) to ``OUT.<rank>``.  ``--resume-at K``: before step K
every rank saves ``model.state_dict()`` and ``opt.state_dict()`` (torch.save),
closes its optimizer, builds the model again with other values and a new
optimizer (a new job), loads the optimizer's state and then the model's, and
trains on.  ``--scaler``: both sides train under a loss scaler
(``ShardedGradScaler`` here, torch's ``GradScaler`` in the reference);
``--inf-step K`` makes the last rank's loss inf at step K, so both skip it.
``--state-dtype``: the daemons keep the moments as bf16 or int8.  ``--meta``:
every rank makes the model on the meta device under a seed of its own; the
optimizer initializes it one submodule at a time with rank 0's generator, so
the run must end where the host-made one does.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from offload_helpers import scaled_step
from scenarios import end_run, join_group, leave, write_json
from torch import nn

from tiermem.client.distributed import ShardedGradScaler, ShardedPagedAdam
from tiermem.core.errors import InvalidState, RankLost

BATCH_PER_RANK = 3
LR = 0.02
MAX_NORM = 0.5
ACCUMULATED = (slice(0, 1), slice(1, 2))
"""The two backward passes of the last, accumulated step: each rank's are the same samples."""


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 11), nn.GELU(), nn.Linear(11, 3))


def groups(model: nn.Module) -> list[dict]:
    """The GPT recipe: no weight decay on biases (a group of its own, with its own learning rate too)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": LR / 2}]


def data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH_PER_RANK * world, 7, generator=g), torch.randn(BATCH_PER_RANK * world, 3, generator=g)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--offload", default="nvme")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--resume-at", type=int, default=-1)
    ap.add_argument("--scaler", action="store_true")
    ap.add_argument("--inf-step", type=int, default=-1)
    ap.add_argument("--state-dtype", default="fp32", help="how the daemon keeps the moments (fp32, bf16, int8)")
    ap.add_argument("--meta", action="store_true", help="each rank makes the model on the meta device, seeded apart")
    args = ap.parse_args(argv)
    rank, world, owned = join_group(outlive_a_killed_peer=args.kill_step >= 0)
    if args.meta:  # rank 0's generator initializes it on every rank: the values of make_model() on the host
        with torch.device("meta"):
            model = make_model(seed=1000 * rank)
    else:
        model = make_model()
    budget = 2 * 13 * 11 * 4 + 4096  # two of the largest layer's params, a little slack

    def optimizer(model: nn.Module, job_id: str | None = None) -> ShardedPagedAdam:
        return ShardedPagedAdam(
            model,
            param_groups=groups(model),
            lr=LR,
            weight_decay=0.01,
            offload=args.offload,
            max_grad_norm=MAX_NORM,
            device_budget=budget,
            prefetch=1,
            job_id=job_id,
            state_dtype=args.state_dtype,
        )

    opt = optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**12) if args.scaler else None
    norms, held = [], []
    try:
        for step in range(args.steps):
            if step == args.resume_at:
                saved = f"{args.out}.ckpt.{rank}"
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, saved)
                job = f"{opt.job_id}-resumed"
                opt.close()
                model = make_model(seed=7)
                opt = optimizer(model, job_id=job)
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
                ckpt = torch.load(saved)
                opt.load_state_dict(ckpt["opt"])  # the optimizer first: the order does not matter
                model.load_state_dict(ckpt["model"])
                sched.load_state_dict(ckpt["sched"])
            x, y = data(step, world)
            mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
            loss = nn.functional.mse_loss(model(x[mine]), y[mine])
            if step == args.kill_step and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.inf_step and rank == world - 1:
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler is not None else loss).backward()
            scaled_step(opt, scaler)
            opt.zero_grad()
            sched.step()
            norms.append(None if opt.last_found_inf else opt.last_grad_norm)
            held.append(max(p.untyped_storage().nbytes() for p in model.parameters()))
    except RankLost as exc:
        write_json(
            f"{args.out}.{rank}", {"rank": rank, "error": "RankLost", "during": exc.during, "at": time.monotonic()}
        )
        return 3
    state = {k: v.tolist() for k, v in model.state_dict().items()}  # a collective: every rank gathers
    peak = opt.pager.stats()["peak_nbytes"]
    accumulated: float | str | None = None
    x, y = data(99, world)
    for part in ACCUMULATED:
        nn.functional.mse_loss(model(x[part]), y[part]).backward()
    try:
        opt.step()
        accumulated = opt.last_grad_norm
    except InvalidState as exc:
        accumulated = str(exc)
    opt.zero_grad()
    everything: list = [None] * world
    dist.all_gather_object(everything, {"rank": rank, "held": held, "peak": peak, "accumulated": accumulated})
    if rank == 0:
        ref = make_model()
        ref_opt = torch.optim.AdamW(groups(ref), lr=LR, weight_decay=0.01)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
        ref_norms = []
        ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if args.scaler else None
        for step in range(args.steps):
            x, y = data(step, world)
            loss = nn.functional.mse_loss(ref(x), y)
            if step == args.inf_step:
                loss = loss * float("inf")
            if ref_scaler is not None:
                ref_scaler.scale(loss).backward()
                ref_scaler.unscale_(ref_opt)
            else:
                loss.backward()
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
            scaled_step(ref_opt, ref_scaler)
            ref_opt.zero_grad()
            ref_sched.step()
        x, y = data(99, world)
        for part in ACCUMULATED:  # every rank's two passes were these: the mean over ranks is their sum
            nn.functional.mse_loss(ref(x[part]), y[part]).backward()
        ref_accumulated = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        result = {
            "state": state,
            "reference": {k: v.tolist() for k, v in ref.state_dict().items()},
            "norms": norms,
            "reference_norms": ref_norms,
            "reference_accumulated": ref_accumulated,
            "budget": budget,
            "scale": scaler.get_scale() if scaler is not None else None,
            "ref_scale": ref_scaler.get_scale() if ref_scaler is not None else None,
            "skipped": opt.stats().client_skipped_steps,
            "ranks": everything,
        }
        write_json(args.out, result)
    return end_run(owned, opt)


if __name__ == "__main__":
    leave(main())

"""One rank of a ZeRO-2 training run, started by ``torchrun`` (gloo), and its single-process reference.

Every rank trains the same small MLP on its share of a global batch through
``ShardedOffloadAdam``; rank 0 also trains a copy with ``torch.optim.AdamW``
on the whole global batch (the loss is the mean of the ranks' local means, as
DDP averages), with the same clipping, ``GradScaler`` and LR schedule, and
writes both final models' largest difference (and its figures) as JSON.

An overflow is injected at ``--inf-step`` on the last rank: its local loss is
scaled by inf, so the global loss overflows too and both sides skip that step.
``--kill-step``: the last rank dies by SIGKILL inside that step, just before
its reduce-scatter; the others must get ``RankLost``.  ``--state-dtype``: the
daemon keeps the moments as bf16 or int8; every rank writes a hash of its
final params, so the test sees that the ranks end equal.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from offload_helpers import scaled_step
from scenarios import Warnings, end_run, join_group, leave, write_json

from tiermem.client.distributed import ShardedGradScaler, ShardedOffloadAdam
from tiermem.core.errors import RankLost, TiermemError

DIM, HIDDEN, BATCH = 24, 40, 16


class Net(torch.nn.Module):
    """An MLP and a layer the forward never uses: its params get no grad on any rank, so torch's AdamW
    neither steps them nor keeps state for them, and neither may the sharded optimizer (weight decay
    would shrink them)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh()
        )
        self.spare = torch.nn.Linear(5, 5)
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Net()


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH * world, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def local_losses(model: torch.nn.Module, step: int, world: int, inf_step: int) -> list[torch.Tensor]:
    x, y = batch(step, world)
    out = []
    for r in range(world):
        rows = slice(r * BATCH, (r + 1) * BATCH)
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        if step == inf_step and r == world - 1:
            loss = loss * float("inf")
        out.append(loss)
    return out


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> ShardedOffloadAdam:
    return ShardedOffloadAdam(
        model.parameters(),
        lr=2e-2,
        weight_decay=0.01,
        offload=args.tier,
        max_grad_norm=args.clip or None,
        bucket_nbytes=args.bucket_nbytes,
        job_id=args.job_id,
        token=args.token,
        overlap_comm=args.overlap,
        delayed_update=args.delayed >= 0,
        warmup_steps=max(args.delayed, 0),
        state_dtype=args.state_dtype,
    )


def refused_load(opt: ShardedOffloadAdam, rank: int) -> dict[str, Any]:
    """Every rank loads rank 0's rank file, which lacks the other ranks' stretches: what each rank raised, how
    long it took, and whether the state stayed as it was (the optimizer goes on training after)."""
    before = opt.full_state_dict()
    files = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(files, src=0)
    began = time.monotonic()
    try:
        opt.load_state_dict(files[0])
        raised: dict[str, Any] = {"error": None}
    except TiermemError as exc:
        raised = {"error": type(exc).__name__, "message": str(exc)}
    raised["seconds"] = time.monotonic() - began
    after = opt.full_state_dict()
    same = all(torch.equal(after["state"][i][k], v) for i, entry in before["state"].items() for k, v in entry.items())
    return {"refused_load": raised, "load_changed_nothing": same}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tier", default="cpu")
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--scaler", action="store_true")
    ap.add_argument("--inf-step", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--bucket-nbytes", type=int, default=4096)
    ap.add_argument("--job-id", default=None)
    ap.add_argument("--token", default=None)
    ap.add_argument("--reload", action="store_true")
    ap.add_argument("--overlap", action="store_true", help="overlap_comm=True")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (each 1/K of the loss)")
    ap.add_argument("--no-sync", action="store_true", help="all but the last micro-batch inside no_sync()")
    ap.add_argument("--late-close", type=float, default=0.0, help="ranks but 0 wait this long before close()")
    ap.add_argument("--delayed", type=int, default=-1, help="delayed_update=True after this many warmup steps")
    ap.add_argument("--state-dtype", default="fp32", help="how the daemon keeps the moments (fp32, bf16, int8)")
    ap.add_argument("--torch-clip", type=float, default=0.0, help="unscale_, then torch's clip_grad_norm_ to this")
    ap.add_argument("--ddp", action="store_true", help="the model wrapped in DistributedDataParallel (HF Trainer's)")
    ap.add_argument("--refused-load", action="store_true", help="every rank loads rank 0's file after training")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rank, world, owned = join_group(outlive_a_killed_peer=args.kill_step >= 0)
    warned = Warnings()
    logging.getLogger("tiermem").addHandler(warned)
    model = make_model(7)
    try:
        opt = make_optimizer(model, args)
    except TiermemError as exc:  # the start failed: on every rank, none hangs
        write_json(f"{args.out}.{rank}", {"rank": rank, "error": type(exc).__name__, "message": str(exc)})
        return 4
    sched = schedule(opt)
    net = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if args.ddp else None
    start = opt.steps  # a relaunch reattached to the job's state continues where it is
    for _ in range(start):
        sched.step()
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10) if args.scaler else None
    result: dict = {"rank": rank, "world": world, "job_id": opt.job_id, "started_at": start}
    try:
        for step in range(start, args.steps):
            for k in range(args.accumulate):  # K equal micro-batches of 1/K each: the same grads, exactly (K=2)
                if net is not None:  # DDP runs one forward a backward: this rank's batch alone
                    x, y = batch(step, world)
                    rows = slice(rank * BATCH, (rank + 1) * BATCH)
                    loss = torch.nn.functional.mse_loss(net(x[rows]), y[rows]) / args.accumulate
                else:
                    loss = local_losses(model, step, world, args.inf_step)[rank] / args.accumulate
                held = args.no_sync and k < args.accumulate - 1
                with opt.no_sync() if held else contextlib.nullcontext():
                    if scaler is not None:
                        scaler.scale(loss).backward()
                    else:
                        loss.backward()
            if step == args.kill_step and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.torch_clip:  # as HF Trainer, accelerate and Lightning clip: on the local grads
                if scaler is not None:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.torch_clip)
            scaled_step(opt, scaler)
            opt.zero_grad()
            sched.step()
    except RankLost as exc:
        result.update(error="RankLost", during=exc.during, message=str(exc), at=time.monotonic())
        write_json(f"{args.out}.{rank}", result)
        return 3
    if args.refused_load:
        result.update(refused_load(opt, rank))
    if args.delayed >= 0:
        opt.flush()  # every rank: the last update's params into the model
    result.update(
        warnings=list(warned.messages),
        steps=opt.steps,
        skipped=opt.skipped_steps,
        last_norm=opt.last_grad_norm,
        sharded_numel=sum(p.numel for p in opt.pieces),
        buckets=len(opt.layout.buckets),
        collectives=dict(opt.schedule.last_counts),  # the last step's, by kind
        socket=opt.inner.client.socket_path if opt.inner is not None else None,
        params_sha256=hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest(),
    )
    full = opt.full_state_dict()
    if args.reload:  # the shard and the full dict, each loaded into a new job's optimizer, give the same state
        shard = opt.state_dict()
        exact = []
        for saved in (shard, full):
            again = ShardedOffloadAdam(
                model.parameters(),
                lr=2e-2,
                weight_decay=0.01,
                offload=args.tier,
                bucket_nbytes=args.bucket_nbytes,
                broadcast_params=False,
                job_id=f"{opt.job_id}-reload",
                state_dtype=args.state_dtype,
            )
            again.load_state_dict(saved)
            back = again.full_state_dict()
            exact.append(
                back["state"].keys() == full["state"].keys()
                and all(
                    torch.equal(back["state"][i][k], full["state"][i][k])
                    for i in full["state"]
                    for k in full["state"][i]
                )
            )
            again.close()
        result["reload_exact"] = exact
    if rank == 0:
        ref = make_model(7)
        # --delayed: the DPU rule; the optimizer keeps a master copy of the model, installed into it one step late
        master = make_model(7) if args.delayed >= 0 else ref
        ref_opt = torch.optim.AdamW(master.parameters(), lr=2e-2, weight_decay=0.01)
        ref_sched = schedule(ref_opt)

        def install() -> None:
            with torch.no_grad():
                for p, q in zip(ref.parameters(), master.parameters(), strict=True):
                    p.copy_(q)

        ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if args.scaler else None
        skipped = 0
        for step in range(args.steps):
            loss = torch.stack(local_losses(ref, step, world, args.inf_step)).mean()
            (ref_scaler.scale(loss) if ref_scaler is not None else loss).backward()
            if master is not ref:
                for p, q in zip(ref.parameters(), master.parameters(), strict=True):
                    q.grad, p.grad = p.grad, None
                if step >= args.delayed:
                    install()  # the model gets update t-1 while update t runs
            if ref_scaler is not None:
                ref_scaler.unscale_(ref_opt)
            if args.clip or args.torch_clip:
                norm = float(torch.nn.utils.clip_grad_norm_(master.parameters(), args.clip or args.torch_clip))
                if args.clip:  # the optimizer's own clip, whose norm it reports
                    result["ref_norm"] = norm
            skipped += scaled_step(ref_opt, ref_scaler)
            if master is not ref and step < args.delayed:
                install()  # a warmup step: synchronous
            ref_opt.zero_grad()
            ref_sched.step()
        if master is not ref:
            install()  # flush()
        result["param_diff"] = max(
            float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref.parameters(), strict=True)
        )
        ref_state = ref_opt.state_dict()["state"]
        result["state_diff"] = max(
            float((full["state"][i][k] - ref_state[i][k]).abs().max())
            for i in ref_state
            for k in ("exp_avg", "exp_avg_sq")
        )
        result["same_params_with_state"] = sorted(full["state"]) == sorted(ref_state)
        result["step_equal"] = all(float(full["state"][i]["step"]) == float(ref_state[i]["step"]) for i in ref_state)
        result["ref_skipped"] = skipped
        result["scale"] = scaler.get_scale() if scaler is not None else None
        result["ref_scale"] = ref_scaler.get_scale() if ref_scaler is not None else None
        moved = max(
            float((p - q).abs().max()) for p, q in zip(model.parameters(), make_model(7).parameters(), strict=True)
        )
        result["moved"] = moved
    write_json(f"{args.out}.{rank}", result)
    if args.late_close and rank != 0:
        time.sleep(args.late_close)
    warned.messages.clear()
    t0 = time.monotonic()
    opt.close()
    logging.getLogger("tiermem").removeHandler(warned)  # the next scenario of the launch has its own
    closed = {"close_s": time.monotonic() - t0, "warnings": warned.messages}
    write_json(f"{args.out}.{rank}.close", closed)
    return end_run(owned)


if __name__ == "__main__":
    leave(main())

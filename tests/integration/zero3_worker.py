"""ZeRO's four-layer scalar example under ``torchrun --nproc-per-node 4`` (gloo): ZeRO-3 by layer.

The model: ``h1 = relu(w1 x + b1)``, ``h2 = relu(w2 h1 + b2)``, ``h3 = relu(w3 h2 + b3)``,
``y = w4 h3 + b4``, loss ``L = (y - x)^2 / 2``, each layer owned by one rank
(``LayerShardedAdam``), each rank training on a quarter of the mini-batch.
Rank 0 writes, as JSON: the reduced grads of the first step next to the
example's analytic formulas (on the global batch), the final params next to
``torch.optim.AdamW`` in one process, and every rank's event trace, its
``model.state_dict()`` and the params after a ``model.load_state_dict()`` of
that plus one.
With ``--scaler`` both sides train under a loss scaler (``ShardedGradScaler``
here, torch's ``GradScaler`` in the reference); ``--inf-step`` makes the last
rank's loss inf at that step, so the global loss overflows and both skip it.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from offload_helpers import scaled_step
from scenarios import end_run, join_group, leave, write_json
from torch.utils.checkpoint import checkpoint_sequential

from tiermem.client.distributed import LayerShardedAdam, ShardedGradScaler
from tiermem.core.errors import InvalidState

BATCH_PER_RANK = 2
LR = 0.05


def make_model() -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for i in range(4):
        linear = torch.nn.Linear(1, 1)
        with torch.no_grad():
            linear.weight.fill_(0.6 + 0.1 * i)
            linear.bias.fill_(0.1 * (i + 1))
        layers.append(linear)
        if i < 3:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def data(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + step)
    return 0.5 + torch.rand(BATCH_PER_RANK * world, 1, generator=g)


def schedule(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def loss_of(model: torch.nn.Module, x: torch.Tensor, checkpoint: str = "") -> torch.Tensor:
    """``checkpoint`` (``reentrant``, ``non-reentrant``): activation checkpointing, the layers in 3 segments
    (``checkpoint_sequential``: the first two recomputed in backward, the last run plainly)."""
    if checkpoint:  # the reentrant kind gives a segment grads only where its input needs one (torch's rule)
        x_in = x.detach().requires_grad_() if checkpoint == "reentrant" else x
        y = checkpoint_sequential(model, 3, x_in, use_reentrant=checkpoint == "reentrant")
    else:
        y = model(x)
    return (0.5 * (y - x) ** 2).mean()


def analytic_grads(params: list[float], x: torch.Tensor) -> list[float]:
    """The example's formulas, per sample, averaged over the batch: [dw1, db1, ..., dw4, db4]."""
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    total = [0.0] * 8
    for xi in x.reshape(-1).double().tolist():
        h1 = max(w1 * xi + b1, 0.0)
        h2 = max(w2 * h1 + b2, 0.0)
        h3 = max(w3 * h2 + b3, 0.0)
        y = w4 * h3 + b4
        dy = y - xi
        dh3 = dy * w4
        g3 = dh3 * (h3 > 0)
        dh2 = g3 * w3
        g2 = dh2 * (h2 > 0)
        dh1 = g2 * w2
        g1 = dh1 * (h1 > 0)
        grads = [g1 * xi, g1, g2 * h1, g2, g3 * h2, g3, dy * h3, dy]
        total = [t + g for t, g in zip(total, grads, strict=True)]
    return [t / x.shape[0] for t in total]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--paged", action="store_true", help="the owners' layers only in their daemon's tier")
    ap.add_argument("--offload", default="cpu")
    ap.add_argument("--micro", type=int, default=1, help="backward passes per step (gradient accumulation)")
    ap.add_argument("--clip", type=float, default=0.0, help="max_grad_norm (with --paged)")
    ap.add_argument("--scaler", choices=["", "sharded", "torch"], default="", help="train under a loss scaler")
    ap.add_argument("--inf-step", type=int, default=-1, help="the last rank's loss is inf at this step")
    ap.add_argument("--schedule", action="store_true", help="an LR schedule on both sides (LambdaLR)")
    ap.add_argument("--checkpoint", choices=["", "reentrant", "non-reentrant"], default="", help="on our side")
    args = ap.parse_args(argv)
    rank, world, owned = join_group()
    model = make_model()
    opt = LayerShardedAdam(
        model,
        lr=LR,
        weight_decay=0.0,
        trace=True,
        paged=args.paged,
        offload=args.offload,
        max_grad_norm=args.clip or None,
    )
    scaler: torch.amp.GradScaler | None = None
    if args.scaler == "sharded":
        scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
    elif args.scaler == "torch":  # the wrong one: it cannot see the grads, which are in the owners' daemons
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if args.schedule else None
    norms: list[float | None] = []
    first_grads: dict[int, list[float]] = {}
    start_params = [float(p) for p in opt.gathered_params()]
    traces = []
    for step in range(args.steps):
        x = data(step, world)[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
        assert opt.events is not None
        opt.events.clear()
        for part in x.chunk(args.micro):  # equal parts: the mean of their mean losses is the batch's
            loss = loss_of(model, part, args.checkpoint) / args.micro
            if step == args.inf_step and rank == world - 1:
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler is not None else loss).backward()
        try:
            if scaler is not None:
                scaler.step(opt)  # type: ignore[arg-type]
                scaler.update()
            else:
                opt.step()
        except InvalidState as exc:  # refused on every rank together (clipping after accumulation, ...)
            with open(f"{args.out}.refused.{rank}", "w") as f:
                f.write(str(exc))
            return end_run(owned, opt)
        norms.append(None if opt.last_found_inf else opt.last_grad_norm)
        opt.zero_grad()
        if sched is not None:
            sched.step()
        traces.append(list(opt.events))
        if step == 0:
            first_grads = {i: g.tolist() for i, g in opt.reduced.items()}
    final = [float(p) for p in opt.gathered_params()]
    saved = [float(v) for v in model.state_dict().values()]  # collective: every layer from its owner
    model.load_state_dict({k: v + 1.0 for k, v in model.state_dict().items()})  # each owner keeps its layers'
    loaded = [float(p) for p in opt.gathered_params()]
    placeholders = [p.numel() for p in model.parameters()]
    pieces = [p.untyped_storage().nbytes() for ps in opt.strategy._pieces.values() for p in ps]
    report = opt.inner.stats().rank if opt.inner is not None else None
    nvme = (
        {}
        if report is None
        else {"placement": report.placement.value if report.placement else "", "nbytes": report.nvme_state_nbytes}
    )
    everything: list = [None] * world
    mine = {"rank": rank, "grads": first_grads, "traces": traces, "held": placeholders, "pieces": pieces}
    mine |= {"final": final, "saved": saved, "loaded": loaded}
    dist.all_gather_object(everything, {**mine, "nvme": nvme})
    if rank == 0:
        ref = make_model()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
        ref_norms = []
        ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler is not None else None
        ref_skipped = 0
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, schedule) if args.schedule else None
        for step in range(args.steps):
            loss = loss_of(ref, data(step, world))
            if step == args.inf_step:
                loss = loss * float("inf")
            (ref_scaler.scale(loss) if ref_scaler is not None else loss).backward()
            if ref_scaler is not None:
                ref_scaler.unscale_(ref_opt)
            if args.clip:
                ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), args.clip)))
            ref_skipped += scaled_step(ref_opt, ref_scaler)
            ref_opt.zero_grad()
            if ref_sched is not None:
                ref_sched.step()
        grads: dict[int, list[float]] = {}
        for r in everything:
            grads.update({int(k): v for k, v in r["grads"].items()})
        ours = [g for unit in range(4) for g in grads[unit]]
        result = {
            "analytic": analytic_grads(start_params, data(0, world)),
            "reduced": ours,
            "final": final,
            "reference": [float(p) for p in ref.parameters()],
            "norms": norms,
            "ref_norms": ref_norms,
            "scale": scaler.get_scale() if scaler is not None else None,
            "ref_scale": ref_scaler.get_scale() if ref_scaler is not None else None,
            "skipped": opt.skipped_steps,
            "ref_skipped": ref_skipped,
            "ranks": everything,
        }
        write_json(args.out, result)
    return end_run(owned, opt)


if __name__ == "__main__":
    leave(main())

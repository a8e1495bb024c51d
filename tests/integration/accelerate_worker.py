"""One rank of an ``accelerate`` training loop with ``ShardedOffloadAdam`` at several ranks (``torchrun``, gloo,
the CPU), a scenario of ``test_zero2.py``'s two-rank launch; ``--optimizer paged``: with ``ShardedPagedAdam``
(ZeRO-3), which clips itself (``accelerator.clip_grad_norm_`` would find no grads) and whose model is gathered
by its state dict on every rank.

``Accelerator.prepare`` wraps the model in DDP; the loop clips with ``accelerator.clip_grad_norm_`` (the mean's
norm, as DDP's grads are).  ``accelerator.save_state`` writes ``optimizer.state_dict()`` from the main process
alone: after ``consolidate_state_dict(0)`` on every rank that is the whole state.  The run trains ``STEPS``,
saves, trains ``STEPS`` more; new objects made from other values ``load_state`` the save and train the same
``STEPS``.  Rank 0 writes both runs' final params to ``OUT.pt``; every rank writes the warnings it logged and the
resumed optimizer's step count to ``OUT.<rank>``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import accelerate
import torch
from scenarios import Warnings, end_run, join_group, write_json

from tiermem.client.distributed import ShardedOffloadAdam, ShardedPagedAdam

STEPS = 3
DIM = 12


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True).cos()


CLIP = 0.05


def prepared(seed: int, optimizer: str) -> tuple[Any, Any, Any]:
    accelerator = accelerate.Accelerator(cpu=True)
    model = make_model(seed)
    if optimizer == "paged":
        opt: Any = ShardedPagedAdam(
            model, lr=2e-2, weight_decay=0.01, offload="cpu", device_budget="1MiB", max_grad_norm=CLIP
        )
    else:
        opt = ShardedOffloadAdam(model.parameters(), lr=2e-2, weight_decay=0.01)
    net, wrapped = accelerator.prepare(model, opt)
    return accelerator, net, wrapped


def train(accelerator: Any, net: Any, opt: Any, steps: range, rank: int) -> None:
    for step in steps:
        x, y = batch(step, rank)
        accelerator.backward(torch.nn.functional.mse_loss(net(x), y))
        if not isinstance(opt.optimizer, ShardedPagedAdam):
            accelerator.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad()


def flat(accelerator: Any, net: Any) -> torch.Tensor:
    """The model's values (a ZeRO-3 model's state dict gathers them: every rank calls this)."""
    return torch.cat([v.reshape(-1).clone() for v in accelerator.unwrap_model(net).state_dict().values()])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizer", choices=["zero2", "paged"], default="zero2")
    args = ap.parse_args(argv)
    rank, _, owned = join_group()
    warned = Warnings()
    logging.getLogger("tiermem").addHandler(warned)
    saved = Path(f"{args.out}-state")
    accelerator, net, opt = prepared(0, args.optimizer)
    train(accelerator, net, opt, range(STEPS), rank)
    opt.optimizer.consolidate_state_dict(0)  # every rank: the main process's state_dict() is then the whole state
    accelerator.save_state(str(saved))
    train(accelerator, net, opt, range(STEPS, 2 * STEPS), rank)
    uninterrupted = flat(accelerator, net)
    opt.optimizer.close()
    accelerator, net, opt = prepared(5, args.optimizer)
    accelerator.load_state(str(saved))
    train(accelerator, net, opt, range(STEPS, 2 * STEPS), rank)
    resumed = flat(accelerator, net)
    if rank == 0:
        torch.save({"uninterrupted": uninterrupted, "resumed": resumed}, f"{args.out}.pt")
    logging.getLogger("tiermem").removeHandler(warned)
    write_json(f"{args.out}.{rank}", {"warnings": warned.messages, "steps": opt.optimizer.steps})
    return end_run(owned, opt.optimizer)

"""One rank of an ``accelerate`` training loop with ``ShardedOffloadAdam`` at several ranks (``torchrun``, gloo,
the CPU), a scenario of ``test_zero2.py``'s two-rank launch.

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

from tiermem.client.distributed import ShardedOffloadAdam

STEPS = 3
DIM = 12


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True).cos()


def prepared(seed: int) -> tuple[Any, Any, Any]:
    accelerator = accelerate.Accelerator(cpu=True)
    model = make_model(seed)
    opt = ShardedOffloadAdam(model.parameters(), lr=2e-2, weight_decay=0.01)
    net, wrapped = accelerator.prepare(model, opt)
    return accelerator, net, wrapped


def train(accelerator: Any, net: Any, opt: Any, steps: range, rank: int) -> None:
    for step in steps:
        x, y = batch(step, rank)
        accelerator.backward(torch.nn.functional.mse_loss(net(x), y))
        accelerator.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
        opt.zero_grad()


def flat(net: Any) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rank, _, owned = join_group()
    warned = Warnings()
    logging.getLogger("tiermem").addHandler(warned)
    saved = Path(f"{args.out}-state")
    accelerator, net, opt = prepared(0)
    train(accelerator, net, opt, range(STEPS), rank)
    opt.optimizer.consolidate_state_dict(0)  # every rank: the main process's state_dict() is then the whole state
    accelerator.save_state(str(saved))
    train(accelerator, net, opt, range(STEPS, 2 * STEPS), rank)
    uninterrupted = flat(net)
    opt.optimizer.close()
    accelerator, net, opt = prepared(5)
    accelerator.load_state(str(saved))
    train(accelerator, net, opt, range(STEPS, 2 * STEPS), rank)
    if rank == 0:
        torch.save({"uninterrupted": uninterrupted, "resumed": flat(net)}, f"{args.out}.pt")
    logging.getLogger("tiermem").removeHandler(warned)
    write_json(f"{args.out}.{rank}", {"warnings": warned.messages, "steps": opt.optimizer.steps})
    return end_run(owned, opt.optimizer)

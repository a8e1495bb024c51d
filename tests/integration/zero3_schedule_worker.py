"""One rank of ``test_zero3_schedule.py`` under ``torchrun`` (gloo): ZeRO-3 under fuzzed timing.

Each run of ``--runs`` (a JSON list of ``{"kind", "prefetch", "budget", "seed"}``) makes a small MLP with
odd sizes (padded shards, a ``LayerNorm``), an optimizer of ``kind`` (``paged``: ``ShardedPagedAdam``
with that ``prefetch`` and ``budget``, ``one`` submodule's params, ``three`` or the ``whole`` model's;
``layers`` / ``layers-paged``: ``LayerShardedAdam``), whose ``probe`` sleeps a random time (seeded by
the run and the rank, so the ranks' delays differ) at each point it is told of: the pager's I/O thread,
the grad hooks, the fetches and the collectives.  It trains ``STEPS`` steps on this rank's slice of the
global batch, then gathers the params.  A ``RankLost`` (a collective waited past ``--timeout-s``) ends
that run only: the next one gets a new group.  Rank 0 writes, as JSON, per run: the largest difference
from ``torch.optim.AdamW`` on the global batch, each rank's error, the seconds it took, and each rank's
collectives per step by kind (``schedule.last_counts``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch
import torch.distributed as dist
from scenarios import end_run, join_group, leave, write_json
from torch import nn

from tiermem.client.distributed import LayerShardedAdam, ShardedPagedAdam
from tiermem.core.errors import RankLost

BATCH_PER_RANK = 2
STEPS = 3
LR = 0.02


def make_model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(7, 13), nn.LayerNorm(13), nn.GELU(), nn.Linear(13, 11), nn.GELU(), nn.Linear(11, 9), nn.Tanh(),
        nn.Linear(9, 3),
    )  # fmt: skip


def budget(model: nn.Module, name: str) -> int:
    """``one``: the largest submodule's params (the least a pager takes), ``three``: three times that,
    ``whole``: every param."""
    largest = max(sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in model.modules())
    return {"one": largest, "three": 3 * largest, "whole": sum(p.numel() * 4 for p in model.parameters())}[name]


def data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(BATCH_PER_RANK * world, 7, generator=g), torch.randn(BATCH_PER_RANK * world, 3, generator=g)


class RandomDelays:
    """The probe: at each point, with probability ``chance``, a sleep of up to ``longest_s``."""

    def __init__(self, seed: int, *, chance: float = 0.5, longest_s: float = 0.004) -> None:
        self.random = random.Random(seed)
        self.chance = chance
        self.longest_s = longest_s
        self.points = 0

    def at(self, point: str, what: str) -> None:
        self.points += 1
        if self.random.random() < self.chance:
            time.sleep(self.random.uniform(0.0, self.longest_s))


def optimizer(run: dict[str, Any], model: nn.Module, probe: RandomDelays, timeout_s: float) -> Any:
    job = f"fuzz-{run['kind']}-{run['seed']}"  # a job of its own: a failed run's state waits for a relaunch
    common: dict[str, Any] = {
        "lr": LR, "weight_decay": 0.01, "collective_timeout_s": timeout_s, "probe": probe, "job_id": job,
    }  # fmt: skip
    if run["kind"] == "paged":
        return ShardedPagedAdam(
            model, offload="cpu", device_budget=budget(model, run["budget"]), prefetch=run["prefetch"], **common
        )
    return LayerShardedAdam(model, offload="cpu", paged=run["kind"] == "layers-paged", **common)


def values(model: nn.Module, opt: Any) -> list[torch.Tensor]:
    """The params after training (a collective: every rank gathers)."""
    if isinstance(opt, LayerShardedAdam):
        return opt.gathered_params()
    return list(model.state_dict().values())


def reference(world: int) -> list[torch.Tensor]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step in range(STEPS):
        x, y = data(step, world)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def train(run: dict[str, Any], rank: int, world: int, timeout_s: float) -> dict[str, Any]:
    """One run on this rank: what it found (its error, if any)."""
    model = make_model()
    probe = RandomDelays(1000 * run["seed"] + rank)
    opt = optimizer(run, model, probe, timeout_s)
    counts: list[dict[str, int]] = []
    mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    try:
        for step in range(STEPS):
            x, y = data(step, world)
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            opt.step()
            opt.zero_grad()
            counts.append(dict(opt.schedule.last_counts))
        got = values(model, opt)
    except RankLost as exc:
        return {"error": str(exc), "counts": counts}
    finally:
        opt.close()
    worst = max(float((a - b).abs().max()) for a, b in zip(got, reference(world), strict=True))
    return {"error": None, "worst": worst, "counts": counts, "points": probe.points}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", required=True, help="a JSON list of runs")
    ap.add_argument("--timeout-s", type=float, default=10.0)
    args = ap.parse_args(argv)
    rank, world, owned = join_group()
    results = []
    for run in json.loads(args.runs):
        started = time.monotonic()
        found = train(run, rank, world, args.timeout_s)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, found)
        results.append({**run, "ranks": everyone, "seconds": time.monotonic() - started})
    if rank == 0:
        write_json(args.out, results)
    return end_run(owned)


if __name__ == "__main__":
    leave(main())

"""One rank of the ZeRO-3 resharding scenarios of ``test_zero3_paged.py`` under ``torchrun`` (gloo): a checkpoint
saved at one world size resumes at another.

Both ZeRO-3 optimizers (``KINDS``: ``ShardedPagedAdam`` with two param
groups, ``LayerShardedAdam`` with one) train a small MLP with odd sizes (padded
shards) and a persistent buffer that the loss uses, on a global batch of
``GLOBAL_BATCH`` samples split over the ranks, so a run is the same at any
world size that divides it and equals ``reference()``: ``torch.optim.AdamW``
on the whole batch in one process.

``--save`` (N ranks): ``SAVED_AT`` steps, then every rank writes its rank
file to ``DIR/<kind>/`` (``save_shard``; ``DIR`` is ``saved_in(OUT)``), and
rank 0 writes the whole state to ``DIR/<kind>-full.pt`` as PyTorch Lightning
saves a sharded optimizer (``consolidate_state_dict(0)`` on every rank, then
rank 0's ``state_dict()``, checked equal to ``full_state_dict()``) and the
model's values to ``DIR/<kind>-model.pt``.

``--save-ranks K``: only the first K ranks save, as a process group of their
own (a save at K ranks inside a launch of more).

With ``torch.distributed.checkpoint`` (``DCP_KINDS``: ZeRO-2 too), ``--save``
also trains each kind ``SAVED_AT`` steps and saves model and optimizer the
way FSDP2's users do (``get_state_dict``, ``dcp.save`` into
``DIR/<kind>-dcp``), and ``--load`` resumes each (``<kind>-dcp``): a model of
other values and an optimizer with another learning rate, ``get_state_dict``
of them as the template, ``dcp.load`` into it, ``set_state_dict``.

``--load DIR`` (M ranks): per kind, two resumes of that save, each into a
model of other values and an optimizer made with another learning rate (the
load must restore both) and trained ``MORE`` steps: ``shards`` from the rank
files (``load_shards``: params, buffer and state), ``full`` from the full dicts
(``model.load_state_dict`` then the optimizer, ``opt.load_state_dict``).
Rank 0 writes ``{"<kind>-<how>": {key: values}}`` as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from scenarios import end_run, join_group, leave
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tiermem.client.distributed import LayerShardedAdam, ShardedOffloadAdam, ShardedPagedAdam

KINDS = ("paged", "layers")
DCP_KINDS = ("paged", "layers", "zero2")
Sharded = ShardedPagedAdam | LayerShardedAdam | ShardedOffloadAdam
GLOBAL_BATCH = 12
SAVED_AT = 3
MORE = 2
LR = 0.02


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 11), nn.GELU(), nn.Linear(11, 3))
    model.register_buffer("shift", torch.linspace(-1.0, 1.0, 3) * (seed + 1))
    return model


def groups(kind: str, model: nn.Module) -> list[dict]:
    """The paged one: no weight decay and half the learning rate on the biases; the layers one: one group."""
    if kind == "layers":
        return [{"params": list(model.parameters())}]
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": LR / 2}]


def make_optimizer(kind: str, model: nn.Module, lr: float = LR, **kwargs: Any) -> Sharded:
    """``zero2``: ``ShardedOffloadAdam`` with the paged one's two groups."""
    if kind == "layers":
        return LayerShardedAdam(model, lr=lr, weight_decay=0.01, **kwargs)
    gs = groups(kind, model)
    gs[1]["lr"] = lr / 2
    if kind == "zero2":
        return ShardedOffloadAdam(gs, lr=lr, weight_decay=0.01, offload="cpu", **kwargs)
    return ShardedPagedAdam(
        model, param_groups=gs, lr=lr, weight_decay=0.01, offload="cpu", device_budget=4096, prefetch=1, **kwargs
    )


def saved_in(out: str | Path) -> Path:
    """Where ``--save`` with ``--out OUT`` writes."""
    return Path(out).parent / "ckpt"


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x) + model.shift, y)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int = 0, world: int = 1) -> None:
    per = GLOBAL_BATCH // world
    for step in steps:
        x, y = batch(step)
        loss_of(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()


def values(model: nn.Module, opt: Sharded) -> dict[str, torch.Tensor]:
    """Collective: the model's values (``LayerShardedAdam``'s modules hold placeholders: gathered from the owners)."""
    if not isinstance(opt, LayerShardedAdam):
        return dict(model.state_dict())
    gathered = opt.gathered_params()
    return {**dict(zip((n for n, _ in model.named_parameters()), gathered, strict=True)), "shift": model.shift.clone()}


def reference(kind: str, steps: int) -> tuple[dict[str, torch.Tensor], torch.optim.AdamW]:
    """``torch.optim.AdamW`` on the whole batch in one process, after ``steps`` steps."""
    model = make_model()
    opt = torch.optim.AdamW(groups(kind, model), lr=LR, weight_decay=0.01)
    train(model, opt, range(steps))
    return dict(model.state_dict()), opt


def save(kind: str, folder: Path, group: Any) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model = make_model()
    opt = make_optimizer(kind, model, process_group=group)
    train(model, opt, range(SAVED_AT), rank, world)
    opt.save_shard(folder / kind)
    full = opt.full_state_dict()
    # PyTorch Lightning's and Fabric's save (ZeroRedundancyOptimizer's protocol): every rank consolidates, then
    # rank 0 alone writes state_dict(), which must be the whole state: that file is what the ``full`` resumes load
    opt.consolidate_state_dict(0)
    consolidated = opt.state_dict() if rank == 0 else None
    saved = values(model, opt)
    if rank == 0:
        assert consolidated is not None and consolidated.keys() == full.keys() == {"state", "param_groups"}
        assert consolidated["param_groups"] == full["param_groups"]
        assert consolidated["state"].keys() == full["state"].keys()
        for i, entry in full["state"].items():
            assert entry.keys() == consolidated["state"][i].keys() and all(
                torch.equal(entry[k], consolidated["state"][i][k]) for k in entry
            ), f"param {i}: the consolidated state differs from full_state_dict()'s"
        torch.save(consolidated, folder / f"{kind}-full.pt")
        torch.save(saved, folder / f"{kind}-model.pt")
    opt.close()


def save_dcp(kind: str, folder: Path, group: Any) -> None:
    """``SAVED_AT`` steps, then model and optimizer through ``torch.distributed.checkpoint``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model = make_model()
    opt = make_optimizer(kind, model, process_group=group)
    train(model, opt, range(SAVED_AT), rank, world)
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder / f"{kind}-dcp", process_group=group)
    opt.close()


def resume_dcp(kind: str, folder: Path) -> dict[str, list]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=7)
    opt = make_optimizer(kind, model, lr=0.5)
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=folder / f"{kind}-dcp")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(model, opt, range(SAVED_AT, SAVED_AT + MORE), rank, world)
    final = values(model, opt)
    opt.close()
    return {k: v.tolist() for k, v in final.items()}


def resume(kind: str, how: str, folder: Path) -> dict[str, list]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=7)
    if how == "full":  # before the optimizer: LayerShardedAdam takes the model's values when made
        model.load_state_dict(torch.load(folder / f"{kind}-model.pt"))
    opt = make_optimizer(kind, model, lr=0.5)
    if how == "shards":
        opt.load_shards(folder / kind)
    else:
        opt.load_state_dict(torch.load(folder / f"{kind}-full.pt"))
    train(model, opt, range(SAVED_AT, SAVED_AT + MORE), rank, world)
    final = values(model, opt)
    opt.close()
    return {k: v.tolist() for k, v in final.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--save", action="store_true", help="train SAVED_AT steps and save (into saved_in(OUT))")
    ap.add_argument("--save-ranks", type=int, default=0, help="save with the first N ranks only (a subgroup)")
    ap.add_argument("--load", help="resume from the save in this directory and train MORE steps")
    args = ap.parse_args(argv)
    _, _, owned = join_group()
    group = dist.new_group(list(range(args.save_ranks))) if args.save_ranks else None  # every rank makes it
    if args.save and (group is None or dist.get_rank() < args.save_ranks):
        for kind in KINDS:
            save(kind, saved_in(args.out), group)
        for kind in DCP_KINDS:
            save_dcp(kind, saved_in(args.out), group)
    dist.barrier()
    results = {}
    if args.load:
        results = {f"{kind}-{how}": resume(kind, how, Path(args.load)) for kind in KINDS for how in ("shards", "full")}
        results.update({f"{kind}-dcp": resume_dcp(kind, Path(args.load)) for kind in DCP_KINDS})
    dist.barrier()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    return end_run(owned)


if __name__ == "__main__":
    leave(main())

"""``tiermem consolidate``: a ZeRO-3 checkpoint's rank files merged offline into one model state dict and one
``torch.optim.AdamW`` state dict (what DeepSpeed's ``zero_to_fp32`` does for its checkpoints).

Reads the files that ``save_shard(directory)`` of ``ShardedPagedAdam`` and
``LayerShardedAdam`` writes (the format: ``tiermem.client.distributed.reshard``),
checks that they are one complete save, and writes the outputs asked for,
each under a temporary name then renamed.  Needs no daemon, no process
group and no GPU.

Exit codes: 0 written; 1 the checkpoint is incomplete or inconsistent, or an
output cannot be written (the message names the file and what is wrong);
2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from tiermem.client.subcommand import Subparsers, add_command
from tiermem.core.errors import TiermemError

__all__ = ["add_parser", "run_consolidate"]

DESCRIPTION = """\
Merges the rank files of a ZeRO-3 checkpoint (ShardedPagedAdam or LayerShardedAdam,
opt.save_shard(directory) on every rank) into one model state dict, which
model.load_state_dict() takes, and one optimizer state dict in torch.optim.AdamW's
format (state keyed by the param's index in model.parameters()), which torch.optim.AdamW
and tiermem's optimizers load at any world size. Every rank's file must be there and
all must come from one save; a missing or mismatched file is named.

example: tiermem consolidate ckpt/step-1000 --model model.pt --optimizer optim.pt
"""


def add_parser(sub: Subparsers) -> None:
    help_line = "merge a ZeRO-3 checkpoint's rank files into one model and one torch.optim.AdamW state dict"
    p = add_command(sub, "consolidate", help=help_line, description=DESCRIPTION, run=run_consolidate)
    p.add_argument(
        "source",
        nargs="+",
        metavar="SOURCE",
        help="the checkpoint directory (every zero3-rank*-of-*.pt in it), or its rank files",
    )
    p.add_argument("--model", metavar="PATH", help="write the model's state dict (torch's keys) here")
    p.add_argument("--optimizer", metavar="PATH", help="write the optimizer state in torch.optim.AdamW's format here")
    p.add_argument(
        "--fp32",
        action="store_true",
        help="the model's values in fp32 (the optimizer's masters) instead of the model's dtype",
    )


def run_consolidate(args: argparse.Namespace) -> int:
    if not args.model and not args.optimizer:
        args.parser.error("nothing to write: give --model PATH, --optimizer PATH or both")
    from tiermem.client.distributed.reshard import adamw_state_dict, model_state_dict, open_shards

    try:
        shards = open_shards(args.source[0] if len(args.source) == 1 else args.source)
        shards.require_complete()
        written = []
        if args.model:
            _write(model_state_dict(shards, fp32=args.fp32), Path(args.model))
            written.append(args.model)
        if args.optimizer:
            _write(adamw_state_dict(shards), Path(args.optimizer))
            written.append(args.optimizer)
    except (TiermemError, OSError) as exc:
        print(f"tiermem consolidate: error: {exc}", file=sys.stderr)
        return 1
    numel = sum(info.numel for info in shards.params)
    at = "" if shards.steps is None else f" at step {shards.steps}"
    print(
        f"{shards.world_size} rank file(s) of a {shards.optimizer} save{at}: {len(shards.params)} params, "
        f"{numel} elements -> {', '.join(written)}"
    )
    return 0


def _write(obj: Any, path: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

"""Hugging Face ``Trainer``'s checkpoints of a sharded optimizer: ``WholeOptimizerState``.

Outside DeepSpeed and FSDP, ``Trainer`` saves an optimizer as
``torch.save(optimizer.state_dict(), "checkpoint-<step>/optimizer.pt")`` on
the process that saves (global rank 0) alone, and a resume loads that file
into the optimizer on every rank.  A sharded optimizer's ``state_dict()`` is
its rank's file, so that ``optimizer.pt`` holds rank 0's share alone and the
other ranks' resume is refused, naming the missing files.

``WholeOptimizerState`` is a ``TrainerCallback``: in ``on_save``, which
``Trainer`` calls on every process once a checkpoint is written, every rank
gathers the whole state (``consolidate_state_dict``, a collective) and the
saving process writes it over ``optimizer.pt``, atomically.  That file is
``torch.optim.AdamW``'s format, which ``Trainer``'s own resume loads into the
sharded optimizer on every rank, at any world size (or into AdamW).

Why a callback and not a change of ``state_dict()``: ``Trainer`` calls
``state_dict()`` on rank 0 alone, where no collective can run, and the state
of the other ranks is in their own daemons.  ``on_save`` is the first point
where every rank runs the same code after the save.

Importing this module imports ``transformers``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import transformers

from tiermem.core.errors import InvalidArgument

__all__ = ["WholeOptimizerState"]

log = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
"""``Trainer``'s name for the optimizer's file in a checkpoint (``transformers.trainer.OPTIMIZER_NAME``)."""


def sharded_optimizer(optimizer: Any) -> Any:
    """The optimizer with ``consolidate_state_dict`` inside ``Trainer``'s (accelerate's ``AcceleratedOptimizer``
    wraps it as ``.optimizer``), or None."""
    seen = 0
    while optimizer is not None and seen < 8:
        if hasattr(optimizer, "consolidate_state_dict"):
            return optimizer
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return None


class WholeOptimizerState(transformers.TrainerCallback):
    """``Trainer(..., callbacks=[WholeOptimizerState()])``: each checkpoint's ``optimizer.pt`` holds the whole
    state of the sharded optimizer (see the module docstring), so ``trainer.train(resume_from_checkpoint=...)``
    resumes every rank, at any world size.  An optimizer that does not shard (``torch.optim.AdamW``,
    ``OffloadAdam``) is left alone."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = sharded_optimizer(kwargs.get("optimizer"))
        if opt is None or getattr(args, "save_only_model", False):
            return  # nothing sharded, or Trainer saved no optimizer (the same on every rank: no collective)
        prefix = transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
        folder = os.path.join(args.output_dir, f"{prefix}-{state.global_step}")
        if getattr(args, "save_on_each_node", False):
            whole: dict[str, Any] | None = opt.full_state_dict()  # each node's saving process writes it
        else:
            opt.consolidate_state_dict(0)
            whole = opt.state_dict() if args.should_save else None
        if not args.should_save or whole is None:
            return
        path = os.path.join(folder, OPTIMIZER_FILE)
        if not os.path.exists(path):
            raise InvalidArgument(
                f"Trainer saved a checkpoint without {path}: WholeOptimizerState writes the whole optimizer state "
                "over the file Trainer wrote in output_dir/checkpoint-<step>, and a hyper-parameter search's trial "
                "directories are not that; save with opt.save_shard(dir) on every rank there"
            )
        partial = f"{path}.partial"
        torch.save(whole, partial)
        os.replace(partial, path)
        log.info("wrote the whole optimizer state (every rank's) over %s", path)

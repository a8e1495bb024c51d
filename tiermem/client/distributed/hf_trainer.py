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

A ZeRO-3 model (``LayerShardedAdam``, ``ShardedPagedAdam``) has the same
problem with the model: ``Trainer`` saves ``model.state_dict()`` on rank 0
alone, and that gathers the params from every rank.  So in ``on_step_end``
and ``on_epoch_end``, where ``Trainer`` has decided to save
(``control.should_save``) but not yet saved, every rank gathers the model
(``consolidate_model_state(0)``), and rank 0's save takes those values.
``trainer.save_model()`` after training saves on rank 0 alone too, as many
times as the script says (``push_to_hub()`` saves again): ``on_train_end``
gathers the model once more, kept on rank 0 until the next step
(``until_step``), so that every such save takes those values.  Before, the
first ``save_model()`` of a ZeRO-3 model left rank 0 in a gather no other
rank joined: ``RankLost`` after ``collective_timeout_s``, and no model saved.
``save_on_each_node=True`` has each node's first process save, and the model
is gathered for one: refused as training begins.

A ZeRO-3 model holds no grads in the trainer either, so ``Trainer``'s clip
(``max_grad_norm``, 1.0 by default) finds none and clips nothing, silently;
so does an ``OffloadAdam`` whose grads go to the daemon during backward
(``offload_params``, ``release_grads``).  ``on_train_begin`` hands Trainer's
``max_grad_norm`` to such an optimizer where it does not clip itself
(``set_max_grad_norm``: the same rule, by the global norm, which the daemons
take), as the DeepSpeed integration fills its ``gradient_clipping: auto``;
it warns where the optimizer cannot (``LayerShardedAdam`` without
``paged=True``).  Trainer still logs its own
clip's ``grad_norm``, 0; the optimizer's ``last_grad_norm`` is the norm.

Importing this module imports ``transformers``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import transformers

from tiermem.client.distributed.frameworks import grads_elsewhere, hand_over_clip, sharded_optimizer, zero3_optimizer
from tiermem.core.errors import InvalidArgument

__all__ = ["WholeOptimizerState"]

log = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
"""``Trainer``'s name for the optimizer's file in a checkpoint (``transformers.trainer.OPTIMIZER_NAME``)."""


class WholeOptimizerState(transformers.TrainerCallback):
    """``Trainer(..., callbacks=[WholeOptimizerState()])``: each checkpoint's ``optimizer.pt`` holds the whole
    state of the sharded optimizer (see the module docstring), so ``trainer.train(resume_from_checkpoint=...)``
    resumes every rank, at any world size; with a ZeRO-3 optimizer, the checkpoint's model is gathered from
    every rank first.  Trainer's clip goes to an optimizer whose grads it cannot see (ZeRO-3, and
    ``OffloadAdam`` under ``offload_params`` or ``release_grads``).  Any other optimizer (``torch.optim.AdamW``,
    ``OffloadAdam`` otherwise) is left alone."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = zero3_optimizer(kwargs.get("optimizer"))
        if opt is not None and opt.world_size > 1 and getattr(args, "save_on_each_node", False):
            raise InvalidArgument(
                f"save_on_each_node=True has each node's first process save the model, and {opt.strategy.name} "
                "gathers it for one rank (consolidate_model_state): use save_on_each_node=False, or save with "
                "opt.save_shard(dir) on every rank"
            )
        clip = getattr(args, "max_grad_norm", None)
        hand_over_clip(
            grads_elsewhere(kwargs.get("optimizer")),
            clip,
            framework="Trainer",
            knob="max_grad_norm",
            off="Trainer max_grad_norm=0",
        )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._gather_model(args, control, kwargs.get("optimizer"))

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._gather_model(args, control, kwargs.get("optimizer"))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """For ``trainer.save_model()`` and ``push_to_hub()`` after ``train()``, on rank 0 alone: a ZeRO-3
        model gathered on every rank, kept on rank 0 until the next step or load."""
        opt = zero3_optimizer(kwargs.get("optimizer"))
        if opt is not None and opt.world_size > 1:
            opt.consolidate_model_state(0, until_step=True)

    @staticmethod
    def _gather_model(args: Any, control: Any, optimizer: Any) -> None:
        """Before a save ``Trainer`` decided on (the same decision on every rank): a ZeRO-3 model gathered on
        every rank for rank 0's ``model.state_dict()``."""
        opt = zero3_optimizer(optimizer)
        if opt is not None and opt.world_size > 1 and control.should_save:
            opt.consolidate_model_state(0)

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

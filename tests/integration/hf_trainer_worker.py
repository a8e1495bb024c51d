"""One rank of Hugging Face ``Trainer`` over a small GPT-2 at several ranks (``torchrun``, gloo, the CPU), a
scenario of ``test_zero2.py``'s two-rank launch.

``Trainer`` wraps the model in DDP, clips with its default ``max_grad_norm`` of 1.0 and checkpoints every
``SAVE_EVERY`` steps.  ``--optimizer zero2`` trains through ``ShardedOffloadAdam`` with
``WholeOptimizerState`` among the callbacks; ``adamw`` through ``torch.optim.AdamW`` (the reference);
``paged`` through ``ShardedPagedAdam`` (ZeRO-3) with the same callback, which also gathers the model for
rank 0's save and hands Trainer's clip to it (Trainer's own would find no grads); ``layer`` through
``LayerShardedAdam`` over an untied model, which Trainer's DDP, made after it, cannot wrap: each rank writes
the error to ``OUT.json.<rank>``.
``--accumulate N``: the same batch a step in N backward passes (``gradient_accumulation_steps``).
``--resume DIR`` resumes from ``DIR``'s checkpoint at ``SAVE_EVERY`` steps, in new objects.  Every rank then
calls ``trainer.save_model()`` twice, as scripts do; rank 0 writes the saved model to ``OUT.pt`` and the logged
losses to ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import safetensors.torch
import torch
import transformers
from scenarios import end_run, join_group
from small_models import TokenData, tiny_gpt2

from tiermem.client.distributed import LayerShardedAdam, ShardedOffloadAdam, ShardedPagedAdam
from tiermem.client.distributed.hf_trainer import WholeOptimizerState
from tiermem.core.errors import InvalidArgument, InvalidState

STEPS = 6
SAVE_EVERY = 3
LR = 1e-3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizer", choices=["zero2", "paged", "layer", "adamw"], required=True)
    ap.add_argument("--output-dir", required=True, help="Trainer's output_dir (its checkpoints)")
    ap.add_argument("--resume", default=None, help="an output_dir to resume from, at step SAVE_EVERY")
    ap.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps (the same batch a step)")
    args = ap.parse_args(argv)
    rank, _, owned = join_group()
    model = tiny_gpt2(tied=args.optimizer != "layer")
    callbacks = []
    if args.optimizer == "zero2":
        opt: torch.optim.Optimizer = ShardedOffloadAdam(model.parameters(), lr=LR, weight_decay=0.0)
        callbacks = [WholeOptimizerState()]
    elif args.optimizer == "paged":
        opt = ShardedPagedAdam(model, lr=LR, weight_decay=0.0, offload="cpu", device_budget="1MiB")
        callbacks = [WholeOptimizerState()]
    elif args.optimizer == "layer":
        opt = LayerShardedAdam(model, lr=LR, weight_decay=0.0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    training = transformers.TrainingArguments(
        output_dir=args.output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=4 // args.accumulate,
        gradient_accumulation_steps=args.accumulate,
        learning_rate=LR,
        save_strategy="steps",
        save_steps=SAVE_EVERY,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_backend="gloo",
    )
    sched = transformers.get_linear_schedule_with_warmup(opt, 2, STEPS)
    trainer = transformers.Trainer(
        model=model, args=training, train_dataset=TokenData(), optimizers=(opt, sched), callbacks=callbacks
    )
    resume = os.path.join(args.resume, f"checkpoint-{SAVE_EVERY}") if args.resume else None
    try:
        trainer.train(resume_from_checkpoint=resume)
    except InvalidArgument as e:
        with open(f"{args.out}.json.{rank}", "w") as f:
            json.dump({"error": type(e).__name__, "message": str(e)}, f)
        return end_run(owned, opt)
    trainer.save_model()  # every rank calls it, as scripts do; Trainer saves on rank 0 alone
    trainer.save_model()  # again (push_to_hub() saves again): rank 0 takes the kept values a second time
    if args.optimizer == "paged":
        after_save(rank, opt, model, args)
    if rank == 0:
        final = safetensors.torch.load_file(os.path.join(args.output_dir, "model.safetensors"))
        torch.save(final, f"{args.out}.pt")
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
        with open(f"{args.out}.json", "w") as f:
            json.dump({"losses": losses, "grad_norms": norms}, f)
    return end_run(owned, *([opt] if not isinstance(opt, torch.optim.AdamW) else []))


def after_save(rank: int, opt: ShardedPagedAdam, model: torch.nn.Module, args: argparse.Namespace) -> None:
    """Rank 0 keeps the model gathered as training ended, until the next step: rank 1's own gather, which
    rank 0 would not join, is refused at once; after ``release_model_state()`` every rank gathers again, and
    the values are the saved ones.  ``save_on_each_node=True`` (each node's first process saving a model
    gathered for one) is refused where training begins.  Each rank writes ``OUT.after.<rank>``."""
    each_node_args = transformers.TrainingArguments(
        output_dir=args.output_dir, save_on_each_node=True, use_cpu=True, report_to=[], ddp_backend="gloo"
    )
    try:
        WholeOptimizerState().on_train_begin(each_node_args, None, None, optimizer=opt)
        each_node = ""
    except InvalidArgument as e:
        each_node = str(e)
    refused = ""
    if rank == 1:
        try:
            model.state_dict()
        except InvalidState as e:
            refused = str(e)
    opt.release_model_state()
    again = model.state_dict()  # a collective: rank 0's save is written by now
    saved = safetensors.torch.load_file(os.path.join(args.output_dir, "model.safetensors"))
    same = all(torch.equal(again[key], value) for key, value in saved.items())
    with open(f"{args.out}.after.{rank}", "w") as f:
        json.dump({"refused": refused, "same_as_saved": same, "saved_keys": len(saved), "each_node": each_node}, f)

"""Hugging Face ``Trainer`` drives ``OffloadAdam`` as it drives ``torch.optim.AdamW``: same losses, and a
run resumed from a checkpoint ends where the uninterrupted one does.

The real ``transformers`` Trainer (its accelerate-wrapped optimizer, its LR scheduler, its
``clip_grad_norm_`` on the model's grads, its safetensors checkpoints with GPT-2's tied weights) over a
small GPT-2 on the CPU tier, against the same Trainer with ``torch.optim.AdamW``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from offload_helpers import OffloadDaemon
from small_models import TokenData, tiny_gpt2

import tiermem

transformers = pytest.importorskip("transformers")

STEPS = 6
LR = 1e-3


OFFLOAD_DAEMON: dict[str, Any] = {"pool_size": 256 << 20}


def _trainer(
    model: Any, opt: torch.optim.Optimizer, out: Path, *, max_grad_norm: float = 1.0, callbacks: list[Any] | None = None
) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=LR,
        save_strategy="steps",
        save_steps=3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        max_grad_norm=max_grad_norm,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    sched = transformers.get_linear_schedule_with_warmup(opt, 2, STEPS)
    return transformers.Trainer(
        model=model, args=args, train_dataset=TokenData(), optimizers=(opt, sched), callbacks=callbacks
    )


def _losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_with_offload_adam_matches_adamw_and_resumes_exactly(offload: OffloadDaemon, tmp_path: Path) -> None:
    model = tiny_gpt2()
    opt = offload.make(model.parameters(), offload="cpu", lr=LR, weight_decay=0.0)
    trainer = _trainer(model, opt, tmp_path / "offload")
    trainer.train()
    full = {k: v.clone() for k, v in model.state_dict().items()}

    reference = tiny_gpt2()
    ref_trainer = _trainer(
        reference, torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0), tmp_path / "ref"
    )
    ref_trainer.train()
    assert _losses(trainer) == pytest.approx(_losses(ref_trainer), rel=1e-5)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, msg=key)

    # a new process's worth of objects, resumed from the step-3 checkpoint Trainer wrote
    checkpoint = tmp_path / "offload" / "checkpoint-3"
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "optimizer.pt").exists()
    resumed = tiny_gpt2()
    resumed_opt = offload.make(resumed.parameters(), offload="cpu", lr=LR, weight_decay=0.0)
    _trainer(resumed, resumed_opt, tmp_path / "offload").train(resume_from_checkpoint=str(checkpoint))
    for key, value in resumed.state_dict().items():
        torch.testing.assert_close(value, full[key], rtol=0, atol=0, msg=key)
    # torch's count is per param: the checkpoint's 3 steps and the 3 after it
    assert int(resumed_opt.state_dict()["state"][0]["step"]) == int(opt.state_dict()["state"][0]["step"]) == STEPS


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_trainer_resumes_compressed_moments_exactly(offload: OffloadDaemon, tmp_path: Path, state_dtype: str) -> None:
    """Compressed moments go through Trainer's ``optimizer.pt`` as AdamW's fp32 values and come back as the
    bits they were, also through the smallest window (its 512-element slots cut GPT-2's int8 blocks unless
    the transfer cuts on blocks)."""
    options: dict[str, Any] = {"offload": "cpu", "lr": LR, "weight_decay": 0.0, "state_dtype": state_dtype}
    model = tiny_gpt2()
    opt = offload.make(model.parameters(), window_nbytes=4096, **options)
    _trainer(model, opt, tmp_path / "full").train()
    resumed = tiny_gpt2()
    resumed_opt = offload.make(resumed.parameters(), window_nbytes=4096, **options)
    _trainer(resumed, resumed_opt, tmp_path / "full").train(
        resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3")
    )
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key


def test_trainer_with_paged_params_clips_in_the_optimizer_and_resumes_exactly(
    offload: OffloadDaemon, tmp_path: Path
) -> None:
    """``offload_params`` under Trainer: the grads go to the daemon during backward, so Trainer's own
    ``clip_grad_norm_`` would see none; clipping is OffloadAdam's ``max_grad_norm`` (Trainer's set to 0).
    Trainer's checkpoints gather the paged params (``model.state_dict()``) and load them back.  With Trainer's
    default clip left on and ``WholeOptimizerState`` among the callbacks, the callback hands that clip to the
    optimizer, and the run is the same, loss for loss (before, it trained unclipped, silently)."""

    def paged(clip: float | None = 1.0) -> tuple[Any, Any]:
        model = tiny_gpt2()
        opt = offload.make(
            model.parameters(), offload="cpu", lr=LR, weight_decay=0.0, exchange="staged", max_grad_norm=clip
        )
        tiermem.offload_params(model, opt, device_budget="1MiB")
        return model, opt

    model, opt = paged()
    trainer = _trainer(model, opt, tmp_path / "paged", max_grad_norm=0.0)
    trainer.train()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    reference = tiny_gpt2()
    adamw = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    ref_trainer = _trainer(reference, adamw, tmp_path / "ref")  # Trainer clips at 1.0 before AdamW
    ref_trainer.train()
    assert _losses(trainer) == pytest.approx(_losses(ref_trainer), rel=1e-5)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, msg=key)
    resumed, resumed_opt = paged()
    _trainer(resumed, resumed_opt, tmp_path / "paged", max_grad_norm=0.0).train(
        resume_from_checkpoint=str(tmp_path / "paged" / "checkpoint-3")
    )
    for key, value in resumed.state_dict().items():
        torch.testing.assert_close(value, full[key], rtol=0, atol=0, msg=key)
    from tiermem.client.distributed.hf_trainer import WholeOptimizerState

    handed, handed_opt = paged(clip=None)
    handed_trainer = _trainer(handed, handed_opt, tmp_path / "handed", callbacks=[WholeOptimizerState()])
    handed_trainer.train()
    assert handed_opt.max_grad_norm == 1.0 and _losses(handed_trainer) == _losses(trainer)
    for key, value in handed.state_dict().items():
        torch.testing.assert_close(value, full[key], rtol=0, atol=0, msg=key)

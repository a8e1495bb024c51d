"""``OffloadAdam`` in an ``accelerate`` training loop, with the real package: ``Accelerator.prepare`` (the
optimizer wrapped in ``AcceleratedOptimizer``, the scheduler in ``AcceleratedScheduler``),
``accelerator.backward`` and ``clip_grad_norm_``; it trains as ``torch.optim.AdamW`` does in the same loop,
and ``save_state``/``load_state`` into fresh objects resume bitwise into the uninterrupted run for fp32, bf16
and int8 moments.

A small Llama built from its config (no download; its 32-element norms put most tensors off the int8 blocks'
256-element grid), through the smallest window (512-element slots) for the resumes.  Not GPT-2: the grad of
its attention's key bias is zero but for rounding, which Adam divides by its own size, so two exact AdamW
implementations drift apart there (3.8e-5 after 6 steps at lr 1e-2) while every other param stays within
3e-7.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from offload_helpers import OffloadDaemon, assert_params_equal, max_param_diff
from small_models import LLAMA_DAEMON, LLAMA_HYPER, LLAMA_STEPS, LLAMA_TOLERANCE, llama_batch, lm_loss, tiny_llama
from torch import nn

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

OFFLOAD_DAEMON = LLAMA_DAEMON


def _prepared(
    model: nn.Module, opt: torch.optim.Optimizer
) -> tuple[Any, nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    accelerator = accelerate.Accelerator(cpu=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))  # a short warm-up
    model, opt, sched = accelerator.prepare(model, opt, sched)
    return accelerator, model, opt, sched


def _train(
    accelerator: Any, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: range
) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        loss = lm_loss(model, llama_batch(step))
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def test_an_accelerate_loop_trains_like_adamw(offload: OffloadDaemon) -> None:
    model = tiny_llama()
    reference = copy.deepcopy(model)
    ours = _prepared(model, offload.make(model.parameters(), offload="cpu", **LLAMA_HYPER))
    theirs = _prepared(reference, torch.optim.AdamW(reference.parameters(), **LLAMA_HYPER))
    losses = _train(*ours, range(LLAMA_STEPS))
    ref_losses = _train(*theirs, range(LLAMA_STEPS))
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    gap = max_param_diff(model, reference)
    assert gap <= LLAMA_TOLERANCE, gap  # 1.2e-7 here


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_save_state_and_load_state_resume_bitwise(offload: OffloadDaemon, tmp_path: Path, state_dtype: str) -> None:
    options = {"offload": "cpu", "state_dtype": state_dtype, "window_nbytes": 4096, **LLAMA_HYPER}
    whole = tiny_llama()
    _train(*_prepared(whole, offload.make(whole.parameters(), **options)), range(LLAMA_STEPS))

    first = tiny_llama()
    accelerator, _, first_opt, _ = prepared = _prepared(first, offload.make(first.parameters(), **options))
    _train(*prepared, range(LLAMA_STEPS // 2))
    accelerator.save_state(str(tmp_path))
    first_opt.optimizer.close()

    # a new process's worth of objects: the model at its initial values, the optimizer without state
    resumed = tiny_llama()
    accelerator, _, resumed_opt, sched = prepared = _prepared(resumed, offload.make(resumed.parameters(), **options))
    accelerator.load_state(str(tmp_path))
    assert sched.scheduler.last_epoch == LLAMA_STEPS // 2
    _train(*prepared, range(LLAMA_STEPS // 2, LLAMA_STEPS))
    assert_params_equal(resumed, whole)
    assert resumed_opt.optimizer.steps == LLAMA_STEPS  # counted from the loaded step, as torch's state["step"]

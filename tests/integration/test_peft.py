"""``OffloadAdam`` over a PEFT/LoRA model, with the real ``peft`` package: given every param of the model (as
scripts write ``OffloadAdam(model.parameters())``), it trains the adapter as ``torch.optim.AdamW`` does, the
daemon holds bytes for the adapter only, a checkpoint resumes bitwise in every state format, and PEFT's own
adapter files round trip beside it.

The model is a small GPT-2 built from its config (no download) with LoRA of rank 3 on its linear layers: 16
trainable tensors of 6,144 elements, 28 frozen ones of 110,336.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from offload_helpers import OffloadDaemon, max_param_diff, train
from small_models import lm_loss, tiny_gpt2, token_batch
from torch import nn

import tiermem

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

OFFLOAD_DAEMON: dict[str, Any] = {"pool_size": 256 << 20}
HYPER: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.01}
VOCAB = 128
TOLERANCE = 1e-5
TARGETS = ["c_attn", "c_proj", "c_fc"]  # c_proj: the attention's output and the MLP's


def _base() -> nn.Module:
    return tiny_gpt2(n_embd=64, vocab_size=VOCAB, n_positions=32)


def _lora_config() -> Any:
    # GPT-2's linear layers are Conv1D (weights stored fan-in first); rank 3 makes most adapter tensors' sizes
    # no multiple of an int8 block (256 elements), so blocks straddle the window's slots
    return peft.LoraConfig(r=3, lora_alpha=6, target_modules=TARGETS, lora_dropout=0.0, fan_in_fan_out=True)


def _lora() -> nn.Module:
    model = _base()
    torch.manual_seed(1)  # LoRA's A is random, B zero: the adapter's values are seeded too
    return peft.get_peft_model(model, _lora_config())


def _train(model: nn.Module, opt: torch.optim.Optimizer, seeds: range) -> None:
    train(model, opt, [token_batch(seed, VOCAB, (2, 16)) for seed in seeds], lm_loss)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def test_lora_trains_like_adamw_given_every_param(offload: OffloadDaemon) -> None:
    model = _lora()
    reference = copy.deepcopy(model)
    opt = offload.make(model.parameters(), offload="cpu", **HYPER)
    adamw = torch.optim.AdamW(reference.parameters(), **HYPER)
    _train(model, opt, range(5))
    _train(reference, adamw, range(5))
    gap = max_param_diff(model, reference)
    assert gap <= TOLERANCE, gap  # 1.0e-7 here
    # the adapter moved, the frozen base did not, and AdamW's numbering of the state (every param counts) holds
    for (name, p), q in zip(model.named_parameters(), _lora().parameters(), strict=True):
        assert torch.equal(p, q) != p.requires_grad, name
    assert opt.state_dict()["state"].keys() == adamw.state_dict()["state"].keys()
    stats = opt.stats()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert (stats.frozen_params, stats.frozen_numel) == (len(frozen), sum(p.numel() for p in frozen))


def test_the_daemon_holds_bytes_for_the_adapter_only(offload: OffloadDaemon) -> None:
    with_base, alone = _lora(), _lora()
    opt = offload.make(with_base.parameters(), offload="cpu", **HYPER)
    only = offload.make(_trainable(alone), offload="cpu", **HYPER)
    _train(with_base, opt, range(2))
    _train(alone, only, range(2))
    a, b = opt.stats().rank, only.stats().rank
    assert a.numel == b.numel == sum(p.numel() for p in _trainable(with_base))
    # 48 KiB of shared storage and 48 KiB of state each; with every param registered, 912 KiB and 910 KiB
    assert a.storage_nbytes <= 1.1 * b.storage_nbytes, (a.storage_nbytes, b.storage_nbytes)
    assert a.cpu_state_nbytes <= 1.1 * b.cpu_state_nbytes, (a.cpu_state_nbytes, b.cpu_state_nbytes)


def test_a_paged_lora_model_trains_bitwise_unpaged_within_a_quarter_of_the_model(offload: OffloadDaemon) -> None:
    """``offload_params`` over a LoRA model: backward goes through every frozen base weight, and each was held
    until backward ended, as a trained param is until its grad lands; the budget had to hold the whole base
    (``device_budget 113.8KiB cannot hold ...h.1.mlp.c_fc.base_layer.weight``).  A frozen param is no
    longer held: it goes once its node has its view."""
    paged, plain = _lora(), _lora()
    opt = offload.make(paged.parameters(), exchange="staged", window_nbytes=1 << 20, **HYPER)
    plain_opt = offload.make(_trainable(plain), exchange="staged", window_nbytes=1 << 20, **HYPER)
    budget = sum(p.numel() * p.element_size() for p in paged.parameters()) // 4
    pager = tiermem.offload_params(paged, opt, device_budget=budget)
    _train(paged, opt, range(3))
    _train(plain, plain_opt, range(3))
    for name, value in plain.state_dict().items():
        assert torch.equal(paged.state_dict()[name], value), name
    assert pager.peak_nbytes <= budget


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_a_lora_checkpoint_resumes_bitwise(offload: OffloadDaemon, tmp_path: Path, state_dtype: str) -> None:
    """6 steps uninterrupted against 3, ``torch.save`` of the adapter and the optimizer, a fresh model and
    optimizer loaded from the file, and 3 more; through the smallest window (its 512-element slots cut the
    adapter's int8 blocks unless the transfer cuts on blocks)."""
    options = {"offload": "cpu", "state_dtype": state_dtype, "window_nbytes": 4096, **HYPER}
    whole = _lora()
    _train(whole, offload.make(whole.parameters(), **options), range(6))

    first = _lora()
    first_opt = offload.make(first.parameters(), **options)
    _train(first, first_opt, range(3))
    path = tmp_path / "checkpoint.pt"
    torch.save({"adapter": peft.get_peft_model_state_dict(first), "optimizer": first_opt.state_dict()}, path)
    first_opt.close()

    checkpoint = torch.load(path)
    resumed = _lora()
    peft.set_peft_model_state_dict(resumed, checkpoint["adapter"])
    resumed_opt = offload.make(resumed.parameters(), **options)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    _train(resumed, resumed_opt, range(3, 6))
    for (name, p), q in zip(resumed.named_parameters(), whole.parameters(), strict=True):
        assert torch.equal(p, q), (name, float((p - q).abs().max()))


def test_peft_save_pretrained_round_trips_the_trained_adapter(offload: OffloadDaemon, tmp_path: Path) -> None:
    model = _lora()
    _train(model, offload.make(model.parameters(), offload="cpu", **HYPER), range(3))
    model.save_pretrained(str(tmp_path))
    assert (tmp_path / "adapter_model.safetensors").exists()
    loaded = peft.PeftModel.from_pretrained(_base(), str(tmp_path))
    for (name, p), q in zip(model.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(p, q), name

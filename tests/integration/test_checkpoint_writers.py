"""Every checkpoint writer keeps every tensor of a model trained through ``OffloadAdam``, at its own size.

``OffloadAdam`` moves the model's params (and their grads) into memory the
daemon shares.  Writers decide which tensors are "tied" by their storages:
``safetensors`` and ``accelerate`` keep one tensor per storage, and
``torch.save`` writes each storage whole.  So every param must have a torch
storage of its own, over its own bytes, with its grad outside it.  Checked
with the real packages (``safetensors``, ``accelerate``, ``transformers``) on
an MLP, a GPT-2 (tied embedding and head) and a Llama (untied), each trained
a few steps on the CPU tier, so the saved values are the daemon's updates.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from offload_helpers import OffloadDaemon
from small_models import lm_loss, tiny_gpt2, tiny_llama, token_batch
from torch import nn

safetensors_torch = pytest.importorskip("safetensors.torch")
accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")


OFFLOAD_DAEMON: dict[str, Any] = {"pool_size": 256 << 20}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": _mlp, "gpt2": tiny_gpt2, "llama": tiny_llama}


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    if isinstance(model, nn.Sequential):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
        return model(x).square().mean()
    return lm_loss(model, token_batch(seed, 64, (2, 12)))


def _trained(offload: OffloadDaemon, name: str, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = MODELS[name]()
    opt = offload.make(model.parameters(), offload="cpu", lr=1e-2)
    for step in range(steps):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the grads bound, so their placement is checked too
    return model, opt


def _extent(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _unique_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}  # tied params once


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_param_and_grad_has_a_storage_of_its_own(offload: OffloadDaemon, name: str) -> None:
    model, opt = _trained(offload, name)
    extents = []
    for pname, p in model.named_parameters():
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), pname
        extents.append((*_extent(p), pname))
        if p.grad is not None:
            assert p.grad.untyped_storage().nbytes() == p.grad.numel() * p.grad.element_size(), pname
            extents.append((*_extent(p.grad), pname + ".grad"))
    extents.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(extents):
        assert end <= start, f"{a} and {b} overlap"
    opt.close()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_safetensors_save_model_round_trips_every_tensor(offload: OffloadDaemon, name: str, tmp_path: Path) -> None:
    model, opt = _trained(offload, name)
    want = _unique_params(model)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_model(model, str(path))
    fresh = MODELS[name]()
    missing, unexpected = safetensors_torch.load_model(fresh, str(path))
    assert (set(missing), set(unexpected)) == (set(), set())
    for pname, p in fresh.named_parameters():
        torch.testing.assert_close(p, want[pname], rtol=0, atol=0, msg=pname)
    opt.close()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_accelerate_save_model_keeps_every_tensor(offload: OffloadDaemon, name: str, tmp_path: Path) -> None:
    model, opt = _trained(offload, name)
    want = _unique_params(model)
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.save_model(model, str(tmp_path))
    saved = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    tied = {"lm_head.weight"} if name == "gpt2" else set()  # GPT-2's head is its embedding, saved once
    assert set(saved) == set(model.state_dict()) - tied
    for pname, value in want.items():
        torch.testing.assert_close(saved[pname], value, rtol=0, atol=0, msg=pname)
    opt.close()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_accelerate_save_state_and_load_state_resume_the_model_and_optimizer(
    offload: OffloadDaemon, name: str, tmp_path: Path
) -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    model, offload_opt = _trained(offload, name)
    model, opt = accelerator.prepare(model, offload_opt)
    want = _unique_params(model)
    accelerator.save_state(str(tmp_path))
    # the next steps happen, then the checkpoint is loaded back over them
    _loss(model, 10).backward()
    opt.step()
    opt.zero_grad()
    accelerator.load_state(str(tmp_path))
    for pname, p in model.named_parameters():
        torch.testing.assert_close(p, want[pname], rtol=0, atol=0, msg=pname)
    # the optimizer resumed too: one more step matches AdamW run from the same checkpoint
    reference = MODELS[name]()
    reference.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_opt.load_state_dict(opt.state_dict())
    for m, o in ((model, opt), (reference, ref_opt)):
        _loss(m, 11).backward()
        o.step()
        o.zero_grad()
    for (pname, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p, r, msg=pname)
    offload_opt.close()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_torch_save_writes_each_param_at_its_own_size(offload: OffloadDaemon, name: str, tmp_path: Path) -> None:
    model, opt = _trained(offload, name)
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    param_nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_nbytes = sum(b.numel() * b.element_size() for b in model.buffers())
    # pickle's framing adds a few hundred bytes per tensor; the grads or a whole shared storage would double it
    assert os.path.getsize(path) < 1.1 * (param_nbytes + buffer_nbytes) + 1024 * len(model.state_dict())
    loaded = torch.load(path)
    for pname, p in model.named_parameters():
        torch.testing.assert_close(loaded[pname], p, rtol=0, atol=0, msg=pname)
    opt.close()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_torch_distributed_checkpoint_resumes_bitwise(offload: OffloadDaemon, name: str, tmp_path: Path) -> None:
    """``torch.distributed.checkpoint`` as FSDP2 and torchtitan users save: ``get_state_dict`` (the
    optimizer's state keyed by param names), ``dcp.save``; then fresh objects, ``dcp.load`` into their own
    state dicts and ``set_state_dict``.  One process, no process group (DCP's single-process mode).  The
    resumed run ends on the uninterrupted one's bits."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _trained(offload, name, steps=3)
    model_sd, optim_sd = get_state_dict(model, opt)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
    for step in range(3, 5):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
    fresh = MODELS[name]()
    fresh_opt = offload.make(fresh.parameters(), offload="cpu", lr=1e-2)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)  # (DCP's own fake step, at lr 0, makes the state)
    loaded = {"model": model_sd, "optim": optim_sd}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(loaded, checkpoint_id=str(tmp_path))
    set_state_dict(fresh, fresh_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    assert fresh_opt.steps == 3
    for step in range(3, 5):
        _loss(fresh, step).backward()
        fresh_opt.step()
        fresh_opt.zero_grad()
    for (pname, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=pname)
    opt.close()
    fresh_opt.close()

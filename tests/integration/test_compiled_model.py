"""A ``torch.compile``'d model trained by ``OffloadAdam``: the compiled graph reads the params from the
memory the daemon shares (also when it was compiled before the optimizer moved them there), trains as
``torch.optim.AdamW`` does, and a checkpoint resumes bitwise into the uninterrupted run for fp32, bf16 and
int8 moments.

A small Llama built from its config (no download; no attention biases, whose near-zero grads Adam would
magnify, see ``test_accelerate``), compiled with inductor.  Every model here reuses one compiled graph
(the params are the graph's inputs): the first test pays for the compile (about 10 s with inductor's
cache warm, a minute cold on two busy cores), the rest does not.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from offload_helpers import OffloadDaemon, assert_params_equal, max_param_diff, train
from small_models import LLAMA_DAEMON, LLAMA_HYPER, LLAMA_STEPS, LLAMA_TOLERANCE, llama_batch, lm_loss, tiny_llama
from torch import nn

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

OFFLOAD_DAEMON = LLAMA_DAEMON


@pytest.fixture(scope="module", autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    yield
    torch._dynamo.reset()  # the module's compiled graphs hold its models' params


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    train(model, opt, [llama_batch(step) for step in steps], lm_loss)


def test_a_compiled_model_trains_like_adamw(offload: OffloadDaemon) -> None:
    model = tiny_llama()
    reference = copy.deepcopy(model)
    compiled, compiled_ref = torch.compile(model), torch.compile(reference)
    for m in (compiled, compiled_ref):  # compiled and run before the optimizer moves the params
        lm_loss(m, llama_batch(-1)).backward()
        m.zero_grad()
    opt = offload.make(compiled.parameters(), offload="cpu", **LLAMA_HYPER)
    adamw = torch.optim.AdamW(compiled_ref.parameters(), **LLAMA_HYPER)
    _train(compiled, opt, range(LLAMA_STEPS))
    _train(compiled_ref, adamw, range(LLAMA_STEPS))
    gap = max_param_diff(model, reference)
    assert gap <= LLAMA_TOLERANCE, gap  # 8.3e-7 here
    assert not torch.equal(model.lm_head.weight, tiny_llama().lm_head.weight)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_a_compiled_model_resumes_bitwise(offload: OffloadDaemon, tmp_path: Path, state_dtype: str) -> None:
    """6 steps uninterrupted against 3, ``torch.save`` of the model and the optimizer, a fresh compiled model
    and optimizer loaded from the file, and 3 more; through the smallest window (its 512-element slots cut
    the int8 blocks of the tensors after the 32-element norms)."""
    options = {"offload": "cpu", "state_dtype": state_dtype, "window_nbytes": 4096, **LLAMA_HYPER}
    whole = torch.compile(tiny_llama())
    _train(whole, offload.make(whole.parameters(), **options), range(LLAMA_STEPS))

    first = torch.compile(tiny_llama())
    first_opt = offload.make(first.parameters(), **options)
    _train(first, first_opt, range(LLAMA_STEPS // 2))
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, path)
    first_opt.close()

    checkpoint = torch.load(path)
    resumed = torch.compile(tiny_llama())
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = offload.make(resumed.parameters(), **options)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    _train(resumed, resumed_opt, range(LLAMA_STEPS // 2, LLAMA_STEPS))
    assert_params_equal(resumed, whole)

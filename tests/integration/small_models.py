"""Small models and their data for the ``OffloadAdam`` integration tests (no daemon here).

``tiny_gpt`` (``tiermem.client.demo.model.GPT``, about 21k parameters, about 10
chunks of 2048 elements) on a fixed character corpus; ``mlp`` on fixed
regression data, where torch and the engine stay within ``assert_close``'s
default tolerances over 100 steps; ``TwoBranches``, whose heads take part or
not (a param without a grad has no Adam state).  Every model is seeded, so two
built alike hold the same values.

``tiny_llama`` and ``tiny_gpt2`` are Hugging Face causal LMs built from their
configs (no download; ``transformers`` is imported when one is built, so the
tests that use them skip without it), trained on ``token_batch`` with
``lm_loss``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tiermem.client.demo.model import GPT, CharCorpus, GPTConfig

TINY_GPT = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)
BATCH = 4

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY_GPT)


def mlp(seed: int = 0, width: int = 64) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 8))


def replicas(model: nn.Module, n: int) -> list[nn.Module]:
    """``n`` independent copies of ``model`` with identical values."""
    return [copy.deepcopy(model) for _ in range(n)]


@functools.cache
def corpus() -> CharCorpus:
    return CharCorpus(nbytes=1 << 16, seed=0)


def gpt_batches(steps: int, seed: int = 1, batch: int = BATCH) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [corpus().batch(batch, TINY_GPT.block_size, g) for _ in range(steps)]


def mlp_batches(steps: int, seed: int = 1, *, fixed: bool = True) -> list[Batch]:
    """Regression data; ``fixed``: the same batch every step."""
    g = torch.Generator().manual_seed(seed)
    if fixed:
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
        return [(x, y)] * steps
    return [(torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)) for _ in range(steps)]


def gpt_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return model(x, y)  # type: ignore[no-any-return]


def mlp_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    out = model(x.to(next(model.parameters()).dtype))
    return F.mse_loss(out.float(), y)


class TwoBranches(nn.Module):
    """A trunk and two heads; ``heads`` says which take part (``"a"``, ``"b"`` or ``"a+b"``, summed): a head
    that takes no part gets no grad, so no Adam state until it does."""

    def __init__(self, heads: str = "a") -> None:
        super().__init__()
        torch.manual_seed(3)
        self.trunk = nn.Linear(16, 32)
        self.branch_a = nn.Linear(32, 8)
        self.branch_b = nn.Linear(32, 8)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if self.heads == "a":
            return self.branch_a(h)
        if self.heads == "b":
            return self.branch_b(h)
        return self.branch_a(h) + self.branch_b(h)


# ----------------------------------------------------------------------------- Hugging Face models

LLAMA_VOCAB = 64
LLAMA_DAEMON: dict[str, Any] = {"pool_size": 256 << 20}
"""The daemon of a test module that trains ``tiny_llama`` in a framework (its ``OFFLOAD_DAEMON``)."""
LLAMA_HYPER: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.01}
LLAMA_STEPS = 6
LLAMA_TOLERANCE = 1e-5
"""How far from ``torch.optim.AdamW`` such a run may end (largest param difference)."""


def tiny_llama(vocab_size: int = LLAMA_VOCAB) -> nn.Module:
    """A Llama of 2 layers, width 32 (norms of 32 elements), no attention biases and an untied head."""
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=vocab_size,
        max_position_embeddings=16,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class TokenData(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """64 fixed sequences of 12 tokens below 64 (``tiny_gpt2``'s vocabulary), each its own labels: HF Trainer's
    dataset in the tests that drive it."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def tiny_gpt2(*, n_embd: int = 32, vocab_size: int = 64, n_positions: int = 16, tied: bool = True) -> nn.Module:
    """A GPT-2 of 2 layers and 2 heads, no dropout, its embedding and head tied unless ``tied`` is False."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=n_embd,
        vocab_size=vocab_size,
        n_positions=n_positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def token_batch(seed: int, vocab_size: int, shape: tuple[int, int]) -> Batch:
    """Random token ids from a generator seeded ``seed``: a causal LM's input, and its labels."""
    ids = torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))
    return ids, ids


def llama_batch(step: int) -> Batch:
    """Batch ``step`` of a ``tiny_llama()`` training run: 4 sequences of 12 tokens (``token_batch`` seeded ``step``)."""
    return token_batch(step, LLAMA_VOCAB, (4, 12))


def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """A Hugging Face causal LM's own loss on ``batch``."""
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss  # type: ignore[no-any-return]

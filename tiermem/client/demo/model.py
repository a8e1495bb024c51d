"""A small GPT-style language model and a synthetic corpus for the demo and benchmarks.

The model is the usual pre-norm decoder: token + position embeddings, ``n_layer``
blocks of causal self-attention and a GELU MLP, a final LayerNorm and an output
projection tied to the token embedding.  ``GPTConfig.for_params`` picks a shape
for a target parameter count, so benchmarks can sweep sizes.

The corpus is generated, not downloaded: sentences of a tiny arithmetic
language ("seven plus five is twelve.") whose next characters are partly
predictable, so the loss falls visibly within a few hundred steps.  Tokens are
bytes (vocabulary 256).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT", "GPTConfig", "CharCorpus"]

_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
]  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    """Tokens are bytes."""
    block_size: int = 64
    """Longest context in tokens."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    @classmethod
    def for_params(cls, target: int, *, block_size: int = 64) -> GPTConfig:
        """A shape with roughly ``target`` parameters (12 * n_layer * n_embd^2 dominates)."""
        best: GPTConfig | None = None
        for n_layer in (2, 4, 6, 8, 12, 16, 24):
            n_embd = max(64, round(math.sqrt(target / (12 * n_layer)) / 64) * 64)
            cfg = cls(block_size=block_size, n_layer=n_layer, n_head=max(1, n_embd // 64), n_embd=n_embd)
            if not 32 <= n_embd / n_layer <= 192:  # keep GPT-like proportions
                continue
            if best is None or abs(cfg.num_params() - target) < abs(best.num_params() - target):
                best = cfg
        if best is None:
            raise ValueError(f"no GPT shape for {target} parameters")
        return best

    def num_params(self) -> int:
        e = self.n_embd
        per_layer = 4 * e + (3 * e * e + 3 * e) + (e * e + e) + (4 * e * e + 4 * e) + (4 * e * e + e)
        return self.vocab_size * e + self.block_size * e + self.n_layer * per_layer + 2 * e


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        out: torch.Tensor = x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))
        return out


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        _, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class CharCorpus:
    """Byte-level batches from a generated arithmetic corpus (deterministic per seed)."""

    def __init__(self, *, nbytes: int = 1 << 20, seed: int = 0) -> None:
        rng = random.Random(seed)
        parts: list[str] = []
        size = 0
        while size < nbytes:
            a, b = rng.randint(0, 10), rng.randint(0, 10)
            if rng.random() < 0.5:
                s = f"{_WORDS[a]} plus {_WORDS[b]} is {_WORDS[a + b]}. "
            else:
                hi, lo = max(a, b), min(a, b)
                s = f"{_WORDS[hi]} minus {_WORDS[lo]} is {_WORDS[hi - lo]}. "
            parts.append(s)
            size += len(s)
        self.data = torch.tensor(list("".join(parts).encode()), dtype=torch.long)

    def batch(self, batch_size: int, block_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.data.numel() - block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([self.data[s : s + block_size] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1 : s + 1 + block_size] for s in starts.tolist()])
        return x, y

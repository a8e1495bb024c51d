"""The demo's training loop: the same model, data and seed under several optimizers.

Each run builds the model from the same seed, trains ``steps`` steps on the
generated corpus and records the loss curve and step times, so runs compare
side by side (loss equality is the proof that the offloaded update is the same
update; step time is the cost).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from tiermem.client.demo.model import GPT, CharCorpus, GPTConfig

__all__ = ["RunResult", "train_run"]

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass
class RunResult:
    name: str
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def final_loss(self) -> float:
        tail = self.losses[-10:]
        return sum(tail) / len(tail)

    @property
    def median_step_s(self) -> float:
        # the first steps include warm-up (kernel compilation, first page-ins)
        steady = self.step_s[min(5, len(self.step_s) - 1) :]
        return statistics.median(steady)


def train_run(
    name: str,
    make_optimizer: OptimizerFactory,
    *,
    cfg: GPTConfig,
    corpus: CharCorpus,
    steps: int,
    batch_size: int,
    seed: int = 0,
    show: bool = True,
    describe: Callable[[torch.optim.Optimizer], dict[str, str]] | None = None,
    close: Callable[[torch.optim.Optimizer], dict[str, float]] | None = None,
) -> RunResult:
    """Train a fresh ``GPT(cfg)`` for ``steps`` steps with the optimizer ``make_optimizer`` builds."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    optimizer = make_optimizer(model.parameters())
    data_gen = torch.Generator().manual_seed(seed + 1)
    result = RunResult(name)
    # on a terminal the bar redraws in place; in a log (CI, a pipe) a line every 10 s at most
    interactive = sys.stderr.isatty()
    progress = tqdm(
        total=steps,
        desc=f"{name:<12}",
        unit="step",
        file=sys.stderr,
        disable=not show,
        dynamic_ncols=interactive,
        mininterval=0.1 if interactive else 10.0,
    )
    try:
        for _ in range(steps):
            x, y = corpus.batch(batch_size, cfg.block_size, data_gen)
            start = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            result.step_s.append(time.perf_counter() - start)
            result.losses.append(loss.item())
            if show:
                fields = {"loss": f"{loss.item():.3f}", "step": f"{result.step_s[-1] * 1e3:.0f}ms"}
                if describe is not None:
                    fields.update(describe(optimizer))
                progress.set_postfix(fields, refresh=False)
                progress.update()
    finally:
        progress.close()
        if close is not None:
            result.extra.update(close(optimizer))
    return result

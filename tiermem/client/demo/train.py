"""The demo's training loop: the same model, data and seed under several optimizers.

Each run builds the model from the same seed, trains ``steps`` steps on the
generated corpus and records the loss curve and step times, so runs compare
side by side (loss equality is the proof that the offloaded update is the same
update; step time is the cost).  The runs take turns, ten steps at a time, so
the step times of one demo compare even on a machine whose speed drifts.
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

__all__ = ["RunResult", "RunSpec", "train_runs"]

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
BLOCK_STEPS = 10
"""Steps a run takes before the next run's turn (``train_runs``)."""


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


@dataclass
class RunSpec:
    """One run of the demo: a name, the optimizer it trains with, and what its progress line shows."""

    name: str
    make_optimizer: OptimizerFactory
    describe: Callable[[torch.optim.Optimizer], dict[str, str]] | None = None
    close: Callable[[torch.optim.Optimizer], dict[str, float]] | None = None


class _Run:
    """A run in progress: a fresh ``GPT(cfg)`` from the seed, its optimizer, its data and its progress bar."""

    def __init__(
        self,
        spec: RunSpec,
        position: int,
        *,
        cfg: GPTConfig,
        steps: int,
        seed: int,
        show: bool,
        lr_factor: Callable[[int], float] | None = None,
    ) -> None:
        self.spec = spec
        torch.manual_seed(seed)
        self.model = GPT(cfg)
        self.optimizer = spec.make_optimizer(self.model.parameters())
        self.lr_factor = lr_factor
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.data_gen = torch.Generator().manual_seed(seed + 1)
        self.result = RunResult(spec.name)
        self.show = show
        # on a terminal the bars redraw in place, one line each; in a log (CI, a pipe) a line every 10 s at most
        interactive = sys.stderr.isatty()
        self.progress = tqdm(
            total=steps,
            desc=f"{spec.name:<12}",
            unit="step",
            file=sys.stderr,
            disable=not show,
            position=position,
            dynamic_ncols=interactive,
            mininterval=0.1 if interactive else 10.0,
        )

    def train(self, steps: int, *, cfg: GPTConfig, corpus: CharCorpus, batch_size: int) -> None:
        model, optimizer, result = self.model, self.optimizer, self.result
        for _ in range(steps):
            if self.lr_factor is not None:  # as an LR scheduler would, between steps
                factor = self.lr_factor(len(result.losses))
                for group, base in zip(optimizer.param_groups, self.base_lrs, strict=True):
                    group["lr"] = base * factor
            x, y = corpus.batch(batch_size, cfg.block_size, self.data_gen)
            start = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            result.step_s.append(time.perf_counter() - start)
            result.losses.append(loss.item())
            if self.show:
                fields = {"loss": f"{loss.item():.3f}", "step": f"{result.step_s[-1] * 1e3:.0f}ms"}
                if self.spec.describe is not None:
                    fields.update(self.spec.describe(optimizer))
                self.progress.set_postfix(fields, refresh=False)
                self.progress.update()

    def finish(self) -> RunResult:
        self.progress.close()
        if self.spec.close is not None:
            self.result.extra.update(self.spec.close(self.optimizer))
        return self.result


def train_runs(
    specs: list[RunSpec],
    *,
    cfg: GPTConfig,
    corpus: CharCorpus,
    steps: int,
    batch_size: int,
    seed: int = 0,
    show: bool = True,
    block: int = BLOCK_STEPS,
    lr_factor: Callable[[int], float] | None = None,
) -> list[RunResult]:
    """Train one fresh ``GPT(cfg)`` per run for ``steps`` steps, the runs taking turns ``block`` steps at a
    time, so a machine that gets faster or slower meanwhile (another process, the clock) weighs on every run
    alike and the step times compare; each run's model, data and losses are its own, as if run alone.
    ``lr_factor(step)`` scales every run's learning rates before step ``step`` (0-based), the same schedule
    for all."""
    runs: list[_Run] = []
    try:
        for position, spec in enumerate(specs):
            runs.append(_Run(spec, position, cfg=cfg, steps=steps, seed=seed, show=show, lr_factor=lr_factor))
        for done in range(0, steps, block):
            for run in runs:
                run.train(min(block, steps - done), cfg=cfg, corpus=corpus, batch_size=batch_size)
    finally:
        results = [run.finish() for run in runs]
    return results

"""The demo's learning-rate schedule: every run trains its first half at ``--lr`` and its second at the
fine-tuning lr, where ``offload-dpu``'s update turns delayed."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tiermem.client.demo.model import CharCorpus, GPTConfig
from tiermem.client.demo.run import FINE_TUNE_LR, fine_tune_from, lr_schedule
from tiermem.client.demo.train import RunSpec, train_runs


class _LrRecorder(torch.optim.SGD):
    """SGD that records the lr of its one group at each step."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        super().__init__(params, lr=0.5)
        self.seen: list[float] = []

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        self.seen.append(self.param_groups[0]["lr"])
        return super().step(closure)


def test_every_run_switches_to_the_fine_tuning_lr_halfway() -> None:
    made: list[_LrRecorder] = []

    def factory(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        made.append(_LrRecorder(params))
        return made[-1]

    steps = 7
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=1, n_embd=8)
    train_runs(
        [RunSpec("a", factory), RunSpec("b", factory)],
        cfg=cfg,
        corpus=CharCorpus(nbytes=4096),
        steps=steps,
        batch_size=2,
        show=False,
        block=3,
        lr_factor=lr_schedule(steps),
    )
    switch = fine_tune_from(steps)
    expected = [0.5] * switch + [0.5 * FINE_TUNE_LR] * (steps - switch)
    assert [opt.seen for opt in made] == [expected, expected]

"""``ShardGrads``: a ZeRO-3 rank takes the figures of its reduced grads only when clipping or a scaler asks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tiermem.client.distributed.group import ShardGrads
from tiermem.core.errors import InvalidState


class OneRank:
    """The group's half of ``ShardGrads.decide``: what it was asked, as one rank sees it."""

    def __init__(self) -> None:
        self.sumsq: list[float | None] = []

    def decide(self, sumsq: float | None, **_: Any) -> None:
        self.sumsq.append(sumsq)


class NoScaler:
    """An optimizer no ``GradScaler`` stepped (``shard_scaler_inputs`` finds no ``grad_scale``)."""


def decide(grads: ShardGrads, *, max_grad_norm: float | None = None, held: float = -1.0) -> tuple[list[Any], int]:
    """One step's decision: what the group was asked, and how often the daemon was asked for ``held``, its sum
    of squares of the summed grads (GRAD_NORM)."""
    group = OneRank()
    asked = []

    def daemon() -> float:
        asked.append(held)
        return held

    grads.decide(group, NoScaler(), max_grad_norm, daemon)  # type: ignore[arg-type]
    grads.new_step()
    return [None if v is None else float(v) for v in group.sumsq], len(asked)


def step(grads: ShardGrads, *, max_grad_norm: float | None = None) -> list[float | None]:
    return decide(grads, max_grad_norm=max_grad_norm)[0]


def test_without_clipping_or_a_scaler_only_the_first_step_takes_the_figures() -> None:
    grads = ShardGrads()
    grads.add((0, 1), torch.tensor([3.0, 4.0]))
    assert grads.total == 25.0
    step(grads)
    assert not grads.watching
    grads.add((0, 1), torch.tensor([float("inf")]))
    assert grads.total == 0.0 and not grads.nonfinite and grads.unchecked
    with pytest.raises(InvalidState, match="use the scaler from the first step"):
        grads.check(torch.tensor(0.5), torch.zeros(()))


def test_clipping_takes_the_figures_of_every_step() -> None:
    grads = ShardGrads(clipping=True)
    for _ in range(2):
        grads.add((0,), torch.tensor([3.0, 4.0]))
        assert step(grads, max_grad_norm=1.0) == [25.0]
    assert grads.watching


def test_a_scaler_at_the_first_step_keeps_the_overflow_check_on() -> None:
    grads = ShardGrads()
    grads.add((0,), torch.tensor([1.0]))
    assert not bool(grads.check(torch.tensor(0.5), torch.zeros(())))
    step(grads)
    grads.add((0,), torch.tensor([float("nan")]))
    assert bool(grads.check(torch.tensor(0.5), torch.zeros(())))
    assert grads.watching


def test_an_accumulated_grad_marks_the_step_and_still_shows_an_overflow() -> None:
    grads = ShardGrads()
    grads.add((0,), torch.tensor([1.0]))
    grads.add((0,), torch.tensor([float("inf")]), accumulate=True)
    assert grads.accumulated and grads.nonfinite and grads.total == 1.0


def test_an_accumulated_step_is_clipped_by_the_daemons_figure_of_the_summed_grads() -> None:
    """Two passes' grads added in the daemon: the figures here are each pass's (9 + 16), and the norm of the
    sum exists only there, so the daemon is asked (once), and only when clipping."""
    grads = ShardGrads(clipping=True)
    grads.add((0,), torch.tensor([3.0]))
    grads.add((0,), torch.tensor([4.0]), accumulate=True)
    assert grads.total == 9.0  # the first pass's figure: the second only marks the step
    assert decide(grads, max_grad_norm=1.0, held=49.0) == ([49.0], 1)
    grads.add((0,), torch.tensor([3.0]))
    assert decide(grads, max_grad_norm=1.0, held=49.0) == ([9.0], 0)  # one pass: its own figure
    grads.add((0,), torch.tensor([3.0]))
    grads.add((0,), torch.tensor([4.0]), accumulate=True)
    assert decide(grads, held=49.0) == ([None], 0)  # no clipping: no norm, nothing asked


class Refusing(OneRank):
    def decide(self, sumsq: float | None, **_: Any) -> None:
        raise InvalidState("refused")


def test_a_refused_first_step_leaves_the_question_open() -> None:
    grads = ShardGrads()
    with pytest.raises(InvalidState, match="refused"):
        grads.decide(Refusing(), NoScaler(), None, lambda: 0.0)  # type: ignore[arg-type]
    grads.new_step()
    grads.add((0,), torch.tensor([float("inf")]))
    assert grads.watching and bool(grads.check(torch.tensor(0.5), torch.zeros(())))


def test_the_figures_stay_where_the_grads_are_until_they_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Taking a reduced grad's figures reads nothing back to the host (no wait for a device per submodule);
    the step reads them once, with the all-reduced norm (``RankGroup.read_back``)."""
    reads: list[str] = []
    for name in ("item", "tolist", "__float__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def counting(self: torch.Tensor, *args: Any, _real: Any = real, _name: str = name) -> Any:
            reads.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counting)
    grads = ShardGrads(clipping=True)
    for k in range(5):
        grads.add((k,), torch.full((7,), float(k)))
    grads.add((0,), torch.ones(3), accumulate=True)
    total = grads.total
    found_inf = grads.check(torch.tensor(0.5), torch.zeros(()))
    assert reads == ["__float__"]  # the scaler's inverse scale, not a grad's figure
    monkeypatch.undo()
    assert float(total) == pytest.approx(7 * (1 + 4 + 9 + 16)) and float(found_inf) == 0.0

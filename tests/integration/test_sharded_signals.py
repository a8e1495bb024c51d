"""The sharded optimizers under a signal handler that saves a checkpoint wherever it lands (one rank of a gloo
group, a real daemon): SIGUSR1 at random moments while training, each handled by ``opt.state_dict()``.

Every save must be one whole step: one step count on every piece, the pieces' masters and moments equal
(bitwise) to the state a save between steps holds after that many steps in a run without signals; the
training ends on the same params as that run.  ZeRO-3 paged is the one whose forward pages params in: a
handler's save that landed while a fetch was being finished finished it a second time ("cannot go from
resident to resident"), and one that landed in a grad push's wait took the push from under it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from signal_helpers import signals_to_main

from tiermem.client.distributed import LayerShardedAdam, ShardedOffloadAdam, ShardedPagedAdam
from tiermem.client.link import connect

KINDS = ["zero2", "zero3-layers", "zero3-paged"]
STEPS = 150
WANTED_IN_STEP = 8


def model() -> torch.nn.Module:
    torch.manual_seed(5)
    layers = [torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)]
    return torch.nn.Sequential(*layers)


def make(kind: str, m: torch.nn.Module, socket_path: str) -> Any:
    client = connect(socket_path)
    if kind == "zero2":
        return ShardedOffloadAdam(m.parameters(), lr=1e-2, client=client)
    if kind == "zero3-layers":
        return LayerShardedAdam(m, lr=1e-2, client=client)
    return ShardedPagedAdam(m, lr=1e-2, device_budget="24KiB", offload="cpu", client=client)


def train_step(m: torch.nn.Module, opt: Any, step: int) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    opt.zero_grad()
    m(x).pow(2).mean().backward()
    opt.step()


def pieces_of(saved: dict[str, Any]) -> tuple[set[int], list[tuple[torch.Tensor | None, ...]]]:
    """The step counts of a rank file's pieces, and each piece's master and moments (none before a step)."""
    pieces = saved["pieces"]
    return {int(p["step"]) for p in pieces}, [(p["value"], p.get("exp_avg"), p.get("exp_avg_sq")) for p in pieces]


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("kind", KINDS)
def test_saves_from_a_signal_handler_mid_training_are_whole_steps(daemon, one_rank_group, kind: str) -> None:
    quiet_model = model()
    quiet = make(kind, quiet_model, daemon.socket_path)
    reference = [pieces_of(quiet.state_dict())[1]]
    for step in range(STEPS):
        train_step(quiet_model, quiet, step)
        reference.append(pieces_of(quiet.state_dict())[1])
    final = [v.clone() for v in quiet_model.state_dict().values()]
    quiet.close()

    m = model()
    opt = make(kind, m, daemon.socket_path)
    saves: list[tuple[str, dict[str, Any]]] = []
    done = 0
    with signals_to_main(lambda inside: saves.append((inside, opt.state_dict())), seed=len(kind)):
        for step in range(STEPS):
            train_step(m, opt, step)
            done += 1
            if sum(inside == "step()" for inside, _ in saves) >= WANTED_IN_STEP:
                break
    in_step = sum(inside == "step()" for inside, _ in saves)
    assert in_step >= WANTED_IN_STEP, f"only {in_step} of {len(saves)} signals landed in step() in {done} steps"
    for inside, saved in saves:
        steps, pieces = pieces_of(saved)
        # ZeRO-3 by layer updates each unit as its grads are reduced, in backward: a save there holds the units
        # updated so far at the new step; the others save every piece at one step
        assert len(steps) <= (2 if kind == "zero3-layers" else 1), f"a save ({inside or 'the loop'}): {steps}"
        for i, (piece, got) in enumerate(zip(saved["pieces"], pieces, strict=True)):
            k = int(piece["step"])
            same_as = [s for s in range(len(reference)) if all(map(same, got, reference[s][i]))]
            assert k in same_as, f"piece {i} of a save at step {k} ({inside}) is step {same_as}"
    for step in range(done, STEPS):
        train_step(m, opt, step)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), final, strict=True))
    opt.close()

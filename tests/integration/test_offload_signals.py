"""A signal handler that saves a checkpoint, landing anywhere in training (``tiermem.client.offload.reentry``).

Lightning's SLURM auto-requeue handler saves a checkpoint from inside its
SIGUSR1 handler, so ``optimizer.state_dict()`` runs wherever the signal
landed: in ``step()`` too, while the optimizer waits for the daemon.  Here a
thread sends SIGUSR1 to the main thread at random moments while it trains;
the handler saves ``opt.state_dict()`` and the model's params.  Every save
must be one whole step: one step count on every tensor, the moments and the
params equal (bitwise) to those of ``CPUAdam`` after that many steps (the
daemon's arithmetic: eager, one thread).  A run counts the saves whose signal
interrupted ``step()`` and needs enough of them, so it cannot pass by never
landing there.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from offload_helpers import OffloadDaemon, cpu_adam
from signal_helpers import signals_to_main
from small_models import mlp, mlp_batches, mlp_loss, replicas

import tiermem
from tiermem.core.errors import InvalidState

HYPER: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
STEPS = 400
WANTED_IN_STEP = 12
"""Saves whose signal landed inside ``step()`` a run needs (at 0.5-4 ms between signals, a few hundred
steps give some dozens)."""


WANTED_MIXED = 6
"""With the overlapped update: saves that fell in a backward after some of its buckets were updated."""


def mixes_steps(save: tuple[str, dict[str, Any], list[torch.Tensor]]) -> bool:
    return len({int(entry["step"]) for entry in save[1]["state"].values()}) > 1


def reference_trajectory(base: torch.nn.Module, batches: list[Any]) -> list[tuple[list[torch.Tensor], list[Any]]]:
    """After each number of steps (0..len(batches)): CPUAdam's params and moments (``exp_avg``)."""
    (model,) = replicas(base, 1)
    opt = cpu_adam(model.parameters(), **HYPER)
    params = list(model.parameters())

    def snapshot() -> tuple[list[torch.Tensor], list[Any]]:
        moments = [opt.state[p]["exp_avg"].clone() if p in opt.state else None for p in params]
        return [p.detach().clone() for p in params], moments

    out = [snapshot()]
    for batch in batches:
        opt.zero_grad()
        mlp_loss(model, batch).backward()
        opt.step()
        out.append(snapshot())
    return out


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"exchange": "staged", "window_nbytes": 8192},
        {"offload": "nvme"},
        {"release_grads": True},
        {"exchange": "staged", "window_nbytes": 8192, "release_grads": True},
        {"exchange": "staged", "paged": True},
        {"overlap_update": True, "bucket_nbytes": 1024},
        {"exchange": "staged", "window_nbytes": 8192, "overlap_update": True, "bucket_nbytes": 1024},
    ],
    ids=["shared", "staged", "nvme", "released", "staged-released", "paged", "overlap", "staged-overlap"],
)
def test_a_handler_saving_checkpoints_mid_training_saves_whole_steps(
    offload: OffloadDaemon, options: dict[str, Any]
) -> None:
    base = mlp()
    batches = mlp_batches(STEPS, fixed=False)
    reference = reference_trajectory(base, batches)
    (model,) = replicas(base, 1)
    paged = options.pop("paged", False)
    opt = offload.make(model.parameters(), **HYPER, **options)
    if paged:  # within a budget of one layer (the largest: 16.25 KiB), so a lease for the handler would fail
        tiermem.offload_params(model, opt, device_budget=20_000, prefetch=1)
    saves: list[tuple[str, dict[str, Any], list[torch.Tensor]]] = []

    def save(inside: str) -> None:
        # as Lightning's checkpoint (and torch.save of a dict of both): the model's state dict (views of the
        # params; a paged model's gathers copies), then the optimizer's, then the bytes
        params = model.state_dict()
        state = opt.state_dict()
        saves.append((inside, state, [v.clone() for v in params.values()]))

    overlap = options.get("overlap_update", False)

    def enough() -> bool:
        in_step = sum(inside == "step()" for inside, _, _ in saves)
        return in_step >= WANTED_IN_STEP and (not overlap or sum(map(mixes_steps, saves)) >= WANTED_MIXED)

    done = 0
    with signals_to_main(save, seed=len(options)):
        for batch in batches:
            opt.zero_grad()
            mlp_loss(model, batch).backward()
            opt.step()
            done += 1
            if enough():
                break
    in_step = sum(inside == "step()" for inside, _, _ in saves)
    assert in_step >= WANTED_IN_STEP, f"only {in_step} of {len(saves)} signals landed in step() in {done} steps"
    if overlap:  # some saves landed in the backward, between the updates of its buckets
        mixed = sum(map(mixes_steps, saves))
        assert mixed >= WANTED_MIXED, f"only {mixed} of {len(saves)} saves fell between two buckets' updates"
    for inside, saved, values in saves:
        steps = sorted({int(entry["step"]) for entry in saved["state"].values()})
        where = inside or "the loop"
        assert len(steps) <= 1 or (overlap and steps[1] == steps[0] + 1), f"a save from {where} has steps {steps}"
        # each tensor at its own step: the model's param and the saved moments both of that step
        for i, p in enumerate(values):
            k = int(saved["state"][i]["step"]) if i in saved["state"] else 0
            ref_params, ref_moments = reference[k]
            assert torch.equal(p, ref_params[i]), f"param {i} of a save at step {k} (from {where})"
            if ref_moments[i] is not None:
                assert torch.equal(saved["state"][i]["exp_avg"], ref_moments[i]), f"exp_avg {i} at step {k}"
    # and training went on as if nothing had happened
    ref_params, _ = reference[done]
    assert all(torch.equal(v, ref) for v, ref in zip(model.state_dict().values(), ref_params, strict=True))


def test_a_handler_mid_training_with_the_delayed_update_saves_whole_steps(offload: OffloadDaemon) -> None:
    """The delayed update's trajectory depends on when its params are installed (a save installs them), so
    no reference run: each save holds one step count, its reads through ``opt.state`` agree with it, and
    training goes on to the end."""
    (model,) = replicas(mlp(), 1)
    opt = offload.make(model.parameters(), **HYPER, delayed_update=True, warmup_steps=2)
    first = next(iter(model.parameters()))
    saves: list[tuple[str, set[int], torch.Tensor | None, torch.Tensor | None]] = []

    def save(inside: str) -> None:
        saved = opt.state_dict()
        read = opt.state[first]["exp_avg"].clone() if first in opt.state else None
        steps = {int(entry["step"]) for entry in saved["state"].values()}
        saves.append((inside, steps, saved["state"].get(0, {}).get("exp_avg"), read))

    batches = mlp_batches(STEPS, fixed=False)
    done = 0
    with signals_to_main(save, seed=3):
        for batch in batches:
            opt.zero_grad()
            mlp_loss(model, batch).backward()
            opt.step()
            done += 1
            if sum(inside == "step()" for inside, _, _, _ in saves) >= WANTED_IN_STEP:
                break
    assert sum(inside == "step()" for inside, _, _, _ in saves) >= WANTED_IN_STEP
    for inside, steps, saved, read in saves:
        assert len(steps) <= 1, f"a save from inside {inside or 'the loop'} mixes steps {sorted(steps)}"
        if saved is not None:
            assert read is not None and torch.equal(saved, read)
    opt.flush()
    assert opt.steps == done
    assert {int(entry["step"]) for entry in opt.state_dict()["state"].values()} == {done}


class Preempted(Exception):
    """What a trainer's SIGUSR1 handler raises to leave the training loop (as ``sys.exit`` raises ``SystemExit``)."""


@pytest.mark.parametrize("exchange", ["shared", "staged"])
def test_an_exception_from_a_handler_mid_step_leaves_steps_true_for_the_loop_that_catches_it(
    offload: OffloadDaemon, exchange: str
) -> None:
    """A handler raises at random moments; the loop catches it and trains the batch ``opt.steps`` names next.
    ``step()`` waits for the outcome of a step the exception interrupted, and ``steps`` reads it where a second
    one ended that wait, so no batch is trained twice or skipped: the end equals CPUAdam's, bitwise.  Before,
    only ``KeyboardInterrupt`` was waited for, and ``steps`` could be a step behind: batches trained twice."""
    base = mlp()
    batches = mlp_batches(STEPS // 2, fixed=False)
    reference = reference_trajectory(base, batches)
    (model,) = replicas(base, 1)
    opt = offload.make(model.parameters(), **HYPER, exchange=exchange)
    armed = [False]
    landed: list[str] = []

    def preempt(inside: str) -> None:
        if armed[0]:
            armed[0] = False  # one exception per arming: the loop's except clause is not interrupted again
            landed.append(inside)
            raise Preempted

    def train() -> None:
        while opt.steps < len(batches):
            batch = batches[opt.steps]
            opt.zero_grad()
            mlp_loss(model, batch).backward()
            opt.step()

    with signals_to_main(preempt, seed=5):
        while True:
            try:
                armed[0] = True
                train()
                armed[0] = False
                break
            except Preempted:
                pass
    assert landed.count("step()") >= WANTED_IN_STEP, landed
    ref_params, _ = reference[len(batches)]
    assert all(torch.equal(p.detach(), ref) for p, ref in zip(model.parameters(), ref_params, strict=True))


def test_a_handler_that_steps_or_loads_mid_step_is_told_to_wait_for_it(offload: OffloadDaemon) -> None:
    (model,) = replicas(mlp(), 1)
    opt = offload.make(model.parameters(), **HYPER)
    batches = mlp_batches(200, fixed=False)
    errors: list[tuple[str, str]] = []
    tried = {"step()": 0}

    def meddle(inside: str) -> None:
        if inside != "step()":
            return
        tried["step()"] += 1
        for name, call in (("step()", opt.step), ("zero_grad()", opt.zero_grad)):
            with pytest.raises(InvalidState) as err:
                call()
            errors.append((name, str(err.value)))
        with pytest.raises(InvalidState):
            opt.load_state_dict(opt.state_dict())

    deadline = time.monotonic() + 60
    with signals_to_main(meddle, seed=7):
        for batch in batches:
            opt.zero_grad()
            mlp_loss(model, batch).backward()
            opt.step()
            if tried["step()"] >= 3 or time.monotonic() > deadline:
                break
    assert tried["step()"] >= 3
    name, message = errors[0]
    assert message.startswith(f"OffloadAdam.{name} was called while this thread is inside OffloadAdam.step()")
    assert "set a flag" in message
    # the refused calls changed nothing: the training equals CPUAdam's
    (ref_model,) = replicas(mlp(), 1)
    ref = cpu_adam(ref_model.parameters(), **HYPER)
    for batch in batches[: opt.steps]:
        ref.zero_grad()
        mlp_loss(ref_model, batch).backward()
        ref.step()
    pairs = zip(model.parameters(), ref_model.parameters(), strict=True)
    assert all(torch.equal(a.detach(), b.detach()) for a, b in pairs)

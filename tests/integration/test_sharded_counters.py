"""``steps``, ``last_grad_norm``, ``state_dict()`` and ``close()`` mean the same for ``OffloadAdam`` and the three
sharded optimizers (one rank of a gloo group, a real daemon):

- ``steps`` counts applied steps, as torch's ``state["step"]`` (a load of an earlier step's state goes back to
  it); a skipped one is ``skipped_steps``;
- ``last_grad_norm`` is the last step's global norm of the unscaled grads (``clip_grad_norm_``'s figure);
  after a skipped step it is that step's non-finite norm, or None where none was taken, never an earlier
  step's figure;
- ``state_dict()`` is a snapshot (later steps leave it alone) whose ``param_groups`` a load restores, as
  torch's are (every key: a scheduler's ``initial_lr`` and the trainer's own too);
- ``close()`` takes every hook off the model; closing twice is once; a closed optimizer refuses ``step()``;
- ``set_max_grad_norm()`` clips from the next step on as the constructor's ``max_grad_norm`` does.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from tiermem.client.distributed import LayerShardedAdam, ShardedGradScaler, ShardedOffloadAdam, ShardedPagedAdam
from tiermem.client.link import connect
from tiermem.client.offload.optimizer import OffloadAdam
from tiermem.core.errors import InvalidState

KINDS = ["offload", "zero2", "zero3-layers", "zero3-paged"]
CLIP = 100.0  # large: every step takes the norm, none is clipped
LR = 0.02


def model() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 2))


def loss_of(m: torch.nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
    return m(x).pow(2).mean()


def make(kind: str, m: torch.nn.Module, socket_path: str, clip: float | None = CLIP) -> tuple[Any, Any]:
    """The optimizer of ``kind`` over ``m`` with clipping at ``clip``, and the loss scaler it takes."""
    client = connect(socket_path)
    if kind == "offload":
        return OffloadAdam(m.parameters(), lr=LR, max_grad_norm=clip, client=client), torch.amp.GradScaler("cpu")
    if kind == "zero2":
        opt: Any = ShardedOffloadAdam(m.parameters(), lr=LR, max_grad_norm=clip, client=client)
    elif kind == "zero3-layers":
        opt = LayerShardedAdam(m, lr=LR, paged=True, max_grad_norm=clip, client=client)
    else:
        opt = ShardedPagedAdam(m, lr=LR, max_grad_norm=clip, device_budget="1MiB", offload="cpu", client=client)
    return opt, ShardedGradScaler("cpu")


def expected_norm(step: int, params: list[torch.Tensor]) -> float:
    """``clip_grad_norm_``'s figure for ``loss_of(model with these params, step)``."""
    ref = model()
    with torch.no_grad():
        for p, value in zip(ref.parameters(), params, strict=True):
            p.copy_(value)
    loss_of(ref, step).backward()
    return float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))


def current_params(kind: str, m: torch.nn.Module, opt: Any) -> list[torch.Tensor]:
    if kind == "zero3-layers":
        return opt.gathered_params()  # type: ignore[no-any-return]
    if kind == "zero3-paged":
        return [v.clone() for v in m.state_dict().values()]
    return [p.detach().clone() for p in m.parameters()]


def train_step(m: torch.nn.Module, opt: Any, scaler: Any, step: int, *, overflow: bool = False) -> None:
    loss = loss_of(m, step) * (math.inf if overflow else 1.0)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) or (isinstance(a, float) and math.isnan(a) and isinstance(b, float) and math.isnan(b))


def hooks_on(m: torch.nn.Module) -> int:
    modules = sum(
        len(x._forward_pre_hooks) + len(x._forward_hooks) + len(x._backward_pre_hooks) + len(x._backward_hooks)
        for x in m.modules()
    )
    return modules + sum(len(p._post_accumulate_grad_hooks or {}) for p in m.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_steps_norm_state_dict_and_close_mean_the_same_for_every_optimizer(daemon, one_rank_group, kind: str) -> None:
    m = model()
    hooks_before = hooks_on(m)
    opt, scaler = make(kind, m, daemon.socket_path)
    try:
        assert (opt.steps, opt.skipped_steps, opt.last_grad_norm) == (0, 0, None)
        norm = expected_norm(0, current_params(kind, m, opt))
        train_step(m, opt, scaler, 0)
        assert (opt.steps, opt.skipped_steps, opt.last_found_inf) == (1, 0, False)
        assert opt.last_grad_norm == pytest.approx(norm, rel=1e-5)

        train_step(m, opt, scaler, 1, overflow=True)  # the scaler finds inf: the step is skipped
        assert (opt.steps, opt.skipped_steps, opt.last_found_inf) == (1, 1, True)
        assert opt.last_grad_norm is None or not math.isfinite(opt.last_grad_norm), opt.last_grad_norm

        # a scheduler's key and the trainer's own are saved and come back with the group, as torch's do
        opt.param_groups[0].update(initial_lr=LR, name="all")
        saved = opt.state_dict()
        kept = copy.deepcopy(saved)
        norm = expected_norm(2, current_params(kind, m, opt))
        train_step(m, opt, scaler, 2)
        assert (opt.steps, opt.skipped_steps, opt.last_found_inf) == (2, 1, False)
        assert opt.last_grad_norm == pytest.approx(norm, rel=1e-5)
        assert same(saved, kept)  # a snapshot: the step after it changed nothing in it

        opt.param_groups[0].update(lr=0.5, initial_lr=0.5, name="changed")
        opt.load_state_dict(saved)
        assert opt.steps == 1  # the loaded step, as torch's state["step"]
        # torch's rule: the saved hyper-parameters come back
        assert (opt.param_groups[0]["lr"], opt.param_groups[0]["initial_lr"], opt.param_groups[0]["name"]) == (
            LR,
            LR,
            "all",
        )
        torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5**k, last_epoch=1)  # a schedule resumed after a load
    finally:
        opt.close()
    assert hooks_on(m) == hooks_before
    opt.close()  # twice is once
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(InvalidState, match="closed"):
        opt.step()


@pytest.mark.parametrize("kind", KINDS)
def test_a_clip_set_after_construction_clips_as_the_constructors_for_every_optimizer(
    daemon, one_rank_group, kind: str
) -> None:
    """``set_max_grad_norm`` (HF Trainer's callback hands its clip this way), before a step's first backward:
    that step clips as an optimizer made with the same ``max_grad_norm`` does, bit for bit, with the same
    norm; ``None`` turns clipping off again, and the next step takes no norm."""
    tight = 1e-3  # far below the norms here: it clips every step
    made, given = model(), model()
    made_opt, _ = make(kind, made, daemon.socket_path, clip=tight)
    given_opt, _ = make(kind, given, daemon.socket_path, clip=None)
    try:
        given_opt.set_max_grad_norm(tight)
        for m, opt in ((made, made_opt), (given, given_opt)):
            loss_of(m, 0).backward()
            opt.step()
            opt.zero_grad()
        assert given_opt.max_grad_norm == tight and given_opt.last_grad_norm == made_opt.last_grad_norm > tight
        for ours, theirs in zip(
            current_params(kind, given, given_opt), current_params(kind, made, made_opt), strict=True
        ):
            assert torch.equal(ours, theirs)
        given_opt.set_max_grad_norm(None)
        loss_of(given, 1).backward()
        given_opt.step()
        assert given_opt.max_grad_norm is None and given_opt.last_grad_norm is None
    finally:
        made_opt.close()
        given_opt.close()

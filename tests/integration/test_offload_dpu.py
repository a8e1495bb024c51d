"""``OffloadAdam(delayed_update=True)``: the delayed parameter update (ZeRO-Offload's DPU).

The rule, written out as a plain-torch reference (``DelayedReference``): the
first ``warmup_steps`` steps are synchronous; from then on, step ``t`` hands its
grads to the optimizer and installs the params of update ``t-1``, so the
forward and backward of step ``t`` ran on the params after update ``t-2`` (one
update behind).  The reference keeps an fp32 master copy of the model with its
own optimizer and copies the master into the model one step late.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
from offload_helpers import OffloadDaemon, assert_params_close, assert_params_equal, assert_state_close, cpu_adam, train
from small_models import Batch, LossFn, gpt_batches, gpt_loss, mlp, mlp_batches, mlp_loss, replicas, tiny_gpt
from torch import nn

WARMUP = 3


class DelayedReference:
    """The DPU rule over any optimizer: ``make_opt(master_params)`` updates an fp32 master copy."""

    def __init__(
        self, model: nn.Module, make_opt: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer], warmup: int
    ) -> None:
        self.model = model
        self.master = copy.deepcopy(model)
        self.opt = make_opt(list(self.master.parameters()))
        self.warmup = warmup
        self.steps = 0

    def _install(self) -> None:
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), self.master.parameters(), strict=True):
                p.copy_(q)

    def step(self, batch: Batch, loss_fn: LossFn) -> float:
        loss = loss_fn(self.model, batch)
        loss.backward()
        for p, q in zip(self.model.parameters(), self.master.parameters(), strict=True):
            q.grad = p.grad
            p.grad = None
        self.steps += 1
        if self.steps <= self.warmup:
            self.opt.step()
            self._install()  # synchronous: the model gets update t now
        else:
            self._install()  # the model gets update t-1 ...
            self.opt.step()  # ... while update t runs on grads taken at update t-2's params
        self.opt.zero_grad()
        return float(loss.detach())

    def flush(self) -> None:
        self._install()


def test_delayed_update_follows_the_reference_rule_mlp(offload: OffloadDaemon) -> None:
    base = mlp()
    batches = mlp_batches(30, fixed=False)
    m_off, m_ref = replicas(base, 2)
    opt = offload.make(m_off.parameters(), lr=1e-2, weight_decay=0.1, delayed_update=True, warmup_steps=WARMUP)
    ref = DelayedReference(m_ref, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), WARMUP)
    staleness = []

    def after(i: int) -> None:
        staleness.append(opt.stats().staleness_steps)

    losses = train(m_off, opt, batches, mlp_loss, after_step=after)
    ref_losses = [ref.step(batch, mlp_loss) for batch in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert staleness == [0] * WARMUP + [1] * (len(batches) - WARMUP)
    # one update behind: the model holds update 29, the optimizer has applied 30
    assert_params_close(m_off, m_ref)
    assert opt.stats().rank.last_step == len(batches)
    sync = replicas(base, 1)[0]
    train(sync, torch.optim.AdamW(sync.parameters(), lr=1e-2, weight_decay=0.1), batches, mlp_loss)
    with pytest.raises(AssertionError):
        assert_params_close(m_off, sync)  # not the synchronous trajectory
    # state_dict() waits for the last update and installs it
    saved = opt.state_dict()
    assert opt.stats().staleness_steps == 0
    ref.flush()
    assert_params_close(m_off, ref.master)
    assert_state_close(saved, ref.opt.state_dict())


def test_delayed_update_gpt_matches_the_engine_exactly(offload: OffloadDaemon) -> None:
    """The transformer, against the same rule over CPUAdam (the daemon's arithmetic): bitwise equal."""
    base = tiny_gpt()
    batches = gpt_batches(25)
    m_off, m_ref = replicas(base, 2)
    opt = offload.make(m_off.parameters(), lr=2e-3, weight_decay=0.1, delayed_update=True, warmup_steps=WARMUP)
    ref = DelayedReference(m_ref, lambda ps: cpu_adam(ps, lr=2e-3, weight_decay=0.1), WARMUP)
    losses = train(m_off, opt, batches, gpt_loss)
    ref_losses = [ref.step(batch, gpt_loss) for batch in batches]
    assert losses == ref_losses
    assert_params_equal(m_off, m_ref)
    opt.flush()
    ref.flush()
    assert_params_equal(m_off, m_ref)
    assert opt.stats().staleness_steps == 0


def test_delayed_update_with_no_warmup(offload: OffloadDaemon) -> None:
    base = mlp()
    batches = mlp_batches(10, fixed=False)
    m_off, m_ref = replicas(base, 2)
    opt = offload.make(m_off.parameters(), lr=1e-2, weight_decay=0.0, delayed_update=True, warmup_steps=0)
    ref = DelayedReference(m_ref, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0), 0)
    train(m_off, opt, batches, mlp_loss)
    for batch in batches:
        ref.step(batch, mlp_loss)
    assert_params_close(m_off, m_ref)


@pytest.mark.slow
def test_delayed_update_lags_the_synchronous_one_no_more_than_the_rule_itself(offload: OffloadDaemon) -> None:
    """The GPT on the generated corpus, 1000 steps: the DPU run learns, and its final loss is no further above
    the synchronous run's than the rule's plain-torch reference (``DelayedReference`` over ``torch.optim.AdamW``)
    is above plain AdamW.

    The one-step staleness costs this tiny, fast-learning model a lasting gap: measured, the reference rule ends
    11.7% above AdamW at 1000 steps and 10.7% at 2000 (mean of the last 30 batches), tiermem's delayed run 3.4%
    above its synchronous one at 1000.  An earlier version of this test asked for 2% at 1000 steps, which the
    rule itself does not reach on this model."""
    base = tiny_gpt()
    batches = gpt_batches(1000, batch=8)

    def final(losses: list[float]) -> float:
        return sum(losses[-30:]) / 30  # the last 30 batches: single batches are noisy

    finals = []
    for delayed in (False, True):
        model = replicas(base, 1)[0]
        opt = offload.make(model.parameters(), lr=3e-3, weight_decay=0.1, delayed_update=delayed, warmup_steps=50)
        losses = train(model, opt, batches, gpt_loss)
        assert losses[-1] < losses[0] * 0.3, "the model did not learn"
        finals.append(final(losses))
        if delayed:
            assert opt.stats().staleness_steps == 1
    m_sync, m_rule = replicas(base, 2)
    plain = final(train(m_sync, torch.optim.AdamW(m_sync.parameters(), lr=3e-3, weight_decay=0.1), batches, gpt_loss))
    rule = DelayedReference(m_rule, lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1), 50)
    rule_final = final([rule.step(batch, gpt_loss) for batch in batches])
    sync, delayed_final = finals
    ours, theirs = (delayed_final - sync) / sync, (rule_final - plain) / plain
    assert ours <= max(theirs, 0.0) + 0.02, f"delayed {ours:+.1%} above synchronous; the rule itself: {theirs:+.1%}"


def test_params_edited_after_a_flush_are_taken_by_the_next_delayed_step(offload: OffloadDaemon) -> None:
    """After ``flush()`` the model holds the last update; an in-place edit made then is the params the next
    delayed step starts from (the daemon adopts it), as in the reference where the edit reaches the master."""
    base = mlp()
    batches = mlp_batches(12, fixed=False)
    m_off, m_ref = replicas(base, 2)
    opt = offload.make(m_off.parameters(), lr=1e-2, weight_decay=0.1, delayed_update=True, warmup_steps=WARMUP)
    ref = DelayedReference(m_ref, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), WARMUP)

    def edit(*models: nn.Module) -> None:
        with torch.no_grad():
            for m in models:
                for p in m.parameters():
                    p.mul_(0.5)

    losses = train(m_off, opt, batches[:6], mlp_loss)
    ref_losses = [ref.step(batch, mlp_loss) for batch in batches[:6]]
    opt.flush()
    ref.flush()
    edit(m_off)
    edit(m_ref, ref.master)
    losses += train(m_off, opt, batches[6:], mlp_loss)
    ref_losses += [ref.step(batch, mlp_loss) for batch in batches[6:]]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    opt.flush()
    ref.flush()
    assert_params_close(m_off, ref.master)

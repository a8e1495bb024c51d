"""``ShardedOptimizer``: the one sharded optimizer; ZeRO-2, ZeRO-3 by layer and ZeRO-3 paged are its strategies.

A sharded optimizer is a ``torch.optim.Optimizer`` per rank composed of the
rank's ``OffloadAdam`` (``inner``, over the share this rank keeps; None on a
rank that keeps nothing), its process group (``RankGroup``) and a strategy.
This facade owns what does not depend on the strategy, once:

- the start: the group (``_join``), the job's identity (``RankGroup.
  agree_identity``), the model every rank must agree on (``_agree_on_model``)
  and the attach of the inner optimizers, on every rank or on none
  (``_attach_inner``);
- the step: the strategy's decision over the global grad statistics
  (collective), then the inner step with that decision, then the strategy's
  gather (``step``);
- the counters, in one record (``StepOutcome``), with one meaning for every
  strategy and for ``OffloadAdam``:

  - ``steps``: steps applied, as torch's ``state["step"]`` counts them
    (skipped steps are ``skipped_steps``); the daemon's counts where the rank
    reattached to a job's state or loaded a checkpoint;
  - ``last_grad_norm``: the last ``step()``'s global norm of the unscaled
    grads, applied or skipped, when that step took one (clipping, or a scaler's
    check over reduced grads), else None.  After a skipped step it is the
    non-finite norm that caused the skip, or None where the scaler's flags
    decided alone; never the figure of an earlier step;
  - ``last_found_inf``, ``last_skipped``: whether the last step saw an inf/nan
    grad, and whether it was skipped;
- ``close()``: the hooks taken off the model, the job id released, the inner
  optimizer detached, the schedule's group given back; twice is once, and a
  closed optimizer refuses ``step()``.

What a strategy declares (``ShardStrategy``, implemented by the subclasses
``ShardedOffloadAdam``, ``LayerShardedAdam`` and ``ShardedPagedAdam``):

- where grads come from and the decision over them (``_decide``): ZeRO-2
  reduce-scatters the trainer's grads at ``step()``; ZeRO-3 reduced them into
  the daemons as they landed and keeps their statistics (``ShardGrads``);
- what the inner optimizer gets before its step (``_hand_over``) and its
  hyper-parameters (``_sync_hyper``);
- how params are gathered after an update (``_after_update``): ZeRO-2
  all-gathers every bucket; ZeRO-3 gathers at use, so it only ends the step's
  schedule;
- which share this rank keeps: ZeRO-2's ``ShardLayout`` pieces, ZeRO-3's
  ``RankShare`` slots (``zero3_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tiermem.client.distributed.group import NotCopyable, RankGroup
from tiermem.client.distributed.identity import release_job_id
from tiermem.client.link import Client
from tiermem.client.offload.args import closure_loss
from tiermem.client.offload.optimizer import OffloadAdam
from tiermem.core.errors import InvalidArgument, InvalidState
from tiermem.core.step_rules import StepDecision

__all__ = ["ShardStrategy", "ShardedOptimizer", "StepOutcome"]


@dataclass
class StepOutcome:
    """The counters of a sharded optimizer (see the module docstring for their meaning): the one record a step's
    outcome is written to."""

    applied: int = 0
    skipped: int = 0
    last_grad_norm: float | None = None
    last_found_inf: bool = False
    last_skipped: bool = False

    def record(self, decision: StepDecision) -> None:
        """Step ``decision`` was applied (or skipped) on every rank."""
        if decision.skip:
            self.skipped += 1
        else:
            self.applied += 1
        self.last_grad_norm = decision.grad_norm
        self.last_found_inf = decision.nonfinite
        self.last_skipped = decision.skip

    def adopt(self, inner: OffloadAdam | None) -> None:
        """The daemon's counts (a reattached job, a loaded checkpoint), where this rank has an inner optimizer."""
        if inner is not None:
            self.applied, self.skipped = inner.steps, inner.skipped_steps


class ShardStrategy(Protocol):
    """What a sharding strategy gives the facade (see the module docstring)."""

    def _decide(self) -> StepDecision:
        """Collective: this step's grads reduced (or their statistics taken as they landed) and the decision every
        rank applies.  A refused step raises here, with the strategy's per-step state reset."""

    def _hand_over(self, decision: StepDecision) -> None:
        """Before the inner step: what the inner optimizer needs of the trainer (ZeRO-2: edited params, the
        reduced grads); only on a rank with an inner optimizer."""

    def _sync_hyper(self) -> None:
        """The groups' hyper-parameters (a scheduler or the user may have changed them) into the inner groups."""

    def _after_update(self, decision: StepDecision) -> None:
        """After the inner step on every rank (also one without an inner optimizer): the params gathered where
        the strategy gathers them after an update."""

    def _end_step(self) -> None:
        """The step is over, applied, skipped or failed: the strategy's per-step state starts afresh."""


class ShardedOptimizer(NotCopyable, torch.optim.Optimizer):
    """The facade of the sharded optimizers; see the module docstring.  Subclasses are the strategies."""

    _step_supports_amp_scaling = True
    """``GradScaler.step`` hands the scale and the found-inf flag over as attributes and always calls
    ``step()``, which skips by itself (the decision is global)."""

    inner: OffloadAdam | None
    group: RankGroup
    job_id: str = ""

    def _join(self, process_group: Any, who: str, *, alone_hint: str = "") -> None:
        """The first thing a strategy's constructor does: this rank's place in ``process_group`` and the facade's
        own state (no collective)."""
        self.group = RankGroup(process_group, who, alone_hint=alone_hint)
        self.process_group = process_group
        """The group the optimizer is sharded over (what ``ShardedGradScaler`` all-reduces its flags over)."""
        self.rank = self.group.rank
        self.world_size = self.group.world_size
        self.inner = None
        self.outcome = StepOutcome()
        self._hooks: list[Any] = []
        """The handles of the hooks on the model or its params, removed at ``close()``."""
        self._closed = False

    # ----------------------------------------------------------------- the start

    def _agree_on_model(self, params: Sequence[torch.Tensor], group_of: Sequence[int]) -> None:
        """Collective: every rank holds the same model (dtypes, shapes, param groups), or every rank raises."""
        mine = ([str(p.dtype) for p in params], [tuple(p.shape) for p in params], list(group_of))
        everyone: list[Any] = [None] * self.world_size
        self.group.collective("check of the model", dist.all_gather_object, everyone, mine)
        for r, theirs in enumerate(everyone):
            if theirs != mine:
                raise InvalidArgument(
                    f"rank {r} has a different model than rank {self.rank} (dtype, param shapes or param groups "
                    f"differ: {len(theirs[1])} params against {len(mine[1])}); every rank must build the same model"
                )

    def _attach_inner(self, client: Client | None, make: Callable[[], OffloadAdam | None]) -> None:
        """Collective: ``inner = make()`` on every rank, or on none: a rank attached here while another failed
        detaches, leaving the job's state waiting, and the job id is released.  ``make`` closes ``client``
        itself when it returns None (a rank that keeps nothing)."""

        def attach() -> None:
            self.inner = make()

        try:
            self.group.all_or_none("attach", attach)
        except BaseException:
            if self.inner is not None:
                self.inner.close(keep_state=True)
                self.inner = None
            elif client is not None:
                client.close()
            release_job_id(self.job_id)
            raise
        self.outcome.adopt(self.inner)

    # ----------------------------------------------------------------- counters

    @property
    def steps(self) -> int:
        """Steps applied (``StepOutcome``; skipped steps are ``skipped_steps``)."""
        return self.outcome.applied

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on an overflow (a ``ShardedGradScaler`` found inf/nan on some rank)."""
        return self.outcome.skipped

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global norm of the unscaled grads, applied or skipped, when it took one (see the
        module docstring)."""
        return self.outcome.last_grad_norm

    @property
    def last_found_inf(self) -> bool:
        return self.outcome.last_found_inf

    @property
    def last_skipped(self) -> bool:
        return self.outcome.last_skipped

    @property
    def token(self) -> str:
        """The job token.  A relaunch of the same run derives it again (``identity``); pass it as ``token=``
        only where the user's job secret is not available."""
        return self.group.token

    # ----------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Decide on the global grad statistics (collective), apply that decision in the rank's daemon, gather."""
        loss = closure_loss(closure)
        self._check_open()
        decision = self._decide()  # type: ignore[attr-defined]
        try:
            if self.inner is not None:
                if not decision.skip:
                    self._hand_over(decision)  # type: ignore[attr-defined]
                self._sync_hyper()  # type: ignore[attr-defined]
                # the daemon scales the grads by the decision's factor (unscaled, then clipped), or counts the skip
                self.inner.step(decision=decision)
            self._after_update(decision)  # type: ignore[attr-defined]
        finally:
            self._end_step()  # type: ignore[attr-defined]
            self.group.steps += 1
        self.outcome.record(decision)
        return loss

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidState(f"this {type(self).__name__} is closed")

    def _after_load(self) -> None:
        """A checkpoint was loaded: the counters are the daemon's."""
        self.outcome.adopt(self.inner)

    # ----------------------------------------------------------------- life

    def _before_close(self) -> None:
        """A strategy's last word before it detaches (a warning, say)."""

    def close(self, *, keep_state: bool = False) -> None:
        """Take the hooks off the model, detach from the daemon (this rank's share is freed unless
        ``keep_state``) and give the schedule's group back.  A closed optimizer refuses ``step()``; closing
        again does nothing."""
        if self._closed:
            return
        self._before_close()
        self._closed = True
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        release_job_id(self.job_id)
        if self.inner is not None:
            self.inner.close(keep_state=keep_state)
            self.inner = None
        self.group.close()

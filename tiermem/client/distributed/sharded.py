"""``ShardedOptimizer``: the one sharded optimizer, and ``ShardStrategy``, the plug-in point its strategies fill.

A sharded optimizer is a ``torch.optim.Optimizer`` per rank composed of the
rank's ``OffloadAdam`` (``inner``, over the share this rank keeps; None on a
rank that keeps nothing), its process group (``RankGroup``), the rank files
(``Zero3Checkpoint``) and a strategy object (``strategy``): ZeRO-2
(``optimizer.Zero2Strategy``), ZeRO-3 by layer (``zero3.LayerStrategy``) or
ZeRO-3 paged (``paged.PagedStrategy``).  ``ShardedOffloadAdam``,
``LayerShardedAdam`` and ``ShardedPagedAdam`` are thin constructors: each
checks its arguments, makes its strategy and hands it to this facade, and
names the strategy's own public methods (``no_sync``, ``unscale_shards``...).

The facade owns what does not depend on the strategy, once:

- the start (``_start``), in one order on every rank: this rank's place in the
  group (``_join``), the model every rank must agree on (``_agree_on_model``)
  and rank 0's values broadcast, the schedule of the steps' collectives, the
  strategy's plan of this rank's share (``plan``), the job's identity
  (``RankGroup.agree_identity``), the node's daemon sized by the strategy's
  ``OffloadOptions``, the inner optimizers attached on every rank or on none
  (``_attach_inner``), the rank files over the strategy's ``share``, the
  strategy's own start over the inner optimizers (``attached``);
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
- the checkpoints, one format for every strategy: ``state_dict()`` is this
  rank's file (``zero3_checkpoint``), loading at any world size
  (``load_shards``) and merged by ``tiermem consolidate``, with torch's
  ``state`` over the rank's stretches beside it, which
  ``torch.distributed.checkpoint`` saves and loads at any world size;
  ``opt.state`` is that ``state`` by param (``stretches.HeldStateView``);
- a ZeRO-3 model's place in the frameworks: a DDP around it reduces no grads
  (``under_ddp``), and ``consolidate_model_state`` gathers it for a save
  from one process (``kept_model``);
- ``close()``: the hooks taken off the model, the job id released, the inner
  optimizer detached, the schedule's group given back; twice is once, and a
  closed optimizer refuses ``step()``.

What a strategy declares (``ShardStrategy``):

- its param groups over the model (``param_groups_for``) and this rank's share
  of them as the inner optimizer's groups (``plan``), and that share in the
  rank files' terms (``share``);
- where grads come from and the decision over them (``decide``): ZeRO-2
  reduce-scatters the trainer's grads at ``step()``; ZeRO-3 reduced them into
  the daemons as they landed and keeps their statistics (``ShardGrads``);
- what the inner optimizer gets before its step (``hand_over``) and its
  hyper-parameters (``sync_hyper``);
- how params are gathered after an update (``after_update``): ZeRO-2
  all-gathers every bucket; ZeRO-3 gathers at use, so it does nothing.

A strategy reads the facade's state (the group, the inner optimizer, the
param groups, the schedule) through ``ShardStrategy``'s properties and owns
only its own: the facade is the one owner of each.
"""

from __future__ import annotations

import abc
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from tiermem.client.distributed.group import NotCopyable, RankGroup, check_max_grad_norm
from tiermem.client.distributed.identity import release_job_id
from tiermem.client.distributed.kept_model import KeptModelState
from tiermem.client.distributed.reshard import ShardSet, Source, is_rank_file, open_shards
from tiermem.client.distributed.schedule import Collectives, Probe, check_timeout
from tiermem.client.distributed.stretches import HeldStateView
from tiermem.client.distributed.under_ddp import DdpOff
from tiermem.client.distributed.zero3_checkpoint import InnerStore, RankShare, Zero3Checkpoint
from tiermem.client.link import Client
from tiermem.client.offload.args import check_group_switches, closure_loss, torch_switch_name
from tiermem.client.offload.optimizer import OffloadAdam
from tiermem.client.offload.options import OffloadOptions
from tiermem.client.offload.reentry import Calls
from tiermem.client.offload.transfer import hooked_load, hooked_state_dict
from tiermem.core.errors import InvalidArgument, InvalidState
from tiermem.core.grad_mode import without_grad
from tiermem.core.param_groups import check_params_once
from tiermem.core.step_rules import StepDecision

__all__ = ["InnerPlan", "ShardStrategy", "ShardedOptimizer", "StepOutcome", "of_strategy"]


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


@dataclass(frozen=True)
class InnerPlan:
    """This rank's share as its inner ``OffloadAdam`` takes it: torch param groups over the rank's host tensors
    (each with its group's hyper-parameters; none: the rank keeps nothing), and what sizes the node's daemon."""

    groups: list[dict[str, Any]]
    dtype: str
    """The working dtype's name (``tiermem.core.dtypes``)."""

    @property
    def numels(self) -> list[int]:
        return [p.numel() for g in self.groups for p in g["params"]]


class ShardStrategy(abc.ABC):
    """What a sharding strategy gives the facade (see the module docstring): the abstract methods every
    strategy implements, and optional hooks that do nothing unless a strategy has something to do there.  ``opt`` is the
    facade, bound by its start."""

    name: ClassVar[str]
    """The optimizer's name, as errors, logs and the rank files say it."""
    alone_hint: ClassVar[str] = ""
    """What to use instead, said where the optimizer is made outside a process group."""
    keeps_values: bool = False
    """The inner tensors hold the params' values in the trainer (not paged): a checkpoint load writes them."""
    groups_rule: ClassVar[str] = (
        "shards the params it was made with; give every group to its constructor, or make a new one"
    )
    """Why a param group cannot be added once the optimizer is made, and what to do instead."""
    broadcast_params: bool = True
    """Rank 0's values become every rank's at the start."""
    max_grad_norm: float | None
    """Clip by the global norm of the reduced grads at this (None: no clipping)."""
    options: OffloadOptions
    """The settings this rank's inner ``OffloadAdam`` is built with, and its node's daemon sized by."""
    opt: ShardedOptimizer

    # ----------------------------------------------------------------- the facade's state, read

    @property
    def group(self) -> RankGroup:
        return self.opt.group

    @property
    def inner(self) -> OffloadAdam | None:
        return self.opt.inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.opt.param_groups

    @property
    def schedule(self) -> Collectives:
        return self.opt.schedule

    @property
    def rank(self) -> int:
        return self.opt.group.rank

    @property
    def world_size(self) -> int:
        return self.opt.group.world_size

    def params(self) -> list[torch.nn.Parameter]:
        """The optimizer's params, in its groups' order."""
        return [p for g in self.opt.param_groups for p in g["params"]]

    def keep_hook(self, handle: Any) -> None:
        """A hook this strategy put on the model or its params: removed at ``close()``."""
        self.opt._hooks.append(handle)

    # ----------------------------------------------------------------- the start

    @abc.abstractmethod
    def param_groups_for(self, group: RankGroup) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The optimizer's torch param groups and defaults (local: no collective)."""

    def prepare(self) -> None:  # noqa: B027 (an optional hook)
        """Local checks of the params, once the param groups are made, before any collective."""

    @abc.abstractmethod
    def plan(self) -> InnerPlan:
        """This rank's share, after the model was agreed on and broadcast (local)."""

    def attached(self) -> None:  # noqa: B027 (an optional hook)
        """Collective: the strategy's own start once the inner optimizers are attached on every rank."""

    @abc.abstractmethod
    def share(self) -> RankShare:
        """What this rank holds, in the rank files' terms; asked once attached, before ``attached``."""

    def reduced_model(self) -> torch.nn.Module | None:
        """The model whose forwards turn off the grad reduction of a DDP that wraps it (``under_ddp``): ZeRO-3's,
        which reduces every grad itself.  None by default: ZeRO-2 takes DDP's reduced grads where DDP wraps the
        model (``Zero2Strategy._backward_end``)."""
        return None

    def refresh(self) -> None:  # noqa: B027 (an optional hook)
        """Before a checkpoint reads the rank's share: bring it up to the model (ZeRO-2: in-place edits)."""

    # ----------------------------------------------------------------- the step

    @abc.abstractmethod
    def decide(self) -> StepDecision:
        """Collective: this step's grads reduced (or their statistics taken as they landed) and the decision every
        rank applies.  A refused step raises here, with the strategy's per-step state reset."""

    def hand_over(self, decision: StepDecision) -> None:  # noqa: B027 (an optional hook)
        """Before an applied inner step: what the inner optimizer needs of the trainer (ZeRO-2: edited params,
        the reduced grads); only on a rank with an inner optimizer."""

    @abc.abstractmethod
    def sync_hyper(self) -> None:
        """The groups' hyper-parameters (a scheduler or the user may have changed them) into the inner groups."""

    def after_update(self, decision: StepDecision) -> None:  # noqa: B027 (an optional hook)
        """After the inner step on every rank (also one without an inner optimizer): the params gathered where
        the strategy gathers them after an update."""

    def end_step(self) -> None:  # noqa: B027 (an optional hook)
        """The step is over, applied, skipped or failed: the strategy's per-step state starts afresh."""

    # ----------------------------------------------------------------- the rest of an optimizer's life

    def zero_grad(self, set_to_none: bool) -> None:
        torch.optim.Optimizer.zero_grad(self.opt, set_to_none=set_to_none)

    def set_max_grad_norm(self, max_grad_norm: float | None) -> None:
        """``ShardedOptimizer.set_max_grad_norm``: a strategy that takes the grads' figures as they are reduced
        (ZeRO-3) says first whether it can from now on."""
        self.max_grad_norm = max_grad_norm

    def values_loaded(self) -> None:  # noqa: B027 (an optional hook)
        """Loaded rank files gave the rank's share its values (ZeRO-2 gathers them into every rank's model)."""

    def before_close(self) -> None:  # noqa: B027 (an optional hook)
        """The strategy's last word before it detaches (a warning, say)."""


class of_strategy:
    """An attribute or method of a thin constructor's optimizer that is its strategy's, by the same name:
    ``no_sync = of_strategy()`` in the class body reads ``opt.strategy.no_sync``.  Read-only."""

    def __init__(self, doc: str = "") -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, opt: Any, owner: type | None = None) -> Any:
        return self if opt is None else getattr(opt.strategy, self.name)

    def __set__(self, opt: Any, value: Any) -> None:
        raise AttributeError(f"{type(opt).__name__}.{self.name} is its strategy's (opt.strategy.{self.name})")


def _no_change() -> None:
    """A load refused on some rank: nothing to do."""


class ShardedOptimizer(NotCopyable, torch.optim.Optimizer):
    """The facade of the sharded optimizers; see the module docstring.  Made by the thin constructors
    (``ShardedOffloadAdam``, ``LayerShardedAdam``, ``ShardedPagedAdam``), each with its strategy."""

    _step_supports_amp_scaling = True
    """``GradScaler.step`` hands the scale and the found-inf flag over as attributes and always calls
    ``step()``, which skips by itself (the decision is global)."""

    inner: OffloadAdam | None
    group: RankGroup
    schedule: Collectives
    """The steps' collectives, each bounded by ``collective_timeout_s`` (their counts: ``last_counts``)."""
    checkpoint: Zero3Checkpoint
    """The rank files (``save_shard``, ``load_shards``: any world size; ``tiermem consolidate``)."""
    job_id: str = ""

    def __init__(
        self,
        strategy: ShardStrategy,
        process_group: Any,
        client: Client | None,
        job_id: str | None,
        token: str | None,
        collective_timeout_s: float,
        probe: Probe | None,
        /,
    ) -> None:
        """The start (see the module docstring); collective from the model's check on.  The thin constructors'
        arguments of the same names, in this order: ``client`` this rank's connection to its node's daemon
        (None: found, or started for the node); ``job_id``, ``token`` (None: agreed, ``identity``)."""
        self._calls = Calls(type(self).__name__)
        self._consolidated: dict[str, Any] | None = None
        """``consolidate_state_dict``'s whole state, on the rank it went to, until a step or a load."""
        check_timeout(collective_timeout_s)
        self._join(process_group, strategy)
        groups, defaults = strategy.param_groups_for(self.group)
        super().__init__(groups, defaults)
        self.state = HeldStateView(self._held_entries)  # type: ignore[assignment]
        self._start(client, job_id, token, collective_timeout_s, probe)

    def _join(self, process_group: Any, strategy: ShardStrategy) -> None:
        """This rank's place in ``process_group`` and the facade's own state (no collective)."""
        self.group = RankGroup(process_group, strategy.name, alone_hint=strategy.alone_hint)
        self.process_group = process_group
        """The group the optimizer is sharded over (what ``ShardedGradScaler`` all-reduces its flags over)."""
        self.rank = self.group.rank
        self.world_size = self.group.world_size
        self.strategy = strategy
        strategy.opt = self
        self.inner = None
        self.outcome = StepOutcome()
        self._hooks: list[Any] = []
        """The handles of the hooks on the model or its params, removed at ``close()``."""
        self.kept_model = KeptModelState()
        """ZeRO-3: ``consolidate_model_state``'s values, on the rank that keeps them."""
        self.ddp_off: DdpOff | None = None
        """ZeRO-3: called by the strategy's forward hooks with the module about to run (``under_ddp``)."""
        self._started = False
        self._closed = False

    @property
    def options(self) -> OffloadOptions:
        """The settings this rank's inner ``OffloadAdam`` is built with, and its node's daemon sized by."""
        return self.strategy.options

    # ----------------------------------------------------------------- the start

    def _start(
        self, client: Client | None, job_id: str | None, token: str | None, timeout_s: float, probe: Probe | None
    ) -> None:
        strategy = self.strategy
        strategy.prepare()
        params = strategy.params()
        self._agree_on_model(params, [g for g, group in enumerate(self.param_groups) for _ in group["params"]])
        if strategy.broadcast_params:
            self.group.broadcast_from_first(p.data for p in params)
        self.schedule = self.group.start_schedule(timeout_s, probe)
        try:
            plan = strategy.plan()
            self.job_id, _ = self.group.agree_identity(job_id, token)
            if client is None:
                client = self.group.node_client(plan.numels, strategy.options, dtype=plan.dtype)
            self._attach_inner(client, plan)
            share = strategy.share()  # while the model still holds whole params (``attached`` may release them)
            self._hook_model(strategy.reduced_model(), params)
            strategy.attached()
        except BaseException:
            self.close(keep_state=True)  # a rank attached while another failed leaves the job's state waiting
            raise
        store = InnerStore(
            self.job_id,
            self.param_groups,
            self.inner,
            strategy.sync_hyper,
            keeps_values=strategy.keeps_values,
            refresh=self._refresh,
        )
        self.checkpoint = Zero3Checkpoint(share, store, self.group.collective)
        self._started = True

    def _hook_model(self, model: torch.nn.Module | None, params: Sequence[torch.nn.Parameter]) -> None:
        """ZeRO-3 (``model`` given): ``ddp_off``, which the strategy's forward hooks call so that a DDP around
        the model reduces no grads (``under_ddp``), and the hooks that end the use of
        ``consolidate_model_state``'s values: the start and end of a ``model.state_dict()``, and the end of a
        ``model.load_state_dict()``."""
        if model is None:
            return
        self.ddp_off = DdpOff(self.strategy.name, model, params)
        kept = self.kept_model  # torch marks its hooks: partials, not bound methods
        self._hooks.append(model.register_state_dict_pre_hook(functools.partial(KeptModelState.check_gather, kept)))
        self._hooks.append(model.register_state_dict_post_hook(functools.partial(KeptModelState.used, kept)))
        self._hooks.append(model.register_load_state_dict_post_hook(functools.partial(KeptModelState.drop, kept)))

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

    def _attach_inner(self, client: Client, plan: InnerPlan) -> None:
        """Collective: the rank's inner optimizer over ``plan`` on every rank, or on none: a rank attached here
        while another failed detaches, leaving the job's state waiting, and the job id is released.  A rank
        that keeps nothing (more ranks than elements) has no inner optimizer and closes ``client``."""

        def attach() -> None:
            if not plan.groups:
                client.close()
                return
            self.inner = self.group.inner_optimizer(plan.groups, client, self.strategy.options)

        try:
            self.group.all_or_none("attach", attach)
        except BaseException:
            if self.inner is not None:
                self.inner.close(keep_state=True)
                self.inner = None
            else:
                client.close()
            raise
        self.outcome.adopt(self.inner)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, while the optimizer is made; after, refused: the strategy sharded the groups it was given."""
        if self._started:
            raise InvalidArgument(f"{self.strategy.name} {self.strategy.groups_rule}")
        check_params_once(param_group, self.strategy.name)
        torch_switch_name(param_group)
        super().add_param_group(param_group)
        check_group_switches(self.param_groups[-1], lambda: f"param_groups[{len(self.param_groups) - 1}]")

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

    @without_grad
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Decide on the global grad statistics (collective), apply that decision in the rank's daemon, gather."""
        loss = closure_loss(closure)
        with self._calls.enter("step()", reads=False):
            self._step()
        return loss

    def _step(self) -> None:
        self._check_open()
        self._consolidated = None
        self.kept_model.drop()
        strategy = self.strategy
        decision = strategy.decide()
        try:
            if self.inner is not None:
                if not decision.skip:
                    strategy.hand_over(decision)
                strategy.sync_hyper()
                # the daemon scales the grads by the decision's factor (unscaled, then clipped), or counts the skip
                self.inner.step(decision=decision)
            strategy.after_update(decision)
        finally:
            strategy.end_step()
            self.schedule.end_step()
            self.group.steps += 1
        self.outcome.record(decision)

    def zero_grad(self, set_to_none: bool = True) -> None:
        with self._calls.enter("zero_grad()", reads=False):
            self.strategy.zero_grad(set_to_none)

    def set_max_grad_norm(self, max_grad_norm: float | None) -> None:
        """Clip by the global norm of the reduced grads at ``max_grad_norm`` from this step on (None: no
        clipping), as the constructor's argument does: before this step's first backward, and the same on every
        rank.  HF Trainer's callback gives a ZeRO-3 optimizer Trainer's ``max_grad_norm`` this way, where
        Trainer's own clip would find no grads (``hf_trainer``)."""
        check_max_grad_norm(max_grad_norm)
        with self._calls.enter("set_max_grad_norm()", reads=False):
            self._check_open()
            self.strategy.set_max_grad_norm(max_grad_norm)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidState(f"this {type(self).__name__} is closed")

    # ----------------------------------------------------------------- checkpoints

    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's file of a checkpoint that loads at any world size (``reshard``); not collective."""
        with self._calls.enter("shard_state_dict()", reads=True):
            return self.checkpoint.shard_state_dict()

    def _refresh(self) -> None:
        """The strategy's ``refresh`` before a checkpoint reads the pieces, except from a signal handler that
        interrupted ``step()``: its pieces may hold the step's update already while the model does not have it
        yet (the gather comes after), and the model's older values would overwrite them
        (``tiermem.client.offload.reentry``)."""
        if not self._calls.reentered:
            self.strategy.refresh()

    def state_dict(self) -> dict[str, Any]:
        """This rank's file (``shard_state_dict()``), for every strategy: the fp32 values and Adam state of the
        stretches of params the rank holds, and what merges it with the other ranks' files.  ``torch.save`` it
        on every rank; ``load_state_dict`` takes it back at the same world size, ``load_shards`` takes the
        files of all ranks at any world size, ``tiermem consolidate`` merges them.  On the rank that
        ``consolidate_state_dict`` gathered the whole state on, that state instead, until a step or a load.
        torch.optim's state-dict hooks run around it."""
        consolidated = self._consolidated
        if consolidated is not None:
            return hooked_state_dict(self, lambda: dict(consolidated))
        return hooked_state_dict(self, self._shard_state_dict)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: the whole state in ``torch.optim.AdamW``'s format (``full_state_dict()``), gathered on rank
        ``to`` of the optimizer's process group alone; its next ``state_dict()`` returns it, until a step or a
        load.  ``torch.distributed.optim.ZeroRedundancyOptimizer``'s protocol, which the checkpoints of PyTorch
        Lightning and Fabric follow: every rank calls this, then rank 0 alone saves ``state_dict()``, and that
        file resumes every rank at any world size (``load_state_dict``)."""
        if not 0 <= to < self.world_size:
            raise InvalidArgument(f"to={to} is not a rank of this optimizer's process group of {self.world_size}")
        with self._calls.enter("consolidate_state_dict()", reads=True):
            self._check_open()
            self._consolidated = self.checkpoint.gather_full((to, self.group.global_rank(to)))

    def consolidate_model_state(self, to: int = 0, *, until_step: bool = False) -> None:
        """Collective, ZeRO-3: every rank gathers ``model.state_dict()``, and rank ``to`` of the optimizer's
        process group keeps it: its next ``model.state_dict()``, before a step or a load, returns those values
        with no collective (``kept_model``); with ``until_step``, every one until then, and the other ranks'
        ``model.state_dict()`` is refused meanwhile (``release_model_state`` ends it).  For a framework that
        saves the model from one process alone (HF Trainer: ``WholeOptimizerState`` calls it before each
        checkpoint, and with ``until_step`` as training ends): every rank calls this just before that save.
        ZeRO-2's model is whole on every rank: nothing to gather."""
        if not 0 <= to < self.world_size:
            raise InvalidArgument(f"to={to} is not a rank of this optimizer's process group of {self.world_size}")
        model = self.strategy.reduced_model()
        with self._calls.enter("consolidate_model_state()", reads=True):
            self._check_open()
            if model is not None:
                self.kept_model.gather(model, keep=self.rank == to, keeper=to, until_step=until_step)

    def release_model_state(self) -> None:
        """Every rank (no communication): drop what ``consolidate_model_state`` kept, so that the next
        ``model.state_dict()`` gathers on every rank again."""
        with self._calls.enter("release_model_state()", reads=True):
            self.kept_model.drop()

    def _shard_state_dict(self) -> dict[str, Any]:
        with self._calls.enter("state_dict()", reads=True):
            return self.checkpoint.shard_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A rank file (``state_dict()``: this rank's stretches must be in it, so the same world size and
        layout), params' values and the model's buffers too; or ``torch.optim.AdamW``'s format over the
        optimizer's params (``full_state_dict()``, ``tiermem consolidate``, ``torch.optim.AdamW``,
        ``OffloadAdam``: any world size; the params are not touched, torch's rule).  Checked whole before
        anything changes.  Collective: every rank calls it, and all load it or none does (``_agreed``);
        torch.optim's load hooks run around it."""
        hooked_load(self, state_dict, self._load_guarded)

    def _load_guarded(self, state_dict: dict[str, Any]) -> None:
        with self._calls.enter("load_state_dict()", reads=False):
            self._load_state_dict(state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Collective: every rank checks the dict, then all load it or none does (``_agreed``)."""
        self._consolidated = None
        self.kept_model.drop()
        if is_rank_file(state_dict):
            opened: list[ShardSet] = []

            def prepare() -> Callable[[], None]:
                opened.append(open_shards([state_dict]))  # a malformed file fails here, inside the agreement
                return self.checkpoint.prepare_shards(opened[0], complete=False)

            self._agreed(prepare)()
            self._shards_loaded(opened[0])
            return
        self._agreed(lambda: self.checkpoint.prepare_full(state_dict))()
        self.outcome.adopt(self.inner)

    def _agreed(self, prepare: Callable[[], Callable[[], None]]) -> Callable[[], None]:
        """Collective: ``prepare`` (a load's checks, changing nothing) on every rank, then one exchange of the
        outcomes; the load's change to make, once every rank's checks passed.  A rank whose checks failed
        raises its error, and every other rank says which rank refused and why, at once: without this, the
        others went on to their next collective and waited out ``collective_timeout_s`` there (``RankLost``),
        or failed at once, without the cause, where the refused rank's process had ended."""
        failure: Exception | None = None
        apply: Callable[[], None] = _no_change
        try:
            apply = prepare()
        except Exception as exc:  # every rank must reach the exchange: the error is raised after it
            failure = exc
        mine = None if failure is None else f"{type(failure).__name__}: {failure}"
        everyone: list[Any] = [None] * self.world_size
        self.group.collective("agreement on the load", dist.all_gather_object, everyone, mine)
        if failure is not None:
            raise failure
        refused = [(r, said) for r, said in enumerate(everyone) if said is not None]
        if refused:
            r, said = refused[0]
            raise InvalidArgument(
                f"rank {r} of {self.world_size} refused this load_state_dict, so no rank loaded it (rank {r}: "
                f"{said}); load a checkpoint that holds every rank's state, on every rank"
            )
        return apply

    def _held_entries(self, param: torch.Tensor | None) -> dict[torch.Tensor, dict[str, Any]]:
        """``opt.state``'s reads (``HeldStateView``): ``param``'s entry, or every key with no value read."""
        if not self._started or self._closed:
            return {}
        flat = [p for g in self.param_groups for p in g["params"]]
        with self._calls.enter("opt.state", reads=True):
            if param is None:
                return {flat[pos]: {} for pos in self.checkpoint.held_positions()}
            at = {pos for pos, p in enumerate(flat) if p is param}
            return {flat[pos]: entry for pos, entry in self.checkpoint.torch_state(at).items()} if at else {}

    def save_shard(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``shard_state_dict()`` to ``directory/zero3-rank<r>-of-<n>.pt`` (atomically; every rank
        calls it); returns the path."""
        return self.checkpoint.save_shard(directory)

    def full_state_dict(self) -> dict[str, Any]:
        """Collective: ``torch.optim.AdamW``'s format over the whole model, on every rank."""
        return self.checkpoint.full_state_dict()

    def load_shards(self, source: Source | ShardSet, *, complete: bool = True) -> None:
        """This rank's stretches of the rank files of a save at any world size (params and buffers too); the
        counters go on from the save's applied steps."""
        shards = source if isinstance(source, ShardSet) else open_shards(source)
        self._consolidated = None
        self.kept_model.drop()
        self.checkpoint.load_shards(shards, complete=complete)
        self._shards_loaded(shards)

    def _shards_loaded(self, shards: ShardSet) -> None:
        self.strategy.values_loaded()
        self.outcome.adopt(self.inner)
        if shards.steps is not None:
            self.outcome.applied = shards.steps

    # ----------------------------------------------------------------- life

    def close(self, *, keep_state: bool = False) -> None:
        """Take the hooks off the model, detach from the daemon (this rank's share is freed unless
        ``keep_state``) and give the schedule's group back.  A closed optimizer refuses ``step()``; closing
        again does nothing."""
        with self._calls.enter("close()", reads=False):
            self._close(keep_state)

    def _close(self, keep_state: bool) -> None:
        if self._closed:
            return
        if self._started:
            self.strategy.before_close()
        self._closed = True
        self._consolidated = None
        self.kept_model.drop()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        release_job_id(self.job_id)
        if self.inner is not None:
            self.inner.close(keep_state=keep_state)
            self.inner = None
        self.group.close()

"""``ShardedOffloadAdam``: ZeRO-2 over ``torch.distributed``, each rank's Adam state shard in its node's tiermemd.

Every rank keeps the whole model (as with DDP) and only its shard of the
optimizer state: the params are cut into buckets and each bucket into one
slice per rank (``tiermem.core.shard_plan``); rank ``r``'s pieces of params
are registered with its node's daemon as the tensors of an ``OffloadAdam``
(rank ``r`` of one job), so the node's ranks share one pool, one set of NVMe
swap files and one CPU-Adam scheduler.  The rank's buckets and pieces are one
record each (``zero2_buckets.BucketRounds``, ``strategy.rounds``).  A step:

1. reduce-scatter: per bucket, the flat grads (zeros for a param without a
   grad) are summed across the ranks with ``reduce_scatter_tensor`` and divided
   by the world size (DDP's mean); each rank keeps its slice, the grads of its
   pieces;
2. statistics: each rank's sum of squares of its slice, and per param whether
   any rank had a grad, are all-reduced in one call; the global norm, the
   overflow decision and the params that step are then the same on every rank,
   exactly as ``clip_grad_norm_`` and ``GradScaler`` over the unsharded model
   (with ``ShardedGradScaler``, whose inf check is all-reduced too);
3. apply: the daemon updates the pieces, multiplying the slice's grads by
   the decision's inverse scale times clip coefficient inside its update
   pass (the trainer does not touch the grads);
4. all-gather: per bucket, the updated slices of all ranks become every rank's
   params.

Params edited in place between steps (``p.data.clamp_()``, ``model.load_state_dict``)
are honoured: each step first copies the rank's pieces from the params, and
the daemon adopts what differs from its master.  By default grads are
reduced at ``step()``, so gradient accumulation is plain repeated backward;
clip with ``max_grad_norm=`` (``clip_grad_norm_`` on the local, unreduced
grads would clip with the wrong norm).

``overlap_comm=True`` (DeepSpeed's ``overlap_comm``, DDP's bucketed
all-reduce) issues each bucket's reduce-scatter during backward, as soon as
its params' grads are complete, from the last bucket to the first on every
rank (a bucket waits for the ones after it, so all ranks issue the
collectives in one order), and ``step()`` waits for them.  A bucket is
whole once its params that had a grad at the last step have one (before the
first step: all that require one), so a layer the forward never uses does not
hold back the buckets before it.  It costs each rank
one model-sized transfer buffer (every bucket in flight has its own).  A
grad that changes after its bucket was issued (a further backward of
gradient accumulation, ``GradScaler.unscale_``, an in-place edit) is caught
by its version counter: the ranks agree on such buckets (one all-reduce of
flags) and reduce them again at ``step()``, so the result never depends on
when the reduce ran; accumulate inside ``no_sync()`` (DDP's) for all but the
last micro-batch to reduce each bucket once.  Edits through ``.data`` are not
seen by version counters: make them before backward, or use the default.

``delayed_update=True`` (ZeRO-Offload's delayed parameter update, after
``warmup_steps`` synchronous steps): the daemon's update of step t runs while
step t+1 computes.  Its params are installed into the storage at the next
``step()``, so each step's all-gather brings the params of the update before
(one update behind, as the rule is in one process: ``OffloadAdam``'s); the
reduce-scatter and the update overlap nothing of each other's buffers (the
delayed inner optimizer alternates two grad buffers).  ``flush()``
(collective) installs the last update and gathers it into every rank's
model: before evaluating, saving ``model.state_dict()`` or ending.

Identity (``identity``): the job id is the launcher's rendezvous id
(``TORCHELASTIC_RUN_ID``, set by ``torchrun``) or one rank 0 draws, and the
token is derived from it and the user's secret, so a relaunch of the run finds
its state; rank 0 broadcasts both before any rank attaches, so the ranks
attach in any order (``ATTACH.create``).  With no node daemon, the first rank of each
node starts a private one sized for the node's ranks and the node's other
ranks connect to it.  A collective that fails (a rank died, a timeout) raises
``RankLost`` naming the phase; the state of this rank is then at its last
completed step.

Checkpoints, the rank files of every sharded optimizer (``zero3_checkpoint``):
``state_dict()`` is this rank's file (the fp32 values and moments of its
pieces), which ``load_state_dict`` takes back at the same world size and
``save_shard(directory)`` writes; ``load_shards`` loads the files of all ranks
at any world size and ``tiermem consolidate`` merges them.
``full_state_dict()`` (collective) gathers ``torch.optim.AdamW``'s format on
every rank, which any ``ShardedOffloadAdam`` (any world size), ``OffloadAdam``
or ``torch.optim.AdamW`` loads; ``load_state_dict`` takes either.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tiermem.client.distributed.group import RankGroup, check_max_grad_norm
from tiermem.client.distributed.reshard import describe_params
from tiermem.client.distributed.schedule import DEFAULT_TIMEOUT_S, Probe
from tiermem.client.distributed.sharded import InnerPlan, ShardedOptimizer, ShardStrategy, of_strategy
from tiermem.client.distributed.zero2_buckets import BucketRounds
from tiermem.client.distributed.zero3_checkpoint import RankShare, Slot
from tiermem.client.link import Client
from tiermem.client.offload.args import (
    check_hyper,
    check_torch_flags,
    copy_hyper,
    hyper_of,
    optimizer_defaults,
)
from tiermem.client.offload.options import OffloadOptions
from tiermem.core import dtypes
from tiermem.core.errors import DTypeError, InvalidArgument, InvalidState
from tiermem.core.modes import Exchange, Placement
from tiermem.core.shard_plan import Piece, ShardLayout, plan_shards
from tiermem.core.step_rules import GradStats, StepDecision, decide
from tiermem.core.units import MiB

__all__ = ["ShardedOffloadAdam", "Zero2Strategy"]

log = logging.getLogger(__name__)


class ShardedOffloadAdam(ShardedOptimizer):
    """AdamW (``adamw=False``: Adam) sharded ZeRO-2 style across ``process_group``; see the module docstring.
    ``state_dtype``: how each rank's daemon stores its shard's moments (``OffloadAdam``'s).  A thin constructor:
    ``ShardedOptimizer`` (the start, the step, the counters, the checkpoints, ``close()``) with the ZeRO-2
    strategy (``Zero2Strategy``, ``strategy``)."""

    strategy: Zero2Strategy

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        adamw: bool = True,
        offload: str | Placement = "auto",
        max_grad_norm: float | None = None,
        process_group: Any = None,
        bucket_nbytes: int = 32 * MiB,
        window_nbytes: int | None = None,
        client: Client | None = None,
        job_id: str | None = None,
        token: str | None = None,
        expected_step: int | None = None,
        rollback: bool = False,
        broadcast_params: bool = True,
        overlap_comm: bool = False,
        delayed_update: bool = False,
        warmup_steps: int = 10,
        state_dtype: str = "fp32",
        collective_timeout_s: float = DEFAULT_TIMEOUT_S,
        probe: Probe | None = None,
    ) -> None:
        """``collective_timeout_s``: how long a collective of a step waits for the other ranks before it raises
        ``RankLost`` naming it (``schedule``; the start and the checkpoints keep ``process_group``'s timeout).
        ``probe``: told of each collective (``schedule.Probe``)."""
        hyper = check_hyper(lr, betas, eps, weight_decay, adamw=adamw)
        check_torch_flags(amsgrad=amsgrad, capturable=capturable, differentiable=differentiable)
        check_max_grad_norm(max_grad_norm)
        _check_sizes(bucket_nbytes=bucket_nbytes, warmup_steps=warmup_steps)
        options = OffloadOptions(
            offload=Placement.parse(offload, "offload"),
            exchange=Exchange.SHARED,  # the pieces are host tensors
            window_nbytes=window_nbytes,
            delayed_update=delayed_update,
            warmup_steps=warmup_steps,
            state_dtype=state_dtype,
            expected_step=expected_step,
            rollback=rollback,
        )
        defaults = optimizer_defaults(hyper, foreach=foreach, maximize=maximize, fused=fused, adamw=adamw)
        strategy = Zero2Strategy(
            params,
            defaults,
            options,
            max_grad_norm=max_grad_norm,
            bucket_nbytes=bucket_nbytes,
            overlap_comm=overlap_comm,
            broadcast_params=broadcast_params,
        )
        super().__init__(strategy, process_group, client, job_id, token, collective_timeout_s, probe)

    # ----------------------------------------------------------------- the strategy's own, by name

    max_grad_norm = of_strategy()
    overlap_comm = of_strategy()
    layout = of_strategy("Who owns which elements (``tiermem.core.shard_plan.ShardLayout``).")
    pieces = of_strategy("This rank's pieces of params (``Piece``).")
    dtype = of_strategy("The params' working dtype (``tiermem.core.dtypes.WorkingDType``).")
    device = of_strategy()
    params_behind = of_strategy("Whether this rank's daemon holds an update the model does not have yet (``flush()``).")
    no_sync = of_strategy("Backward passes inside reduce nothing (DDP's ``no_sync``; ``Zero2Strategy.no_sync``).")
    flush = of_strategy("Collective: a delayed update installed and gathered into every rank's model.")
    take_found_inf = of_strategy("``ShardedGradScaler``'s found-inf flags of this step, already global.")

    @property
    def state_dtype(self) -> str:
        return self.strategy.options.state_dtype


@dataclass(eq=False, repr=False)
class Zero2Strategy(ShardStrategy):
    """ZeRO-2 (see the module docstring): every rank keeps the whole model and its pieces of the Adam state;
    grads are reduce-scattered at ``step()`` (or during backward, ``overlap_comm``), params all-gathered after
    each update, through the rank's buckets (``BucketRounds``, ``rounds``)."""

    name = "ShardedOffloadAdam"
    alone_hint = "; for one process use OffloadAdam"
    keeps_values = True
    rounds: BucketRounds = field(init=False)

    params_given: InitVar[Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]]
    defaults: InitVar[dict[str, Any]]
    options: OffloadOptions
    _: KW_ONLY
    max_grad_norm: float | None
    bucket_nbytes: int
    overlap_comm: bool
    broadcast_params: bool

    def __post_init__(
        self, params_given: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], defaults: dict[str, Any]
    ) -> None:
        self._given = (params_given, defaults)
        self._global_found_inf: dict[torch.device, torch.Tensor] | None = None
        """This step's found-inf flags from ``ShardedGradScaler`` (``take_found_inf``)."""
        self._has_grad: list[bool] | None = None
        """This step's: per param, whether any rank had a grad."""
        self._landed: dict[int, tuple[torch.Tensor, int]] = {}
        """Per param index: the grad its last backward left and that grad's version when it ended
        (``_tell_edits``)."""
        self._backward_ending = False
        """The end-of-backward look at the landed grads is queued (``_grad_hook``)."""
        self._reduced_in_backward = False
        """The last backward's grads were rewritten before it ended: DDP wraps the model, and they are the
        mean of every rank's already."""
        self._told_edits = False

    # ----------------------------------------------------------------- the start

    def param_groups_for(self, group: RankGroup) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        params, defaults = self._given
        del self._given
        return params, defaults  # type: ignore[return-value]  # torch's Optimizer takes either form

    def prepare(self) -> None:
        """One dtype and one device for every param, remembered with the shapes (``_check_params``)."""
        params = self.params()
        self.dtype, self.device = _one_dtype_and_device(params)
        self._shapes = [tuple(p.shape) for p in params]

    def plan(self) -> InnerPlan:
        """Who owns which elements (``layout``), this rank's buckets and pieces, and the inner optimizer's groups
        over the pieces (the groups that have a piece here: ``_inner_of_group``)."""
        params = self.params()
        group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        self.layout: ShardLayout = plan_shards(
            [p.numel() for p in params], group_of, self.world_size, max(1, self.bucket_nbytes // self.dtype.itemsize)
        )
        self.rounds = BucketRounds(
            self.layout, self.rank, params, dtype=self.dtype, device=self.device, schedule=self.schedule
        )
        inner_groups: list[dict[str, Any]] = []
        self._inner_of_group: dict[int, int] = {}
        for g, group in enumerate(self.param_groups):
            members = [p.param for p in self.rounds.pieces if group_of[p.plan.param] == g]
            if members:
                self._inner_of_group[g] = len(inner_groups)
                inner_groups.append({"params": members, **hyper_of(group)})
        return InnerPlan(inner_groups, self.dtype.name)

    def attached(self) -> None:
        """The buckets bound to the daemon's storage, the grad hooks (which note each grad backward leaves,
        and reduce during backward with ``overlap_comm``), and where the job's state is."""
        params = self.params()
        self.rounds.attach(self.inner)
        for index, p in enumerate(params):
            if p.requires_grad:
                self.keep_hook(p.register_post_accumulate_grad_hook(self._grad_hook(index)))
        self._resume(params)

    def _grad_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is not None:
                self._landed[index] = (grad, grad._version)
                if not self._backward_ending:
                    self._backward_ending = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._queue_backward_end)
            if self.overlap_comm:
                self.rounds.grad_landed(index, self.params)

        return hook

    def _queue_backward_end(self) -> None:
        """Run as backward ends, queued by the first grad hook: DDP queues the write of its averaged grads later
        in backward, so a look queued from here runs after it."""
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _backward_end(self) -> None:
        """Once backward (and DDP's write of the mean into the grads, if DDP wraps the model) is over: whether the
        grads changed since their hooks, and their versions now, against which ``_tell_edits`` looks."""
        self._backward_ending = False
        self._reduced_in_backward = self._note_grads()

    def _note_grads(self) -> bool:
        """The landed grads' versions as they are now (a grad replaced since: the new one; gone: forgotten);
        whether any had changed."""
        params = self.params()
        changed = False
        for index, (grad, version) in list(self._landed.items()):
            now = params[index].grad
            changed = changed or now is not grad or (now is not None and now._version != version)
            if now is None:
                del self._landed[index]
            else:
                self._landed[index] = (now, now._version)
        return changed

    def _tell_edits(self, params: list[torch.nn.Parameter]) -> None:
        """Warn once when a grad was changed in place after backward left it: ``p.grad`` is this rank's own,
        unreduced grad, so ``clip_grad_norm_`` (HF Trainer's and accelerate's ``max_grad_norm``, Lightning's
        ``gradient_clip_val``) clips each rank's by its own norm, and the step averages the results: not the
        clip of DDP's mean.  A grad replaced (``p.grad = g``) is taken as the user's; edits through ``.data``
        are not seen.  Not when DDP wraps the model: its grads are the mean of every rank's when backward ends,
        and a clip of them is DDP's (``_backward_end``)."""
        if self._told_edits or self._reduced_in_backward:
            return
        landed = self._landed.items()
        edited = [i for i, (grad, version) in landed if params[i].grad is grad and grad._version != version]
        if not edited:
            return
        self._told_edits = True
        log.warning(
            "ShardedOffloadAdam: the grads of %d param(s) (param %d first) were changed in place after backward "
            "left them (torch.nn.utils.clip_grad_norm_, or an edit of your own). p.grad holds this rank's own "
            "grads, not yet reduced: a clip by their norm differs on each rank, and the step averages what each "
            "rank clipped, which is not the clip of the mean that DDP's clip_grad_norm_ makes. Clip with "
            "ShardedOffloadAdam(max_grad_norm=...), by the global norm of the reduced grads, and set HF Trainer's "
            "or accelerate's max_grad_norm to 0 (Lightning: no gradient_clip_val). An edit that is the same on "
            "every rank (a division by a constant) is right as it is. Said once",
            len(edited),
            edited[0],
        )

    @property
    def pieces(self) -> list[Piece]:
        """This rank's pieces of params, in the layout's terms."""
        return [p.plan for p in self.rounds.pieces]

    def share(self) -> RankShare:
        """This rank's pieces in the rank files' terms: param ``i`` is the optimizer's ``i``-th (named by its
        index: the optimizer sees params, not the module)."""
        params = self.params()
        holder = torch.nn.ParameterList(params)
        slots = tuple(Slot(pc.param, pc.lo, pc.hi, i, pc.numel) for i, pc in enumerate(self.pieces))
        order = tuple(range(len(params)))
        infos = tuple(describe_params(holder))
        return RankShare(self.name, self.rank, self.world_size, infos, order, slots, (), holder, self.group.device)

    def values_loaded(self) -> None:
        """Loaded rank files gave the pieces their values: every rank's model gets them (collective)."""
        self.rounds.all_gather(self.params())

    def _resume(self, params: list[torch.nn.Parameter]) -> None:
        """Agree on where the job's state is: new on every rank, or reattached at one step on every rank
        (then the daemon's params, the masters of the pieces, become the model's on every rank)."""
        inner = self.inner
        mine = (inner.state_from, inner.steps, inner.skipped_steps) if inner is not None else None
        everyone: list[Any] = [None] * self.world_size
        self.group.collective("agreement on the state", dist.all_gather_object, everyone, mine)
        known = [(r, v) for r, v in enumerate(everyone) if v is not None]
        reattached = [(r, v) for r, v in known if v[0] != "new"]
        if not reattached:
            return
        counts = {v[1:] for _, v in known}
        if len(reattached) != len(known) or len(counts) != 1:
            where = ", ".join(f"rank {r}: {v[0]} at step {v[1] + v[2]}" for r, v in known)
            raise InvalidState(
                f"the ranks' states disagree ({where}): a rank died between its update and another's; "
                "load a checkpoint into every rank (load_state_dict) to go on"
            )
        self.opt.outcome.applied, self.opt.outcome.skipped = counts.pop()
        self.group.steps = self.opt.outcome.applied + self.opt.outcome.skipped
        self.rounds.all_gather(params)

    # ----------------------------------------------------------------- the step

    def take_found_inf(self, per_device: dict[torch.device, torch.Tensor]) -> None:
        """``ShardedGradScaler``'s found-inf flags of this step, already global (all-reduced over the group);
        ``step()`` sets them too when the reduced grads overflow, so the scaler backs off as every rank does.
        The scaler has just unscaled the grads in place, by the same figure on every rank: not an edit to tell."""
        self._global_found_inf = per_device
        self._note_grads()

    def decide(self) -> StepDecision:
        """Where ZeRO-2's grads come from: the trainer's, reduce-scattered now (or during backward, with
        ``overlap_comm``); their statistics and the per-param grad flags all-reduced in one call; the scaler's
        rule and the clip over them, the same on every rank."""
        grad_scale = getattr(self.opt, "grad_scale", False)
        found_inf = getattr(self.opt, "found_inf", None)
        scaled = grad_scale is not False
        global_flags, self._global_found_inf = self._global_found_inf, None
        if scaled and global_flags is None:
            raise InvalidState(
                "a torch.amp.GradScaler checks only this rank's grads for inf/nan, so the ranks would skip "
                "different steps; use tiermem.distributed.ShardedGradScaler (the same API)"
            )
        params = self.params()
        self._check_params(params)
        self._tell_edits(params)
        need_norm = scaled or self.max_grad_norm is not None
        flags = [0.0] + [0.0 if p.grad is None else 1.0 for p in params]
        stats = torch.tensor(flags, dtype=torch.float64).to(self.device)
        buffer = self.inner.feed.buffer if self.inner is not None else 0
        try:
            self.rounds.reduce_scatter(
                params, stats if need_norm else None, grad_buffer=buffer, overlap=self.overlap_comm
            )
        finally:
            self.rounds.new_round(params)
        self.schedule.run("all-reduce", "the grad statistics", dist.all_reduce, stats)
        values = self.group.read_back(stats)  # the step's one read of its grad statistics
        total_sq = values[0]
        self._has_grad = [v > 0 for v in values[1:]]
        inv_scale = 1.0
        if scaled and grad_scale is not None:
            inv_scale = float(torch.as_tensor(grad_scale).double().reciprocal().float())
        # the scaler's rule over the reduced grads: every rank decides on the same global statistics
        decision = decide(
            GradStats.of(total_sq * inv_scale * inv_scale, False) if need_norm else None,
            inv_scale=inv_scale,
            max_grad_norm=self.max_grad_norm,
            scaler_found_inf=scaled and found_inf is not None and float(found_inf) > 0,
            skip_nonfinite=scaled,
        )
        if decision.skip and global_flags is not None:
            for flag in global_flags.values():
                flag.fill_(1.0)  # the reduced grads overflowed: the scaler backs off as every rank does
        return decision

    def hand_over(self, decision: StepDecision) -> None:
        """The pieces' params from the model (in-place edits since the last step) and their reduced grads."""
        self.rounds.pull_params(self.params())
        has_grad = self._has_grad
        for piece in self.rounds.pieces:
            piece.param.grad = piece.grad if has_grad is not None and has_grad[piece.plan.param] else None

    def sync_hyper(self) -> None:
        if self.inner is not None:
            copy_hyper(self.param_groups, self.inner.param_groups, self._inner_of_group.items())

    def after_update(self, decision: StepDecision) -> None:
        """Every bucket's updated slices all-gathered into every rank's params (a skip changed nothing)."""
        if not decision.skip:
            self.rounds.all_gather(self.params())

    def end_step(self) -> None:
        self.rounds.drop_grads()
        self._has_grad = None
        self._landed.clear()

    def _check_params(self, params: list[torch.nn.Parameter]) -> None:
        for i, p in enumerate(params):
            if p.dtype != self.dtype.torch or p.device != self.device or tuple(p.shape) != self._shapes[i]:
                raise InvalidState(
                    f"param {i} is now {p.dtype} {tuple(p.shape)} on {p.device}; it was registered as "
                    f"{self.dtype.torch} {self._shapes[i]} on {self.device} (create the optimizer after changing "
                    "the model)"
                )
            if p.grad is not None and (p.grad.dtype != p.dtype or p.grad.is_sparse):
                raise DTypeError(f"param {i} got a {p.grad.dtype} {p.grad.layout} grad; it needs a dense {p.dtype} one")

    # ----------------------------------------------------------------- between steps

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside reduce nothing (DDP's ``no_sync``; ``BucketRounds.no_sync``)."""
        return self.rounds.no_sync()

    def flush(self) -> None:
        """Collective: wait for a delayed update, install its params and gather them into every rank's model
        (``delayed_update=True``; a no-op's worth of copies otherwise)."""
        if self.inner is not None:
            self.inner.flush()
        self.rounds.all_gather(self.params())

    @property
    def params_behind(self) -> bool:
        """Whether this rank's daemon holds an update that the model does not have yet (``flush()``)."""
        return self.inner is not None and self.inner.update_in_flight

    def refresh(self) -> None:
        """Before a checkpoint reads the pieces: the model's params, edited in place since the last step, into
        them, as a step would take them; not while an update is in flight, whose pieces are newer than the
        model (``flush()``)."""
        if not self.params_behind:
            self.rounds.pull_params(self.params())

    # ----------------------------------------------------------------- life

    def before_close(self) -> None:
        if self.params_behind:
            log.warning(
                "closing with a delayed update the model does not have: its params are one update behind (call "
                "flush() on every rank before close())"
            )


def _check_sizes(*, bucket_nbytes: int, warmup_steps: int) -> None:
    if bucket_nbytes <= 0:
        raise InvalidArgument(f"bucket_nbytes must be > 0, got {bucket_nbytes}")
    if warmup_steps < 0:
        raise InvalidArgument(f"warmup_steps must be >= 0, got {warmup_steps}")


def _one_dtype_and_device(params: list[torch.nn.Parameter]) -> tuple[dtypes.WorkingDType, torch.device]:
    if not params:
        raise InvalidArgument("ShardedOffloadAdam got an empty parameter list")
    kinds = {p.dtype for p in params}
    devices = {p.device for p in params}
    if len(kinds) != 1 or len(devices) != 1:
        raise DTypeError(
            f"ShardedOffloadAdam needs one dtype and one device for all params, got dtypes "
            f"{sorted(str(d) for d in kinds)} on {sorted(str(d) for d in devices)}"
        )
    return dtypes.by_torch(kinds.pop()), devices.pop()

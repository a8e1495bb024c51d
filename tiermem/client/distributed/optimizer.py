"""``ShardedOffloadAdam``: ZeRO-2 over ``torch.distributed``, each rank's Adam state shard in its node's tiermemd.

Every rank keeps the whole model (as with DDP) and only its shard of the
optimizer state: the params are cut into buckets and each bucket into one
slice per rank (``tiermem.core.shard_plan``); rank ``r``'s pieces of params
are registered with its node's daemon as the tensors of an ``OffloadAdam``
(rank ``r`` of one job), so the node's ranks share one pool, one set of NVMe
swap files and one CPU-Adam scheduler.  A step:

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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tiermem.client.distributed.group import RankGroup, check_max_grad_norm
from tiermem.client.distributed.reshard import describe_params
from tiermem.client.distributed.schedule import ALL_GATHER, DEFAULT_TIMEOUT_S, REDUCE_SCATTER, Probe
from tiermem.client.distributed.sharded import InnerPlan, ShardedOptimizer, ShardStrategy, of_strategy
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
from tiermem.client.offload.shared import TensorEntry
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


class Zero2Strategy(ShardStrategy):
    """ZeRO-2 (see the module docstring): every rank keeps the whole model and its pieces of the Adam state;
    grads are reduce-scattered at ``step()`` (or during backward, ``overlap_comm``), params all-gathered after
    each update."""

    name = "ShardedOffloadAdam"
    alone_hint = "; for one process use OffloadAdam"
    keeps_values = True

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        options: OffloadOptions,
        *,
        max_grad_norm: float | None,
        bucket_nbytes: int,
        overlap_comm: bool,
        broadcast_params: bool,
    ) -> None:
        self._given = (params, defaults)
        self.options = options
        self.max_grad_norm = max_grad_norm
        self.bucket_nbytes = bucket_nbytes
        self.overlap_comm = overlap_comm
        self.broadcast_params = broadcast_params
        self._global_found_inf: dict[torch.device, torch.Tensor] | None = None
        """This step's found-inf flags from ``ShardedGradScaler`` (``take_found_inf``)."""
        self._reduced: list[torch.Tensor] = []
        """This step's mean grads of the rank's pieces (``decide``), and per param whether any rank had one."""
        self._has_grad: list[bool] | None = None

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
        """Who owns which elements (``layout``), this rank's ``pieces`` as host params and the inner groups over
        them."""
        params = self.params()
        group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        self._plan(params, group_of, self.bucket_nbytes)
        return InnerPlan(self._piece_groups(params, group_of), self.dtype.name)

    def attached(self) -> None:
        """The transfer buffers, the reduce rounds (and their hooks), and where the job's state is."""
        params = self.params()
        self._transfer_buffers()
        self._start_rounds(params)
        self._resume(params)

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
        self._all_gather(self.params())

    def _plan(self, params: list[torch.nn.Parameter], group_of: list[int], bucket_nbytes: int) -> None:
        """Who owns which elements (``layout``), this rank's ``pieces`` and which of them each bucket holds."""
        self.layout: ShardLayout = plan_shards(
            [p.numel() for p in params], group_of, self.world_size, max(1, bucket_nbytes // self.dtype.itemsize)
        )
        self.pieces: list[Piece] = self.layout.pieces(self.rank)
        self._by_bucket: list[list[int]] = [[] for _ in self.layout.buckets]
        for i, piece in enumerate(self.pieces):
            self._by_bucket[piece.bucket].append(i)

    def _transfer_buffers(self) -> None:
        """The buffers a bucket's collectives go through, and where this rank's slices can be the daemon's
        storage itself (``_storage_slices``)."""
        largest = self.layout.largest_bucket()
        self._flat = torch.empty(largest, dtype=self.dtype.torch, device=self.device)
        self._slice = torch.empty(-(-largest // self.world_size), dtype=self.dtype.torch, device=self.device)
        self._shared: list[TensorEntry] = []
        """The inner optimizer's tensors in the shared storage (the shared exchange), one per piece."""
        if self.inner is not None and self.inner.shared_feed is not None:
            self._shared = self.inner.shared_feed.entries
        self._param_slices, self._grad_slices = self._storage_slices()

    def _start_rounds(self, params: list[torch.nn.Parameter]) -> None:
        """The reduce rounds' bookkeeping, and with ``overlap_comm`` the hooks that start a bucket's reduce
        during backward."""
        self._bucket_of = [0] * len(params)
        for b, bucket in enumerate(self.layout.buckets):
            for index in bucket.params:
                self._bucket_of[index] = b
        self._wanted = [sum(params[i].requires_grad for i in bucket.params) for bucket in self.layout.buckets]
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._holding = False
        self._told_accumulation = False
        self._new_round()
        if self.overlap_comm:
            for index, p in enumerate(params):
                if p.requires_grad:
                    self.keep_hook(p.register_post_accumulate_grad_hook(self._grad_hook(index)))

    def _piece_groups(self, params: list[torch.nn.Parameter], group_of: list[int]) -> list[dict[str, Any]]:
        """This rank's pieces as host params (``_piece_params``) and the inner optimizer's groups over them (the
        groups that have a piece here: ``_inner_of_group``)."""
        flat = [p.detach().reshape(-1) for p in params]
        self._piece_params = [
            torch.nn.Parameter(flat[pc.param][pc.lo : pc.hi].to("cpu", copy=True)) for pc in self.pieces
        ]
        inner_groups: list[dict[str, Any]] = []
        self._inner_of_group: dict[int, int] = {}
        for g, group in enumerate(self.param_groups):
            members = [pp for pp, pc in zip(self._piece_params, self.pieces, strict=True) if group_of[pc.param] == g]
            if members:
                self._inner_of_group[g] = len(inner_groups)
                inner_groups.append({"params": members, **hyper_of(group)})
        return inner_groups

    def _storage_slices(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Per bucket, this rank's slice of params and of grads as one tensor of the daemon's shared storage,
        where its pieces fill the slice (no padding) side by side there (the storage packs tensors densely in
        registration order, ``tiermem.core.layout``); else None.  The reduce-scatter then writes the grads
        straight into the daemon's grad buffer and the all-gather reads the updated params straight from
        the storage, with no copy through the transfer buffer (one pass over the shard each, per step)."""
        buckets = len(self.layout.buckets)
        params: list[torch.Tensor | None] = [None] * buckets
        grads: list[torch.Tensor | None] = [None] * buckets
        entries = self._shared
        if self.device.type != "cpu" or not entries or len(entries[0].grad_views) != 1 or self.inner is None:
            return params, grads  # device params: the collectives run on the device; two grad buffers: alternated
        base = self.inner.client.storage
        for b, bucket in enumerate(self.layout.buckets):
            members = self._by_bucket[b]
            if not members or sum(self.pieces[i].numel for i in members) != bucket.slice_numel:
                continue
            first = entries[members[0]]
            runs = [
                _run_from(base, first.view, bucket.slice_numel),
                _run_from(base, first.grad_views[0], bucket.slice_numel),
            ]
            if all(
                view.data_ptr() == run.data_ptr() + self.pieces[i].at * run.element_size()
                for i in members
                for view, run in zip((entries[i].view, entries[i].grad_views[0]), runs, strict=True)
            ):
                params[b], grads[b] = runs
        return params, grads

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
        self._all_gather(params)

    # ----------------------------------------------------------------- the step

    def take_found_inf(self, per_device: dict[torch.device, torch.Tensor]) -> None:
        """``ShardedGradScaler``'s found-inf flags of this step, already global (all-reduced over the group);
        ``step()`` sets them too when the reduced grads overflow, so the scaler backs off as every rank does."""
        self._global_found_inf = per_device

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
        need_norm = scaled or self.max_grad_norm is not None
        flags = [0.0] + [0.0 if p.grad is None else 1.0 for p in params]
        stats = torch.tensor(flags, dtype=torch.float64).to(self.device)
        try:
            self._reduced = self._reduce_scatter(params, stats if need_norm else None)
        finally:
            # the next backward's buckets are whole once the params that had a grad this step have one (an
            # unused layer's params would otherwise hold back every bucket before it until step())
            self._wanted = [sum(params[i].grad is not None for i in b.params) for b in self.layout.buckets]
            self._new_round()
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
        params = self.params()
        self._pull_params_into_pieces(params)
        has_grad = self._has_grad
        for piece, pp, grad in zip(self.pieces, self._piece_params, self._reduced, strict=True):
            pp.grad = grad if has_grad is not None and has_grad[piece.param] else None

    def sync_hyper(self) -> None:
        if self.inner is not None:
            copy_hyper(self.param_groups, self.inner.param_groups, self._inner_of_group.items())

    def after_update(self, decision: StepDecision) -> None:
        """Every bucket's updated slices all-gathered into every rank's params (a skip changed nothing)."""
        if not decision.skip:
            self._all_gather(self.params())

    def end_step(self) -> None:
        self._reduced = []
        self._has_grad = None

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

    # ----------------------------------------------------------------- the reduce-scatter

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside reduce nothing (DDP's ``no_sync``): accumulate micro-batches in it and run
        the last backward of the step outside.  Needed only for speed, with ``overlap_comm``: without it an
        accumulated bucket is reduced again at ``step()``, correct but twice."""
        before, self._holding = self._holding, True
        try:
            yield
        finally:
            self._holding = before

    def _new_round(self) -> None:
        """A new step: no param has landed, no bucket is reduced or in flight."""
        self._landed = [False] * len(self._shapes)
        self._left = list(self._wanted)
        self._next = len(self.layout.buckets) - 1
        """The next bucket to reduce: the last first (backward makes the last params' grads first), so every
        rank issues the collectives in one order, whichever of them ran during backward."""
        self._reduces: dict[int, _Reduce] = {}
        self._accumulated = False

    def _grad_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._grad_landed(index)

        return hook

    def _grad_landed(self, index: int) -> None:
        """``overlap_comm``: a param's grad is complete for this backward; reduce every bucket that is whole."""
        if self._holding:
            return
        if self._landed[index]:
            self._accumulated = True  # a second backward: step() sees the changed grad and reduces it again
            return
        self._landed[index] = True
        self._left[self._bucket_of[index]] -= 1
        if self._next < 0 or self._left[self._next] > 0:
            return  # most grads: their bucket, or one after it, is not whole yet
        params = self.params()
        while self._next >= 0 and self._left[self._next] <= 0:
            self._reduces[self._next] = self._launch(params, self._next, async_op=True, own=True)
            self._next -= 1

    def _buffers_of(self, b: int, *, own: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket ``b``'s flat grads and reduced slice: the shared transfer buffers, or (``own``: its collective
        runs while others are issued) buffers of its own, kept for the next steps."""
        bucket = self.layout.buckets[b]
        padded = self.layout.padded_numel(bucket)
        if not own:
            return self._flat[:padded], self._slice[: bucket.slice_numel]
        if b not in self._buffers:
            self._buffers[b] = (
                torch.empty(padded, dtype=self.dtype.torch, device=self.device),
                torch.empty(bucket.slice_numel, dtype=self.dtype.torch, device=self.device),
            )
        return self._buffers[b]

    def _launch(self, params: list[torch.nn.Parameter], b: int, *, async_op: bool, own: bool) -> _Reduce:
        """Copy bucket ``b``'s grads (zeros for a param without one) and issue its reduce-scatter, into the
        shared transfer buffers (``own`` False: the caller consumes the result before the next launch) or
        the bucket's own."""
        bucket = self.layout.buckets[b]
        direct = self._grad_slices[b]
        alone = self.world_size == 1
        flat, out = self._buffers_of(b, own=own)
        if alone and direct is not None:
            flat = direct  # one rank: its slice is the whole bucket, and the grads go straight to the daemon
        seen: list[tuple[torch.Tensor | None, int]] = []
        for index, offset in zip(bucket.params, bucket.offsets, strict=True):
            grad = params[index].grad
            dst = flat[offset : offset + params[index].numel()]
            if grad is None:
                dst.zero_()
            else:
                dst.copy_(grad.reshape(-1))
            seen.append((grad, -1 if grad is None else grad._version))
        flat[bucket.numel :].zero_()
        if alone:
            return _Reduce(None, flat[: bucket.slice_numel], seen, b)
        if direct is not None:
            out = direct  # the mean grads land in the daemon's grad buffer
        work = self.schedule.run("reduce-scatter", f"bucket {b}", REDUCE_SCATTER, out, flat, async_op=async_op)
        return _Reduce(work if async_op else None, out, seen, b)

    def _changed(self, params: list[torch.nn.Parameter], b: int, reduce: _Reduce) -> bool:
        """A grad of bucket ``b`` was replaced or changed in place after its reduce was issued (a further
        backward, ``GradScaler.unscale_``, an edit; edits through ``.data`` are not seen)."""
        bucket = self.layout.buckets[b]
        for index, (grad, version) in zip(bucket.params, reduce.seen, strict=True):
            now = params[index].grad
            if now is not grad or (now is not None and now._version != version):
                return True
        return False

    def _reduce_scatter(self, params: list[torch.nn.Parameter], stats: torch.Tensor | None) -> list[torch.Tensor]:
        """The mean grads of this rank's pieces (in the pieces' grad tensors), bucket by bucket; adds the
        slices' sums of squares to ``stats[0]``.  With ``overlap_comm`` the buckets reduced during backward
        are waited for, and those whose grads changed since (on any rank: one all-reduce of the flags, so
        every rank issues the same collectives) are reduced again."""
        grads: list[torch.Tensor] = []
        buffer = self.inner.feed.buffer if self.inner is not None else 0
        for i, pp in enumerate(self._piece_params):
            if self._grad_slices[self.pieces[i].bucket] is not None:
                grads.append(self._shared[i].grad_views[0])  # the reduce-scatter writes it in place
                continue
            if self._shared:
                # this step's grad buffer of the daemon's storage, never the one a delayed update still reads
                # (pp.grad is left pointing at the last step's buffer by the inner optimizer)
                grads.append(self._shared[i].grad_views[buffer])
                continue
            if pp.grad is None:
                pp.grad = torch.empty_like(pp)
            grads.append(pp.grad)
        if not self.overlap_comm:
            while self._next >= 0:  # bucket by bucket through the shared buffers
                reduce = self._launch(params, self._next, async_op=False, own=False)
                self._finish_reduce(reduce, self._next, stats, grads)
                self._next -= 1
            return grads
        order = range(len(self.layout.buckets) - 1, -1, -1)
        while self._next >= 0:  # what backward did not reduce (a param without a grad on this rank)
            self._reduces[self._next] = self._launch(params, self._next, async_op=True, own=True)
            self._next -= 1
        for b in order:
            self._wait(self._reduces[b])
        flags = torch.tensor(
            [float(self._changed(params, b, self._reduces[b])) for b in range(len(self.layout.buckets))],
            device=self.device,
        )
        self.schedule.run("all-reduce", "the overlapped reduces' check", dist.all_reduce, flags, op=dist.ReduceOp.MAX)
        again = [b for b in order if float(flags[b]) > 0]
        if again and self._accumulated and not self._told_accumulation:
            self._told_accumulation = True
            log.warning(
                "grads were accumulated over several backward passes with overlap_comm=True: %d bucket(s) were "
                "reduced once per pass and again at step(); run all but the last micro-batch's backward inside "
                "optimizer.no_sync() to reduce each once",
                len(again),
            )
        for b in again:
            self._reduces[b] = self._launch(params, b, async_op=False, own=True)
        for b in order:
            self._finish_reduce(self._reduces[b], b, stats, grads)
        return grads

    def _finish_reduce(self, reduce: _Reduce, b: int, stats: torch.Tensor | None, grads: list[torch.Tensor]) -> None:
        """Bucket ``b``'s reduce landed: the mean (DDP's), the slice's sum of squares into ``stats[0]``, and the
        pieces' grads (copied out of the transfer buffer unless it was the daemon's grad buffer itself)."""
        out = reduce.out
        if self.world_size > 1:
            out.div_(self.world_size)
        if stats is not None:
            stats[0] += out.double().square().sum()
        if self._grad_slices[b] is None:
            for i in self._by_bucket[b]:
                piece = self.pieces[i]
                grads[i].copy_(out[piece.at : piece.at + piece.numel])

    def _wait(self, reduce: _Reduce) -> None:
        if reduce.work is not None:
            self.schedule.wait("reduce-scatter", f"bucket {reduce.bucket}", reduce.work)
            reduce.work = None

    def _all_gather(self, params: list[torch.nn.Parameter]) -> None:
        for b, bucket in enumerate(self.layout.buckets):
            mine = self._param_slices[b]
            if mine is None:
                mine = self._slice[: bucket.slice_numel]
                mine.zero_()
                for i in self._by_bucket[b]:
                    piece = self.pieces[i]
                    mine[piece.at : piece.at + piece.numel].copy_(self._piece_params[i].detach())
            if self.world_size == 1:
                flat = mine  # the slice is the whole bucket
            else:
                flat = self._flat[: self.layout.padded_numel(bucket)]
                self.schedule.run("all-gather", f"bucket {b}", ALL_GATHER, flat, mine)
            for index, offset in zip(bucket.params, bucket.offsets, strict=True):
                p = params[index]
                p.data.copy_(flat[offset : offset + p.numel()].view(p.shape))

    def flush(self) -> None:
        """Collective: wait for a delayed update, install its params and gather them into every rank's model
        (``delayed_update=True``; a no-op's worth of copies otherwise)."""
        if self.inner is not None:
            self.inner.flush()
        self._all_gather(self.params())

    @property
    def params_behind(self) -> bool:
        """Whether this rank's daemon holds an update that the model does not have yet (``flush()``)."""
        return self.inner is not None and self.inner.update_in_flight

    def refresh(self) -> None:
        """Before a checkpoint reads the pieces: the model's params, edited in place since the last step, into
        them, as a step would take them; not while an update is in flight, whose pieces are newer than the
        model (``flush()``)."""
        if not self.params_behind:
            self._pull_params_into_pieces(self.params())

    def _pull_params_into_pieces(self, params: list[torch.nn.Parameter]) -> None:
        for piece, pp in zip(self.pieces, self._piece_params, strict=True):
            pp.data.copy_(params[piece.param].detach().reshape(-1)[piece.lo : piece.hi])

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


@dataclass
class _Reduce:
    """One bucket's reduce-scatter: its collective while in flight, where the slice lands, and the grads it
    read with their versions (``_changed``)."""

    work: Any
    out: torch.Tensor
    seen: list[tuple[torch.Tensor | None, int]]
    bucket: int


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


def _run_from(base: torch.Tensor, first: torch.Tensor, numel: int) -> torch.Tensor:
    """``numel`` elements of the shared storage ``base`` (uint8) from where ``first`` starts: a flat view across
    the tensors laid out after it (each of which has a torch storage of its own over the same mapping)."""
    offset = first.data_ptr() - base.data_ptr()
    return base[offset : offset + numel * first.element_size()].view(first.dtype)

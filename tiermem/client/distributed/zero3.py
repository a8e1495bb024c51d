"""``LayerShardedAdam``: ZeRO-3 by layer, each layer's params and Adam state on its owner rank's daemon.

The model's units (the submodules that own trained params directly; a module
whose params are all frozen stays whole in every rank's model) are dealt to the
ranks (``owners``: unit i to rank ``i * world // units`` by default, so four
layers over four ranks give one layer each, as in ZeRO's example).  A unit's
params live only in its owner's daemon (the pieces of an ``OffloadAdam`` of
the owner); every rank's module holds empty placeholders.  Per step:

- forward: before a unit runs, its params are gathered (a broadcast from the
  owner, the all-gather of a shard that is whole on one rank) into the
  module, and the next unit's gather is already in flight (the order is
  recorded on the first forward); after the unit ran they are released on
  every rank;
- backward: before a unit's backward its params are gathered again (the
  previous unit's gather in flight meanwhile); once its grads are complete
  they are reduced to the owner (the reduce-scatter of a whole-layer shard,
  DDP's mean) and released, and the owner hands them to its daemon, which
  updates that layer while the backward of the layer before runs (the
  overlapped update, from the second step on: the first step is synchronous
  and checks that the loop allows it);
- ``step()`` waits for what is still in flight.

Activation checkpointing (``torch.utils.checkpoint``) runs a unit's forward
again inside the backward (``in_backward``: autograd runs a backward on this
thread, the check ``torch.utils.checkpoint`` makes): that recompute finds the
unit gathered, or gathers it, leaves it for its backward, whose reduce releases
it, and gathers nothing ahead: a unit later in the forward order has had its
backward, so its update may be in flight, and a gather would broadcast its
old values for the next forward.

Each rank's daemon thus holds only its layers: params, master and moments.
``trace`` records the events (``gather``, ``release``, ``reduce``,
``update``) per unit, so the pipeline can be checked step by step.

``paged=True`` (ZeRO-Infinity's placement): the owner keeps no copy of its
layers either.  Their values live only as the ``master`` state key in its
daemon's tier (with ``offload="nvme"``, paged through the swap files with the
moments), read from there through the staging window before each broadcast,
and the reduced grads are written to the daemon's ``grad`` key as each
layer's reduce lands (accumulating over several backward passes), so the
trainer holds no param or grad between uses, on any rank.  The update then
runs at ``step()``, for all the owner's layers at once (the overlapped update
needs the params resident).

``max_grad_norm`` (with ``paged`` only: the overlapped update applies a
layer before the global norm exists) clips by the global norm of the reduced
grads, as ``clip_grad_norm_`` over the whole model: each owner adds up its
layers' sums of squares as their reduces land, every rank all-reduces them at
``step()``, and the coefficient reaches the daemon as the STEP's grad scale.

Loss scaling (with ``paged`` only, for the same reason): use
``ShardedGradScaler`` as torch's ``GradScaler`` (``scale``, ``step``,
``update``).  Each owner notes whether a reduced grad of its layers is
non-finite as it lands (an overflow on any rank is in the sum the owner
gets); the scaler all-reduces those flags, so every rank skips the same
steps and backs off its scale together; an applied step's inverse scale
reaches the daemon with the STEP's grad scale (times the clip coefficient),
and the global norm is that of the unscaled grads.

The model's own state dict: ``model.state_dict()`` gathers each unit from
its owner (a broadcast: every rank calls it, as ``ShardedPagedAdam``'s) and
holds the values in place of the placeholders; ``model.load_state_dict()``
(every rank, not a collective) gives each unit buffers of its params' shapes
for torch to copy into, then the owner writes the loaded values as its pieces
and masters (``InnerStore.write_values``, as ``load_shards``), and the unit is
released.  The moments stay, as under AdamW.

Checkpoints (``zero3_checkpoint``): ``state_dict()`` is this rank's file,
the fp32 values and moments of its layers' params, and
``save_shard(directory)`` writes it; ``load_shards(directory)`` loads the
rank files of a save at any world size or by ``ShardedPagedAdam``, params
included, and ``tiermem consolidate`` merges them offline into one model and
one ``torch.optim.AdamW`` state dict.  ``full_state_dict()`` (collective)
gathers AdamW's format, which ``load_state_dict`` takes at any world size
(the params then come from the model given to the constructor).

Limits: gradient accumulation only with ``paged`` (with ``max_grad_norm``,
each owner's daemon gives the sum of squares of the summed grads, GRAD_NORM);
CPU params; each unit used once per forward (a checkpointing
recompute is not a second use); one param group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, InitVar, dataclass
from typing import Any

import torch
import torch.distributed as dist

from tiermem.client.distributed.daemon_grads import DaemonGrads
from tiermem.client.distributed.group import RankGroup, ShardGrads, check_max_grad_norm
from tiermem.client.distributed.reshard import describe_params
from tiermem.client.distributed.schedule import DEFAULT_TIMEOUT_S, Probe
from tiermem.client.distributed.sharded import InnerPlan, ShardedOptimizer, ShardStrategy, of_strategy
from tiermem.client.distributed.zero3_checkpoint import RankShare, Slot
from tiermem.client.link import Client
from tiermem.client.offload.args import (
    check_hyper,
    copy_hyper,
    hyper_of,
    optimizer_defaults,
)
from tiermem.client.offload.copies import param_buffer
from tiermem.client.offload.optimizer import OffloadAdam
from tiermem.client.offload.options import OffloadOptions
from tiermem.client.offload.pagedparam import placeholder_edit
from tiermem.client.offload.pagehooks import ModelHook, in_backward
from tiermem.core import dtypes
from tiermem.core.errors import InvalidArgument, InvalidState
from tiermem.core.modes import Exchange, Placement
from tiermem.core.step_rules import StepDecision

__all__ = ["LayerShardedAdam", "LayerStrategy"]


class _Unit:
    def __init__(self, index: int, name: str, module: torch.nn.Module, owner: int) -> None:
        self.index = index
        self.name = f"{name or 'the root module'} ({type(module).__name__})"
        """The module, as a collective names it."""
        self.module = module
        self.owner = owner
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        self.params = [p for _, p in own]
        self.names = [f"{name}.{n}" if name else n for n, _ in own]
        self.dtypes = [p.dtype for p in self.params]
        self.versions = [0] * len(own)
        """Each param's version counter when it was given its empty placeholder (``_release``)."""
        self.shapes = [tuple(p.shape) for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.numel = sum(self.numels)
        self.flat: torch.Tensor | None = None
        self.work: Any = None
        self.grads_left = 0


class LayerShardedAdam(ShardedOptimizer):
    """See the module docstring.  A ``torch.optim.Optimizer`` over the model's params (one param group: LR
    schedulers and edits of ``param_groups[0]["lr"]`` reach the owners' daemons with the next update);
    ``step()``, ``zero_grad()``, ``close()``.  A thin constructor: ``ShardedOptimizer`` (the owner's
    ``OffloadAdam`` over its layers, ``inner``, None on a rank that owns none; the group; the checkpoints)
    with the by-layer strategy (``LayerStrategy``, ``strategy``).  ``state_dtype``: how the owners' daemons
    store the moments (``OffloadAdam``'s)."""

    strategy: LayerStrategy

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        adamw: bool = True,
        owners: Iterable[int] | None = None,
        process_group: Any = None,
        offload: str = "cpu",
        client: Client | None = None,
        job_id: str | None = None,
        token: str | None = None,
        trace: bool = False,
        paged: bool = False,
        max_grad_norm: float | None = None,
        state_dtype: str = "fp32",
        collective_timeout_s: float = DEFAULT_TIMEOUT_S,
        probe: Probe | None = None,
    ) -> None:
        """``collective_timeout_s``: how long a collective of a step waits for the other ranks before it
        raises ``RankLost`` (``schedule``).  ``probe``: told of each gather, grad and collective
        (``schedule.Probe``; tests slow them down through it)."""
        check_max_grad_norm(max_grad_norm)
        _check_clip(max_grad_norm, paged=paged)
        hyper = check_hyper(lr, betas, eps, weight_decay, adamw=adamw)
        defaults = optimizer_defaults(hyper, foreach=None, maximize=False, fused=None, adamw=adamw)
        options = _owner_options(offload, paged=paged, state_dtype=state_dtype)
        strategy = LayerStrategy(
            model, defaults, options, owners=owners, paged=paged, max_grad_norm=max_grad_norm, trace=trace, probe=probe
        )
        super().__init__(strategy, process_group, client, job_id, token, collective_timeout_s, probe)

    # ----------------------------------------------------------------- the strategy's own, by name

    paged = of_strategy()
    max_grad_norm = of_strategy()
    grads = of_strategy("This step's statistics of the reduced grads of this owner's layers (``ShardGrads``).")
    units = of_strategy("The model's units (submodules that own params), each with its owner rank.")
    events = of_strategy("With ``trace``: the events (``gather``, ``release``, ``reduce``, ``update``) per unit.")
    reduced = of_strategy("With ``trace``: the last reduced (mean) grads of the units this rank owns, flat.")
    unscale_shards = of_strategy("``ShardedGradScaler``'s check of this owner's reduced grads.")
    gathered_params = of_strategy("Collective: every unit's params, gathered (copies), in the model's order.")


@dataclass(eq=False, repr=False)
class LayerStrategy(ShardStrategy):
    """ZeRO-3 by layer (see the module docstring): each unit's params and Adam state on its owner, gathered
    for use by the facade's hooks, reduced to the owner as its grads complete."""

    name = "LayerShardedAdam"
    groups_rule = "takes the model's params as one param group; make a new one"

    model: torch.nn.Module
    defaults: dict[str, Any]
    options: OffloadOptions
    _: KW_ONLY
    owners: Iterable[int] | None
    paged: bool
    max_grad_norm: float | None
    trace: InitVar[bool]
    probe: Probe | None

    def __post_init__(self, trace: bool) -> None:
        self.keeps_values = not self.paged
        self.grads = ShardGrads(clipping=self.max_grad_norm is not None)
        """This step's statistics of the reduced grads of this owner's layers."""
        self._early = False
        """The inner step of this step updates what was not updated during backward (``trace``)."""
        self.events: list[tuple[str, int]] | None = [] if trace else None
        self.reduced: dict[int, torch.Tensor] = {}
        """With ``trace``: the last reduced (mean) grads of the units this rank owns, flat."""
        self._order: list[int] = []
        self._at: dict[int, int] = {}
        """Each unit's first place in ``_order`` (a lookup per unit and step: ``list.index`` made it O(units))."""
        self._recording = True
        self._grads: DaemonGrads | None = None
        self._loading: dict[int, list[int]] = {}
        """``model.load_state_dict()`` under way: the unit's params torch copies into, by index in the unit."""

    def set_max_grad_norm(self, max_grad_norm: float | None) -> None:
        _check_clip(max_grad_norm, paged=self.paged)
        self.grads.set_clipping(max_grad_norm is not None, self.name)
        super().set_max_grad_norm(max_grad_norm)

    # ----------------------------------------------------------------- the start

    def param_groups_for(self, group: RankGroup) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """One group of the units' trained params (the units dealt to the ranks)."""
        self.units = _deal_units(self.model, self.owners, group.world_size)
        return [{"params": [p for unit in self.units for p in unit.params]}], self.defaults

    def plan(self) -> InnerPlan:
        """Copies of this owner's layers' params (``_pieces``, the inner tensors), in one group."""
        self._mine = [u for u in self.units if u.owner == self.rank]
        self._pieces = {u.index: [torch.nn.Parameter(p.detach().clone()) for p in u.params] for u in self._mine}
        self._entry_of: dict[int, list[int]] = {}
        flat_pieces: list[torch.nn.Parameter] = []
        for u in self._mine:
            self._entry_of[u.index] = list(range(len(flat_pieces), len(flat_pieces) + len(u.params)))
            flat_pieces += self._pieces[u.index]
        groups = [{"params": flat_pieces, **hyper_of(self.param_groups[0])}] if flat_pieces else []
        return InnerPlan(groups, dtypes.by_torch(self.units[0].params[0].dtype).name)

    def attached(self) -> None:
        """``paged``: the inner optimizer's feed taken over; every unit released and hooked."""
        if self.paged and self.inner is not None:
            self._grads = self._page(self.inner)
        for unit in self.units:
            self._release(unit, log=False)
            for handle in (
                unit.module.register_forward_pre_hook(self._make_hook(unit, self._before_forward)),
                unit.module.register_forward_hook(self._make_hook(unit, self._after_forward)),
                unit.module.register_full_backward_pre_hook(self._make_hook(unit, self._before_backward)),
                *(p.register_post_accumulate_grad_hook(self._make_grad_hook(unit)) for p in unit.params),
                unit.module.register_state_dict_post_hook(functools.partial(self._save_unit, unit)),
                unit.module.register_load_state_dict_pre_hook(functools.partial(self._load_unit, unit)),
                unit.module.register_load_state_dict_post_hook(functools.partial(self._loaded_unit, unit)),
            ):
                self.keep_hook(handle)

    def reduced_model(self) -> torch.nn.Module:
        return self.model

    def _page(self, inner: OffloadAdam) -> DaemonGrads:
        """``paged``: the daemon has the values now (the staged exchange wrote them as masters): every copy here
        is dropped, and the grads go to the daemon as each layer's reduce lands (the feed only counts them)."""
        grads = DaemonGrads()
        inner.use_feed(grads, send_edits=False)
        for pieces in self._pieces.values():  # no copy stays here, only the shape (the inner state dicts'
            for piece in pieces:  # reads and writes are sized by it)
                piece.data = torch.full((), float("nan"), dtype=piece.dtype).expand(piece.shape)
        return grads

    def share(self) -> RankShare:
        """What this rank holds, in the checkpoints' terms: its layers' params whole, by tensor id."""
        model, mine = self.model, self._mine
        infos = describe_params(model)
        index = {id(p): i for i, p in enumerate(model.parameters())}
        order = tuple(index[id(p)] for unit in self.units for p in unit.params)
        slots = tuple(
            Slot(index[id(p)], 0, n, tid, n)
            for u in mine
            for p, n, tid in zip(u.params, u.numels, self._entry_of[u.index], strict=True)
        )
        sharded = set(order)
        frozen = tuple(i for i in range(len(infos)) if i not in sharded)  # whole in every rank's module
        return RankShare(
            self.name, self.rank, self.world_size, tuple(infos), order, slots, frozen, model, torch.device("cpu")
        )

    # ----------------------------------------------------------------- collectives

    def _log(self, what: str, unit: _Unit) -> None:
        if self.events is not None:
            self.events.append((what, unit.index))

    # ----------------------------------------------------------------- gather / release

    def _start_gather(self, unit: _Unit) -> None:
        if unit.flat is not None or unit.work is not None:
            return
        self._check_released(unit)
        flat = param_buffer(torch.Size([unit.numel]), unit.params[0].dtype, torch.device("cpu"))
        if unit.owner == self.rank and self.paged and self.inner is not None:
            self.inner.transfer.pull_many_into(
                [
                    (tid, "param", view)
                    for tid, view in zip(self._entry_of[unit.index], self._views(unit, flat), strict=True)
                ]
            )
        elif unit.owner == self.rank:
            torch.cat([p.detach().reshape(-1) for p in self._pieces[unit.index]], out=flat)
        src = self.group.global_rank(unit.owner)
        if self.probe is not None:
            self.probe.at("fetch", unit.name)
        unit.work = (flat, self.schedule.run("broadcast", unit.name, dist.broadcast, flat, src=src, async_op=True))

    def _finish_gather(self, unit: _Unit, *, log: bool = True) -> None:
        if unit.flat is not None and unit.work is None:
            return  # gathered already: a recompute's forward, within the unit's backward
        self._start_gather(unit)
        flat, work = unit.work
        self.schedule.wait("broadcast", unit.name, work)
        unit.work = None
        self._show(unit, flat)
        if log:
            self._log("gather", unit)

    @staticmethod
    def _show(unit: _Unit, flat: torch.Tensor) -> None:
        """The unit's params become views of ``flat``."""
        unit.flat = flat
        offset = 0
        for p, shape, n in zip(unit.params, unit.shapes, unit.numels, strict=True):
            p.data = flat[offset : offset + n].view(shape)
            offset += n

    @staticmethod
    def _views(unit: _Unit, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each param's stretch of a unit's flat buffer."""
        return list(torch.split(flat, unit.numels))

    def _release(self, unit: _Unit, *, log: bool = True) -> None:
        for p, dtype in zip(unit.params, unit.dtypes, strict=True):
            p.data = torch.empty(0, dtype=dtype)
        unit.versions = [p._version for p in unit.params]
        unit.flat = None
        if log:
            self._log("release", unit)

    def _check_released(self, unit: _Unit) -> None:
        """Before a released unit is gathered (every rank, before its collective): refuse params edited while
        they were empty placeholders (``nn.init``, ``p.data = t``, ``model.half()``), an edit the owner's
        daemon never saw and the gather would drop.  Every released unit's placeholders are put back first,
        so training goes on from the daemons' values."""
        changed = self._released_changes(unit)
        if not changed:
            return
        name, shape, dtype, how = changed[0]
        others = [c for u in self.units if u.flat is None and u.work is None for c in self._released_changes(u)]
        for u in self.units:
            if u.flat is None and u.work is None:
                self._release(u, log=False)
        more = f" (and {len(others) - 1} other params)" if len(others) > 1 else ""
        raise InvalidState(
            f"param {name!r} ({shape}, {dtype}) was {how} while its layer was released{more}: LayerShardedAdam "
            "keeps a layer's params on its owner's daemon, and between forwards the model holds empty "
            "placeholders, so the edit would be dropped at the next gather; the placeholders are put back. "
            "Edit the params with model.load_state_dict() (it reaches the owner), or before making the "
            "optimizer; convert the model's dtype first"
        )

    @staticmethod
    def _released_changes(unit: _Unit) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
        """What was done to each of a released unit's params since ``_release``: (name, shape, dtype, how)."""
        cpu = torch.device("cpu")
        found = []
        for p, name, shape, dtype, version in zip(
            unit.params, unit.names, unit.shapes, unit.dtypes, unit.versions, strict=True
        ):
            how = placeholder_edit(p, dtype, cpu, version, same_data=p.numel() == 0)
            if how is not None:
                found.append((name, shape, dtype, how))
        return found

    def _neighbour(self, unit: _Unit, step: int) -> _Unit | None:
        first = None if self._recording else self._at.get(unit.index)
        if first is None:
            return None
        at = first + step
        return self.units[self._order[at]] if 0 <= at < len(self._order) else None

    # ----------------------------------------------------------------- hooks

    @staticmethod
    def _make_hook(unit: _Unit, fn: Callable[[_Unit], None]) -> Callable[..., None]:
        def hook(*_args: Any) -> None:
            fn(unit)

        return ModelHook(hook, "sharded by layer by LayerShardedAdam", ranks=True)

    def _before_forward(self, unit: _Unit) -> None:
        if in_backward():  # activation checkpointing's recompute: the unit's backward comes next
            self._finish_gather(unit)
            return
        if self._recording:
            self._at.setdefault(unit.index, len(self._order))
            self._order.append(unit.index)
        self._finish_gather(unit)
        if self.opt.ddp_off is not None:
            self.opt.ddp_off(unit.module)
        ahead = self._neighbour(unit, +1)
        if ahead is not None:
            self._start_gather(ahead)  # overlaps this unit's forward
        unit.grads_left = len(unit.params)

    def _after_forward(self, unit: _Unit) -> None:
        if not in_backward():  # a recompute's params stay for the backward; its grads release them
            self._release(unit)

    def _before_backward(self, unit: _Unit) -> None:
        self._finish_gather(unit)
        behind = self._neighbour(unit, -1)
        if behind is not None:
            self._start_gather(behind)  # overlaps this unit's backward

    def _make_grad_hook(self, unit: _Unit) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self.probe is not None:
                self.probe.at("grad", unit.name)
            unit.grads_left -= 1
            if unit.grads_left == 0:
                self._grads_ready(unit)

        return torch.compiler.disable(hook)

    def _grads_ready(self, unit: _Unit) -> None:
        """The unit's grads are complete: reduce them to the owner, release, and let the owner's daemon
        update the layer while the backward goes on."""
        flat = torch.cat([p.grad.reshape(-1) for p in unit.params])  # type: ignore[union-attr]
        dst = self.group.global_rank(unit.owner)
        self.schedule.run("reduce", unit.name, dist.reduce, flat, dst=dst)
        self._log("reduce", unit)
        for p in unit.params:
            p.grad = None
        self._release(unit)
        if unit.owner != self.rank or self.inner is None:
            return
        self.sync_hyper()  # an overlapped update of this layer starts now, with the current hyper-parameters
        flat.div_(self.world_size)
        if self.paged:  # the global norm and the overflow check of this step, at step() (the grads go now)
            self.grads.add(unit.index, flat)
        if self.events is not None:
            self.reduced[unit.index] = flat.clone()
        if self._grads is not None:  # paged: the grads go to the daemon now, nothing stays here
            tids = self._entry_of[unit.index]
            self.inner.transfer.push_many(
                (tid, "grad", view, 0, self._grads.land(tid))
                for tid, view in zip(tids, self._views(unit, flat), strict=True)
            )
            return
        feed = self.inner.shared_feed
        if feed is None:
            raise InvalidState("LayerShardedAdam without paging needs its owner's params in shared storage (CPU)")
        offset = 0
        for piece, n, entry in zip(self._pieces[unit.index], unit.numels, self._entry_of[unit.index], strict=True):
            view = feed.entries[entry].grad_views[feed.buffer]
            view.copy_(flat[offset : offset + n].view(view.shape))
            offset += n
            piece.grad = view
            feed.land_grad(piece)  # as autograd's hook would: land, then the bucket
        if self.inner.policy.overlap_now:
            self._log("update", unit)

    # ----------------------------------------------------------------- the step

    def unscale_shards(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> torch.Tensor:
        """``ShardedGradScaler``'s check of this owner's reduced grads (``ShardGrads.check``)."""
        if not self.paged:
            raise InvalidState(
                "loss scaling needs LayerShardedAdam(paged=True): without it a layer is updated during backward, "
                "before an overflow on any rank is known"
            )
        return self.grads.check(inv_scale, found_inf)

    def _new_step(self, *, drop_grads: bool = True) -> None:
        """This step's statistics start afresh; ``drop_grads``: so do the daemon's grads (a refused step: the
        next backward overwrites them; after a sent step the inner optimizer did it)."""
        self.grads.new_step()
        if drop_grads and self._grads is not None:
            self._grads.reset()

    def decide(self) -> StepDecision:
        """Where ZeRO-3 by layer's grads come from: reduced to their owners during backward (paged: into the
        daemon); their statistics (``ShardGrads``) all-reduced where clipping asks, the scaler's flags global."""
        self._recording = False
        try:
            accumulated = self._grads is not None and self._grads.accumulated
            decision = self.grads.decide(
                self.group, self.opt, self.max_grad_norm, self._held_sq_norm, accumulated=accumulated
            )
        except InvalidState:
            self._new_step()  # the step is refused
            raise
        self._new_step(drop_grads=False)
        return decision

    def _held_sq_norm(self) -> float:
        """This owner's sum of squares of its layers' grads as its daemon holds them (summed over the step's
        backward passes); 0 for a rank that owns no layer."""
        return 0.0 if self.inner is None else self.inner.held_grad_stats().sq_norm

    def hand_over(self, decision: StepDecision) -> None:
        """The grads are in the daemon already; only what the trace records is noted (the first step: every
        update runs now)."""
        self._early = self.inner is not None and self.inner.policy.overlap_now

    def after_update(self, decision: StepDecision) -> None:
        """Nothing to gather: a layer is gathered when it is used."""
        if self.inner is not None and not self._early and not decision.skip and self.events is not None:
            for index in self._entry_of:
                self.events.append(("update", index))

    def sync_hyper(self) -> None:
        """The group's hyper-parameters (a scheduler or the user may have changed them) into the inner
        optimizer's group, which the daemon's updates read."""
        if self.inner is not None:
            copy_hyper(
                self.param_groups, self.inner.param_groups, ((0, j) for j in range(len(self.inner.param_groups)))
            )

    def zero_grad(self, set_to_none: bool) -> None:
        for unit in self.units:
            for p in unit.params:
                p.grad = None
        if self.inner is not None:
            self.inner.zero_grad(set_to_none=set_to_none)
        self._new_step(drop_grads=False)

    def gathered_params(self) -> list[torch.Tensor]:
        """Collective: every unit's params, gathered (copies), in the model's order."""
        out = []
        for unit in self.units:
            self._finish_gather(unit, log=False)
            out += [p.detach().clone() for p in unit.params]
            self._release(unit, log=False)
        return out

    # ----------------------------------------------------------------- the model's state dict

    @staticmethod
    def _named(unit: _Unit) -> list[str]:
        """The names, in ``unit.module``, of ``unit.params``."""
        return [name for name, p in unit.module.named_parameters(recurse=False) if p.requires_grad]

    def _save_unit(self, unit: _Unit, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, _: Any) -> None:
        """``model.state_dict()``: the unit's params, gathered from their owner (a collective: every rank
        calls it, as it gathers before a forward), as CPU copies in place of the placeholders (as the paged
        strategy's: a whole model in the device memory of each rank is what ZeRO-3 is there to avoid); from
        ``consolidate_model_state``'s values where this rank keeps them (no collective)."""
        kept = [self.opt.kept_model.value(p) for p in unit.params]
        if all(v is not None for v in kept):
            for name, value in zip(self._named(unit), kept, strict=True):
                if prefix + name in state_dict:
                    state_dict[prefix + name] = value
            return
        held = unit.flat is not None
        if not held:
            self._finish_gather(unit, log=False)
        for name, p in zip(self._named(unit), unit.params, strict=True):
            if prefix + name in state_dict:
                state_dict[prefix + name] = p.detach().to("cpu", copy=True)
        if not held:
            self._release(unit, log=False)

    def _load_unit(
        self, unit: _Unit, module: torch.nn.Module, state_dict: Any, prefix: str, local_metadata: Any, *_: Any
    ) -> None:
        """``model.load_state_dict()``, before torch copies: the unit gets buffers of its params' shapes to
        copy into (not a collective: every rank has the whole state dict, only the owner keeps the values)."""
        if local_metadata.get("assign_to_params_buffers", False):
            raise InvalidArgument(
                "load_state_dict(assign=True) would replace LayerShardedAdam's placeholders with the loaded "
                "tensors; load with assign=False (each layer's owner keeps the values)"
            )
        if unit.flat is not None or unit.work is not None:
            raise InvalidState(f"load_state_dict while {unit.name} is gathered (in a forward or backward)")
        ok = []
        for j, name in enumerate(self._named(unit)):
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and tuple(value.shape) == unit.shapes[j]:
                ok.append(j)  # torch copies these; it reports the others (missing, or of another shape)
        self._loading[unit.index] = ok
        self._show(unit, torch.empty(unit.numel, dtype=unit.params[0].dtype))

    def _loaded_unit(self, unit: _Unit, module: torch.nn.Module, incompatible_keys: Any) -> None:
        """After torch copied: the owner makes the loaded values its params' (pieces and masters); every rank
        releases the unit again."""
        loaded = self._loading.pop(unit.index, None)
        if loaded is None:
            return
        try:
            if loaded and unit.owner == self.rank and self.inner is not None:
                slots = {slot.tid: slot for slot in self.opt.checkpoint.share.slots}
                tids = self._entry_of[unit.index]
                self.opt.checkpoint.store.write_values(
                    [(slots[tids[j]], unit.params[j].detach().reshape(-1)) for j in loaded]
                )
        finally:
            self._release(unit, log=False)


def _owner_options(offload: str, *, paged: bool, state_dtype: str) -> OffloadOptions:
    """An owner's inner ``OffloadAdam``'s settings.  Paged: the grads go to the daemon as each layer's reduce
    lands, through the window.  Else each layer's update starts when its grads are in (one bucket per tensor),
    during backward, on params in the shared storage."""
    return OffloadOptions(
        offload=Placement.parse(offload, "offload"),
        exchange=Exchange.STAGED if paged else Exchange.SHARED,
        release_grads=paged,
        overlap_update=not paged,
        bucket_nbytes=1,
        state_dtype=state_dtype,
    )


def _deal_units(model: torch.nn.Module, owners: Iterable[int] | None, world_size: int) -> list[_Unit]:
    """The model's units (the submodules that own trained params directly), each with its owner rank
    (``owners``, or unit i to rank ``i * world_size // units``); their params must be on the host.  A module
    whose params are all frozen is no unit: its params stay whole in every rank's model, as torch's."""
    modules = [(n, m) for n, m in model.named_modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    if not modules:
        raise InvalidArgument("the model has no trained params (every param has requires_grad=False)")
    count = len(modules)
    owner_of = list(owners) if owners is not None else [i * world_size // count for i in range(count)]
    if len(owner_of) != count or not all(0 <= o < world_size for o in owner_of):
        raise InvalidArgument(f"owners must give a rank in [0, {world_size}) for each of the {count} units")
    trained = [p for _, m in modules for p in m.parameters(recurse=False) if p.requires_grad]
    elsewhere = sorted({str(p.device) for p in trained} - {"cpu"})
    if elsewhere:  # every rank has the same model: every rank raises here, before any collective
        raise InvalidArgument(
            f"LayerShardedAdam gathers each layer into host memory, so the model's params must be on the CPU; "
            f"they are on {elsewhere}. For a model on a GPU use tiermem.distributed.ShardedPagedAdam (ZeRO-3 "
            "by shard, paged within device_budget) or ShardedOffloadAdam (ZeRO-2)"
        )
    _refuse_shared_params(modules)
    return [_Unit(i, n, m, o) for i, ((n, m), o) in enumerate(zip(modules, owner_of, strict=True))]


def _refuse_shared_params(modules: list[tuple[str, torch.nn.Module]]) -> None:
    """A param of two units (tied weights: GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) would have
    two owners, each gathering and updating it: refused, naming both, before any collective (every rank
    raises)."""
    seen: dict[int, str] = {}
    for name, module in modules:
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue  # not gathered: whole in every rank's model
            here = f"{name}.{pname}" if name else pname
            first = seen.setdefault(id(p), here)
            if first != here:
                raise InvalidArgument(
                    f"LayerShardedAdam: {here} is {first} (tied weights, shape {tuple(p.shape)}); a param "
                    "belongs to one unit, on one rank. Use tiermem.distributed.ShardedPagedAdam (ZeRO-3 by "
                    "shard), which takes tied params, or untie them"
                )


def _check_clip(max_grad_norm: float | None, *, paged: bool) -> None:
    if max_grad_norm is not None and not paged:
        raise InvalidArgument(
            "max_grad_norm needs paged=True: without it a layer is updated during backward, before the "
            "global norm of all the layers' grads exists"
        )

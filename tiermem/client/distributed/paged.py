"""``ShardedPagedAdam``: ZeRO-3 with param paging (ZeRO-Infinity) over ``torch.distributed``.

Every param of the model is cut into one equal shard per rank (``numel``
rounded up to a multiple of the world size; the last shard padded with
zeros).  Rank ``r``'s shard of param ``i`` is tensor ``i`` of an
``OffloadAdam`` attached to its node's daemon as rank ``r`` of one job, made
with the staged exchange: the daemon keeps the shard's value as its ``master``
state key beside the moments, in the pool or (``offload="nvme"``) paged
through the swap files.  No rank holds a whole param, or any param, between
uses: the model is paged by ``offload_params``' pager (``ParamPager``: hooks
on the submodules that own params, saved-tensor hooks, prefetch along the
recorded order, a ``device_budget``), whose copies are collective here:

- fetch: the rank reads its shards of a submodule's params from its daemon
  through the staging window into one flat buffer, and one
  ``all_gather_into_tensor`` of it makes the whole params on every rank, just
  before the submodule's forward (and again in backward, for the params its
  backward needs);
- grad: once every grad of a submodule is complete (or the backward pass
  ends), one ``reduce_scatter_tensor`` of a flat buffer of them sums them
  across the ranks, each rank divides its shards by the world size (DDP's
  mean) and writes them to its daemon's ``grad`` key (adding to them from a
  second backward pass: gradient accumulation);
- ``model.state_dict()`` gathers each param the same way (a collective: every
  rank calls it), ``model.load_state_dict()`` writes each rank's shard.

Checkpoints (``zero3_checkpoint``): ``opt.save_shard(directory)`` on every
rank writes the rank's stretch of every param (fp32 value, moments, step);
``opt.load_shards(directory)`` loads them at any world size, into either
ZeRO-3 optimizer, params included, and ``tiermem consolidate`` merges them
offline into one model and one ``torch.optim.AdamW`` state dict.
``opt.full_state_dict()`` (collective) gathers AdamW's format on every rank,
which ``opt.load_state_dict`` takes at any world size (the model's params
then come from ``model.load_state_dict``: torch's keys, gathered by
``model.state_dict()``, loadable at any world size too).  ``opt.state_dict()``
is this rank's file, as for every sharded optimizer (``ShardedOptimizer``):
``load_state_dict`` takes it back at the same world size.

The collectives run on the pager's one I/O thread, in the order the trainer
submitted them; that order is the same on every rank because every rank runs
the same model with the same budget: the pager's fetches depend on sizes and
the recorded order only, and a submodule's grads go when the last of them
lands (``GradUnits``), never batched by when the I/O thread happens to be
free.  Each collective waits at most ``collective_timeout_s``, then raises
``RankLost`` naming itself (``schedule``).

``step()``: with ``max_grad_norm`` the norm is global: each rank's sum of
squares of its reduced shards (taken when they were written) is all-reduced,
and the clip coefficient reaches the daemon with the step as a grad scale, so
every rank clips by ``clip_grad_norm_``'s coefficient over the unsharded
model.  After several backward passes (gradient accumulation) those figures
are each pass's, and only the daemon holds the sum: each rank asks its daemon
for the sum of squares of its shards (GRAD_NORM), and those are all-reduced.

Loss scaling: ``ShardedGradScaler``, used as torch's ``GradScaler``.  Each
reduced shard is checked for inf/nan as it is written (an overflow on any
rank is in every rank's reduced shard); the scaler all-reduces the flags, so
every rank skips the same steps; an applied step's inverse scale reaches the
daemon with the grad scale (times the clip coefficient), and the norm is
that of the unscaled grads.

Params on a GPU (one device per rank, NCCL): the model's placeholders and
materialized params are on the device, the copies and collectives run on
the pager's copy stream (``ShardCopies``), and the staging window is
registered with CUDA so the shards' copies to and from it are DMA.

A model made on the meta device (``zero.Init``'s purpose: never whole on any
rank): every rank takes rank 0's random generators (``_rank_0s_generator``),
and the pager materializes one submodule at a time on ``init_device``, runs
its ``reset_parameters()`` and ``init``, writes this rank's shard of each
param to the daemon as its master, and releases it.  So every rank computes
the values rank 0 would have built on the host, and keeps its stretch of
them; each rank's generators are its own again afterwards (rank 0's advanced,
as building would have).  Its buffers must have values already (refused
otherwise, naming them): only params are initialized.  A reattach takes the
daemon's values instead of an init.  Otherwise the initial values are rank
0's, broadcast, and each rank writes its stretch of each param to the daemon
one param at a time (``_write_masters``), each straight from the param where
its stretch needs no padding: the inner optimizer's shards are meta tensors
(shapes only), so no second copy of the model is ever whole in the trainer
(``benchmarks/bench_meta_init.py``: 1.15x the model at construction, of
which 0.14x is torch's own first-optimizer import, which ``AdamW`` pays too;
2.40x when every shard was copied first, 1.28x when each was copied in turn).

Not supported: the overlapped and delayed updates (as with
``offload_params``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tiermem.client.distributed.group import RankGroup, ShardGrads, check_max_grad_norm
from tiermem.client.distributed.reshard import describe_params
from tiermem.client.distributed.schedule import (
    ALL_GATHER,
    DEFAULT_TIMEOUT_S,
    REDUCE_SCATTER,
    Collectives,
    Probe,
)
from tiermem.client.distributed.sharded import InnerPlan, ShardedOptimizer, ShardStrategy, of_strategy
from tiermem.client.distributed.zero3_checkpoint import RankShare, Slot
from tiermem.client.link import Client
from tiermem.client.offload.args import check_hyper, copy_hyper, optimizer_defaults
from tiermem.client.offload.copies import FetchItem, GradItem, compute_mark, param_buffer
from tiermem.client.offload.optimizer import OffloadAdam
from tiermem.client.offload.options import OffloadOptions
from tiermem.client.offload.pageargs import check_buffers
from tiermem.client.offload.paging import ParamPager
from tiermem.client.offload.stats import OptimizerStats
from tiermem.client.offload.transfer import StateTransfer
from tiermem.core import dtypes
from tiermem.core.errors import InvalidArgument, InvalidState
from tiermem.core.modes import Exchange, Placement
from tiermem.core.step_rules import StepDecision

__all__ = ["PagedStrategy", "ShardCopies", "ShardedPagedAdam"]


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of each rank's shard of a param of ``numel`` elements."""
    return max(1, -(-numel // world_size))


@dataclass(eq=False)
class ShardCopies:
    """The pager's copies when tensor ``i`` of this rank is its shard of param ``i`` (I/O thread only).

    ``device``: where the model's params are.  On the host every copy and collective completes when it
    returns.  On a CUDA device they run on one copy stream, as ``CudaCopies``' do: a fetch pulls the shard
    from the (CUDA-registered) staging window to the device, all-gathers it there (NCCL orders its stream
    after the current one, the copy stream, and a synchronous collective orders the copy stream after its
    own) and records an event that the compute stream waits on before the param is used; a grad push
    waits on the event recorded where the grad was produced, reduce-scatters on the device and writes the
    reduced shard to the daemon.  Every temporary is allocated on the copy stream."""

    numels: list[int]
    units: list[str]
    """The submodule that owns each param (by tensor id), as a collective names it."""
    rank: int
    world_size: int
    schedule: Collectives
    grads: ShardGrads
    """This step's statistics of the reduced shards written to the daemon."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    stream: Any = field(init=False)
    """The copy stream on a CUDA device; None on the host."""

    def __post_init__(self) -> None:
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    def _shard(self, tid: int) -> int:
        return shard_numel(self.numels[tid], self.world_size)

    def _on_copy_stream(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _event(self) -> Any:
        """What the compute stream waits on before using what the copy stream wrote (None on the host)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return param_buffer(shape, dtype, self.device)

    def ready(self, token: Any) -> None:
        if token is not None:
            torch.cuda.current_stream(self.device).wait_event(token)

    def grad_token(self, grad: torch.Tensor) -> Any:
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        grad.record_stream(self.stream)  # the copy stream reads it: its memory is not handed out before
        return event

    def _label(self, tids: Iterable[int]) -> str:
        """The submodule(s) a collective over these params serves."""
        return ", ".join(dict.fromkeys(self.units[tid] for tid in tids))

    def _gather(self, transfer: StateTransfer, items: Sequence[FetchItem]) -> None:
        """This rank's shards of ``items`` (a submodule's params) in one transfer into one flat buffer, and one
        all-gather of it (rank r's shards after rank r-1's); then each param's stretches into its ``out``."""
        sizes = [self._shard(tid) for tid, _ in items]
        dtype = items[0][1].dtype
        with self._on_copy_stream():
            mine = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            transfer.pull_many_into([(tid, "param", m) for (tid, _), m in zip(items, mine.split(sizes), strict=True)])
            whole = torch.empty(self.world_size, mine.numel(), dtype=dtype, device=self.device)
            self.schedule.run("all-gather", self._label(tid for tid, _ in items), ALL_GATHER, whole.view(-1), mine)
            at = 0
            for (_, out), n in zip(items, sizes, strict=True):
                _from_rows(whole[:, at : at + n], out.view(-1))  # to a host ``out``: complete when it returns
                at += n

    def mark(self) -> Any:
        return compute_mark(self.device) if self.stream is not None else None

    def fetch_many(self, transfer: StateTransfer, items: Sequence[FetchItem], after: Any = None) -> Any:
        if after is not None and self.stream is not None:
            self.stream.wait_event(after)
        self._gather(transfer, items)
        return self._event()

    def read_master(self, transfer: StateTransfer, tid: int, out: torch.Tensor) -> None:
        self._gather(transfer, [(tid, out)])

    def mine(self, tid: int, values: torch.Tensor) -> torch.Tensor:
        """This rank's stretch of a whole param's ``values`` (any device), padded to the shard's size: a view
        of ``values`` where it needs no padding (a push copies it span by span into the window, so a model
        built on the host is never copied whole), else a padded copy on the host."""
        n = self._shard(tid)
        flat = values.detach().reshape(-1)
        lo = min(self.rank * n, flat.numel())
        hi = min(lo + n, flat.numel())
        if hi - lo == n:
            return flat[lo:hi]
        out = torch.zeros(n, dtype=values.dtype)
        out[: hi - lo].copy_(flat[lo:hi])
        return out

    def write_master(self, transfer: StateTransfer, tid: int, values: torch.Tensor) -> None:
        transfer.push(tid, "master", self.mine(tid, values), step=0)

    def adopt_master(self, transfer: StateTransfer, tid: int, values: torch.Tensor) -> None:
        transfer.adopt_many([(tid, self.mine(tid, values))])

    def push_many(self, transfer: StateTransfer, items: Sequence[GradItem]) -> None:
        """A submodule's grads in one flat buffer (rank r's stretch of each after rank r-1's), one
        reduce-scatter of it, and this rank's reduced shards written in one transfer."""
        sizes = [self._shard(tid) for tid, _, _, _ in items]
        dtype = items[0][1].dtype
        for _, _, _, token in items:
            if token is not None and self.stream is not None:
                self.stream.wait_event(token)
        with self._on_copy_stream():
            whole = torch.zeros(self.world_size, sum(sizes), dtype=dtype, device=self.device)
            at = 0
            for (_, grad, _, _), n in zip(items, sizes, strict=True):
                _into_rows(grad.reshape(-1), whole[:, at : at + n])
                at += n
            mine = torch.empty(whole.shape[1], dtype=dtype, device=self.device)
            tids = tuple(tid for tid, _, _, _ in items)
            self.schedule.run("reduce-scatter", self._label(tids), REDUCE_SCATTER, mine, whole.view(-1))
            if self.world_size > 1:
                mine.div_(self.world_size)
            self.grads.add(tids, mine, accumulate=any(accumulate for _, _, accumulate, _ in items))
            shards = mine.split(sizes)
            transfer.push_many(
                [(tid, "grad", m, 0, accumulate) for (tid, _, accumulate, _), m in zip(items, shards, strict=True)]
            )


def _from_rows(rows: torch.Tensor, flat: torch.Tensor) -> None:
    """``flat`` (a param's ``numel`` values) from ``rows`` (one stretch of ``n`` per rank, the last padded)."""
    n = rows.shape[1]
    full, rest = divmod(flat.numel(), n)
    flat[: full * n].view(full, n).copy_(rows[:full])
    if rest:
        flat[full * n :].copy_(rows[full, :rest])


def _into_rows(flat: torch.Tensor, rows: torch.Tensor) -> None:
    """``flat`` into ``rows`` (zeros), one stretch of ``n`` per rank: ``_from_rows``' inverse."""
    n = rows.shape[1]
    full, rest = divmod(flat.numel(), n)
    rows[:full].copy_(flat[: full * n].view(full, n))
    if rest:
        rows[full, :rest].copy_(flat[full * n :])


def _model_groups(model: nn.Module, param_groups: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The param groups over the model's params, checked: each of its params in exactly one group."""
    mine = list(model.parameters())
    if param_groups is None:
        return [{"params": mine}]
    if not isinstance(param_groups, list) or not all(isinstance(g, dict) and "params" in g for g in param_groups):
        raise InvalidArgument("param_groups must be a list of dicts with 'params', as torch.optim takes them")
    groups = [{**g, "params": list(g["params"])} for g in param_groups]
    seen: dict[int, int] = {}
    for i, g in enumerate(groups):
        for p in g["params"]:
            if id(p) in seen:
                raise InvalidArgument(f"a param is in param groups {seen[id(p)]} and {i}; give each param once")
            seen[id(p)] = i
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [names[id(p)] for p in mine if id(p) not in seen]
    foreign = [i for i, g in enumerate(groups) for p in g["params"] if id(p) not in names]
    if missing or foreign:
        raise InvalidArgument(
            f"param_groups must hold every param of the model and nothing else: missing {missing[:4]}, "
            f"{len(foreign)} param(s) not in the model"
        )
    return groups


def _device_and_dtype(params: list[nn.Parameter], init_device: str | torch.device) -> tuple[torch.device, torch.dtype]:
    """The one device (the host or a GPU) and the one dtype of ``params``, or ``InvalidArgument``; for a
    model made on the meta device, ``init_device``."""
    if not params:
        raise InvalidArgument("the model has no params")
    devices = {p.device for p in params}
    if devices == {torch.device("meta")}:
        devices = {torch.device(init_device)}
    if len(devices) > 1 or not {d.type for d in devices} <= {"cpu", "cuda"}:
        raise InvalidArgument(
            f"ShardedPagedAdam pages the params of one device, the host or a GPU (or a model made on the meta "
            f"device, materialized on init_device); the model's are on {sorted(map(str, devices))}"
        )
    kinds = {p.dtype for p in params}
    if len(kinds) != 1:
        raise InvalidArgument(f"ShardedPagedAdam needs one dtype for all params, got {sorted(map(str, kinds))}")
    return devices.pop(), kinds.pop()


def _generators(device: torch.device) -> list[torch.Tensor]:
    """The host's random generator state, and the CUDA device's when ``device`` is one."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _set_generators(states: list[torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


def _owners(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    """The name of the first submodule (in module order) that owns each of ``params``, as collectives name it."""
    owner: dict[int, str] = {}
    for name, module in model.named_modules():
        for p in module._parameters.values():
            if p is not None:
                owner.setdefault(id(p), f"{name or 'the root module'} ({type(module).__name__})")
    return [owner[id(p)] for p in params]


class ShardedPagedAdam(ShardedOptimizer):
    """AdamW (``adamw=False``: Adam) over a model paged and sharded across ``process_group``; see the module
    docstring.  A ``torch.optim.Optimizer`` over the model's params (LR schedulers and edits of the groups'
    hyper-parameters reach the daemon with the next step).  A thin constructor: ``ShardedOptimizer`` (this
    rank's ``OffloadAdam`` over its shards, ``inner``; the group; the checkpoints) with the paged strategy
    (``PagedStrategy``, ``strategy``: the model's ``ParamPager``, ``pager``; its figures: ``pager.stats()``).
    ``state_dtype``: how the daemons store the shards' moments (``OffloadAdam``'s); checkpoints stay AdamW's
    fp32 format."""

    strategy: PagedStrategy
    inner: OffloadAdam

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        adamw: bool = True,
        offload: str | Placement = "nvme",
        max_grad_norm: float | None = None,
        device_budget: int | str,
        prefetch: int = 2,
        process_group: Any = None,
        window_nbytes: int | None = None,
        client: Client | None = None,
        job_id: str | None = None,
        token: str | None = None,
        param_groups: list[dict[str, Any]] | None = None,
        state_dtype: str = "fp32",
        collective_timeout_s: float = DEFAULT_TIMEOUT_S,
        probe: Probe | None = None,
        init: Callable[[nn.Module], None] | None = None,
        init_device: str | torch.device = "cpu",
    ) -> None:
        """``param_groups``: torch's param groups over the model's params (``{"params": [...], "weight_decay":
        0.0}``, ...; every param of the model in exactly one), for hyper-parameters per group; by default one
        group of every param with the keyword arguments' values.  ``collective_timeout_s``: how long a
        collective of a step waits for the other ranks before it raises ``RankLost`` (``schedule``).
        ``probe``: told of each fetch, grad, transfer and collective (``schedule.Probe``; tests slow them
        down through it).  A model made on the meta device (see the module docstring) is materialized on
        ``init_device`` one submodule at a time: ``reset_parameters()``, then ``init(submodule)``."""
        check_max_grad_norm(max_grad_norm)
        hyper = check_hyper(lr, betas, eps, weight_decay, adamw=adamw)
        groups = _model_groups(model, param_groups)
        device, dtype = _device_and_dtype([p for g in groups for p in g["params"]], init_device)
        check_buffers(model, "ShardedPagedAdam")
        options = OffloadOptions(
            offload=Placement.parse(offload, "offload"),
            exchange=Exchange.STAGED,  # the pager's: params and grads through the window, grads in the daemon
            release_grads=True,
            window_nbytes=window_nbytes,
            pin_window=device.type == "cuda",  # the shards are host tensors; the copies go to and from the GPU
            state_dtype=state_dtype,
        )
        defaults = optimizer_defaults(hyper, foreach=None, maximize=False, fused=None, adamw=adamw)
        strategy = PagedStrategy(
            model,
            groups,
            defaults,
            options,
            device=device,
            dtype=dtype,
            max_grad_norm=max_grad_norm,
            device_budget=device_budget,
            prefetch=prefetch,
            probe=probe,
            init=init,
        )
        super().__init__(strategy, process_group, client, job_id, token, collective_timeout_s, probe)

    # ----------------------------------------------------------------- the strategy's own, by name

    max_grad_norm = of_strategy("``max_grad_norm`` over the unsharded model (the daemon gets the coefficient).")
    grads = of_strategy("This step's statistics of the rank's reduced shards (``ShardGrads``).")
    pager = of_strategy("The model's ``ParamPager`` (its figures: ``pager.stats()``).")
    copies = of_strategy("The pager's collective copies (``ShardCopies``).")
    unscale_shards = of_strategy("``ShardedGradScaler``'s check of this rank's reduced shards.")

    @property
    def client(self) -> Client:
        return self.inner.client

    def stats(self) -> OptimizerStats:
        return self.inner.stats()

    def flush(self) -> None:
        self.inner.flush()  # the pager's transfers drained too: it is the inner optimizer's feed


@dataclass(eq=False, repr=False)
class PagedStrategy(ShardStrategy):
    """ZeRO-3 paged (see the module docstring): every param sharded across the ranks, each shard only in its
    rank's daemon; the pager all-gathers a submodule's params before use and reduce-scatters its grads into
    the daemons, so there is nothing to hand over before the inner step nor to gather after it."""

    name = "ShardedPagedAdam"
    groups_rule = (
        "shards the model it was made with; give every group to the constructor (param_groups=), or make a new one"
    )

    model: nn.Module
    groups: InitVar[list[dict[str, Any]]]
    defaults: InitVar[dict[str, Any]]
    options: OffloadOptions
    _: KW_ONLY
    device: torch.device
    dtype: torch.dtype
    max_grad_norm: float | None
    device_budget: int | str
    prefetch: int
    probe: Probe | None
    init: Callable[[nn.Module], None] | None = None

    def __post_init__(self, groups: list[dict[str, Any]], defaults: dict[str, Any]) -> None:
        self.meta = all(p.is_meta for g in groups for p in g["params"])
        """The model was made on the meta device: its values come from an init, not from rank 0's."""
        self.broadcast_params = not self.meta
        self._given = (groups, defaults)
        self.grads = ShardGrads(clipping=self.max_grad_norm is not None)

    def set_max_grad_norm(self, max_grad_norm: float | None) -> None:
        self.pager.drain()  # the grads whose pushes are under way have their figures (or not) by now
        self.grads.set_clipping(max_grad_norm is not None, self.name)
        super().set_max_grad_norm(max_grad_norm)

    @property
    def inner(self) -> OffloadAdam:
        """Every rank holds a shard of every param, so every rank has an inner optimizer once attached."""
        return self.opt.inner  # type: ignore[return-value]

    # ----------------------------------------------------------------- the start

    def param_groups_for(self, group: RankGroup) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        groups, defaults = self._given
        del self._given
        return groups, defaults

    def plan(self) -> InnerPlan:
        """The collective copies, and this rank's shard of each param (tensor i: param i's) in the same groups."""
        params = self.params()
        numels = [p.numel() for p in params]
        self.copies = ShardCopies(
            numels, _owners(self.model, params), self.rank, self.world_size, self.schedule, self.grads, self.device
        )
        shard_groups = self._shard_groups(params)
        return InnerPlan(shard_groups, dtypes.by_torch(self.dtype).name)

    def attached(self) -> None:
        """A new job's masters (``_write_masters``; a meta model's come from its init), then the model's pager
        over the inner optimizer."""
        if not self.meta and self.inner.state_from == "new":
            self._write_masters()
        own = self._rank_0s_generator() if self.meta else None
        try:
            self.pager = ParamPager(
                self.model,
                self.inner,
                device_budget=self.device_budget,
                prefetch=self.prefetch,
                init=self.init,
                params=self.params(),
                copies=self.copies,
                probe=self.probe,
                owner="ShardedPagedAdam",
            )
            self.pager.kept = self.opt.kept_model.value
            self.pager.on_forward = self.opt.ddp_off
        finally:
            if own is not None and self.rank != 0:
                _set_generators(own, self.device)

    def reduced_model(self) -> nn.Module:
        return self.model

    def _write_masters(self) -> None:
        """This rank's stretch of each param (rank 0's values: broadcast at the start) to the daemon as its
        master, one param at a time; a reattach keeps the daemon's instead."""
        transfer = self.inner.transfer
        for i, p in enumerate(self.params()):
            self.copies.write_master(transfer, i, p.data)

    def _rank_0s_generator(self) -> list[torch.Tensor]:
        """Collective: every rank takes rank 0's random generators (the host's, and the init device's) to
        initialize a meta model, so each computes the values rank 0 would have built; this rank's own, to
        give back afterwards (rank 0 keeps its advanced ones, as if it had built the model itself)."""
        own = _generators(self.device)
        first: list[Any] = [own if self.rank == 0 else None]
        self.group.collective(
            "broadcast of rank 0's random generators", dist.broadcast_object_list, first, src=self.group.global_rank(0)
        )
        _set_generators(first[0], self.device)
        return own

    def _shard_groups(self, params: list[nn.Parameter]) -> list[dict[str, Any]]:
        """The optimizer's groups over this rank's shard of each param (tensor i: param i's).  The shards are on
        the meta device: they give the inner optimizer its tensors' shapes, and their values go to the daemon
        one param at a time (``_write_masters``), never all at once beside the model."""
        shards = [
            nn.Parameter(
                torch.empty(shard_numel(p.numel(), self.world_size), dtype=p.dtype, device="meta"),
                requires_grad=p.requires_grad,
            )
            for p in params
        ]
        shard_groups, at = [], 0
        for g in self.param_groups:  # the same groups over the shards, in the same order
            n = len(g["params"])
            shard_groups.append({**g, "params": shards[at : at + n]})
            at += n
        return shard_groups

    def share(self) -> RankShare:
        """What this rank holds, in the checkpoints' terms: its stretch of every param, by tensor id."""
        model, params, device = self.model, self.params(), self.device
        rank, world = self.group.rank, self.group.world_size
        index = {id(p): i for i, p in enumerate(model.parameters())}
        order = tuple(index[id(p)] for p in params)
        slots = []
        for tid, (param, numel) in enumerate(zip(order, (p.numel() for p in params), strict=True)):
            n = shard_numel(numel, world)
            lo = min(rank * n, numel)
            slots.append(Slot(param, lo, min(lo + n, numel), tid, n))
        return RankShare(self.name, rank, world, tuple(describe_params(model)), order, tuple(slots), (), model, device)

    def sync_hyper(self) -> None:
        """The groups' hyper-parameters (a scheduler or the user may have changed them) into the inner groups."""
        copy_hyper(self.param_groups, self.inner.param_groups)

    # ----------------------------------------------------------------- the step

    def unscale_shards(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> torch.Tensor:
        """``ShardedGradScaler``'s check of this rank's reduced shards (``ShardGrads.check``)."""
        self.pager.check()  # grads set by hand land now, every push is done
        return self.grads.check(inv_scale, found_inf)

    def decide(self) -> StepDecision:
        """Where ZeRO-3 paged's grads come from: reduce-scattered into the daemons as each submodule's landed
        (the pager's pushes, drained now); their statistics (``ShardGrads``) all-reduced where clipping asks."""
        self.pager.drain()
        try:
            if self.max_grad_norm is not None:
                self.pager.check()  # grads set by hand land now, every push is done
            return self.grads.decide(self.group, self.opt, self.max_grad_norm, self._held_sq_norm)
        except InvalidState:
            self.grads.new_step()  # the step is refused
            raise

    def _held_sq_norm(self) -> float:
        """This rank's sum of squares of its shards' grads as its daemon holds them (summed over the step's
        backward passes)."""
        return self.inner.held_grad_stats().sq_norm

    def end_step(self) -> None:
        self.grads.new_step()

    def zero_grad(self, set_to_none: bool) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        self.grads.new_step()

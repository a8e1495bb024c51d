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

- fetch: the rank reads its shard of the param from its daemon through the
  staging window, and ``all_gather_into_tensor`` makes the whole param on
  every rank, just before the submodule's forward (and again in backward);
- grad: once a param's grad is complete, ``reduce_scatter_tensor`` sums it
  across the ranks, each rank divides its shard by the world size (DDP's
  mean) and writes it to its daemon's ``grad`` key (adding to it from a
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
stays this rank's shard in AdamW's format over the shards, which only the
same world size loads.

The collectives run on the pager's one I/O thread, in the order the trainer
asks for them; that order is the same on every rank because every rank runs
the same model with the same budget (the pager's decisions depend on sizes
and the recorded order only), which is what ``torch.distributed`` needs.

``step()``: with ``max_grad_norm`` the norm is global: each rank's sum of
squares of its reduced shards (taken when they were written) is all-reduced,
and the clip coefficient reaches the daemon with the step as a grad scale, so
every rank clips by ``clip_grad_norm_``'s coefficient over the unsharded
model.  Clipping needs the grads of one backward pass (the daemon's
accumulated sum has no sum of squares here); it is refused after
accumulation.

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

Not supported: the overlapped and delayed updates (as with
``offload_params``), a model on the meta device (the initial values are
broadcast from rank 0).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tiermem.client.distributed.collective import guarded
from tiermem.client.distributed.identity import agree_identity, release_job_id
from tiermem.client.distributed.node import node_client
from tiermem.client.distributed.reshard import describe_params, is_rank_file
from tiermem.client.distributed.scaler import shard_scaler_inputs
from tiermem.client.distributed.zero3_checkpoint import RankShare, Slot, Zero3Checkpoints
from tiermem.client.link import Client
from tiermem.client.offload.optimizer import OffloadAdam
from tiermem.client.offload.paging import ParamPager
from tiermem.client.offload.transfer import StateTransfer
from tiermem.core import dtypes
from tiermem.core.errors import InvalidArgument, InvalidState
from tiermem.core.modes import Exchange, Placement
from tiermem.core.step_rules import GradStats, decide

__all__ = ["ShardCopies", "ShardedPagedAdam"]

# torch 2.13 renamed the tensor collectives (the old names warn); older releases have only the old ones
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of each rank's shard of a param of ``numel`` elements."""
    return max(1, -(-numel // world_size))


class ShardCopies:
    """The pager's copies when tensor ``i`` of this rank is its shard of param ``i`` (I/O thread only).

    ``device``: where the model's params are.  On the host every copy and collective completes when it
    returns.  On a CUDA device they run on one copy stream, as ``CudaCopies``' do: a fetch pulls the shard
    from the (CUDA-registered) staging window to the device, all-gathers it there (NCCL orders its stream
    after the current one, the copy stream, and a synchronous collective orders the copy stream after its
    own) and records an event that the compute stream waits on before the param is used; a grad push
    waits on the event recorded where the grad was produced, reduce-scatters on the device and writes the
    reduced shard to the daemon.  Every temporary is allocated on the copy stream."""

    def __init__(
        self,
        numels: list[int],
        rank: int,
        world_size: int,
        collective: Callable[..., Any],
        device: torch.device | None = None,
    ) -> None:
        self.device = torch.device("cpu") if device is None else device
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self.numels = numels
        self.rank = rank
        self.world_size = world_size
        self.collective = collective
        self.sumsq: dict[int, float] = {}
        """This step's sum of squares of each reduced shard (first landing only)."""
        self.accumulated = False
        self.nonfinite = False
        """Whether a reduced shard written this step had an inf or a nan."""

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
        return torch.empty(shape, dtype=dtype, device=self.device)

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

    def _gather(self, transfer: StateTransfer, tid: int, out: torch.Tensor) -> None:
        n = self._shard(tid)
        with self._on_copy_stream():
            mine = torch.empty(n, dtype=out.dtype, device=self.device)
            transfer.pull_into(tid, "master", mine)
            whole = torch.empty(n * self.world_size, dtype=out.dtype, device=self.device)
            self.collective("the all-gather of a param", _ALL_GATHER, whole, mine)
            out.view(-1).copy_(whole[: self.numels[tid]])  # to a host ``out``: complete when it returns

    def fetch(self, transfer: StateTransfer, tid: int, dest: torch.Tensor) -> Any:
        self._gather(transfer, tid, dest)
        return self._event()

    def read_master(self, transfer: StateTransfer, tid: int, out: torch.Tensor) -> None:
        self._gather(transfer, tid, out)

    def _mine(self, tid: int, values: torch.Tensor) -> torch.Tensor:
        """This rank's stretch of a whole param's ``values`` (any device), on the host, padded to the shard's
        size."""
        n = self._shard(tid)
        flat = values.detach().reshape(-1)
        lo = min(self.rank * n, flat.numel())
        hi = min(lo + n, flat.numel())
        out = torch.zeros(n, dtype=values.dtype)
        out[: hi - lo].copy_(flat[lo:hi])
        return out

    def write_master(self, transfer: StateTransfer, tid: int, values: torch.Tensor) -> None:
        transfer.push(tid, "master", self._mine(tid, values), step=0)

    def push(self, transfer: StateTransfer, tid: int, grad: torch.Tensor, accumulate: bool, token: Any) -> None:
        n = self._shard(tid)
        if token is not None and self.stream is not None:
            self.stream.wait_event(token)
        with self._on_copy_stream():
            whole = torch.zeros(n * self.world_size, dtype=grad.dtype, device=self.device)
            whole[: self.numels[tid]].copy_(grad.reshape(-1))
            mine = torch.empty(n, dtype=grad.dtype, device=self.device)
            self.collective("the reduce-scatter of a grad", _REDUCE_SCATTER, mine, whole)
            if self.world_size > 1:
                mine.div_(self.world_size)
            sq = float(torch.linalg.vector_norm(mine, dtype=torch.float64)) ** 2  # waits for the copy stream
            self.nonfinite = self.nonfinite or not math.isfinite(sq)
            if accumulate:
                self.accumulated = True
            else:
                self.sumsq[tid] = sq
            transfer.push(tid, "grad", mine, step=0, accumulate=accumulate)

    def new_step(self) -> None:
        self.sumsq.clear()
        self.accumulated = False
        self.nonfinite = False


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


class ShardedPagedAdam(Zero3Checkpoints, OffloadAdam):
    """AdamW (``adamw=False``: Adam) over a model paged and sharded across ``process_group``; see the module
    docstring.  ``pager`` is the model's ``ParamPager`` (its figures: ``pager.stats()``)."""

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
    ) -> None:
        """``param_groups``: torch's param groups over the model's params (``{"params": [...], "weight_decay":
        0.0}``, ...; every param of the model in exactly one), for hyper-parameters per group; by default one
        group of every param with the keyword arguments' values."""
        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidState("ShardedPagedAdam needs torch.distributed initialised (torchrun)")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InvalidArgument(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self.process_group = process_group
        group_rank = dist.get_rank(process_group)
        world = dist.get_world_size(process_group)
        groups = _model_groups(model, param_groups)
        params = [p for g in groups for p in g["params"]]
        if not params:
            raise InvalidArgument("the model has no params")
        devices = {p.device for p in params}
        if len(devices) > 1 or not {d.type for d in devices} <= {"cpu", "cuda"}:
            raise InvalidArgument(
                f"ShardedPagedAdam pages the params of one device, the host or a GPU; the model's are on "
                f"{sorted(map(str, devices))}"
            )
        (device,) = devices
        infos = describe_params(model)
        kinds = {p.dtype for p in params}
        if len(kinds) != 1:
            raise InvalidArgument(f"ShardedPagedAdam needs one dtype for all params, got {sorted(map(str, kinds))}")
        self._group_rank = group_rank
        self._collective_steps = 0
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        for p in params:  # one truth to start from: rank 0's values
            self._collective("broadcast of the initial params", dist.broadcast, p.data, src=src)
        numels = [p.numel() for p in params]
        copies = ShardCopies(numels, group_rank, world, self._collective, device)
        shards = [nn.Parameter(copies._mine(i, p.data), requires_grad=p.requires_grad) for i, p in enumerate(params)]
        shard_groups, at = [], 0
        for g in groups:  # the same groups over the shards, in the same order (tensor i is param i's shard)
            n = len(g["params"])
            shard_groups.append({**g, "params": shards[at : at + n]})
            at += n
        ident = agree_identity(self._collective, process_group, group_rank, job_id, token)
        if client is None:
            client = node_client(
                self._collective,
                group_rank,
                world,
                sum(s.numel() for s in shards),
                dtype=dtypes.by_torch(kinds.pop()).name,
                placement=Placement.parse(offload, "offload"),
                window_nbytes=window_nbytes,
                exchange=Exchange.STAGED,  # the pager's: params and grads through the window, grads in the daemon
                release_grads=True,
            )
        super().__init__(
            shard_groups,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw=adamw,
            offload=offload,
            exchange=Exchange.STAGED,
            window_nbytes=window_nbytes,
            client=client,
            job_id=str(ident[0]),
            token=str(ident[1]),
            create_job=True,
            rank=group_rank,
            world_size=world,
        )
        if device.type == "cuda":  # the shards are host tensors; the copies go between the window and the GPU
            self._pinned = self._pin_window(client, params)
        self._unscaled_by = 1.0
        self._scale_checked = False
        self.global_max_grad_norm = max_grad_norm
        """``max_grad_norm`` over the unsharded model (the daemon gets the coefficient, not the norm)."""
        self.copies = copies
        self.pager = ParamPager(
            model, self, device_budget=device_budget, prefetch=prefetch, params=params, copies=copies
        )
        for shard in shards:  # the daemon has them as masters now: no copy stays here, only the shape
            shard.data = torch.full((), float("nan"), dtype=shard.dtype).expand(shard.shape)
        index = {id(p): i for i, p in enumerate(model.parameters())}
        order = tuple(index[id(p)] for p in params)
        slots = []
        for tid, (param, numel) in enumerate(zip(order, numels, strict=True)):
            n = shard_numel(numel, world)
            lo = min(group_rank * n, numel)
            slots.append(Slot(param, lo, min(lo + n, numel), tid, n))
        self._share = RankShare(
            "ShardedPagedAdam", group_rank, world, tuple(infos), order, tuple(slots), (), model, device
        )

    def close(self, *, keep_state: bool = False) -> None:
        release_job_id(self.job_id)
        super().close(keep_state=keep_state)

    # ----------------------------------------------------------------- checkpoints (zero3_checkpoint)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim.AdamW``'s format over the whole model (``full_state_dict()``, ``tiermem consolidate``,
        ``torch.optim.AdamW``: any world size; the params are not touched), this rank's ``state_dict()``
        (the same world size), or one rank's ``shard_state_dict()`` (params and buffers too)."""
        if is_rank_file(state_dict):
            self.load_shards([state_dict], complete=False)
        elif self._is_own_shard(state_dict):
            super().load_state_dict(state_dict)
        else:
            self._load_full(state_dict)

    def _is_own_shard(self, state_dict: Any) -> bool:
        """Whether ``state_dict`` is ``state_dict()``'s format (every state tensor of this rank's shard size),
        not the whole params' (where the sizes agree, either reading loads the same)."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        state = state_dict.get("state") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or not isinstance(state, dict):
            return False
        at = {key: pos for pos, key in enumerate(k for g in groups if isinstance(g, dict) for k in g.get("params", ()))}
        shard = whole = True
        for key, entry in state.items():
            pos = at.get(key)
            value = entry.get("exp_avg") if isinstance(entry, dict) else None
            if pos is None or pos >= len(self.tensors) or not isinstance(value, torch.Tensor):
                return False
            shard = shard and value.numel() == self.tensors[pos].numel()
            whole = whole and value.numel() == self._share.params[self._share.order[pos]].numel
        return shard and not whole

    def _state_io(self) -> tuple[StateTransfer | None, int | None]:
        self.pager.drain()
        self.flush()
        return self.transfer, self.steps

    def _load_rank_state(self, state: dict[int, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
        inner_groups, at = [], 0
        for mine, saved in zip(self.param_groups, groups, strict=True):
            inner_groups.append({**saved, "params": list(range(at, at + len(mine["params"])))})
            at += len(mine["params"])
        super().load_state_dict({"state": state, "param_groups": inner_groups})

    def _write_values(self, values: list[tuple[Slot, torch.Tensor]]) -> None:
        self.pager.drain()  # nothing is materialized after a load: the next use fetches these
        self.transfer.push_many((slot.tid, "master", value, 0, False) for slot, value in values)

    def _collective(self, during: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("group", self.process_group)
        return guarded(during, self._group_rank, self._collective_steps, fn, *args, **kwargs)

    def _unscale_shards(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> torch.Tensor:
        """``ShardedGradScaler``'s check: whether this rank's reduced shards overflowed (it all-reduces the
        flag); the inverse scale is applied by the daemon at ``step()``."""
        self.pager.check()  # grads set by hand land now, every push is done
        self._unscaled_by = float(inv_scale)
        self._scale_checked = True
        if self.copies.nonfinite:
            found_inf.fill_(1.0)
        return found_inf

    def _scaler_inputs(self) -> tuple[Any, Any]:
        """``step()`` takes the scale into its decision: the inner step sees no scale, only whether to skip."""
        return False, getattr(self, "found_inf", None)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.pager.drain()
        checked, self._scale_checked = self._scale_checked, False
        inv_scale, skip = shard_scaler_inputs(self, checked=checked, unscaled_by=self._unscaled_by)
        if skip:
            try:  # an overflow on some rank: every rank skips (the flag is global); the inner step drops it
                super().step()
            finally:
                self.copies.new_step()
                self._collective_steps += 1
            return loss
        stats = None
        if self.global_max_grad_norm is not None:
            self.pager.check()  # grads set by hand land now, every push is done
            flags = torch.tensor(
                [float(self.copies.accumulated), math.fsum(self.copies.sumsq.values())], dtype=torch.float64
            )
            self._collective("the norm's all-reduce", dist.all_reduce, flags)
            if flags[0] > 0:
                raise InvalidState(
                    "ShardedPagedAdam clips with the norm of one backward pass; this step accumulated grads over "
                    "several (call step() after each backward, or train without max_grad_norm)"
                )
            stats = GradStats.of(float(flags[1]) * inv_scale * inv_scale, False)
        decision = decide(stats, inv_scale=inv_scale, max_grad_norm=self.global_max_grad_norm)
        try:
            super().step(decision=decision)
        finally:
            self.copies.new_step()
            self._collective_steps += 1
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.copies.new_step()

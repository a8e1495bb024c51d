"""Rank-file checkpoints of the sharded optimizers in ``reshard``'s format, at any world size: ``Zero3Checkpoint``,
the part every sharded optimizer (``ShardedOptimizer``, whatever its strategy) is composed with, over
``RankShare`` (what the rank holds) and a ``RankStore`` (the rank's state: ``InnerStore``, its inner
``OffloadAdam``).

- ``shard_state_dict()`` (not collective): this rank's file: the fp32 values and Adam state of the
  stretches of params it holds, with the metadata to merge it with the others (``reshard``), and torch's
  ``state`` over them (``held_state``: ``torch.distributed.checkpoint`` saves that, and loads into it);
  ``save_shard(directory)`` writes it there, atomically, under its rank's name;
- ``load_shards(source)``: every rank takes the stretches it holds now from the rank files of a save made
  at any world size (a directory, or the files): values, moments and steps, the groups'
  hyper-parameters, and the model's persistent buffers and unsharded params;
- ``full_state_dict()`` (collective): ``torch.optim.AdamW``'s format, on every rank: state keyed by the
  index in ``model.parameters()``, each param's moments summed over the ranks holding its stretches
  (every other rank contributes zeros: one all-reduce per param, the same for either layout);
- ``load_full(state_dict)``: this rank's stretches of a dict in that format, from any world size, or
  from ``torch.optim.AdamW`` itself, or one ``torch.distributed.checkpoint`` loaded into what
  ``held_state`` gave; the model's params are not touched (torch's rule).

A rank's tensor ``tid`` in its daemon is a ``Slot``: elements ``[lo, hi)`` of one param, then zero
padding up to the tensor's ``numel``; the ``master`` state key is the param's fp32 value.

Cost: a save or a load holds the rank's share in host memory while it runs
(fp32 value and two moments: 12 bytes per element the rank holds), read from
or written to the daemon in one pipelined transfer; no rank holds more.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from tiermem.client.distributed.reshard import (
    FORMAT,
    MOMENTS,
    VERSION,
    ParamInfo,
    Piece,
    ShardSet,
    Source,
    build_adamw,
    open_shards,
    persistent_buffers,
    save_file,
)
from tiermem.client.distributed.stretches import flat_range, held_state, resolve_steps
from tiermem.client.offload.optimizer import OffloadAdam
from tiermem.client.offload.transfer import StateTransfer, adopt_saved_groups, packed_groups, plan_load
from tiermem.core.errors import InvalidArgument

__all__ = ["InnerStore", "RankShare", "RankStore", "Slot", "Zero3Checkpoint"]


@dataclass(frozen=True)
class Slot:
    """Tensor ``tid`` of this rank's daemon: elements ``[lo, hi)`` of param ``param`` (its index in
    ``model.parameters()``), then zeros up to ``numel``."""

    param: int
    lo: int
    hi: int
    tid: int
    numel: int


@dataclass(frozen=True)
class RankShare:
    """What one rank of a ZeRO-3 optimizer holds, in the checkpoint's terms."""

    optimizer: str
    rank: int
    world_size: int
    params: tuple[ParamInfo, ...]
    """Every param of the model, in ``model.parameters()`` order."""
    order: tuple[int, ...]
    """The optimizer's params (its param groups' order) as indices into ``params``."""
    slots: tuple[Slot, ...]
    replicated: tuple[int, ...]
    """Params every rank holds whole in the module, unsharded and never stepped (frozen ones)."""
    model: nn.Module
    device: torch.device
    """Where the collectives' tensors go (the process group's backend's device)."""

    def groups(self, param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """torch's saved param groups, listing indices into ``params``."""
        packed = packed_groups(param_groups)
        for group in packed:
            group["params"] = [self.order[i] for i in group["params"]]
        return packed


def _padded(values: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.zeros(numel, dtype=dtype)
    out[: values.numel()].copy_(values.reshape(-1))
    return out


class RankStore(Protocol):
    """What a ZeRO-3 optimizer gives its checkpoints: the rank's state, read and written."""

    job_id: str
    param_groups: list[dict[str, Any]]
    """The optimizer's groups over the model's params (the checkpoint's groups)."""

    def read(self) -> tuple[StateTransfer | None, int | None]:
        """The rank's transfer, settled (None: it holds no tensor) and its applied steps (None: unknown)."""

    def load(self, state: dict[int, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
        """Load ``state`` (``OffloadAdam``'s format over the rank's tensors, by tensor id) and adopt the saved
        ``groups``' hyper-parameters (checked to match the optimizer's groups)."""

    def write_values(self, values: list[tuple[Slot, torch.Tensor]]) -> None:
        """Make each slot's values (padded to its ``numel``) its param's values: fp32 ones (a checkpoint's) are
        the masters whole; ones in a lower dtype (a model state dict's) are taken into the master where they
        differ from it at that precision (``StateTransfer.adopt_many``)."""


@dataclass
class InnerStore:
    """A ZeRO-3 rank's state in its inner ``OffloadAdam`` (None: the rank holds no tensor), as ``RankStore``.

    The inner optimizer is flushed before its state is read or written (an interrupted step settled, its
    feed's transfers drained: the pager's too); ``sync`` copies the optimizer's hyper-parameters into the
    inner groups; ``keeps_values``: the inner tensors hold the values in the trainer (not paged), so a load
    writes them there too; ``refresh``: brings the inner tensors up to the model before a read (ZeRO-2: the
    model's params, edited in place since the last step, into the pieces)."""

    job_id: str
    param_groups: list[dict[str, Any]]
    inner: OffloadAdam | None
    sync: Callable[[], None]
    keeps_values: bool = False
    refresh: Callable[[], None] | None = None

    def read(self) -> tuple[StateTransfer | None, int | None]:
        if self.inner is None:
            return None, None
        if self.refresh is not None:
            self.refresh()
        self.inner.flush()
        return self.inner.transfer, self.inner.steps

    def load(self, state: dict[int, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
        adopt_saved_groups(self.param_groups, groups)
        self.sync()
        if self.inner is not None:
            self.inner.load_state_dict({"state": state, "param_groups": packed_groups(self.inner.param_groups)})

    def write_values(self, values: list[tuple[Slot, torch.Tensor]]) -> None:
        if self.inner is None:
            return
        self.inner.flush()
        padded = [(s, v if v.numel() == s.numel else _padded(v, s.numel, v.dtype)) for s, v in values]
        if self.keeps_values:
            with torch.no_grad():
                for slot, value in padded:
                    piece = self.inner.tensors[slot.tid]
                    piece.copy_(value.view(piece.shape))
        self.inner.transfer.adopt_many([(slot.tid, value) for slot, value in padded])


class Zero3Checkpoint:
    """See the module docstring: the checkpoints of one rank, over what it holds (``share``) and its state
    (``store``); ``collective(what, fn, *args)`` runs a collective over the optimizer's group."""

    def __init__(self, share: RankShare, store: RankStore, collective: Callable[..., Any]) -> None:
        self.share = share
        self.store = store
        self._collective = collective

    # ----------------------------------------------------------------- saving

    def read_pieces(self, params: set[int] | None = None) -> tuple[list[Piece], int | None]:
        """This rank's stretches (of ``params`` only, indices into ``share.params``, where given)."""
        share = self.share
        io, steps = self.store.read()
        keys = ("master", *MOMENTS)
        slots = [s for s in share.slots if params is None or s.param in params]
        reads = [(s.tid, key, torch.empty(s.numel, dtype=torch.float32)) for s in slots for key in keys]
        counts = io.pull_many_into(reads) if io is not None and reads else []
        pieces = []
        for k, slot in enumerate(slots):
            n = slot.hi - slot.lo
            if n == 0 and share.params[slot.param].numel > 0:  # padding only (an empty param: for its step)
                continue
            step = counts[k * len(keys)]
            got = {name: reads[k * len(keys) + j][2] for j, name in enumerate(("value", *MOMENTS))}
            tensors = {key: got[key][:n].clone() if n < slot.numel else got[key] for key in got}
            if step == 0:
                tensors = {"value": tensors["value"]}
            pieces.append(Piece(slot.param, slot.lo, slot.hi, step, tensors))
        return pieces, steps

    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's file of a checkpoint that loads at any world size (see ``tiermem.client.distributed.
        reshard``); not collective, but every rank saves its own."""
        share = self.share
        pieces, steps = self.read_pieces()
        if share.rank == 0:  # the params no rank shards: once, from rank 0
            module_params = list(share.model.parameters())
            for i in share.replicated:
                value = module_params[i].detach().reshape(-1).to("cpu", torch.float32, copy=True)
                pieces.append(Piece(i, 0, value.numel(), 0, {"value": value}))
        return {
            "format": FORMAT,
            "version": VERSION,
            "optimizer": share.optimizer,
            "job_id": self.store.job_id,
            "steps": steps,
            "rank": share.rank,
            "world_size": share.world_size,
            "params": [info.to_dict() for info in share.params],
            "param_groups": packed_groups(self.store.param_groups),
            "order": list(share.order),
            "pieces": [piece.to_dict() for piece in pieces],
            "state": self.held_state(pieces, steps),
            "buffers": {k: v.detach().to("cpu", copy=True) for k, v in persistent_buffers(share.model).items()},
        }

    def held_state(self, pieces: list[Piece], steps: int | None) -> dict[int, dict[str, Any]]:
        """torch's ``state`` over ``pieces`` (``stretches.held_state``; ``steps``, the applied ones, as
        ``read_pieces`` gives them): what ``torch.distributed.checkpoint`` saves of this rank, by the
        optimizer's positions."""
        return held_state(self.share.params, self.share.order, pieces, self._wanted(), steps)

    def _wanted(self) -> list[bool]:
        """Whether each of the optimizer's params requires grad, read past torch-function modes: a paged
        forward's catches a read of a param, and a save may run in a signal handler in the middle of one."""
        with torch._C.DisableTorchFunction():
            return [bool(p.requires_grad) for g in self.store.param_groups for p in g["params"]]

    def torch_state(self, positions: set[int]) -> dict[int, dict[str, Any]]:
        """``held_state``'s entries at ``positions`` (the optimizer's), read from this rank's stretches of them."""
        pieces, steps = self.read_pieces({self.share.order[pos] for pos in positions})
        return {pos: entry for pos, entry in self.held_state(pieces, steps).items() if pos in positions}

    def held_positions(self) -> list[int]:
        """The positions ``held_state`` has an entry at, reading no values: those that require grad, and those
        this rank holds state of (their step counts, read)."""
        share, wanted = self.share, self._wanted()
        frozen = {share.order[pos] for pos, w in enumerate(wanted) if not w}
        slots = [s for s in share.slots if s.param in frozen]
        stepped: set[int] = set()
        if slots:
            io, _ = self.store.read()
            counts = io.pull_many_into([(s.tid, "exp_avg", torch.empty(0)) for s in slots]) if io is not None else []
            stepped = {s.param for s, count in zip(slots, counts, strict=False) if count > 0}
        return [pos for pos, w in enumerate(wanted) if w or share.order[pos] in stepped]

    def save_shard(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``shard_state_dict()`` to ``directory/zero3-rank<r>-of-<n>.pt`` (atomically; every rank
        calls it; wait for all, a barrier, before reading the directory); returns the path."""
        return save_file(self.shard_state_dict(), directory)

    def full_state_dict(self) -> dict[str, Any]:
        """Collective: the whole optimizer state in ``torch.optim.AdamW``'s format, on every rank (state keyed
        by the index in ``model.parameters()``; ``master`` too for low-precision params), which
        ``torch.optim.AdamW`` and either ZeRO-3 optimizer at any world size load."""
        return self._as_adamw(*self._gather(None))

    def gather_full(self, to: tuple[int, int]) -> dict[str, Any] | None:
        """``full_state_dict()`` on one rank alone: ``to`` is its rank in the group and its global rank; the others
        get None, and none of them holds more than one param's whole state."""
        gathered = self._gather(to)
        return self._as_adamw(*gathered) if to[0] == self.share.rank else None

    def _gather(self, to: tuple[int, int] | None) -> tuple[list[int], dict[tuple[int, str], torch.Tensor]]:
        """Collective: every param's step, and its whole state (by param and key) on every rank (``to`` None) or
        on ``to`` alone (empty elsewhere)."""
        share = self.share
        alone = to is not None and to[0] != share.rank
        pieces, _ = self.read_pieces()
        steps = torch.zeros(len(share.params), dtype=torch.float64, device=share.device)
        mine: dict[int, list[Piece]] = {}
        for piece in pieces:
            steps[piece.param] = max(float(steps[piece.param]), float(piece.step))
            mine.setdefault(piece.param, []).append(piece)
        self._collective("gather of the steps", dist.all_reduce, steps, op=dist.ReduceOp.MAX)
        step_of = [int(s) for s in steps.tolist()]
        gathered: dict[tuple[int, str], torch.Tensor] = {}
        for i, info in enumerate(share.params):
            if step_of[i] == 0:
                continue
            keys = [*MOMENTS, "value"] if info.dtype != "float32" else list(MOMENTS)
            flat = torch.zeros(len(keys), info.numel, dtype=torch.float32, device=share.device)
            for piece in mine.get(i, []):
                if piece.step > 0:
                    for k, key in enumerate(keys):
                        flat[k, piece.lo : piece.hi] = piece.tensors[key]
            if to is None:
                self._collective("gather of the state", dist.all_reduce, flat)
            else:
                self._collective("gather of the state", dist.reduce, flat, dst=to[1])
            if alone:
                continue
            for k, key in enumerate(keys):
                gathered[(i, key)] = flat[k].to("cpu", copy=True)
        return step_of, gathered

    def _as_adamw(self, step_of: list[int], gathered: dict[tuple[int, str], torch.Tensor]) -> dict[str, Any]:
        share = self.share
        return build_adamw(
            share.params, share.groups(self.store.param_groups), step_of.__getitem__, lambda i, key: gathered[(i, key)]
        )

    # ----------------------------------------------------------------- loading

    def load_full(self, state_dict: dict[str, Any]) -> None:
        """This rank's stretches of a ``torch.optim.AdamW``-format dict (checked whole before anything changes):
        whole tensors, or ``Stretches`` holding at least this rank's (``torch.distributed.checkpoint`` loads into
        the dict ``state_dict()`` made)."""
        self.prepare_full(state_dict)()

    def prepare_full(self, state_dict: dict[str, Any]) -> Callable[[], None]:
        """``load_full``'s checks and cuts, changing nothing: what is left to do, as a call."""
        share = self.share
        state_dict = resolve_steps(state_dict)
        loads = plan_load(state_dict, self.store.param_groups, [share.params[i].numel for i in share.order])
        by_param = {share.order[pos]: (entry, step) for pos, entry, step in loads}
        state: dict[int, dict[str, Any]] = {}
        for slot in share.slots:
            found = by_param.get(slot.param)
            if found is None:
                continue
            entry, step = found
            cut: dict[str, Any] = {"step": torch.tensor(float(step))}
            for key in (*MOMENTS, "master"):
                value = entry.get(key)
                if isinstance(value, torch.Tensor):
                    cut[key] = _padded(flat_range(value, slot.lo, slot.hi), slot.numel)
            state[slot.tid] = cut
        groups = list(state_dict["param_groups"])
        return lambda: self.store.load(state, groups)

    def load_shards(self, source: Source | ShardSet, *, complete: bool = True) -> None:
        """Take this rank's stretches from the rank files of a save at any world size (``source``: their
        directory, or the files as paths or loaded dicts): the params' values, their Adam state and steps,
        the groups' hyper-parameters, and the model's persistent buffers and unsharded params.  Every rank
        calls it; it is not collective.  ``complete``: every rank's file must be there (a directory always
        must); without it, only the stretches this rank needs."""
        self.prepare_shards(source, complete=complete)()

    def prepare_shards(self, source: Source | ShardSet, *, complete: bool = True) -> Callable[[], None]:
        """``load_shards``' checks and reads, changing nothing: what is left to do, as a call."""
        share = self.share
        shards = source if isinstance(source, ShardSet) else open_shards(source)
        if complete:
            shards.require_complete()
        self.check_compatible(shards)
        state: dict[int, dict[str, Any]] = {}
        values: list[tuple[Slot, torch.Tensor]] = []
        for slot in share.slots:
            values.append((slot, _padded(shards.read(slot.param, "value", slot.lo, slot.hi), slot.numel)))
            step = shards.step_of(slot.param)
            if step > 0:
                entry = {key: _padded(shards.read(slot.param, key, slot.lo, slot.hi), slot.numel) for key in MOMENTS}
                state[slot.tid] = {"step": torch.tensor(float(step)), **entry}
        module_params = list(share.model.parameters())
        replicated = [(i, shards.read(i, "value", 0, share.params[i].numel)) for i in share.replicated]
        buffers = persistent_buffers(share.model)
        if set(buffers) != set(shards.buffers):
            raise InvalidArgument(
                f"the checkpoint's buffers are {sorted(shards.buffers)[:6]}, this model's {sorted(buffers)[:6]}"
            )
        for name, buf in buffers.items():
            if shards.buffers[name].shape != buf.shape:
                raise InvalidArgument(
                    f"buffer {name!r} has shape {list(shards.buffers[name].shape)} in the checkpoint, "
                    f"{list(buf.shape)} in this model"
                )
        groups = [dict(g) for g in shards.param_groups]

        def apply() -> None:  # checked: now change things
            self.store.load(state, groups)
            self.store.write_values(values)
            with torch.no_grad():
                for i, value in replicated:
                    p = module_params[i]
                    p.copy_(value.view(p.shape))
                for name, buf in buffers.items():
                    buf.copy_(shards.buffers[name])

        return apply

    def check_compatible(self, shards: ShardSet) -> None:
        share = self.share
        if len(shards.params) != len(share.params):
            raise InvalidArgument(
                f"the checkpoint is of a model with {len(shards.params)} params; this one has {len(share.params)}"
            )
        for i, (saved, mine) in enumerate(zip(shards.params, share.params, strict=True)):
            if saved.shape != mine.shape or saved.names != mine.names:
                raise InvalidArgument(
                    f"param {i} is {saved.name!r} of shape {list(saved.shape)} in the checkpoint, {mine.name!r} of "
                    f"shape {list(mine.shape)} in this model"
                )
        saved_groups = [g["params"] for g in shards.param_groups]
        my_groups = [g["params"] for g in share.groups(self.store.param_groups)]
        if saved_groups != my_groups:
            raise InvalidArgument(
                f"the checkpoint's param groups hold params {saved_groups}, this optimizer's {my_groups}; make the "
                "optimizer with the same groups"
            )

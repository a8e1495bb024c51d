"""State transfer: the daemon's state in and out, piece by piece through the staging window.

The staging window is bounded (``jobs.window_size`` or the client's
``window_nbytes``) and cut into a ring of slots; what a transfer moves is
packed into slots (``pack_spans``: small tensors share one, a large one
spans several), and each slot filled is one STATE_READ_MANY /
STATE_WRITE_MANY request, pipelined (``StateTransfer``).  ``state_dict`` and
``load_state_dict`` build ``torch.optim.AdamW``'s format on top of this.
``StateTransfer.requests`` counts the requests sent (one per slot filled).

Working dtype across the boundary: a tensor of fp16 or bf16 (a param
fetched, a grad pushed, a param written as its master) is staged as it is,
2 bytes an element; anything else as fp32.  The daemon widens or narrows it
in its one copy between the window and the state, so the copy on this side,
which is the host/device copy where the tensor is on a GPU, moves the
working dtype's bytes only, and the values are those a copy through fp32
gives (a widening is exact; a narrowing rounds to nearest-even on either
side).  ``StateTransfer.crossed`` counts what the copies of this side moved,
by direction and state key: the figure a test holds to 2 bytes an element
for a bf16 model.

A moment written in pieces is cut only at multiples of ``lowbit.BLOCK``
elements from its tensor's start, and a slot holds a block at least: the
daemon quantizes an int8 block from the values of one request, all of them,
once.  A block cut in two would be quantized against the first piece's
largest, then again against the whole block's, and the first piece's
elements would change (a checkpoint would not load back exact).  Every
format's moments are cut so (the transfer does not know the rank's); what
that costs is less than a block of room in a slot where a moment continues.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tiermem.client.link import Client
from tiermem.client.offload.args import check_hyper
from tiermem.core import dtypes
from tiermem.core.errors import InvalidArgument, InvalidState, ProtocolError
from tiermem.core.lowbit import BLOCK
from tiermem.core.protocol import MemRef, Message, StateReadMany, StateSpans, StateWriteMany
from tiermem.core.protocol.step import MAX_SPANS, StateSpan, WriteSpan
from tiermem.core.statekeys import MOMENTS

__all__ = [
    "FIXED_GROUP_KEYS",
    "RING_SLOTS",
    "Crossings",
    "PullItem",
    "PushItem",
    "Span",
    "StateTransfer",
    "hooked_load",
    "hooked_state_dict",
    "pack_spans",
    "plan_load",
    "staged_dtype",
]


def packed_groups(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``param_groups`` as ``torch.optim`` saves them: every setting, and the params as running indices."""
    groups = []
    index = 0
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(index, index + len(group["params"])))
        index += len(group["params"])
        groups.append(packed)
    return groups


FIXED_GROUP_KEYS = frozenset({"params", "amsgrad", "capturable", "differentiable"})
"""Group keys a load leaves as they are: the params, and torch flags tiermem refuses when true."""


def adopt_saved_groups(mine: Sequence[dict[str, Any]], saved: Sequence[dict[str, Any]]) -> None:
    """Take a loaded state dict's groups (checked by ``plan_load``) into ``mine``, as torch does: every saved
    key but ``FIXED_GROUP_KEYS``, a scheduler's ``initial_lr`` and the trainer's own keys included;
    torch's ``decoupled_weight_decay`` from itself or, in a dict saved before the groups carried torch's key
    alone, ``adamw``, which is not kept (``args.torch_switch_name``)."""
    for group, loaded in zip(mine, saved, strict=True):
        for name, value in loaded.items():
            if name not in FIXED_GROUP_KEYS and name != "adamw":
                group[name] = tuple(value) if name == "betas" else value
        switch = loaded.get("decoupled_weight_decay", loaded.get("adamw"))
        if switch is not None:
            group["decoupled_weight_decay"] = bool(switch)
        group.pop("adamw", None)


def hooked_state_dict(opt: Any, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``build()``'s state dict between the state-dict hooks of ``opt`` (a ``torch.optim.Optimizer``), as
    ``Optimizer.state_dict`` runs them: the pre hooks first, then each post hook, whose returned dict (when
    not None) replaces it."""
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    state_dict = build()
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        returned = post_hook(opt, state_dict)
        if returned is not None:
            state_dict = returned
    return state_dict


def hooked_load(opt: Any, state_dict: Any, load: Callable[[Any], None]) -> None:
    """``load(state_dict)`` between the load hooks of ``opt`` (a ``torch.optim.Optimizer``), as
    ``Optimizer.load_state_dict`` runs them: each pre hook gets a shallow copy and may return the dict to load
    instead; the post hooks run after."""
    if isinstance(state_dict, dict):
        state_dict = state_dict.copy()
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        returned = pre_hook(opt, state_dict)
        if returned is not None:
            state_dict = returned
    load(state_dict)
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def plan_load(
    state_dict: Any, param_groups: Sequence[dict[str, Any]], numels: Sequence[int]
) -> list[tuple[int, dict[str, Any], int]]:
    """Check a ``torch.optim.AdamW``-format state dict against this optimizer's groups and tensor sizes, before
    anything is changed; returns ``(tensor id, state entry, step)`` per param that has state in it."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(groups, list) or len(groups) != len(param_groups):
        raise InvalidArgument(
            f"state dict has {len(groups) if isinstance(groups, list) else 'no'} param groups, "
            f"this optimizer has {len(param_groups)}"
        )
    mapping: dict[Any, int] = {}
    tid = 0
    for mine, saved in zip(param_groups, groups, strict=True):
        if len(mine["params"]) != len(saved["params"]):
            raise InvalidArgument(
                f"a saved param group has {len(saved['params'])} params, the matching group here has "
                f"{len(mine['params'])}"
            )
        for key in saved["params"]:
            mapping[key] = tid
            tid += 1
    loads: list[tuple[int, dict[str, Any], int]] = []
    for key, entry in state_dict.get("state", {}).items():
        if key not in mapping:
            raise InvalidArgument(f"state for param {key!r}, which no param group lists")
        t = mapping[key]
        missing = [name for name in ("step", "exp_avg", "exp_avg_sq") if name not in entry]
        if missing:
            raise InvalidArgument(
                f"the state of param {key!r} has no {', '.join(repr(n) for n in missing)} (it has "
                f"{', '.join(repr(n) for n in entry) or 'nothing'}): torch.optim.Adam and AdamW keep step, exp_avg "
                "and exp_avg_sq for each param; was this state dict saved by another optimizer?"
            )
        for name in ("exp_avg", "exp_avg_sq"):
            value = entry[name]
            if isinstance(value, Mapping) and "boxes" in value:
                raise InvalidArgument(
                    f"state {name} of param {key!r} is one rank's stretches of a sharded optimizer's state, not the "
                    "whole tensor (torch.save of its state_dict() writes them so, and get_state_dict with "
                    "full_state_dict=True does not gather them): load every rank's file with load_shards, or save "
                    "opt.full_state_dict() (collective) for a whole state"
                )
            if not isinstance(value, torch.Tensor):
                raise InvalidArgument(f"state {name} of param {key!r} is a {type(value).__name__}, not a tensor")
            if value.numel() != numels[t]:
                raise InvalidArgument(f"state {name} of param {key!r} has {value.numel()} elements, not {numels[t]}")
        loads.append((t, entry, int(float(entry["step"]))))
    for index, (mine, saved) in enumerate(zip(param_groups, groups, strict=True)):
        if saved.get("amsgrad"):
            raise InvalidArgument(
                f"the state dict's param_groups[{index}] has amsgrad=True: it was saved by an AMSGrad optimizer, "
                "and OffloadAdam's Adam keeps no max of the second moment (max_exp_avg_sq), so it would go on as "
                "plain AdamW. Resume it with torch.optim.AdamW(amsgrad=True); to go on without AMSGrad on "
                "purpose, set 'amsgrad' to False in the dict's param_groups"
            )
        saved_adamw = saved.get("decoupled_weight_decay", saved.get("adamw", mine.get("decoupled_weight_decay", True)))
        check_hyper(
            saved.get("lr", mine["lr"]),
            tuple(saved.get("betas", mine["betas"])),
            saved.get("eps", mine["eps"]),
            saved.get("weight_decay", mine["weight_decay"]),
            adamw=bool(saved_adamw),
        )
    return loads


PushItem = tuple[int, str, torch.Tensor, int, bool]
"""``(tensor id, key, values, step, accumulate)``: one tensor's state to write (see ``StateTransfer.push``)."""
PullItem = tuple[int, str, torch.Tensor]
"""``(tensor id, key, destination)``: one tensor's state to read into ``destination``."""

RING_SLOTS = 2
"""Slots the window is cut into: while the daemon copies one, the client fills (or empties) the next."""
_SLOT_ALIGN = 64
_SLOT_MIN_NBYTES = BLOCK * 4
"""A slot holds a quantization block at least (the window is cut in fewer slots where it is smaller)."""


@dataclass(frozen=True, slots=True)
class Span:
    """A piece of item ``item`` (elements ``[start, start + numel)`` of its flat values) staged at ``at`` of a
    slot: a byte offset, a multiple of the item's element size (an element offset where sizes are 1)."""

    item: int
    start: int
    numel: int
    at: int


def pack_spans(
    numels: Sequence[int],
    slot_nbytes: int,
    max_spans: int = MAX_SPANS,
    *,
    aligns: Sequence[int] | None = None,
    itemsizes: Sequence[int] | None = None,
) -> Iterator[list[Span]]:
    """Cut items of ``numels`` elements into batches, each one request: what fits one slot of ``slot_nbytes``
    bytes, at most ``max_spans`` spans.  Consecutive items share a slot; an item larger than the room left
    continues in the next batch.  A zero-length item is a span with no elements (it still reaches the
    daemon: a read of it answers the tensor's step count, a write of a moment sets it).  ``aligns`` (one per
    item, default 1): an item is cut only at a multiple of its align from its start (the room left in a slot
    that is less is left empty), so that a quantization block of a moment reaches the daemon whole.
    ``itemsizes`` (one per item, default 1: sizes in elements): an item's bytes per element as staged; its
    spans start at a multiple of it (a fp32 item after an odd number of bf16 elements skips 2 bytes).
    Pure."""
    if slot_nbytes < 1 or max_spans < 1:
        raise InvalidArgument(f"a slot needs room for an element and a span, got {slot_nbytes} and {max_spans}")
    for name, per_item in (("aligns", aligns), ("itemsizes", itemsizes)):
        if per_item is not None and len(per_item) != len(numels):
            raise InvalidArgument(f"{len(per_item)} {name} for {len(numels)} items")
    batch: list[Span] = []
    used = 0
    for i, n in enumerate(numels):
        align = 1 if aligns is None else aligns[i]
        size = 1 if itemsizes is None else itemsizes[i]
        if size < 1 or not 1 <= align <= slot_nbytes // size:
            raise InvalidArgument(
                f"item {i} is cut at multiples of {align} elements; a slot holds {slot_nbytes // max(size, 1)}"
            )
        start = 0
        while True:
            at = -(-used // size) * size
            room = max(0, slot_nbytes - at) // size
            take = n - start if n - start <= room else room // align * align
            if len(batch) == max_spans or at > slot_nbytes or (take == 0 and n > start):
                yield batch
                batch, used = [], 0
                continue
            batch.append(Span(i, start, take, at))
            used = at + take * size
            start += take
            if start >= n:
                break
    if batch:
        yield batch


def staged_dtype(dtype: torch.dtype) -> dtypes.WorkingDType:
    """How a tensor of ``dtype`` is staged in the window: as it is when a working dtype below fp32 (fp16,
    bf16: the daemon widens or narrows it), else as fp32."""
    kind = dtypes.by_torch(dtype) if dtype in (torch.float16, torch.bfloat16) else None
    return kind if kind is not None else dtypes.by_name("float32")


@dataclass
class Crossings:
    """What this side's copies moved between its tensors and the staging window (across the host/device
    boundary, where the tensors are on a GPU), keyed ``"<direction>.<state key>"``: ``to_host`` (into the
    window: grads, masters, moments written) or ``to_device`` (out of it: params, state read)."""

    nbytes: collections.Counter[str] = field(default_factory=collections.Counter)
    """Bytes, as staged (2 an element for a fp16/bf16 tensor, else 4)."""
    numel: collections.Counter[str] = field(default_factory=collections.Counter)
    """Elements."""

    def add(self, direction: str, key: str, numel: int, itemsize: int) -> None:
        name = f"{direction}.{key}"
        self.nbytes[name] += numel * itemsize
        self.numel[name] += numel

    def since(self, before: Crossings) -> Crossings:
        """What moved after ``before`` (a ``snapshot``) was taken."""
        return Crossings(self.nbytes - before.nbytes, self.numel - before.numel)

    def snapshot(self) -> Crossings:
        return Crossings(collections.Counter(self.nbytes), collections.Counter(self.numel))


class StateTransfer:
    """Moves state through the staging window as a ring of ``slots`` slots, pipelined.

    The pieces to move are packed into slots (``pack_spans``): one request per slot filled, however many
    tensors share it (STATE_READ_MANY / STATE_WRITE_MANY), so a submodule of small params costs a request,
    not one per param.  Batch ``i`` goes through slot ``i % slots``; up to ``slots`` requests are outstanding
    (``Connection.pipeline``), so the client's copy of one batch (into the window, or out of it) overlaps
    the daemon's copy of the previous one.  A slot is refilled only after the reply for its previous batch
    was read and, for reads, after that batch was copied out, so neither side ever sees a slot the other
    is still using.  Copies between the window and a device tensor are synchronous (complete when
    ``copy_`` returns), which is what makes a slot free again on CUDA too."""

    def __init__(self, client: Client, *, slots: int = RING_SLOTS) -> None:
        if slots < 1:
            raise InvalidArgument(f"slots must be >= 1, got {slots}")
        self.client = client
        self.slots = slots
        self.requests = 0
        """Requests sent to the daemon (one per slot filled), since this was made."""
        self.crossed = Crossings()
        """Bytes and elements this side's copies moved through the window, since this was made."""

    def _ring(self) -> list[tuple[MemRef, torch.Tensor]]:
        """The slots: each one's area of the window, and its bytes."""
        info = self.client.info
        if info is None:
            raise InvalidState("not attached")
        total = self.client.window.numel()
        count = self.slots if total >= self.slots * _SLOT_MIN_NBYTES else 1
        per = total // count // _SLOT_ALIGN * _SLOT_ALIGN if count > 1 else total // 4 * 4
        if per == 0:
            raise InvalidState("the staging window is empty")
        window = self.client.window
        return [(MemRef(info.window_id, k * per, per), window[k * per : (k + 1) * per]) for k in range(count)]

    @staticmethod
    def _staged(ref: MemRef, buf: torch.Tensor, span: Span, kind: dtypes.WorkingDType) -> tuple[MemRef, torch.Tensor]:
        """Where ``span`` is staged as ``kind``: its area of the window, and the slot's bytes there as ``kind``."""
        nbytes = span.numel * kind.itemsize
        return MemRef(ref.window, ref.offset + span.at, nbytes), buf[span.at : span.at + nbytes].view(kind.torch)

    def push_many(self, items: Iterable[PushItem]) -> int:
        """Write several tensors' state, pipelined; returns the number of requests sent.

        ``values`` may be of any float dtype and on any device: each piece is copied into its slot as it is
        where it is fp16 or bf16 (``staged_dtype``; the daemon widens it) and converted to fp32 on that copy
        otherwise, so no full-size host copy is made.  ``step`` sets the tensor's count when ``key`` is a
        moment.  A moment is cut only on its quantization blocks (``BLOCK`` elements from the tensor's start,
        where the daemon's blocks are): an int8 block is quantized once, from all of its values, whatever
        the window's size."""
        ring = self._ring()
        chosen = [
            (tid, key, values.detach().reshape(-1), step, accumulate) for tid, key, values, step, accumulate in items
        ]
        kinds = [staged_dtype(flat.dtype) for _, _, flat, _, _ in chosen]
        batches = pack_spans(
            [flat.numel() for _, _, flat, _, _ in chosen],
            ring[0][1].numel(),
            aligns=[BLOCK if key in MOMENTS else 1 for _, key, _, _, _ in chosen],
            itemsizes=[kind.itemsize for kind in kinds],
        )

        def requests() -> Iterator[StateWriteMany]:
            for k, batch in enumerate(batches):
                ref, buf = ring[k % len(ring)]
                spans = []
                for span in batch:
                    tid, key, flat, step, accumulate = chosen[span.item]
                    kind = kinds[span.item]
                    area, staged = self._staged(ref, buf, span, kind)
                    staged.copy_(flat[span.start : span.start + span.numel])
                    self.crossed.add("to_host", key, span.numel, kind.itemsize)
                    spans.append(WriteSpan(tid, key, span.start * 4, area, step, accumulate, kind.name))
                self.requests += 1
                yield StateWriteMany(spans=tuple(spans))

        with self._window_kept():
            return self.client.conn.pipeline(requests(), depth=len(ring))

    def pull_many_into(self, items: Sequence[PullItem]) -> list[int]:
        """Read several tensors' state into their destinations (any float dtype, any device: staged as the
        destination's dtype where it is fp16 or bf16, the daemon narrowing it, else as fp32 converted on the
        copy out of the slot), pipelined; returns each tensor's step count."""
        ring = self._ring()
        flats = [dest.view(-1) for _, _, dest in items]
        kinds = [staged_dtype(flat.dtype) for flat in flats]
        steps = [0] * len(items)
        sent: list[tuple[list[Span], MemRef, torch.Tensor]] = []
        batches = pack_spans(
            [flat.numel() for flat in flats], ring[0][1].numel(), itemsizes=[kind.itemsize for kind in kinds]
        )

        def requests() -> Iterator[StateReadMany]:
            for k, batch in enumerate(batches):
                ref, buf = ring[k % len(ring)]
                sent.append((batch, ref, buf))
                spans = []
                for span in batch:
                    tid, key, _ = items[span.item]
                    kind = kinds[span.item]
                    area = self._staged(ref, buf, span, kind)[0]
                    spans.append(StateSpan(tid, key if span.numel else "exp_avg", span.start * 4, area, kind.name))
                self.requests += 1
                yield StateReadMany(spans=tuple(spans))

        def on_reply(i: int, reply: Message) -> None:
            if not isinstance(reply, StateSpans):
                raise ProtocolError(f"expected STATE_SPANS, got {type(reply).__name__}")
            batch, ref, buf = sent[i]
            if len(reply.steps) != len(batch):
                raise ProtocolError(f"STATE_SPANS carries {len(reply.steps)} step counts for {len(batch)} spans")
            for span, step in zip(batch, reply.steps, strict=True):
                if span.numel:
                    kind = kinds[span.item]
                    flats[span.item][span.start : span.start + span.numel].copy_(self._staged(ref, buf, span, kind)[1])
                    self.crossed.add("to_device", items[span.item][1], span.numel, kind.itemsize)
                steps[span.item] = step

        with self._window_kept():
            self.client.conn.pipeline(requests(), depth=len(ring), on_reply=on_reply)
        return steps

    @contextlib.contextmanager
    def _window_kept(self) -> Iterator[None]:
        """Around a transfer made from a signal handler that interrupted one of this thread's exchanges
        (``Connection.reentered``): the interrupted transfer may have data in the slots, which this one
        would overwrite, so the daemon first finishes what was sent before (a PING's round trip), the
        window is copied aside, and it is put back once this transfer is done.  (The window is small: 2 MiB
        by default.)"""
        conn = self.client.conn
        if not conn.reentered:
            yield
            return
        conn.sync()
        saved = self.client.window.clone()
        try:
            yield
        finally:
            self.client.window.copy_(saved)

    def adopt_many(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Make ``values`` (each in its param's working dtype, flat) the tensors' masters by
        ``dtypes.adopt_edits``: a low-precision param's fp32 master is read, takes the elements that differ
        from it at the param's precision, and is written back, so a model state dict loaded over values the
        model already had, or one element edited, costs the rest of the master none of its precision.  fp32
        values are the master whole, written as they are."""
        low = [(tid, values) for tid, values in items if values.dtype != torch.float32]
        masters = [(tid, "master", torch.empty(values.numel(), dtype=torch.float32)) for tid, values in low]
        if masters:
            self.pull_many_into(masters)
        pushes: list[PushItem] = [(tid, "master", v, 0, False) for tid, v in items if v.dtype == torch.float32]
        for (_, values), (tid, _, master) in zip(low, masters, strict=True):
            dtypes.adopt_edits(master, values.detach().reshape(-1).to("cpu"))
            pushes.append((tid, "master", master, 0, False))
        self.push_many(pushes)

    def push(self, tid: int, key: str, values: torch.Tensor, *, step: int, accumulate: bool = False) -> None:
        """Write state ``key`` of tensor ``tid`` (``step`` sets its count when ``key`` is a moment)."""
        self.push_many([(tid, key, values, step, accumulate)])

    def pull(self, tid: int, key: str, numel: int) -> tuple[torch.Tensor, int]:
        """Read fp32 state ``key`` of tensor ``tid``; returns (values, the tensor's step count)."""
        out = torch.empty(numel, dtype=torch.float32)
        return out, self.pull_many_into([(tid, key, out)])[0]

    def pull_into(self, tid: int, key: str, dest: torch.Tensor) -> int:
        """Read state ``key`` of tensor ``tid`` into ``dest`` (converted to its dtype); returns the tensor's step
        count."""
        return self.pull_many_into([(tid, key, dest)])[0]

    def step_of(self, tid: int) -> int:
        """The tensor's Adam step count (a zero-length read)."""
        return self.pull_many_into([(tid, "exp_avg", torch.empty(0))])[0]

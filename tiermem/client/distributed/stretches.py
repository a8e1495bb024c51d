"""One param's state tensor as a sharded optimizer's rank holds it: the stretches of it that are this rank's.

``ShardedOptimizer.state_dict()`` keeps, beside its rank file, torch's
``state`` entries (``step``, ``exp_avg``, ``exp_avg_sq``, and ``master`` for
low-precision params), each moment a ``Stretches``: a tensor of the param's
shape whose values this rank holds only in part.  That is what
``torch.distributed.checkpoint`` needs to save a ZeRO checkpoint in parallel,
each rank writing its own elements, and to load it at any world size (or into
``torch.optim.AdamW``, or FSDP2): ``Stretches`` speaks its checkpoint protocol
(``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``, as ``DTensor`` does), naming its elements as boxes
of the param's shape (``tiermem.core.boxes``).

Why not ``DTensor``: its shards are ``torch.chunk``'s even cuts of whole
dimensions, while ZeRO-2 cuts the flattened model into bucket slices and ZeRO-3
by layer gives whole params to owners.  ``ShardedTensor`` takes any boxes but
is deprecated.  ``Stretches`` is no more than the protocol needs; any other
operation on it raises ``InvalidState`` naming ``full_state_dict()``, the way
to the whole values (not a ``TypeError``, which a Python operator would turn
into one that names nothing).  ``torch.save`` writes it as a plain dict (its shape, dtype
and boxes), so a file of it loads with ``weights_only=True`` and without
tiermem.

What DCP does not know of it: ``get_state_dict``'s ``full_state_dict=True``
gathers ``DTensor`` and ``ShardedTensor`` only, so it returns each rank's own
``Stretches`` (a load of that names it and ``full_state_dict()``), and
``async_save`` stages tensors whole (refused, naming ``dcp.save``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from tiermem.client.distributed.reshard import MOMENTS, ParamInfo, Piece
from tiermem.core.boxes import Box, flat_boxes
from tiermem.core.errors import InvalidArgument, InvalidState

__all__ = ["HeldStateView", "Stretches", "flat_range", "held_state", "resolve_steps"]


class Stretches(torch.Tensor):
    """A tensor of ``shape`` of which this rank holds the boxes ``boxes`` (each a view of its values)."""

    _boxes: tuple[tuple[Box, torch.Tensor], ...]

    @staticmethod
    def __new__(
        cls,
        shape: Iterable[int],
        dtype: torch.dtype,
        boxes: Iterable[tuple[Box, torch.Tensor]],
        device: torch.device | str = "cpu",
    ) -> Stretches:
        size, where = torch.Size(shape), torch.device(device)
        out = torch.Tensor._make_wrapper_subclass(cls, size, dtype=dtype, device=where)
        out._boxes = tuple(boxes)
        for box, values in out._boxes:
            if tuple(values.shape) != box.sizes or values.dtype != dtype or len(box.offsets) != len(size):
                raise InvalidArgument(f"box {box} of a {list(size)} tensor holds {values.dtype} {list(values.shape)}")
            if values.device != where:
                raise InvalidArgument(f"box {box} of a tensor on {where} is on {values.device}")
        return out

    @classmethod
    def of_flat(cls, shape: Iterable[int], pieces: Iterable[tuple[int, torch.Tensor]]) -> Stretches:
        """From flat stretches ``(lo, values)`` of a row-major tensor of ``shape``: the boxes are views of them."""
        shape = tuple(shape)
        boxes = []
        dtype, device = torch.float32, torch.device("cpu")
        for lo, values in pieces:
            dtype, device = values.dtype, values.device
            flat = values.reshape(-1)
            for box in flat_boxes(shape, lo, lo + flat.numel()):
                boxes.append((box, flat[box.start - lo : box.stop - lo].view(box.sizes)))
        return cls(shape, dtype, boxes, device)

    @property
    def held_numel(self) -> int:
        """How many of its elements this rank holds."""
        return sum(box.stop - box.start for box, _ in self._boxes)

    def flat(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattening, a new tensor; raises where this rank holds some of them not."""
        out = torch.empty(hi - lo, dtype=self.dtype)
        covered = 0
        for box, values in self._boxes:
            a, b = max(lo, box.start), min(hi, box.stop)
            if a < b:
                out[a - lo : b - lo].copy_(values.reshape(-1)[a - box.start : b - box.start])
                covered += b - a
        if covered != hi - lo:
            raise InvalidArgument(
                f"elements [{lo}, {hi}) of a {list(self.shape)} state tensor are not all among the {self.held_numel} "
                "this rank's stretches hold: load the state dict the same optimizer's state_dict() made for this "
                "rank (torch.distributed.checkpoint loads into it), or a whole one (full_state_dict())"
            )
        return out

    def _moved(self, *, dtype: torch.dtype | None = None, device: Any = None, **options: Any) -> Stretches:
        """``.to(device, dtype)``: the same boxes, each moved; the result is on the device they land on (``cpu``
        for ``cpu:0``, the current GPU for ``cuda``), as a plain tensor's ``.to`` is."""
        dtype, device = dtype or self.dtype, torch.device(device) if device is not None else self.device
        blocking = bool(options.get("non_blocking", False))
        moved = [(box, values.to(device=device, dtype=dtype, non_blocking=blocking)) for box, values in self._boxes]
        landed = moved[0][1].device if moved else torch.empty(0, device=device).device
        return Stretches(self.shape, dtype, moved, landed)

    def _same(self, other: Stretches) -> bool:
        """``torch.equal``: the same shape, boxes and values (two holdings of one rank's, compared)."""
        return (
            self.shape == other.shape
            and self.dtype == other.dtype
            and [box for box, _ in self._boxes] == [box for box, _ in other._boxes]
            and all(torch.equal(a.cpu(), b.cpu()) for (_, a), (_, b) in zip(self._boxes, other._boxes, strict=True))
        )

    # ----------------------------------------------------------------- torch.distributed.checkpoint's protocol

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(box.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)),
                    properties=properties,
                    size=self.size(),
                ),
            )
            for box, _ in self._boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)) for box, _ in self._boxes
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self._boxes):
            box, values = self._boxes[index.index]
            if torch.Size(box.offsets) == index.offset:
                return values
        for box, values in self._boxes:
            if torch.Size(box.offsets) == index.offset:
                return values
        raise InvalidArgument(f"{index.fqn}: this rank holds no box at offsets {list(index.offset or ())}")

    # ----------------------------------------------------------------- everything else

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        this = args[0] if args and isinstance(args[0], Stretches) else None
        if this is not None and func is torch.ops.aten.detach.default:
            return Stretches(this.shape, this.dtype, this._boxes, this.device)
        if this is not None and func is torch.ops.aten.clone.default:
            return Stretches(this.shape, this.dtype, ((b, v.clone()) for b, v in this._boxes), this.device)
        if this is not None and func is torch.ops.aten._to_copy.default:  # .to(): accelerate and Lightning move state
            return this._moved(**(kwargs or {}))
        if this is not None and func is torch.ops.aten.equal.default and isinstance(args[1], Stretches):
            return this._same(args[1])
        shape = list(this.shape) if this is not None else "?"
        raise InvalidState(
            f"{func} on a sharded optimizer's state tensor of shape {shape}, of which this rank holds only its own "
            "stretches: opt.full_state_dict() gathers the whole state (a collective, on every rank); "
            "torch.distributed.checkpoint's save and load take it as it is, but not its async_save, whose staging "
            "copies each tensor whole: use dcp.save"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        # a plain dict on disk: loads with weights_only=True, without tiermem
        return (
            collections.OrderedDict,
            (
                [
                    ("shape", list(self.shape)),
                    ("dtype", str(self.dtype).removeprefix("torch.")),
                    ("boxes", [(list(box.offsets), values) for box, values in self._boxes]),
                ],
            ),
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"Stretches(shape={list(self.shape)}, dtype={self.dtype}, this rank holds {self.held_numel} of "
            f"{math.prod(self.shape)} elements in {len(self._boxes)} box(es))"
        )


# --------------------------------------------------------------------------- torch's state over a rank's stretches


def held_state(
    params: Sequence[ParamInfo],
    order: Sequence[int],
    pieces: Sequence[Piece],
    wanted: Sequence[bool],
    steps: int | None,
) -> dict[int, dict[str, Any]]:
    """torch's ``state`` over this rank's ``pieces``, keyed by the optimizer's positions (``order``: position to
    index into ``params``): an entry for each position that is ``wanted`` (its param requires grad: every rank
    has the same keys, as ``torch.distributed.checkpoint`` wants) or of which this rank holds state.  Its
    ``step`` is a 0-d ``Stretches`` (held where the rank holds a stretch of the param), its moments, and for a
    low-precision param ``master`` (the fp32 value), ``Stretches`` of the stretches the rank holds (zeros
    before the first step, so a loaded checkpoint has somewhere to go).  An empty param that requires grad
    and that no piece here holds (ZeRO-2 gives it no piece) is held by every rank with a state, at the
    optimizer's applied ``steps``: torch's AdamW keeps a step for it, and would find none to load."""
    held: dict[int, list[Piece]] = {}
    for piece in pieces:
        held.setdefault(piece.param, []).append(piece)
    state: dict[int, dict[str, Any]] = {}
    for position, i in enumerate(order):
        mine = held.get(i, [])
        if not wanted[position] and not any(piece.step > 0 for piece in mine):
            continue
        info = params[i]
        if not mine and info.numel == 0 and steps is not None:
            mine = [Piece(i, 0, 0, steps, {"value": torch.zeros(0)})]
        step = [(0, torch.tensor([float(mine[0].step)]))] if mine else []
        entry: dict[str, Any] = {"step": Stretches.of_flat((), step)}
        for key in MOMENTS:
            entry[key] = Stretches.of_flat(info.shape, [(p.lo, _moment(p, key)) for p in mine])
        if info.dtype != "float32":
            entry["master"] = Stretches.of_flat(info.shape, [(p.lo, p.tensors["value"]) for p in mine])
        state[position] = entry
    return state


def _moment(piece: Piece, key: str) -> torch.Tensor:
    found = piece.tensors.get(key)
    return found if found is not None else torch.zeros(piece.hi - piece.lo, dtype=torch.float32)


def resolve_steps(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (torch's format) with each ``Stretches`` step read: its value where this rank holds it,
    else 0 (no stretch of that param is this rank's: nothing of it loads here)."""
    state = {}
    for key, entry in state_dict.get("state", {}).items():
        step = entry.get("step") if hasattr(entry, "get") else None
        if isinstance(step, Stretches):
            held = step.held_numel > 0
            state[key] = {**entry, "step": torch.tensor(float(step.flat(0, 1)[0]) if held else 0.0)}
        else:
            state[key] = entry
    return {**state_dict, "state": state}


def flat_range(value: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of ``value``'s flattening as fp32 on the CPU, whether whole or ``Stretches``."""
    if isinstance(value, Stretches):
        return value.flat(lo, hi).to(torch.float32)
    return value.detach().reshape(-1)[lo:hi].to("cpu", torch.float32)


class HeldStateView(MutableMapping[torch.Tensor, dict[str, Any]]):
    """``opt.state`` of a sharded optimizer: its params to torch's state entries over this rank's stretches
    (``held_state``; ``ShardedOptimizer.state_dict()["state"]`` by param).  A param that requires grad has an
    entry from the start (at step 0 until it steps), on every rank, so that ``torch.distributed.checkpoint``
    finds state to save and to load into, and never takes a step of its own to make some (it steps an
    optimizer whose ``state`` is empty).  Reading an entry reads this rank's stretches of it from the daemon,
    a copy.  Assigning back the entry a read returned, as PyTorch Lightning does when it moves an optimizer,
    changes nothing, moved to another device or not (compared by value); any other write is refused:
    ``load_state_dict`` loads state."""

    def __init__(self, read: Callable[[torch.Tensor | None], dict[torch.Tensor, dict[str, Any]]]) -> None:
        self._read = read
        """``read(param)``: the entries of ``param`` (None: every param's key, with no values read)."""
        self._given: dict[int, dict[str, Any]] = {}

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        found = self._read(param).get(param) if isinstance(param, torch.Tensor) else None
        if found is None:
            raise KeyError(param)
        self._given[id(param)] = found
        return found

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(list(self._read(None)))

    def __len__(self) -> int:
        return len(self._read(None))

    def __contains__(self, param: object) -> bool:
        return isinstance(param, torch.Tensor) and any(p is param for p in self._read(None))

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        given = self._given.get(id(param)) or {}
        handed_back = bool(given) and hasattr(value, "items") and value.keys() == given.keys()
        if handed_back and all(_same(value[key], given[key]) for key in given):
            return  # the entry a read returned, handed back
        raise InvalidState(
            "a sharded optimizer's opt.state cannot be written: each rank holds only its stretches of the state, "
            "in its daemon; load state with load_state_dict (a state_dict(), full_state_dict() or "
            "torch.optim.AdamW's), or torch.distributed.checkpoint"
        )

    def __delitem__(self, param: torch.Tensor) -> None:
        self[param] = None  # refused, with the same words


def _same(value: Any, given: Stretches) -> bool:
    """``value`` is what a read gave, or a copy of it on another device."""
    return value is given or (isinstance(value, Stretches) and value.dtype == given.dtype and value._same(given))

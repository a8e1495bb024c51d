"""ZeRO-3 checkpoints that load at any world size: one file per rank, each a list of stretches of the model's params.

A rank's file says what each of its numbers is: elements ``[lo, hi)`` of
the flattened param ``i`` of ``model.parameters()``, with that stretch's fp32
value and Adam moments.  Nothing in it depends on how the saving optimizer
laid its state out (``ShardedPagedAdam``: an equal, zero-padded stretch of
every param per rank; ``LayerShardedAdam``: whole params of the layers a
rank owns), so loading at another world size, or into the other optimizer,
is an interval intersection per param: each loading rank reads the stretches
it now holds from whichever files have them.

Why this design:

- per-rank files, not a gathered one: a save moves no data between ranks and
  no rank ever holds more than its own share (the point of ZeRO-3: a model
  whose state fits only across the ranks also checkpoints across them), and
  the ranks write in parallel.  ``full_state_dict()`` still gathers
  ``torch.optim.AdamW``'s format, for models small enough to;
- stretches of params, not the ranks' flat buffers (DeepSpeed's fp32 flat
  groups, whose meaning depends on the partitioner's padding and alignment):
  the merge needs no knowledge of the saving layout, and it is checked (the
  stretches of a param cover it exactly once and agree on its step);
- the fp32 values (the optimizer's masters) are saved with the moments: a
  resume is exact for low-precision models too, and ``tiermem consolidate``
  writes fp32 weights as ``zero_to_fp32`` does;
- the files are read with ``torch.load(mmap=True)``: a rank's load touches
  only the pages of the stretches it takes.

Layout of one rank's file (``torch.save`` of a dict; every tensor fp32, 1-D,
on the CPU):

    format, version  "tiermem.zero3", 2
    optimizer        the class that saved it
    job_id, steps    the job and its applied steps (None on a rank holding no state):
                     every file of one save has the same
    rank, world_size
    params           per param of the model, in model.parameters() order: names (every
                     state-dict key of it: tied params have several), shape, dtype
    param_groups     torch's param groups; "params" lists positions in the optimizer
    order            per position in the optimizer, its index into params
    pieces           per stretch: param, lo, hi, step, value, and exp_avg, exp_avg_sq
                     when step > 0
    buffers          the model's persistent buffers (in every file: each rank holds them)
    state            torch's per-param state over the pieces, by position (what
                     torch.distributed.checkpoint saves: ``stretches``); a load ignores it

Version 1 had no ``order`` and listed indices into ``params`` in its groups; it
is read as before.  Version 2's groups are torch's own, so that the dict with
its ``state`` is also an optimizer state dict in torch's sense.

Files are named ``zero3-rank00003-of-00008.pt`` and written under a temporary
name, synced and renamed, so a save that dies leaves no half file under a
final name; ``open_shards`` of a directory names each missing rank's file.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiermem.core.errors import InvalidArgument

__all__ = [
    "FORMAT",
    "ParamInfo",
    "Piece",
    "ShardSet",
    "adamw_state_dict",
    "build_adamw",
    "describe_params",
    "file_name",
    "is_rank_file",
    "model_state_dict",
    "open_shards",
    "persistent_buffers",
    "save_file",
]

FORMAT = "tiermem.zero3"
VERSION = 2
READS = (1, 2)
"""The versions this tiermem reads: 1 had no ``order`` and gave ``param_groups`` as indices into ``params``."""
MOMENTS = ("exp_avg", "exp_avg_sq")
FILE_GLOB = "zero3-rank*-of-*.pt"

Source = str | os.PathLike[str] | Sequence[str | os.PathLike[str] | Mapping[str, Any]]
"""What ``open_shards`` reads: a directory of rank files, or rank files (paths or loaded dicts)."""


def file_name(rank: int, world_size: int) -> str:
    return f"zero3-rank{rank:05d}-of-{world_size:05d}.pt"


def is_rank_file(contents: Any) -> bool:
    """Whether ``contents`` is one rank's file of this format (as opposed to a ``torch.optim`` state dict)."""
    return isinstance(contents, Mapping) and contents.get("format") == FORMAT


@dataclass(frozen=True)
class ParamInfo:
    """One param of the model: every state-dict key it has, its shape and dtype (``float32``, ``bfloat16``...)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def name(self) -> str:
        return self.names[0]

    def to_dict(self) -> dict[str, Any]:
        return {"names": list(self.names), "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> ParamInfo:
        try:
            info = cls(tuple(str(n) for n in d["names"]), tuple(int(s) for s in d["shape"]), str(d["dtype"]))
        except (KeyError, TypeError, ValueError):
            raise InvalidArgument(f"{where}: a param entry is not {{names, shape, dtype}}: {d!r}"[:300]) from None
        if not isinstance(getattr(torch, info.dtype, None), torch.dtype) or not info.names:
            raise InvalidArgument(f"{where}: param entry {d!r} has no name or an unknown dtype"[:300])
        return info


def describe_params(model: nn.Module) -> list[ParamInfo]:
    """``model.parameters()`` as ``ParamInfo``s (call it while the params have their real shapes)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [
        ParamInfo(tuple(names[id(p)]), tuple(p.shape), str(p.dtype).removeprefix("torch.")) for p in model.parameters()
    ]


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``model.state_dict()`` saves (not those registered ``persistent=False``), by key."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


@dataclass(frozen=True)
class Piece:
    """Elements ``[lo, hi)`` of param ``param``'s flattened value: ``value`` and, when ``step`` > 0, the moments."""

    param: int
    lo: int
    hi: int
    step: int
    tensors: Mapping[str, torch.Tensor]

    def to_dict(self) -> dict[str, Any]:
        return {"param": self.param, "lo": self.lo, "hi": self.hi, "step": self.step, **self.tensors}

    @classmethod
    def from_dict(cls, d: Any, params: Sequence[ParamInfo], where: str) -> Piece:
        try:
            param, lo, hi, step = int(d["param"]), int(d["lo"]), int(d["hi"]), int(d["step"])
        except (KeyError, TypeError, ValueError):
            raise InvalidArgument(f"{where}: a piece is not {{param, lo, hi, step, value...}}") from None
        if not 0 <= param < len(params) or not 0 <= lo <= hi <= params[param].numel or step < 0:
            raise InvalidArgument(
                f"{where}: piece [{lo}, {hi}) of param {param} at step {step} lies outside the "
                f"{len(params)} params' shapes"
            )
        keys = ("value", *MOMENTS) if step > 0 else ("value",)
        tensors = {}
        for key in keys:
            t = d.get(key)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != hi - lo:
                raise InvalidArgument(
                    f"{where}: {key} of param {params[param].name!r} [{lo}, {hi}) is not {hi - lo} fp32 elements"
                )
            tensors[key] = t.reshape(-1)
        return cls(param, lo, hi, step, tensors)


def save_file(data: Mapping[str, Any], directory: str | os.PathLike[str]) -> Path:
    """Write one rank's file into ``directory`` (made if absent) under its final name, atomically."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(int(data["rank"]), int(data["world_size"]))
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(dict(data), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


class ShardSet:
    """The rank files of one save, checked against each other; reads any stretch of any param from them.

    ``files`` are ``(label, contents)`` pairs (the label, a path, names the file in errors); ``folder`` is
    the directory they came from, to name the missing ones."""

    def __init__(self, files: Sequence[tuple[str, Mapping[str, Any]]], folder: Path | None = None) -> None:
        if not files:
            raise InvalidArgument("no ZeRO-3 rank files given")
        self.folder = folder
        heads = [_check_head(label, d) for label, d in files]
        heads.sort(key=lambda h: h[1]["rank"])
        first_label, first = heads[0]
        self.world_size: int = first["world_size"]
        self.optimizer: str = first["optimizer"]
        self.params = [ParamInfo.from_dict(p, first_label) for p in first["params"]]
        self.param_groups: list[dict[str, Any]] = [dict(g) for g in first["param_groups"]]
        self.labels: dict[int, str] = {}
        """Each given rank's file, by rank."""
        steps = [(label, d["steps"]) for label, d in heads if d["steps"] is not None]
        self.steps: int | None = steps[0][1] if steps else None
        """The optimizer's applied steps at the save."""
        for label, d in heads:
            for key in ("world_size", "optimizer", "job_id", "params", "param_groups"):
                if d[key] != first[key]:
                    raise InvalidArgument(
                        f"{label}: its {key} differs from {first_label}'s ({_short(d[key])} vs "
                        f"{_short(first[key])}); the files are not of one save"
                    )
            rank = d["rank"]
            if not 0 <= rank < self.world_size:
                raise InvalidArgument(f"{label}: rank {rank} is outside world size {self.world_size}")
            if rank in self.labels:
                raise InvalidArgument(f"{self.labels[rank]} and {label} are both rank {rank} of {self.world_size}")
            self.labels[rank] = label
        if steps and any(s != steps[0][1] for _, s in steps):
            odd = next((label, s) for label, s in steps if s != steps[0][1])
            raise InvalidArgument(
                f"{odd[0]} was saved at step {odd[1]}, {steps[0][0]} at step {steps[0][1]}; the files are not of "
                "one save"
            )
        self.buffers: dict[str, torch.Tensor] = dict(heads[0][1]["buffers"])
        """The model's persistent buffers, as the lowest rank given saved them."""
        self._pieces: list[list[tuple[Piece, int]]] = [[] for _ in self.params]
        for label, d in heads:
            for raw in d["pieces"]:
                piece = Piece.from_dict(raw, self.params, label)
                if piece.hi > piece.lo or self.params[piece.param].numel == 0:  # the latter: for its step
                    self._pieces[piece.param].append((piece, d["rank"]))
        for i, pieces in enumerate(self._pieces):
            pieces.sort(key=lambda pr: pr[0].lo)
            for (a, ra), (b, rb) in itertools.pairwise(pieces):
                if b.lo < a.hi:
                    raise InvalidArgument(
                        f"{self.labels[ra]} and {self.labels[rb]} both hold elements [{b.lo}, {min(a.hi, b.hi)}) "
                        f"of param {self.params[i].name!r}"
                    )
                if a.step != b.step:
                    raise InvalidArgument(
                        f"param {self.params[i].name!r} is at step {a.step} in {self.labels[ra]} and at step "
                        f"{b.step} in {self.labels[rb]}; the files are not of one save"
                    )

    @property
    def missing_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.labels]

    def _missing_files(self) -> str:
        missing = self.missing_ranks
        if self.folder is not None:
            shown = ", ".join(str(self.folder / file_name(r, self.world_size)) for r in missing[:4])
        else:
            shown = "rank(s) " + ", ".join(map(str, missing[:4]))
        return shown + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")

    def require_complete(self) -> None:
        """Every rank's file is there and every param is covered exactly once."""
        if self.missing_ranks:
            raise InvalidArgument(
                f"the checkpoint was saved by {self.world_size} ranks and {len(self.missing_ranks)} rank file(s) "
                f"are missing: {self._missing_files()}"
            )
        for i, info in enumerate(self.params):
            self._gap(i, 0, info.numel, raise_it=True)

    def _gap(self, param: int, lo: int, hi: int, *, raise_it: bool) -> tuple[int, int] | None:
        at = lo
        for piece, _ in self._pieces[param]:
            if piece.hi <= at or piece.lo >= hi:
                continue
            if piece.lo > at:
                break
            at = piece.hi
        if at >= hi:
            return None
        end = next((p.lo for p, _ in self._pieces[param] if p.lo > at), hi)
        if raise_it:
            where = f"; the missing files: {self._missing_files()}" if self.missing_ranks else ""
            raise InvalidArgument(
                f"elements [{at}, {min(end, hi)}) of param {self.params[param].name!r} are in none of the "
                f"{len(self.labels)} rank file(s) of this {self.world_size}-rank checkpoint{where}"
            )
        return at, min(end, hi)

    def step_of(self, param: int) -> int:
        """The param's Adam step (0: it never stepped, or no file holds it)."""
        pieces = self._pieces[param]
        return pieces[0][0].step if pieces else 0

    def read(self, param: int, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``key`` (``value``, ``exp_avg``, ``exp_avg_sq``) of param ``param``, a new
        fp32 tensor; raises naming the elements no given file holds."""
        self._gap(param, lo, hi, raise_it=True)
        out = torch.empty(hi - lo, dtype=torch.float32)
        for piece, _ in self._pieces[param]:
            a, b = max(lo, piece.lo), min(hi, piece.hi)
            if a < b:
                out[a - lo : b - lo].copy_(piece.tensors[key][a - piece.lo : b - piece.lo])
        return out


def _check_head(label: str, d: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(d, Mapping) or d.get("format") != FORMAT:
        raise InvalidArgument(f"{label} is not a tiermem ZeRO-3 rank file (no 'format': {FORMAT!r} in it)")
    version = d.get("version")
    if version not in READS:
        raise InvalidArgument(
            f"{label} is in version {version!r} of the format; this tiermem reads {', '.join(map(str, READS))}"
        )
    out = dict(d)
    needed = (("rank", int), ("world_size", int), ("params", list), ("param_groups", list))
    for key, kind in needed + ((("order", list),) if version >= 2 else ()):
        if not isinstance(out.get(key), kind):
            raise InvalidArgument(f"{label}: {key!r} is missing or not a {kind.__name__}")
    for key, default in (("optimizer", ""), ("job_id", ""), ("steps", None), ("pieces", []), ("buffers", {})):
        out.setdefault(key, default)
    if version >= 2:  # the groups by position in the optimizer, as torch saves them: by param index here
        order = out["order"]
        try:
            out["param_groups"] = [{**g, "params": [int(order[i]) for i in g["params"]]} for g in out["param_groups"]]
        except (IndexError, KeyError, TypeError, ValueError):
            raise InvalidArgument(f"{label}: its param_groups list positions its 'order' does not have") from None
    return label, out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def open_shards(source: Source) -> ShardSet:
    """The rank files of ``source``: a directory (every ``zero3-rank*-of-*.pt`` in it, which must be one save
    with no rank missing), or rank files as paths or loaded dicts (checked against each other; a missing rank
    is an error only when a stretch it held is read)."""
    if isinstance(source, str | os.PathLike) and Path(source).is_dir():
        folder = Path(source)
        found = sorted(folder.glob(FILE_GLOB))
        if not found:
            raise InvalidArgument(f"{folder} holds no ZeRO-3 rank files ({FILE_GLOB})")
        sizes = sorted({p.name.rsplit("-of-", 1)[1] for p in found})
        if len(sizes) > 1:
            raise InvalidArgument(
                f"{folder} holds rank files of {len(sizes)} saves at different world sizes "
                f"({', '.join(s.removesuffix('.pt').lstrip('0') or '0' for s in sizes)} ranks); keep one save per "
                "directory"
            )
        shards = ShardSet([(str(p), _load(p)) for p in found], folder)
        for rank, label in shards.labels.items():
            if Path(label).name != file_name(rank, shards.world_size):
                raise InvalidArgument(f"{label} holds rank {rank} of {shards.world_size}, not what its name says")
        shards.require_complete()
        return shards
    items = [source] if isinstance(source, str | os.PathLike | Mapping) else list(source)
    files = []
    for i, item in enumerate(items):
        if isinstance(item, Mapping):
            files.append((f"rank file #{i} (a dict)", item))
        else:
            files.append((str(item), _load(Path(item))))
    return ShardSet(files)


def _load(path: Path) -> Mapping[str, Any]:
    if not path.exists():
        raise InvalidArgument(f"{path} does not exist: give a directory of rank files (save_shard's) or rank files")
    if not path.is_file():
        raise InvalidArgument(f"{path} is neither a directory of rank files nor a rank file")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise InvalidArgument(f"{path} cannot be read as a torch.save file: {exc}") from None
    if not isinstance(loaded, Mapping):
        raise InvalidArgument(f"{path} holds a {type(loaded).__name__}, not a tiermem ZeRO-3 rank file")
    return loaded


def build_adamw(
    params: Sequence[ParamInfo],
    param_groups: Sequence[Mapping[str, Any]],
    step_of: Callable[[int], int],
    read: Callable[[int, str], torch.Tensor],
) -> dict[str, Any]:
    """``torch.optim.AdamW``'s state dict: state keyed by the index in ``model.parameters()`` of each param that
    stepped (plus ``master``, the fp32 value, for low-precision params), and the groups listing those indices;
    ``read(i, key)`` gives a whole param's fp32 ``key`` (``value`` or a moment), flat."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, info in enumerate(params):
        step = step_of(i)
        if step == 0:
            continue
        entry = {"step": torch.tensor(float(step))}
        for key in MOMENTS:
            entry[key] = read(i, key).view(info.shape)
        if info.dtype != "float32":
            entry["master"] = read(i, "value").view(info.shape)
        state[i] = entry
    return {"state": state, "param_groups": [{**g, "params": list(g["params"])} for g in param_groups]}


def adamw_state_dict(shards: ShardSet) -> dict[str, Any]:
    """The whole optimizer state of a complete ``shards`` in ``torch.optim.AdamW``'s format."""

    def whole(i: int, key: str) -> torch.Tensor:
        return shards.read(i, key, 0, shards.params[i].numel)

    return build_adamw(shards.params, shards.param_groups, shards.step_of, whole)


def model_state_dict(shards: ShardSet, *, fp32: bool = False) -> dict[str, torch.Tensor]:
    """The model's state dict from a complete ``shards``: every param under each of its keys, in its dtype (fp32
    with ``fp32``), and the persistent buffers."""
    out: dict[str, torch.Tensor] = {}
    for i, info in enumerate(shards.params):
        value = shards.read(i, "value", 0, info.numel).view(info.shape)
        if not fp32:
            value = value.to(getattr(torch, info.dtype))
        for name in info.names:
            out[name] = value
    for name, buf in shards.buffers.items():
        out[name] = buf.clone()
    return out

"""Typed messages: one frozen dataclass per ``MsgType``, with field checks.

Owns what each message means and the range of every field.  Pure: no I/O.
``to_payload`` gives the JSON object sent on the wire; ``from_payload`` checks
every field of a received object (type, range, length, enumeration, cross-field
rules) and raises ``FieldError``, which ``decode_message`` reports as a
``ProtocolError`` naming the message and the field.  Unknown fields are
refused: a payload change is a protocol version change (docs/protocol.md).

Memory is never sent, only named: a ``MemRef`` is (window id, byte offset,
byte length) inside a shared window the daemon created and handed over at
``ATTACH``.  The daemon checks every reference with ``MemRef.check_bounds``
before touching memory.  On the wire a MemRef is the list ``[window, offset, length]``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from tiermem.errors import BoundsError, TiermemError, error_from_wire
from tiermem.protocol.fields import (
    FieldError,
    check_keys,
    get_bool,
    get_dict,
    get_float,
    get_int,
    get_list,
    get_opt_float,
    get_opt_str,
    get_str,
    get_value,
    int_value,
    list_of,
    str_value,
)
from tiermem.protocol.frame import MsgType

__all__ = [
    "DTYPES",
    "MAX_NAME",
    "MAX_NBYTES",
    "MAX_NDIM",
    "PLACEMENTS",
    "STATE_KEYS",
    "Attach",
    "AttachOk",
    "BucketReady",
    "Detach",
    "ErrorReply",
    "FetchParams",
    "MemRef",
    "Message",
    "Ok",
    "ParamGroup",
    "ParamsReady",
    "Ping",
    "Pong",
    "Register",
    "RegisterOk",
    "StateChunk",
    "StateRead",
    "StateWrite",
    "Stats",
    "StatsReply",
    "Step",
    "StepDone",
    "TensorSlot",
    "TensorSpec",
    "MESSAGE_CLASSES",
    "REPLY_TYPES",
]

DTYPES = ("float32", "float16", "bfloat16")
PLACEMENTS = ("cpu", "nvme", "auto")
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
MAX_NAME = 256
MAX_ID = 128
MAX_NDIM = 16
MAX_DIM = (1 << 48) - 1
MAX_NBYTES = (1 << 56) - 1
MAX_WORLD = 1 << 20
MAX_GROUPS = 4096
MAX_TENSORS = 1 << 20
MAX_STEP = (1 << 62) - 1
MAX_WINDOW_ID = 0xFFFFFFFF
MAX_TIMINGS = 64
MAX_GRAD_BUFFERS = 2
MAX_STATS = 4096
MAX_MESSAGE = 16384
_NUMBER = (int, float)
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]*")


# --------------------------------------------------------------------------- memory references


@dataclass(frozen=True, slots=True)
class MemRef:
    """``length`` bytes at byte ``offset`` of shared window ``window``."""

    window: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def check_bounds(self, window_nbytes: int, window: int | None = None) -> None:
        """Raise ``BoundsError`` unless the reference lies inside a window of ``window_nbytes`` (id ``window``)."""
        if window is not None and self.window != window:
            raise BoundsError(f"reference to window {self.window}, but this job's window is {window}")
        if self.offset < 0 or self.length < 0 or self.offset + self.length > window_nbytes:
            raise BoundsError(
                f"reference [{self.offset}, {self.offset + self.length}) of window {self.window} "
                f"falls outside its {window_nbytes} bytes"
            )

    def to_wire(self) -> list[int]:
        return [self.window, self.offset, self.length]

    @staticmethod
    def from_wire(value: Any) -> MemRef:
        if type(value) is not list or len(value) != 3:
            raise FieldError("", "a [window, offset, length] list", value)
        return MemRef(
            int_value(value[0], 0, MAX_WINDOW_ID, "[0]"),
            int_value(value[1], 0, MAX_NBYTES, "[1]"),
            int_value(value[2], 0, MAX_NBYTES, "[2]"),
        )


def _tensor_id(value: Any) -> int:
    return int_value(value, 0, MAX_TENSORS - 1)


def _as_item(parse: Any) -> Any:
    """Adapt a ``from_payload`` (which takes a dict) to a list item parser."""

    def item(value: Any) -> Any:
        if type(value) is not dict:
            raise FieldError("", "an object", value)
        return parse(value)

    return item


# --------------------------------------------------------------------------- records inside messages


@dataclass(frozen=True, slots=True)
class ParamGroup:
    """Adam hyper-parameters of one parameter group, as in ``torch.optim.Adam``/``AdamW``."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw: bool = True
    maximize: bool = False

    KEYS: ClassVar[frozenset[str]] = frozenset({"lr", "betas", "eps", "weight_decay", "adamw", "maximize"})

    def to_payload(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "adamw": self.adamw,
            "maximize": self.maximize,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> ParamGroup:
        check_keys(d, cls.KEYS)
        betas = get_list(d, "betas", 2)
        if len(betas) != 2:
            raise FieldError("betas", "a list of two numbers", betas)
        beta1, beta2 = betas
        if type(beta1) not in _NUMBER or not 0.0 <= beta1 < 1.0:
            raise FieldError("betas[0]", "a number in [0, 1)", beta1)
        if type(beta2) not in _NUMBER or not 0.0 <= beta2 < 1.0:
            raise FieldError("betas[1]", "a number in [0, 1)", beta2)
        return cls(
            lr=get_float(d, "lr", 0.0),
            betas=(float(beta1), float(beta2)),
            eps=get_float(d, "eps", 0.0),
            weight_decay=get_float(d, "weight_decay", 0.0),
            adamw=get_bool(d, "adamw"),
            maximize=get_bool(d, "maximize"),
        )


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor to register: its name, shape, dtype, where its state may live, and its param group."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    placement: str = "auto"
    group: int = 0

    KEYS: ClassVar[frozenset[str]] = frozenset({"name", "shape", "dtype", "placement", "group"})

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_payload(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "placement": self.placement,
            "group": self.group,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> TensorSpec:
        check_keys(d, cls.KEYS)
        name = get_str(d, "name", MAX_NAME)
        if not name:
            raise FieldError("name", "a non-empty string", name)
        shape = list_of(d, "shape", MAX_NDIM, lambda v: int_value(v, 0, MAX_DIM))
        dtype = get_str(d, "dtype", 16)
        if dtype not in DTYPES:
            raise FieldError("dtype", f"one of {', '.join(DTYPES)}", dtype)
        placement = get_str(d, "placement", 16)
        if placement not in PLACEMENTS:
            raise FieldError("placement", f"one of {', '.join(PLACEMENTS)}", placement)
        return cls(name, shape, dtype, placement, get_int(d, "group", 0, MAX_GROUPS - 1))


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where a registered tensor's working-precision param and grads live in the window.

    ``grads`` has one reference per grad buffer (two when the job uses the
    delayed update, so step t+1's grads land while step t's are read).
    """

    tensor_id: int
    param: MemRef
    grads: tuple[MemRef, ...]

    def to_wire(self) -> list[Any]:
        return [self.tensor_id, self.param.to_wire(), [g.to_wire() for g in self.grads]]

    @staticmethod
    def from_wire(value: Any) -> TensorSlot:
        if type(value) is not list or len(value) != 3:
            raise FieldError("", "a [tensor_id, param_ref, [grad_ref, ...]] list", value)
        tensor_id = int_value(value[0], 0, MAX_TENSORS - 1, "[0]")
        try:
            param = MemRef.from_wire(value[1])
        except FieldError as exc:
            raise exc.within("[1]") from None
        grads = value[2]
        if type(grads) is not list or not 1 <= len(grads) <= MAX_GRAD_BUFFERS:
            raise FieldError("[2]", f"a list of 1 to {MAX_GRAD_BUFFERS} grad references", grads)
        refs = []
        for index, ref in enumerate(grads):
            try:
                refs.append(MemRef.from_wire(ref))
            except FieldError as exc:
                raise exc.within(f"[{index}]").within("[2]") from None
        return TensorSlot(tensor_id, param, tuple(refs))


# --------------------------------------------------------------------------- messages


class Message:
    """Base of all messages; ``TYPE`` is the wire type, ``KEYS`` the payload fields."""

    __slots__ = ()
    TYPE: ClassVar[MsgType]
    KEYS: ClassVar[frozenset[str]] = frozenset()

    def to_payload(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> Message:
        check_keys(d, cls.KEYS)
        return cls()


@dataclass(frozen=True, slots=True)
class Attach(Message):
    """Join job ``job_id`` as ``rank`` of ``world_size``; the first rank sizes the job's window.

    ``token`` (from an earlier ``ATTACH_OK``) reattaches to a job kept after a crash.
    """

    TYPE: ClassVar[MsgType] = MsgType.ATTACH
    KEYS: ClassVar[frozenset[str]] = frozenset({"job_id", "rank", "world_size", "window_nbytes", "token"})
    job_id: str
    rank: int
    world_size: int
    window_nbytes: int
    token: str | None = None

    def to_payload(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "window_nbytes": self.window_nbytes,
            "token": self.token,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> Attach:
        check_keys(d, cls.KEYS)
        world_size = get_int(d, "world_size", 1, MAX_WORLD)
        rank = get_int(d, "rank", 0, MAX_WORLD - 1)
        if rank >= world_size:
            raise FieldError("rank", f"an integer in [0, world_size={world_size})", rank)
        return cls(
            job_id=get_str(d, "job_id", MAX_ID, _ID_RE),
            rank=rank,
            world_size=world_size,
            window_nbytes=get_int(d, "window_nbytes", 1, MAX_NBYTES),
            token=get_opt_str(d, "token", MAX_ID),
        )


@dataclass(frozen=True, slots=True)
class AttachOk(Message):
    """Attached.  The frame carries the window's memfd (``FLAG_FDS``), mapped ``window_nbytes`` long."""

    TYPE: ClassVar[MsgType] = MsgType.ATTACH_OK
    KEYS: ClassVar[frozenset[str]] = frozenset(
        {"job_token", "window_id", "window_nbytes", "alignment", "max_frame", "reattached"}
    )
    job_token: str
    window_id: int
    window_nbytes: int
    alignment: int
    max_frame: int
    reattached: bool = False

    def to_payload(self) -> dict[str, Any]:
        return {
            "job_token": self.job_token,
            "window_id": self.window_id,
            "window_nbytes": self.window_nbytes,
            "alignment": self.alignment,
            "max_frame": self.max_frame,
            "reattached": self.reattached,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> AttachOk:
        check_keys(d, cls.KEYS)
        alignment = get_int(d, "alignment", 1, 1 << 30)
        if alignment & (alignment - 1):
            raise FieldError("alignment", "a power of two", alignment)
        return cls(
            job_token=get_str(d, "job_token", MAX_ID),
            window_id=get_int(d, "window_id", 0, MAX_WINDOW_ID),
            window_nbytes=get_int(d, "window_nbytes", 1, MAX_NBYTES),
            alignment=alignment,
            max_frame=get_int(d, "max_frame", 4096, 1 << 30),
            reattached=get_bool(d, "reattached"),
        )


@dataclass(frozen=True, slots=True)
class Register(Message):
    """Register the rank's tensors (once); ``groups`` are its param groups.

    ``grad_buffers``: 1, or 2 for the delayed update (step t+1's grads land in
    the other buffer while step t's update still reads its own).
    """

    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    KEYS: ClassVar[frozenset[str]] = frozenset({"tensors", "groups", "grad_buffers"})
    tensors: tuple[TensorSpec, ...]
    groups: tuple[ParamGroup, ...]
    grad_buffers: int = 1

    def to_payload(self) -> dict[str, Any]:
        return {
            "tensors": [t.to_payload() for t in self.tensors],
            "groups": [g.to_payload() for g in self.groups],
            "grad_buffers": self.grad_buffers,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> Register:
        check_keys(d, cls.KEYS)
        groups = list_of(d, "groups", MAX_GROUPS, _as_item(ParamGroup.from_payload))
        if not groups:
            raise FieldError("groups", "at least one param group", [])
        tensors = list_of(d, "tensors", MAX_TENSORS, _as_item(TensorSpec.from_payload))
        seen: set[str] = set()
        for index, tensor in enumerate(tensors):
            if tensor.group >= len(groups):
                raise FieldError(f"tensors[{index}].group", f"a group index < {len(groups)}", tensor.group)
            if tensor.name in seen:
                raise FieldError(f"tensors[{index}].name", "a name not used before in this message", tensor.name)
            seen.add(tensor.name)
        return cls(tensors, groups, get_int(d, "grad_buffers", 1, MAX_GRAD_BUFFERS))


@dataclass(frozen=True, slots=True)
class RegisterOk(Message):
    """One slot per registered tensor, in request order."""

    TYPE: ClassVar[MsgType] = MsgType.REGISTER_OK
    KEYS: ClassVar[frozenset[str]] = frozenset({"slots"})
    slots: tuple[TensorSlot, ...]

    def to_payload(self) -> dict[str, Any]:
        return {"slots": [s.to_wire() for s in self.slots]}

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> RegisterOk:
        check_keys(d, cls.KEYS)
        return cls(list_of(d, "slots", MAX_TENSORS, TensorSlot.from_wire))


@dataclass(frozen=True, slots=True)
class Step(Message):
    """Apply step ``step`` using the grads now in the window.

    ``groups``: the hyper-parameters for this step (empty: unchanged since the
    last step or REGISTER).  ``tensor_ids``: tensors whose grads are present
    (empty: all registered), in grad buffer ``grad_buffer``.  ``buckets``: how
    many BUCKET_READY messages were sent for this step before it.  ``max_grad_norm``: clip to this global norm
    (None: no clipping).  ``skip_nonfinite``: skip the whole step when any grad
    is inf/nan (``torch.amp.GradScaler``'s rule); without it non-finite grads are
    applied as torch would.  ``delayed``: reply once the gradient statistics are
    known; the update runs on, and the next STEP or FETCH_PARAMS waits for it.
    """

    TYPE: ClassVar[MsgType] = MsgType.STEP
    KEYS: ClassVar[frozenset[str]] = frozenset(
        {
            "step",
            "groups",
            "loss_scale",
            "max_grad_norm",
            "skip_nonfinite",
            "tensor_ids",
            "buckets",
            "delayed",
            "grad_buffer",
        }
    )
    step: int
    groups: tuple[ParamGroup, ...] = ()
    loss_scale: float = 1.0
    max_grad_norm: float | None = None
    skip_nonfinite: bool = False
    tensor_ids: tuple[int, ...] = ()
    buckets: int = 0
    delayed: bool = False
    grad_buffer: int = 0

    def to_payload(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "groups": [g.to_payload() for g in self.groups],
            "loss_scale": self.loss_scale,
            "max_grad_norm": self.max_grad_norm,
            "skip_nonfinite": self.skip_nonfinite,
            "tensor_ids": list(self.tensor_ids),
            "buckets": self.buckets,
            "delayed": self.delayed,
            "grad_buffer": self.grad_buffer,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> Step:
        check_keys(d, cls.KEYS)
        loss_scale = get_float(d, "loss_scale", 0.0)
        if loss_scale <= 0.0:
            raise FieldError("loss_scale", "a positive number", loss_scale)
        max_grad_norm = get_opt_float(d, "max_grad_norm", 0.0)
        if max_grad_norm is not None and max_grad_norm <= 0.0:
            raise FieldError("max_grad_norm", "a positive number or null", max_grad_norm)
        return cls(
            step=get_int(d, "step", 0, MAX_STEP),
            groups=list_of(d, "groups", MAX_GROUPS, _as_item(ParamGroup.from_payload)),
            loss_scale=loss_scale,
            max_grad_norm=max_grad_norm,
            skip_nonfinite=get_bool(d, "skip_nonfinite"),
            tensor_ids=list_of(d, "tensor_ids", MAX_TENSORS, _tensor_id),
            buckets=get_int(d, "buckets", 0, MAX_TENSORS),
            delayed=get_bool(d, "delayed"),
            grad_buffer=get_int(d, "grad_buffer", 0, MAX_GRAD_BUFFERS - 1),
        )


@dataclass(frozen=True, slots=True)
class BucketReady(Message):
    """Grads of ``tensor_ids`` (and/or the raw regions ``refs``) are in the window for ``step`` (usually one-way)."""

    TYPE: ClassVar[MsgType] = MsgType.BUCKET_READY
    KEYS: ClassVar[frozenset[str]] = frozenset({"step", "bucket", "tensor_ids", "refs", "grad_buffer"})
    step: int
    bucket: int
    tensor_ids: tuple[int, ...] = ()
    refs: tuple[MemRef, ...] = ()
    grad_buffer: int = 0

    def to_payload(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "bucket": self.bucket,
            "tensor_ids": list(self.tensor_ids),
            "refs": [r.to_wire() for r in self.refs],
            "grad_buffer": self.grad_buffer,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> BucketReady:
        check_keys(d, cls.KEYS)
        tensor_ids = list_of(d, "tensor_ids", MAX_TENSORS, _tensor_id)
        refs = list_of(d, "refs", MAX_TENSORS, MemRef.from_wire)
        if not tensor_ids and not refs:
            raise FieldError("tensor_ids", "tensor ids or refs (both are empty)", [])
        return cls(
            get_int(d, "step", 0, MAX_STEP),
            get_int(d, "bucket", 0, MAX_TENSORS),
            tensor_ids,
            refs,
            get_int(d, "grad_buffer", 0, MAX_GRAD_BUFFERS - 1),
        )


@dataclass(frozen=True, slots=True)
class StepDone(Message):
    """Step ``step`` is applied (or skipped when ``found_inf``); ``grad_norm`` is the unclipped global norm."""

    TYPE: ClassVar[MsgType] = MsgType.STEP_DONE
    KEYS: ClassVar[frozenset[str]] = frozenset({"step", "found_inf", "grad_norm", "params_ready", "timings"})
    step: int
    found_inf: bool
    grad_norm: float | None = None
    params_ready: bool = True
    timings: tuple[tuple[str, float], ...] = ()
    """(phase, seconds) pairs, e.g. ("update", 0.12)."""

    def to_payload(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "found_inf": self.found_inf,
            "grad_norm": self.grad_norm,
            "params_ready": self.params_ready,
            "timings": dict(self.timings),
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> StepDone:
        check_keys(d, cls.KEYS)
        timings = []
        for key, value in get_dict(d, "timings", MAX_TIMINGS).items():
            path = f"timings.{key}"
            str_value(key, MAX_NAME, path)
            if type(value) not in (int, float) or not 0.0 <= value < math.inf:
                raise FieldError(path, "a finite number of seconds >= 0", value)
            timings.append((key, float(value)))
        return cls(
            step=get_int(d, "step", 0, MAX_STEP),
            found_inf=get_bool(d, "found_inf"),
            grad_norm=get_opt_float(d, "grad_norm", 0.0, finite=False),
            params_ready=get_bool(d, "params_ready"),
            timings=tuple(timings),
        )


@dataclass(frozen=True, slots=True)
class FetchParams(Message):
    """Write the params of ``tensor_ids`` (empty: all) as of ``step`` into their window slots."""

    TYPE: ClassVar[MsgType] = MsgType.FETCH_PARAMS
    KEYS: ClassVar[frozenset[str]] = frozenset({"step", "tensor_ids"})
    step: int
    tensor_ids: tuple[int, ...] = ()

    def to_payload(self) -> dict[str, Any]:
        return {"step": self.step, "tensor_ids": list(self.tensor_ids)}

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> FetchParams:
        check_keys(d, cls.KEYS)
        return cls(get_int(d, "step", 0, MAX_STEP), list_of(d, "tensor_ids", MAX_TENSORS, _tensor_id))


@dataclass(frozen=True, slots=True)
class ParamsReady(FetchParams):
    """The params of ``tensor_ids`` (empty: all) as of ``step`` are in their window slots."""

    TYPE: ClassVar[MsgType] = MsgType.PARAMS_READY


def _state_key(d: dict[str, Any]) -> str:
    key = get_str(d, "key", 16)
    if key not in STATE_KEYS:
        raise FieldError("key", f"one of {', '.join(STATE_KEYS)}", key)
    return key


def _get_ref(d: dict[str, Any], key: str) -> MemRef:
    value = get_value(d, key)
    try:
        return MemRef.from_wire(value)
    except FieldError as exc:
        raise exc.within(key) from None


@dataclass(frozen=True, slots=True)
class StateRead(Message):
    """Copy fp32 state ``key`` of ``tensor_id``, from byte ``offset``, into ``dest`` (a staging area)."""

    TYPE: ClassVar[MsgType] = MsgType.STATE_READ
    KEYS: ClassVar[frozenset[str]] = frozenset({"tensor_id", "key", "offset", "dest"})
    tensor_id: int
    key: str
    offset: int
    dest: MemRef

    def to_payload(self) -> dict[str, Any]:
        return {"tensor_id": self.tensor_id, "key": self.key, "offset": self.offset, "dest": self.dest.to_wire()}

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> StateRead:
        check_keys(d, cls.KEYS)
        return cls(
            get_int(d, "tensor_id", 0, MAX_TENSORS - 1),
            _state_key(d),
            get_int(d, "offset", 0, MAX_NBYTES),
            _get_ref(d, "dest"),
        )


@dataclass(frozen=True, slots=True)
class StateChunk(Message):
    """``nbytes`` of ``total_nbytes`` bytes of state, from ``offset``, are in the staging area; ``step``: its count."""

    TYPE: ClassVar[MsgType] = MsgType.STATE_CHUNK
    KEYS: ClassVar[frozenset[str]] = frozenset({"tensor_id", "key", "offset", "nbytes", "total_nbytes", "step"})
    tensor_id: int
    key: str
    offset: int
    nbytes: int
    total_nbytes: int
    step: int

    def to_payload(self) -> dict[str, Any]:
        return {
            "tensor_id": self.tensor_id,
            "key": self.key,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "total_nbytes": self.total_nbytes,
            "step": self.step,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> StateChunk:
        check_keys(d, cls.KEYS)
        total = get_int(d, "total_nbytes", 0, MAX_NBYTES)
        offset = get_int(d, "offset", 0, total)
        nbytes = get_int(d, "nbytes", 0, total - offset)
        return cls(
            get_int(d, "tensor_id", 0, MAX_TENSORS - 1),
            _state_key(d),
            offset,
            nbytes,
            total,
            get_int(d, "step", 0, MAX_STEP),
        )


@dataclass(frozen=True, slots=True)
class StateWrite(Message):
    """Load fp32 state ``key`` of ``tensor_id`` from ``src`` at byte ``offset``; ``step`` sets Adam's count."""

    TYPE: ClassVar[MsgType] = MsgType.STATE_WRITE
    KEYS: ClassVar[frozenset[str]] = frozenset({"tensor_id", "key", "offset", "src", "step"})
    tensor_id: int
    key: str
    offset: int
    src: MemRef
    step: int

    def to_payload(self) -> dict[str, Any]:
        return {
            "tensor_id": self.tensor_id,
            "key": self.key,
            "offset": self.offset,
            "src": self.src.to_wire(),
            "step": self.step,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> StateWrite:
        check_keys(d, cls.KEYS)
        return cls(
            get_int(d, "tensor_id", 0, MAX_TENSORS - 1),
            _state_key(d),
            get_int(d, "offset", 0, MAX_NBYTES),
            _get_ref(d, "src"),
            get_int(d, "step", 0, MAX_STEP),
        )


@dataclass(frozen=True, slots=True)
class Stats(Message):
    """Ask for the daemon's numbers as seen by this job."""

    TYPE: ClassVar[MsgType] = MsgType.STATS


@dataclass(frozen=True, slots=True)
class StatsReply(Message):
    """Named numbers (ints or floats), e.g. {"pool_free_bytes": 1.2e9}."""

    TYPE: ClassVar[MsgType] = MsgType.STATS_REPLY
    KEYS: ClassVar[frozenset[str]] = frozenset({"values"})
    values: tuple[tuple[str, int | float], ...]

    def to_payload(self) -> dict[str, Any]:
        return {"values": dict(self.values)}

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> StatsReply:
        check_keys(d, cls.KEYS)
        out: list[tuple[str, int | float]] = []
        for key, value in get_dict(d, "values", MAX_STATS).items():
            path = f"values.{key}"
            str_value(key, MAX_NAME, path)
            if type(value) not in (int, float):
                raise FieldError(path, "a number", value)
            out.append((key, value))
        return cls(tuple(out))


@dataclass(frozen=True, slots=True)
class Detach(Message):
    """Leave the job; ``keep_state`` keeps it for a reattach with its token during the grace period."""

    TYPE: ClassVar[MsgType] = MsgType.DETACH
    KEYS: ClassVar[frozenset[str]] = frozenset({"keep_state"})
    keep_state: bool = False

    def to_payload(self) -> dict[str, Any]:
        return {"keep_state": self.keep_state}

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> Detach:
        check_keys(d, cls.KEYS)
        return cls(get_bool(d, "keep_state"))


@dataclass(frozen=True, slots=True)
class Ping(Message):
    TYPE: ClassVar[MsgType] = MsgType.PING


@dataclass(frozen=True, slots=True)
class Pong(Message):
    TYPE: ClassVar[MsgType] = MsgType.PONG


@dataclass(frozen=True, slots=True)
class Ok(Message):
    """A request succeeded and has nothing to return (STATE_WRITE, DETACH)."""

    TYPE: ClassVar[MsgType] = MsgType.OK


@dataclass(frozen=True, slots=True)
class ErrorReply(Message):
    """A request failed: ``error`` is ``TiermemError.to_wire()``; the client raises ``to_exception()``."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    KEYS: ClassVar[frozenset[str]] = frozenset({"type", "message", "fields"})
    kind: str
    """The error class name (``BoundsError``); the wire field is ``type``."""
    message: str
    fields: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_exception(cls, exc: TiermemError) -> ErrorReply:
        wire = exc.to_wire()
        return cls(wire["type"], wire["message"], tuple(wire["fields"].items()))

    def to_exception(self) -> TiermemError:
        return error_from_wire(self.to_payload())

    def to_payload(self) -> dict[str, Any]:
        return {"type": self.kind, "message": self.message, "fields": dict(self.fields)}

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> ErrorReply:
        check_keys(d, cls.KEYS)
        fields = get_dict(d, "fields", 64)
        for key, value in fields.items():
            str_value(key, MAX_NAME, f"fields.{key}")
            _check_scalar(value, f"fields.{key}")
        return cls(get_str(d, "type", MAX_NAME, _ID_RE), get_str(d, "message", MAX_MESSAGE), tuple(fields.items()))


def _check_scalar(value: Any, path: str) -> None:
    """Error facts are scalars or flat lists of scalars (paths, sizes, keys)."""
    scalar = (str, int, float, bool, type(None))
    if type(value) in scalar:
        return
    if type(value) is list and len(value) <= 64 and all(type(v) in scalar for v in value):
        return
    raise FieldError(path, "a scalar or a list of at most 64 scalars", value)


MESSAGE_CLASSES: dict[MsgType, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Attach,
        AttachOk,
        Register,
        RegisterOk,
        Step,
        BucketReady,
        StepDone,
        FetchParams,
        ParamsReady,
        StateRead,
        StateChunk,
        StateWrite,
        Stats,
        StatsReply,
        Detach,
        Ping,
        Pong,
        Ok,
        ErrorReply,
    )
}

REPLY_TYPES: dict[MsgType, MsgType | None] = {
    MsgType.ATTACH: MsgType.ATTACH_OK,
    MsgType.REGISTER: MsgType.REGISTER_OK,
    MsgType.STEP: MsgType.STEP_DONE,
    MsgType.BUCKET_READY: None,
    MsgType.FETCH_PARAMS: MsgType.PARAMS_READY,
    MsgType.STATE_READ: MsgType.STATE_CHUNK,
    MsgType.STATE_WRITE: MsgType.OK,
    MsgType.STATS: MsgType.STATS_REPLY,
    MsgType.DETACH: MsgType.OK,
    MsgType.PING: MsgType.PONG,
}
"""The successful reply to each request (None: one-way, no reply); any request may get ERROR instead."""

"""Step-path messages: step, bucket ready, step done, abort, fetch params; state read, write and reset.

Owns what these messages mean and the range of every field.  The per-step
ones (STEP, STEP_DONE, FETCH_PARAMS, PARAMS_READY) have a fast
path in ``from_payload`` for the common well-formed case, falling back to the
field-by-field checks (``_checked``) that word the errors; a property test
holds both to the same answers.
Unknown fields are refused: a payload change is a protocol version change
(docs/protocol.md).  Pure: no I/O.  ``from_payload`` raises ``FieldError``,
which ``decode_message`` reports as a ``ProtocolError`` naming the message and
the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from tiermem.protocol.fields import (
    FieldError,
    check_keys,
    get_bool,
    get_dict,
    get_float,
    get_int,
    get_opt_float,
    get_str,
    get_value,
    list_of,
    str_value,
)
from tiermem.protocol.frame import MsgType
from tiermem.protocol.records import (
    FLOAT_MAX,
    MAX_GRAD_BUFFERS,
    MAX_GROUPS,
    MAX_NAME,
    MAX_NBYTES,
    MAX_STEP,
    MAX_TENSORS,
    MAX_TIMINGS,
    STATE_KEYS,
    MemRef,
    Message,
    ParamGroup,
    as_item,
    tensor_id_value,
)

__all__ = [
    "Abort",
    "Aborted",
    "BucketReady",
    "FetchParams",
    "ParamsReady",
    "StateChunk",
    "StateRead",
    "StateReset",
    "StateWrite",
    "Step",
    "StepDone",
]


def _ids_ok(ids: Any) -> bool:
    """Fast check of a tensor id list (the slow path words the error)."""
    return type(ids) is list and len(ids) <= MAX_TENSORS and all(type(i) is int and 0 <= i < MAX_TENSORS for i in ids)


@dataclass(slots=True)
class Step(Message):
    """Apply step ``step`` (attempt ``attempt``) using the grads now in the rank's grad buffer.

    ``groups``: the hyper-parameters for this step (empty: unchanged since the
    last step or REGISTER).  ``tensor_ids``: tensors whose grads are present
    (empty: all registered), in grad buffer ``grad_buffer``.  ``attempt``: the
    client's id for this try of the step (an ABORT names it; a reply echoes it).
    ``max_grad_norm``: clip to this global norm
    (None: no clipping).  ``skip_nonfinite``: skip the whole step when any grad
    is inf/nan (``torch.amp.GradScaler``'s rule); without it non-finite grads are
    applied as torch would.  ``delayed``: reply once the gradient statistics are
    known; the update runs on, and the next STEP or FETCH_PARAMS waits for it.
    """

    TYPE: ClassVar[MsgType] = MsgType.STEP
    KEYS: ClassVar[frozenset[str]] = frozenset(
        {
            "step",
            "attempt",
            "groups",
            "loss_scale",
            "max_grad_norm",
            "skip_nonfinite",
            "tensor_ids",
            "delayed",
            "grad_buffer",
        }
    )
    step: int
    attempt: int = 0
    groups: tuple[ParamGroup, ...] = ()
    loss_scale: float = 1.0
    max_grad_norm: float | None = None
    skip_nonfinite: bool = False
    tensor_ids: tuple[int, ...] = ()
    delayed: bool = False
    grad_buffer: int = 0

    def to_payload(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "attempt": self.attempt,
            "groups": [g.to_payload() for g in self.groups],
            "loss_scale": self.loss_scale,
            "max_grad_norm": self.max_grad_norm,
            "skip_nonfinite": self.skip_nonfinite,
            "tensor_ids": list(self.tensor_ids),
            "delayed": self.delayed,
            "grad_buffer": self.grad_buffer,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> Step:
        if d.keys() == cls.KEYS:
            step, attempt, groups, scale, clip, skip, ids, delayed, buffer = (
                d["step"],
                d["attempt"],
                d["groups"],
                d["loss_scale"],
                d["max_grad_norm"],
                d["skip_nonfinite"],
                d["tensor_ids"],
                d["delayed"],
                d["grad_buffer"],
            )
            if (
                type(step) is int
                and 0 <= step <= MAX_STEP
                and type(attempt) is int
                and 0 <= attempt <= MAX_STEP
                and type(scale) is float
                and 0.0 < scale <= FLOAT_MAX
                and (clip is None or (type(clip) is float and 0.0 < clip <= FLOAT_MAX))
                and type(skip) is bool
                and type(delayed) is bool
                and type(buffer) is int
                and 0 <= buffer < MAX_GRAD_BUFFERS
                and type(groups) is list
                and len(groups) <= MAX_GROUPS
                and all(type(g) is dict for g in groups)
                and _ids_ok(ids)
            ):
                return cls(
                    step,
                    attempt,
                    list_of(d, "groups", MAX_GROUPS, ParamGroup.from_payload),
                    scale,
                    clip,
                    skip,
                    tuple(ids),
                    delayed,
                    buffer,
                )
        return cls._checked(d)

    @classmethod
    def _checked(cls, d: dict[str, Any]) -> Step:
        check_keys(d, cls.KEYS)
        loss_scale = get_float(d, "loss_scale", 0.0)
        if loss_scale <= 0.0:
            raise FieldError("loss_scale", "a positive number", loss_scale)
        max_grad_norm = get_opt_float(d, "max_grad_norm", 0.0)
        if max_grad_norm is not None and max_grad_norm <= 0.0:
            raise FieldError("max_grad_norm", "a positive number or null", max_grad_norm)
        return cls(
            step=get_int(d, "step", 0, MAX_STEP),
            attempt=get_int(d, "attempt", 0, MAX_STEP),
            groups=list_of(d, "groups", MAX_GROUPS, as_item(ParamGroup.from_payload)),
            loss_scale=loss_scale,
            max_grad_norm=max_grad_norm,
            skip_nonfinite=get_bool(d, "skip_nonfinite"),
            tensor_ids=list_of(d, "tensor_ids", MAX_TENSORS, tensor_id_value),
            delayed=get_bool(d, "delayed"),
            grad_buffer=get_int(d, "grad_buffer", 0, MAX_GRAD_BUFFERS - 1),
        )


@dataclass(slots=True)
class BucketReady(Message):
    """The grads of ``tensor_ids`` are final for step ``step`` (attempt ``attempt``): update them now (one-way).

    The overlapped update: the daemon applies Adam to these tensors with ``groups`` (the client's
    hyper-parameters when backward started) while backward computes the next buckets.  Only for steps
    without loss scaling, clipping or accumulation, which the client checks before it sends any.
    """

    TYPE: ClassVar[MsgType] = MsgType.BUCKET_READY
    KEYS: ClassVar[frozenset[str]] = frozenset({"step", "attempt", "bucket", "tensor_ids", "grad_buffer", "groups"})
    step: int
    attempt: int
    bucket: int
    tensor_ids: tuple[int, ...]
    grad_buffer: int = 0
    groups: tuple[ParamGroup, ...] = ()

    def to_payload(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "attempt": self.attempt,
            "bucket": self.bucket,
            "tensor_ids": list(self.tensor_ids),
            "grad_buffer": self.grad_buffer,
            "groups": [g.to_payload() for g in self.groups],
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> BucketReady:
        check_keys(d, cls.KEYS)
        tensor_ids = list_of(d, "tensor_ids", MAX_TENSORS, tensor_id_value)
        if not tensor_ids:
            raise FieldError("tensor_ids", "at least one tensor id", [])
        groups = list_of(d, "groups", MAX_GROUPS, as_item(ParamGroup.from_payload))
        if not groups:
            raise FieldError("groups", "the param groups to update with", [])
        return cls(
            get_int(d, "step", 0, MAX_STEP),
            get_int(d, "attempt", 0, MAX_STEP),
            get_int(d, "bucket", 0, MAX_TENSORS),
            tensor_ids,
            get_int(d, "grad_buffer", 0, MAX_GRAD_BUFFERS - 1),
            groups,
        )


@dataclass(slots=True)
class Abort(Message):
    """Drop attempt ``attempt`` of step ``step`` (the client was interrupted before or during it).

    What was not started is dropped; an update already running ends first (state is never left
    half-stepped).  Buckets already updated by an overlapped attempt stay applied, with their
    per-tensor step counts, as torch leaves a param whose grad was None un-stepped.
    """

    TYPE: ClassVar[MsgType] = MsgType.ABORT
    KEYS: ClassVar[frozenset[str]] = frozenset({"step", "attempt"})
    step: int
    attempt: int

    def to_payload(self) -> dict[str, Any]:
        return {"step": self.step, "attempt": self.attempt}

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> Abort:
        check_keys(d, cls.KEYS)
        return cls(get_int(d, "step", 0, MAX_STEP), get_int(d, "attempt", 0, MAX_STEP))


@dataclass(slots=True)
class Aborted(Message):
    """Reply to ABORT: ``last_step`` is the rank's last applied step now, ``tensors_applied`` how many
    tensors of the aborted attempt had been updated (overlap) and keep it."""

    TYPE: ClassVar[MsgType] = MsgType.ABORTED
    KEYS: ClassVar[frozenset[str]] = frozenset({"step", "attempt", "last_step", "tensors_applied"})
    step: int
    attempt: int
    last_step: int
    tensors_applied: int

    def to_payload(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "attempt": self.attempt,
            "last_step": self.last_step,
            "tensors_applied": self.tensors_applied,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> Aborted:
        check_keys(d, cls.KEYS)
        return cls(
            get_int(d, "step", 0, MAX_STEP),
            get_int(d, "attempt", 0, MAX_STEP),
            get_int(d, "last_step", 0, MAX_STEP),
            get_int(d, "tensors_applied", 0, MAX_TENSORS),
        )


@dataclass(slots=True)
class StateReset(Message):
    """Zero the Adam state of ``tensor_ids`` (empty: all) and set their step counts to 0.

    A load of a checkpoint resets the tensors it has no state for (as ``torch.optim`` does), and a
    rank that is FAILED becomes usable again once all its tensors are reset (then loaded).
    """

    TYPE: ClassVar[MsgType] = MsgType.STATE_RESET
    KEYS: ClassVar[frozenset[str]] = frozenset({"tensor_ids"})
    tensor_ids: tuple[int, ...] = ()

    def to_payload(self) -> dict[str, Any]:
        return {"tensor_ids": list(self.tensor_ids)}

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> StateReset:
        check_keys(d, cls.KEYS)
        return cls(list_of(d, "tensor_ids", MAX_TENSORS, tensor_id_value))


@dataclass(slots=True)
class StepDone(Message):
    """Step ``step`` (attempt ``attempt``) is applied, or skipped when ``found_inf``; ``grad_norm`` is the
    unclipped global norm (None when the step needed none)."""

    TYPE: ClassVar[MsgType] = MsgType.STEP_DONE
    KEYS: ClassVar[frozenset[str]] = frozenset({"step", "attempt", "found_inf", "grad_norm", "params_ready", "timings"})
    step: int
    attempt: int
    found_inf: bool
    grad_norm: float | None = None
    params_ready: bool = True
    timings: tuple[tuple[str, float], ...] = ()
    """(phase, seconds) pairs, e.g. ("update", 0.12)."""

    def to_payload(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "attempt": self.attempt,
            "found_inf": self.found_inf,
            "grad_norm": self.grad_norm,
            "params_ready": self.params_ready,
            "timings": dict(self.timings),
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> StepDone:
        if d.keys() == cls.KEYS:
            step, attempt, found_inf, norm, ready, timings = (
                d["step"],
                d["attempt"],
                d["found_inf"],
                d["grad_norm"],
                d["params_ready"],
                d["timings"],
            )
            if (
                type(step) is int
                and 0 <= step <= MAX_STEP
                and type(attempt) is int
                and 0 <= attempt <= MAX_STEP
                and type(found_inf) is bool
                and (norm is None or (type(norm) is float and 0.0 <= norm <= FLOAT_MAX))
                and type(ready) is bool
                and type(timings) is dict
                and len(timings) <= MAX_TIMINGS
                and all(
                    type(k) is str and len(k) <= MAX_NAME and type(v) is float and 0.0 <= v <= FLOAT_MAX
                    for k, v in timings.items()
                )
            ):
                return cls(step, attempt, found_inf, norm, ready, tuple(timings.items()))
        return cls._checked(d)

    @classmethod
    def _checked(cls, d: dict[str, Any]) -> StepDone:
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
            attempt=get_int(d, "attempt", 0, MAX_STEP),
            found_inf=get_bool(d, "found_inf"),
            grad_norm=get_opt_float(d, "grad_norm", 0.0, finite=False),
            params_ready=get_bool(d, "params_ready"),
            timings=tuple(timings),
        )


@dataclass(slots=True)
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
        if d.keys() == cls.KEYS:
            step, ids = d["step"], d["tensor_ids"]
            if type(step) is int and 0 <= step <= MAX_STEP and _ids_ok(ids):
                return cls(step, tuple(ids))
        return cls._checked(d)

    @classmethod
    def _checked(cls, d: dict[str, Any]) -> FetchParams:
        check_keys(d, cls.KEYS)
        return cls(get_int(d, "step", 0, MAX_STEP), list_of(d, "tensor_ids", MAX_TENSORS, tensor_id_value))


@dataclass(slots=True)
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


@dataclass(slots=True)
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


@dataclass(slots=True)
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


@dataclass(slots=True)
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

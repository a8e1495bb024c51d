"""Session messages: attach, register, stats, detach, ping, ok, and error replies.

Owns what these messages mean and the range of every field.
Unknown fields are refused: a payload change is a protocol version change
(docs/protocol.md).  Pure: no I/O.  ``from_payload`` raises ``FieldError``,
which ``decode_message`` reports as a ``ProtocolError`` naming the message and
the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tiermem.errors import TiermemError, error_from_wire
from tiermem.protocol.fields import (
    FieldError,
    check_keys,
    get_bool,
    get_dict,
    get_int,
    get_opt_str,
    get_str,
    list_of,
    str_value,
)
from tiermem.protocol.frame import MsgType
from tiermem.protocol.records import (
    EXCHANGES,
    ID_PATTERN,
    MAX_GRAD_BUFFERS,
    MAX_GROUPS,
    MAX_ID,
    MAX_MESSAGE,
    MAX_NAME,
    MAX_NBYTES,
    MAX_STATS,
    MAX_TENSORS,
    MAX_WINDOW_ID,
    MAX_WORLD,
    STATE_KEYS,
    Message,
    ParamGroup,
    TensorSlot,
    TensorSpec,
    as_item,
)

__all__ = [
    "Attach",
    "AttachOk",
    "Detach",
    "ErrorReply",
    "Ok",
    "Ping",
    "Pong",
    "Register",
    "RegisterOk",
    "Stats",
    "StatsReply",
]


@dataclass(slots=True)
class Attach(Message):
    """Join job ``job_id`` as ``rank`` of ``world_size``, with a staging window of ``window_nbytes``.

    ``window_nbytes`` 0 takes the daemon's ``jobs.window_size``.  ``token`` (from an earlier
    ``ATTACH_OK``) reattaches to a job kept after a crash.
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
            job_id=get_str(d, "job_id", MAX_ID, ID_PATTERN),
            rank=rank,
            world_size=world_size,
            window_nbytes=get_int(d, "window_nbytes", 0, MAX_NBYTES),
            token=get_opt_str(d, "token", MAX_ID),
        )


@dataclass(slots=True)
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


@dataclass(slots=True)
class Register(Message):
    """Register the rank's tensors (once); ``groups`` are its param groups.

    ``exchange``: how params and grads move (``"shared"``: the daemon creates
    the tensors' storage, params and grads, as one shared-memory segment that
    the client's tensors then live in).  ``grad_buffers``: 1, or 2 for the
    delayed update (step t+1's grads land in the other buffer while step t's
    update still reads its own).
    """

    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    KEYS: ClassVar[frozenset[str]] = frozenset({"tensors", "groups", "grad_buffers", "exchange"})
    tensors: tuple[TensorSpec, ...]
    groups: tuple[ParamGroup, ...]
    grad_buffers: int = 1
    exchange: str = "shared"

    def to_payload(self) -> dict[str, Any]:
        return {
            "tensors": [t.to_payload() for t in self.tensors],
            "groups": [g.to_payload() for g in self.groups],
            "grad_buffers": self.grad_buffers,
            "exchange": self.exchange,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> Register:
        check_keys(d, cls.KEYS)
        groups = list_of(d, "groups", MAX_GROUPS, as_item(ParamGroup.from_payload))
        if not groups:
            raise FieldError("groups", "at least one param group", [])
        tensors = list_of(d, "tensors", MAX_TENSORS, as_item(TensorSpec.from_payload))
        seen: set[str] = set()
        for index, tensor in enumerate(tensors):
            if tensor.group >= len(groups):
                raise FieldError(f"tensors[{index}].group", f"a group index < {len(groups)}", tensor.group)
            if tensor.name in seen:
                raise FieldError(f"tensors[{index}].name", "a name not used before in this message", tensor.name)
            seen.add(tensor.name)
        exchange = get_str(d, "exchange", 16)
        if exchange not in EXCHANGES:
            raise FieldError("exchange", f"one of {', '.join(EXCHANGES)}", exchange)
        return cls(tensors, groups, get_int(d, "grad_buffers", 1, MAX_GRAD_BUFFERS), exchange)


@dataclass(slots=True)
class RegisterOk(Message):
    """The daemon's plan for the registered tensors: one slot per tensor, in request order.

    With the shared exchange the reply carries one fd, the tensors' storage
    (``storage_nbytes`` bytes; the slots' references name it).  ``placement``:
    where the Adam state went (``cpu``/``nvme``); ``state_keys``: the fp32
    state the daemon keeps per tensor (no ``master`` when the fp32 params in
    the storage are the master themselves).
    """

    TYPE: ClassVar[MsgType] = MsgType.REGISTER_OK
    KEYS: ClassVar[frozenset[str]] = frozenset({"slots", "placement", "state_keys", "storage_nbytes"})
    slots: tuple[TensorSlot, ...]
    placement: str = "cpu"
    state_keys: tuple[str, ...] = STATE_KEYS
    storage_nbytes: int = 0

    def to_payload(self) -> dict[str, Any]:
        return {
            "slots": [s.to_wire() for s in self.slots],
            "placement": self.placement,
            "state_keys": list(self.state_keys),
            "storage_nbytes": self.storage_nbytes,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> RegisterOk:
        check_keys(d, cls.KEYS)
        placement = get_str(d, "placement", 16)
        if placement not in ("cpu", "nvme"):
            raise FieldError("placement", "cpu or nvme", placement)
        keys = list_of(d, "state_keys", len(STATE_KEYS), lambda v: str_value(v, 16))
        for index, key in enumerate(keys):
            if key not in STATE_KEYS:
                raise FieldError(f"state_keys[{index}]", f"one of {', '.join(STATE_KEYS)}", key)
        return cls(
            list_of(d, "slots", MAX_TENSORS, TensorSlot.from_wire),
            placement,
            keys,
            get_int(d, "storage_nbytes", 0, MAX_NBYTES),
        )


@dataclass(slots=True)
class Stats(Message):
    """Ask for the daemon's numbers as seen by this job."""

    TYPE: ClassVar[MsgType] = MsgType.STATS


@dataclass(slots=True)
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


@dataclass(slots=True)
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


@dataclass(slots=True)
class Ping(Message):
    TYPE: ClassVar[MsgType] = MsgType.PING


@dataclass(slots=True)
class Pong(Message):
    TYPE: ClassVar[MsgType] = MsgType.PONG


@dataclass(slots=True)
class Ok(Message):
    """A request succeeded and has nothing to return (STATE_WRITE, DETACH)."""

    TYPE: ClassVar[MsgType] = MsgType.OK


@dataclass(slots=True)
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
        return cls(get_str(d, "type", MAX_NAME, ID_PATTERN), get_str(d, "message", MAX_MESSAGE), tuple(fields.items()))


def _check_scalar(value: Any, path: str) -> None:
    """Error facts are scalars or flat lists of scalars (paths, sizes, keys)."""
    scalar = (str, int, float, bool, type(None))
    if type(value) in scalar:
        return
    if type(value) is list and len(value) <= 64 and all(type(v) in scalar for v in value):
        return
    raise FieldError(path, "a scalar or a list of at most 64 scalars", value)

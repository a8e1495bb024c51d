"""Session messages: attach, register, stats, detach, ping, ok, and error replies.

Owns what these messages mean and the range of every field, each declared
once with ``tiermem.core.protocol.spec`` (``@wire`` derives the codec; the shared
kinds and limits are in ``records``), and the three field kinds only these
messages use: an alignment (a power of two), a stats value (any JSON number,
kept as sent) and an error fact (a scalar or a flat list of scalars).
Unknown fields are refused: a payload change is a protocol version change
(docs/protocol.md).  Pure: no I/O.  ``from_payload`` raises ``FieldError``,
which ``decode_message`` reports as a ``ProtocolError`` naming the message and
the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from tiermem.core.errors import TiermemError, error_from_wire
from tiermem.core.modes import STATE_DTYPES, Exchange, Placement
from tiermem.core.protocol.fields import FieldError
from tiermem.core.protocol.frame import MsgType
from tiermem.core.protocol.kinds import Kind, Source
from tiermem.core.protocol.records import (
    DEFAULT_MAX_INFLIGHT,
    ID_PATTERN,
    MAX_GRAD_BUFFERS,
    MAX_GROUPS,
    MAX_ID,
    MAX_MESSAGE,
    MAX_NAME,
    MAX_NBYTES,
    MAX_TENSORS,
    MAX_WINDOW_ID,
    MAX_WORLD,
    NAME,
    NBYTES,
    STATE_KEY,
    STATE_KEYS,
    STEP_NO,
    Message,
    ParamGroup,
    TensorSlot,
    TensorSpec,
)
from tiermem.core.protocol.report import MAX_REPORTED_JOBS, JobReport, NodeReport, RankReport
from tiermem.core.protocol.spec import Choice, Int, List, Map, Opt, Str, WireName, wire

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

MAX_FACTS = 64
"""Facts per error reply, and items per fact that is a list."""


class PowerOfTwo(Int):
    """An integer in [lo, hi] that is a power of two (an alignment)."""

    __slots__ = ()

    def check(self, value: Any, path: str) -> int:
        number = super().check(value, path)
        if number & (number - 1):
            raise FieldError(path, "a power of two", number)
        return number

    def test(self, gen: Source, v: str) -> str:
        return f"{super().test(gen, v)} and not {v} & ({v} - 1)"


_SCALARS = frozenset({str, int, float, bool, type(None)})


class Fact(Kind):
    """One fact of an error (a path, a size, a key): a scalar, or a list of at most ``MAX_FACTS`` scalars."""

    __slots__ = ()

    def check(self, value: Any, path: str) -> Any:
        if type(value) in _SCALARS:
            return value
        if type(value) is list and len(value) <= MAX_FACTS and all(type(v) in _SCALARS for v in value):
            return value
        raise FieldError(path, f"a scalar or a list of at most {MAX_FACTS} scalars", value)

    def test(self, gen: Source, v: str) -> str:
        scalars, x = gen.const(_SCALARS), gen.var("x")
        return (
            f"type({v}) in {scalars} or (type({v}) is list and len({v}) <= {MAX_FACTS}"
            f" and all(type({x}) in {scalars} for {x} in {v}))"
        )


@wire
@dataclass(slots=True)
class Attach(Message):
    """Join job ``job_id`` as ``rank`` of ``world_size``, with a staging window of ``window_nbytes``.

    ``window_nbytes`` 0 takes the daemon's ``jobs.window_size``.  ``token`` (from an earlier
    ``ATTACH_OK``) reattaches to a job kept after a crash.  ``create`` with a ``token`` the ranks
    agreed on beforehand (``tiermem.distributed``: rank 0 makes it and broadcasts it): a job that
    does not exist yet is created with that token, so the ranks of a job attach in any order.
    """

    TYPE: ClassVar[MsgType] = MsgType.ATTACH
    job_id: Annotated[str, Str(MAX_ID, pattern=ID_PATTERN)]
    rank: Annotated[int, Int(0, MAX_WORLD - 1)]
    world_size: Annotated[int, Int(1, MAX_WORLD)]
    window_nbytes: Annotated[int, NBYTES]
    token: Annotated[str | None, Opt(Str(MAX_ID))] = None
    create: bool = False

    def validate(self) -> None:
        if self.rank >= self.world_size:
            raise FieldError("rank", f"an integer in [0, world_size={self.world_size})", self.rank)
        if self.create and (self.token is None or len(self.token) < MIN_AGREED_TOKEN):
            raise FieldError("token", f"a token of at least {MIN_AGREED_TOKEN} characters with create", self.token)


MIN_AGREED_TOKEN = 32
"""The shortest token a job may be created with (``ATTACH.create``): 128 bits in hex."""


STATE_FROM = ("new", "live", "shutdown", "commit")
"""Where a rank's state comes from, as ``ATTACH_OK.state_from`` says."""


@wire
@dataclass(slots=True)
class AttachOk(Message):
    """Attached.  The frame carries the window's memfd (``FLAG_FDS``), mapped ``window_nbytes`` long."""

    TYPE: ClassVar[MsgType] = MsgType.ATTACH_OK
    job_token: Annotated[str, Str(MAX_ID)]
    window_id: Annotated[int, Int(0, MAX_WINDOW_ID)]
    window_nbytes: Annotated[int, Int(1, MAX_NBYTES)]
    alignment: Annotated[int, PowerOfTwo(1, 1 << 30)]
    max_frame: Annotated[int, Int(4096, 1 << 30)]
    max_inflight: Annotated[int, Int(1, 1 << 30)] = DEFAULT_MAX_INFLIGHT
    """One-way messages the daemon takes in a row (``server.max_inflight``): the client sends a request (a
    PING when it has none) before the next one."""
    reattached: bool = False
    state_step: Annotated[int, STEP_NO] = 0
    """The step the rank's state is at (0: it has none yet)."""
    state_from: Annotated[str, Choice(STATE_FROM)] = "new"
    """Where that state comes from: ``new``; ``live`` (this daemon kept it); ``shutdown`` (reopened from the
    commit of a daemon that stopped cleanly); ``commit`` (reopened from the last commit of a daemon that did
    not: the steps after it are lost)."""


@wire
@dataclass(slots=True)
class Register(Message):
    """Register the rank's tensors (once); ``groups`` are its param groups.

    ``exchange``: how params and grads move (``"shared"``: the daemon creates
    the tensors' storage, params and grads, as one shared-memory segment that
    the client's tensors then live in; ``"staged"``: the tensors stay on the
    client's device and move through the staging window as the ``grad`` and
    ``master`` state keys).  ``grads_in_state``: see the field.  ``grad_buffers``: 1, or 2 for the
    delayed update (step t+1's grads land in the other buffer while step t's
    update still reads its own).
    """

    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    tensors: Annotated[tuple[TensorSpec, ...], List(TensorSpec, MAX_TENSORS)]
    groups: Annotated[tuple[ParamGroup, ...], List(ParamGroup, MAX_GROUPS, min_len=1)]
    grad_buffers: Annotated[int, Int(1, MAX_GRAD_BUFFERS)] = 1
    exchange: Annotated[Exchange, Choice((Exchange.SHARED, Exchange.STAGED))] = Exchange.SHARED
    grads_in_state: bool = False
    """The grads go into the daemon's ``grad`` state key as they land (the client releases them), not into
    the storage's grad buffers: with the NVMe placement they are paged like the rest of the state."""
    state_dtype: Annotated[str, Choice(STATE_DTYPES)] = "fp32"
    """How the daemon stores ``exp_avg`` and ``exp_avg_sq`` (``tiermem.core.lowbit``): ``fp32`` (exact AdamW),
    ``bf16`` or ``int8``; the state keys still read and write fp32 values."""

    def validate(self) -> None:
        """Each tensor names one of ``groups``, and no name is used twice."""
        seen: set[str] = set()
        for index, tensor in enumerate(self.tensors):
            if tensor.group >= len(self.groups):
                raise FieldError(f"tensors[{index}].group", f"a group index < {len(self.groups)}", tensor.group)
            if tensor.name in seen:
                raise FieldError(f"tensors[{index}].name", "a name not used before in this message", tensor.name)
            seen.add(tensor.name)


@wire
@dataclass(slots=True)
class RegisterOk(Message):
    """The daemon's plan for the registered tensors: one slot per tensor, in request order.

    With the shared exchange the reply carries one fd, the tensors' storage
    (``storage_nbytes`` bytes; the slots' references name it); the staged
    exchange gets no storage, no slots and no fd.  ``placement``: where the
    Adam state went (``cpu``/``nvme``); ``state_keys``: the state the daemon
    keeps per tensor (no ``master`` when the fp32 params in the storage are the
    master themselves; ``grad`` for the staged exchange); ``state_dtype``: how
    it stores the moments (what the registration asked).
    """

    TYPE: ClassVar[MsgType] = MsgType.REGISTER_OK
    slots: Annotated[tuple[TensorSlot, ...], List(TensorSlot, MAX_TENSORS)]
    placement: Annotated[Placement, Choice((Placement.CPU, Placement.NVME))] = Placement.CPU
    state_keys: Annotated[tuple[str, ...], List(STATE_KEY, len(STATE_KEYS))] = STATE_KEYS[:3]
    storage_nbytes: Annotated[int, NBYTES] = 0
    state_dtype: Annotated[str, Choice(STATE_DTYPES)] = "fp32"


@wire
@dataclass(slots=True)
class Stats(Message):
    """Ask for the daemon's numbers as seen by this job."""

    TYPE: ClassVar[MsgType] = MsgType.STATS


@wire
@dataclass(slots=True)
class StatsReply(Message):
    """The daemon's figures: the node's, the jobs the caller may see (all for root and the daemon's uid, else
    its own uid's, at most ``MAX_REPORTED_JOBS``), and the caller's rank when its connection is attached."""

    TYPE: ClassVar[MsgType] = MsgType.STATS_REPLY
    node: NodeReport
    jobs: Annotated[tuple[JobReport, ...], List(JobReport, MAX_REPORTED_JOBS)] = ()
    rank: Annotated[RankReport | None, Opt(RankReport)] = None


@wire
@dataclass(slots=True)
class Detach(Message):
    """Leave the job; ``keep_state`` keeps it for a reattach with its token during the grace period."""

    TYPE: ClassVar[MsgType] = MsgType.DETACH
    keep_state: bool = False


@wire
@dataclass(slots=True)
class Ping(Message):
    TYPE: ClassVar[MsgType] = MsgType.PING


@wire
@dataclass(slots=True)
class Pong(Message):
    TYPE: ClassVar[MsgType] = MsgType.PONG


@wire
@dataclass(slots=True)
class Ok(Message):
    """A request succeeded and has nothing to return (STATE_WRITE, DETACH)."""

    TYPE: ClassVar[MsgType] = MsgType.OK


@wire
@dataclass(slots=True)
class ErrorReply(Message):
    """A request failed: ``error`` is ``TiermemError.to_wire()``; the client raises ``to_exception()``."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    kind: Annotated[str, Str(MAX_NAME, pattern=ID_PATTERN), WireName("type")]
    """The error class name (``BoundsError``); the wire field is ``type``."""
    message: Annotated[str, Str(MAX_MESSAGE)]
    fields: Annotated[tuple[tuple[str, Any], ...], Map(NAME, Fact(), MAX_FACTS)] = ()

    @classmethod
    def from_exception(cls, exc: TiermemError) -> ErrorReply:
        sent = exc.to_wire()
        return cls(sent["type"], sent["message"], tuple(sent["fields"].items()))

    def to_exception(self) -> TiermemError:
        return error_from_wire(self.to_payload())

"""Some of today's messages declared again with ``tiermem.protocol.spec``, for tests and the codec benchmark.

Each class mirrors the hand-written one of the same name in ``tiermem.protocol``
(same fields in the same order, same ranges); ``tests/unit/test_protocol_spec.py``
holds the two decoders to the same answers and ``benchmarks/bench_codec.py``
measures both.  Where a message's cross-field checks cannot be said by field
kinds they are in ``validate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

from tiermem.protocol import records
from tiermem.protocol.fields import FieldError
from tiermem.protocol.frame import MsgType
from tiermem.protocol.records import (
    DTYPES,
    MAX_DIM,
    MAX_GRAD_BUFFERS,
    MAX_GROUPS,
    MAX_NAME,
    MAX_NBYTES,
    MAX_NDIM,
    MAX_STEP,
    MAX_TENSORS,
    MAX_TIMINGS,
    MAX_WINDOW_ID,
    PLACEMENTS,
    STATE_KEYS,
)
from tiermem.protocol.spec import Choice, Float, Int, List, Map, Opt, Str, Tuple, Wire, wire

EXCHANGES: tuple[str, ...] = getattr(records, "EXCHANGES", ("shared",))

# Field kinds shared by several messages.
STEP_NO = Int(0, MAX_STEP)
TENSOR_ID = Int(0, MAX_TENSORS - 1)
TENSOR_IDS = List(TENSOR_ID, MAX_TENSORS)
NBYTES = Int(0, MAX_NBYTES)
GRAD_BUFFER = Int(0, MAX_GRAD_BUFFERS - 1)
BETA = Float(ge=0.0, lt=1.0)


class Message(Wire):
    __slots__ = ()
    TYPE: ClassVar[MsgType]


@wire(array=True)
@dataclass(frozen=True, slots=True)
class MemRef(Wire):
    window: Annotated[int, Int(0, MAX_WINDOW_ID)]
    offset: Annotated[int, NBYTES]
    length: Annotated[int, NBYTES]


@wire
@dataclass(frozen=True, slots=True)
class ParamGroup(Wire):
    lr: Annotated[float, Float(ge=0.0)]
    betas: Annotated[tuple[float, float], Tuple(BETA, BETA)] = (0.9, 0.999)
    eps: Annotated[float, Float(ge=0.0)] = 1e-8
    weight_decay: Annotated[float, Float(ge=0.0)] = 0.0
    adamw: bool = True
    maximize: bool = False


@wire
@dataclass(frozen=True, slots=True)
class TensorSpec(Wire):
    name: Annotated[str, Str(MAX_NAME, min_len=1)]
    shape: Annotated[tuple[int, ...], List(Int(0, MAX_DIM), MAX_NDIM)]
    dtype: Annotated[str, Choice(DTYPES)]
    placement: Annotated[str, Choice(PLACEMENTS)] = "auto"
    group: Annotated[int, Int(0, MAX_GROUPS - 1)] = 0


@wire(array=True)
@dataclass(frozen=True, slots=True)
class TensorSlot(Wire):
    tensor_id: Annotated[int, TENSOR_ID]
    param: MemRef
    grads: Annotated[tuple[MemRef, ...], List(MemRef, MAX_GRAD_BUFFERS, min_len=1)]


@wire
@dataclass(slots=True)
class Register(Message):
    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    tensors: Annotated[tuple[TensorSpec, ...], List(TensorSpec, MAX_TENSORS)]
    groups: Annotated[tuple[ParamGroup, ...], List(ParamGroup, MAX_GROUPS, min_len=1)]
    grad_buffers: Annotated[int, Int(1, MAX_GRAD_BUFFERS)] = 1
    exchange: Annotated[str, Choice(EXCHANGES)] = "shared"

    def validate(self) -> None:
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
    TYPE: ClassVar[MsgType] = MsgType.REGISTER_OK
    slots: Annotated[tuple[TensorSlot, ...], List(TensorSlot, MAX_TENSORS)]
    placement: Annotated[str, Choice(("cpu", "nvme"))] = "cpu"
    state_keys: Annotated[tuple[str, ...], List(Choice(STATE_KEYS), len(STATE_KEYS))] = STATE_KEYS
    storage_nbytes: Annotated[int, NBYTES] = 0


@wire
@dataclass(slots=True)
class Step(Message):
    TYPE: ClassVar[MsgType] = MsgType.STEP
    step: Annotated[int, STEP_NO]
    attempt: Annotated[int, STEP_NO] = 0
    groups: Annotated[tuple[ParamGroup, ...], List(ParamGroup, MAX_GROUPS)] = ()
    loss_scale: Annotated[float, Float(gt=0.0)] = 1.0
    max_grad_norm: Annotated[float | None, Opt(Float(gt=0.0))] = None
    skip_nonfinite: bool = False
    tensor_ids: Annotated[tuple[int, ...], TENSOR_IDS] = ()
    delayed: bool = False
    grad_buffer: Annotated[int, GRAD_BUFFER] = 0


@wire
@dataclass(slots=True)
class BucketReady(Message):
    TYPE: ClassVar[MsgType] = MsgType.BUCKET_READY
    step: Annotated[int, STEP_NO]
    attempt: Annotated[int, STEP_NO]
    bucket: Annotated[int, Int(0, MAX_TENSORS)]
    tensor_ids: Annotated[tuple[int, ...], List(TENSOR_ID, MAX_TENSORS, min_len=1)]
    grad_buffer: Annotated[int, GRAD_BUFFER] = 0
    groups: Annotated[tuple[ParamGroup, ...], List(ParamGroup, MAX_GROUPS, min_len=1)] = ()


@wire
@dataclass(slots=True)
class StepDone(Message):
    TYPE: ClassVar[MsgType] = MsgType.STEP_DONE
    step: Annotated[int, STEP_NO]
    attempt: Annotated[int, STEP_NO]
    found_inf: bool
    grad_norm: Annotated[float | None, Opt(Float(ge=0.0, finite=False))] = None
    params_ready: bool = True
    timings: Annotated[tuple[tuple[str, float], ...], Map(Str(MAX_NAME), Float(ge=0.0), MAX_TIMINGS)] = ()


@wire
@dataclass(slots=True)
class FetchParams(Message):
    TYPE: ClassVar[MsgType] = MsgType.FETCH_PARAMS
    step: Annotated[int, STEP_NO]
    tensor_ids: Annotated[tuple[int, ...], TENSOR_IDS] = ()


@wire
@dataclass(slots=True)
class StateRead(Message):
    TYPE: ClassVar[MsgType] = MsgType.STATE_READ
    tensor_id: Annotated[int, TENSOR_ID]
    key: Annotated[str, Choice(STATE_KEYS)]
    offset: Annotated[int, NBYTES]
    dest: MemRef


DECLARED: tuple[type[Wire], ...] = (
    MemRef,
    ParamGroup,
    TensorSpec,
    TensorSlot,
    Register,
    RegisterOk,
    Step,
    BucketReady,
    StepDone,
    FetchParams,
    StateRead,
)

"""Wire protocol, property-based: every message round-trips; no input raises anything but ProtocolError."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from stats_samples import sample_reply
from wire_strategies import mutated, shape, valid

from tiermem.core import protocol
from tiermem.core.errors import ProtocolError
from tiermem.core.modes import Exchange, Placement
from tiermem.core.protocol import Message, MsgType, decode_frame, decode_message, encode_message
from tiermem.core.protocol.fields import FieldError
from tiermem.core.protocol.step import StateSpan, WriteSpan

u64 = st.integers(0, (1 << 56) - 1)
step_no = st.integers(0, (1 << 62) - 1)
tensor_id = st.integers(0, (1 << 20) - 1)
ids = st.lists(tensor_id, max_size=8).map(tuple)
names = st.text(min_size=1, max_size=40)
job_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,30}", fullmatch=True)
nonneg = st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False)
positive = st.floats(1e-12, 1e9, allow_nan=False, allow_infinity=False)
unit = st.floats(0.0, 1.0, exclude_max=True)
state_key = st.sampled_from(protocol.STATE_KEYS)
dtype_name = st.sampled_from(protocol.DTYPES)
memref = st.builds(protocol.MemRef, st.integers(0, 0xFFFFFFFF), u64, u64)

param_group = st.builds(
    protocol.ParamGroup,
    lr=nonneg,
    betas=st.tuples(unit, unit),
    eps=nonneg,
    weight_decay=nonneg,
    adamw=st.booleans(),
    maximize=st.booleans(),
)
tensor_spec = st.builds(
    protocol.TensorSpec,
    name=names,
    shape=st.lists(st.integers(0, (1 << 48) - 1), max_size=16).map(tuple),
    dtype=dtype_name,
    placement=st.sampled_from(Placement),
    group=st.just(0),
)


@st.composite
def registers(draw: st.DrawFn) -> protocol.Register:
    groups = tuple(draw(st.lists(param_group, min_size=1, max_size=3)))
    specs = draw(st.lists(tensor_spec, max_size=5, unique_by=lambda t: t.name))
    tensors = tuple(
        protocol.TensorSpec(t.name, t.shape, t.dtype, t.placement, draw(st.integers(0, len(groups) - 1))) for t in specs
    )
    return protocol.Register(tensors, groups, draw(st.integers(1, 2)), Exchange.SHARED)


@st.composite
def state_chunks(draw: st.DrawFn) -> protocol.StateChunk:
    total = draw(u64)
    offset = draw(st.integers(0, total))
    nbytes = draw(st.integers(0, total - offset))
    return protocol.StateChunk(draw(tensor_id), draw(state_key), offset, nbytes, total, draw(step_no))


@st.composite
def attaches(draw: st.DrawFn) -> protocol.Attach:
    world = draw(st.integers(1, 1 << 20))
    token = draw(st.none() | st.text(max_size=128))
    return protocol.Attach(
        draw(job_ids), draw(st.integers(0, world - 1)), world, draw(st.integers(1, (1 << 56) - 1)), token
    )


scalar = st.none() | st.booleans() | st.integers(-(1 << 60), 1 << 60) | st.text(max_size=20) | nonneg
wire_key = st.text(max_size=20)

STRATEGIES: dict[MsgType, st.SearchStrategy[Message]] = {
    MsgType.ATTACH: attaches(),
    MsgType.ATTACH_OK: st.builds(
        protocol.AttachOk,
        job_token=st.text(max_size=128),
        window_id=st.integers(0, 0xFFFFFFFF),
        window_nbytes=st.integers(1, (1 << 56) - 1),
        alignment=st.integers(0, 30).map(lambda b: 1 << b),
        max_frame=st.integers(4096, 1 << 30),
        reattached=st.booleans(),
    ),
    MsgType.REGISTER: registers(),
    MsgType.REGISTER_OK: st.builds(
        protocol.RegisterOk,
        st.lists(
            st.builds(protocol.TensorSlot, tensor_id, memref, st.lists(memref, min_size=1, max_size=2).map(tuple)),
            max_size=5,
        ).map(tuple),
        st.sampled_from([Placement.CPU, Placement.NVME]),
        st.sampled_from([("exp_avg", "exp_avg_sq"), protocol.STATE_KEYS]),
        u64,
    ),
    MsgType.STEP: st.builds(
        protocol.Step,
        step=step_no,
        groups=st.lists(param_group, max_size=3).map(tuple),
        loss_scale=positive,
        max_grad_norm=st.none() | positive,
        clip_coef=st.none() | st.floats(0.0, 1.0),
        skip=st.booleans(),
        tensor_ids=ids,
        attempt=step_no,
        delayed=st.booleans(),
        grad_buffer=st.integers(0, 1),
    ),
    MsgType.BUCKET_READY: st.builds(
        protocol.BucketReady,
        step=step_no,
        attempt=step_no,
        bucket=st.integers(0, 1 << 20),
        tensor_ids=st.lists(tensor_id, min_size=1, max_size=8).map(tuple),
        grad_buffer=st.integers(0, 1),
        groups=st.lists(param_group, min_size=1, max_size=3).map(tuple),
    ),
    MsgType.ABORT: st.builds(protocol.Abort, step_no, step_no),
    MsgType.ABORTED: st.builds(protocol.Aborted, step_no, step_no, step_no, st.integers(0, 1 << 20)),
    MsgType.STATE_RESET: st.builds(protocol.StateReset, ids),
    MsgType.STEP_DONE: st.builds(
        protocol.StepDone,
        step=step_no,
        attempt=step_no,
        skipped=st.booleans(),
        nonfinite=st.booleans(),
        skipped_steps=step_no,
        grad_norm=st.none() | st.floats(0.0, allow_nan=False),
        params_ready=st.booleans(),
        timings=st.dictionaries(st.text(max_size=20), nonneg, max_size=5).map(lambda d: tuple(d.items())),
    ),
    MsgType.FETCH_PARAMS: st.builds(protocol.FetchParams, step_no, ids),
    MsgType.PARAMS_READY: st.builds(protocol.ParamsReady, step_no, ids),
    MsgType.STATE_READ: st.builds(protocol.StateRead, tensor_id, state_key, u64, memref),
    MsgType.STATE_CHUNK: state_chunks(),
    MsgType.STATE_WRITE: st.builds(protocol.StateWrite, tensor_id, state_key, u64, memref, step_no),
    MsgType.STATE_READ_MANY: st.lists(
        st.builds(StateSpan, tensor_id, state_key, u64, memref, dtype_name),
        min_size=1,
        max_size=4,
    ).map(lambda spans: protocol.StateReadMany(spans=tuple(spans))),
    MsgType.STATE_SPANS: st.lists(step_no, max_size=4).map(lambda steps: protocol.StateSpans(steps=tuple(steps))),
    MsgType.STATE_WRITE_MANY: st.lists(
        st.builds(
            WriteSpan,
            tensor_id,
            state_key,
            u64,
            memref,
            step_no,
            st.booleans(),
            dtype_name,
        ),
        min_size=1,
        max_size=4,
    ).map(lambda spans: protocol.StateWriteMany(spans=tuple(spans))),
    MsgType.GRAD_NORM: st.builds(protocol.GradNorm, positive, ids, st.integers(0, 1)),
    MsgType.GRAD_NORM_REPLY: st.builds(protocol.GradNormReply, st.floats(0.0, allow_nan=False), st.booleans()),
    MsgType.STATS: st.just(protocol.Stats()),
    MsgType.STATS_REPLY: st.integers(0, 1 << 60).map(lambda n: sample_reply(jobs=n)),
    MsgType.DETACH: st.builds(protocol.Detach, st.booleans()),
    MsgType.PING: st.just(protocol.Ping()),
    MsgType.PONG: st.just(protocol.Pong()),
    MsgType.OK: st.just(protocol.Ok()),
    MsgType.ERROR: st.builds(
        protocol.ErrorReply,
        kind=st.from_regex(r"[A-Za-z][A-Za-z0-9]{0,30}", fullmatch=True),
        message=st.text(max_size=200),
        fields=st.dictionaries(wire_key, scalar | st.lists(scalar, max_size=4), max_size=4).map(
            lambda d: tuple(d.items())
        ),
    ),
}


def test_every_message_type_has_a_strategy():
    assert set(STRATEGIES) == set(protocol.MESSAGE_CLASSES)


@settings(max_examples=500)
@given(st.one_of(*STRATEGIES.values()), st.integers(0, 0xFFFFFFFF))
def test_every_message_round_trips(msg: Message, request_id: int):
    frame = decode_frame(encode_message(msg, request_id))
    assert frame.type is msg.TYPE
    assert frame.request_id == request_id
    assert decode_message(frame) == msg


def decode_all(data: bytes, max_frame: int = 1 << 20) -> None:
    with contextlib.suppress(ProtocolError):
        decode_message(decode_frame(data, max_frame=max_frame))


@settings(max_examples=600)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_protocol_error(data: bytes):
    decode_all(data)
    decode_all(b"TM\x01" + data)


@settings(max_examples=600)
@given(st.sampled_from(list(MsgType)), st.binary(max_size=300))
def test_random_payload_under_valid_header_raises_only_protocol_error(msg_type: MsgType, payload: bytes):
    decode_all(
        encode_message(protocol.Ping(), 1)[:3]
        + bytes([msg_type])
        + b"\0" * 8
        + len(payload).to_bytes(4, "little")
        + payload
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


def _mutate(draw: st.DrawFn, payload: dict) -> None:
    key = draw(st.sampled_from([*payload, "extra"])) if payload else "extra"
    if draw(st.booleans()) and key in payload:
        del payload[key]
    else:
        payload[key] = draw(json_values | st.floats() | st.integers(-(1 << 64), 1 << 64))


@st.composite
def near_valid_payloads(draw: st.DrawFn, types: tuple[MsgType, ...] = tuple(STRATEGIES)) -> tuple[MsgType, dict]:
    """A valid payload with one field replaced by an arbitrary JSON value (or deleted, or added).

    For STEP, the change may land inside a param group instead.
    """
    msg = draw(st.one_of(*(STRATEGIES[t] for t in types)))
    payload = json.loads(json.dumps(msg.to_payload()))
    groups = payload.get("groups")
    if msg.TYPE is MsgType.STEP and groups and draw(st.booleans()):
        _mutate(draw, groups[draw(st.integers(0, len(groups) - 1))])
    elif draw(st.integers(0, 9)):
        _mutate(draw, payload)
    return msg.TYPE, payload


@settings(max_examples=600)
@given(near_valid_payloads())
def test_wrong_field_values_raise_only_protocol_error(case: tuple[MsgType, dict]):
    msg_type, payload = case
    try:
        msg = decode_message(protocol.Frame(msg_type, 1, json.dumps(payload).encode()))
    except ProtocolError:
        return
    # Accepted: it must then be a well-formed message that round-trips.
    again = decode_message(decode_frame(encode_message(msg, 1)))
    assert _same(again, msg)


def _same(a: Message, b: Message) -> bool:
    """Equality where NaN equals NaN (a replaced float field may be NaN where NaN is allowed)."""
    return json.dumps(a.to_payload()) == json.dumps(b.to_payload())


@settings(max_examples=500)
@given(st.one_of(*STRATEGIES.values()), st.data())
def test_mutated_frames_raise_only_protocol_error(msg: Message, data: st.DataObject):
    frame = bytearray(encode_message(msg, 7))
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(frame) - 1))
        frame[index] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    decode_all(bytes(frame[:cut]))
    decode_all(bytes(frame))


def test_float_fields_reject_non_finite_where_they_must_be_finite():
    for value in (math.inf, -math.inf, math.nan):
        payload = dict(protocol.Step(step=1).to_payload(), loss_scale=value)
        try:
            decode_message(protocol.Frame(MsgType.STEP, 1, json.dumps(payload).encode()))
        except ProtocolError as exc:
            assert "loss_scale" in str(exc)
        else:
            raise AssertionError(f"loss_scale {value} accepted")


def test_header_size_is_sixteen():
    assert protocol.HEADER_NBYTES == 16


def _outcome(decode: Callable[[], Any]) -> tuple[str, Any]:
    try:
        obj = decode()
    except FieldError as exc:
        return "error", (exc.path, exc.expected)
    return "ok", shape(obj)


@pytest.mark.parametrize("cls", list(protocol.MESSAGE_CLASSES.values()), ids=lambda c: c.__name__)
@settings(max_examples=60)
@given(st.data())
def test_generated_decoder_agrees_with_the_interpreted_checks(cls: type[Message], data: st.DataObject):
    """Where the generated decoder answers, the interpreted checks give the same object; ``from_payload`` is theirs."""
    spec = cls.__wire__
    from_message = STRATEGIES[cls.TYPE].map(lambda m: json.loads(json.dumps(m.to_payload())))
    payload = data.draw(from_message | valid(spec))
    if data.draw(st.integers(0, 3)):
        payload, _ = data.draw(mutated(spec, payload, whole=False))
    fast = spec.decode_fast(cls, payload)
    checked = _outcome(lambda: spec.decode_checked(cls, payload))
    event(f"generated {'declined' if fast is None else 'answered'}, checks: {checked[0]}")
    if fast is not None:
        assert checked == ("ok", shape(fast))
    assert _outcome(lambda: cls.from_payload(payload)) == checked

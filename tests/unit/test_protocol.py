"""Wire protocol: golden frames, header checks, field checks, errors across the wire."""

from __future__ import annotations

import json
import math

import pytest
from stats_samples import sample_node, sample_reply

from tiermem.core.errors import BoundsError, PoolExhausted, ProtocolError, SwapIOError, TiermemError, UnknownKey
from tiermem.core.modes import Placement
from tiermem.core.protocol import (
    FLAG_FDS,
    FLAG_ONEWAY,
    HEADER_NBYTES,
    MESSAGE_CLASSES,
    REPLY_TYPES,
    Attach,
    AttachOk,
    BucketReady,
    ErrorReply,
    Frame,
    MemRef,
    MsgType,
    ParamGroup,
    Ping,
    Register,
    RegisterOk,
    StateChunk,
    StateWriteMany,
    StatsReply,
    Step,
    StepDone,
    TensorSlot,
    TensorSpec,
    check_message,
    decode_frame,
    decode_message,
    encode_message,
    frame_nbytes,
    peek_request_id,
)
from tiermem.core.protocol.step import WriteSpan


def header(hexstr: str) -> bytes:
    data = bytes.fromhex(hexstr)
    assert len(data) == HEADER_NBYTES
    return data


# Golden frames: the exact bytes of protocol version 11.  A change here is a wire change: bump the version.
GOLDEN = [
    (Ping(), 1, 0, header("544d 0b 0a 0000 0000 01000000 00000000"), b""),
    (
        Attach(job_id="job-7", rank=1, world_size=2, window_nbytes=1 << 30),
        2,
        0,
        header("544d 0b 01 0000 0000 02000000 61000000"),
        b'{"job_id":"job-7","rank":1,"world_size":2,"window_nbytes":1073741824,"token":null,"create":false}',
    ),
    (
        Step(
            step=12,
            groups=(ParamGroup(lr=0.001, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),),
            loss_scale=1024.0,
            max_grad_norm=1.0,
            tensor_ids=(0, 1),
            grad_buffer=1,
        ),
        3,
        0,
        header("544d 0b 03 0000 0000 03000000 fa000000"),
        b'{"step":12,"attempt":0,"groups":[{"lr":0.001,"betas":[0.9,0.999],"eps":1e-08,"weight_decay":0.01,'
        b'"adamw":true,"maximize":false}],"loss_scale":1024.0,"max_grad_norm":1.0,"clip_coef":null,"skip":false,'
        b'"tensor_ids":[0,1],'
        b'"delayed":false,"grad_buffer":1}',
    ),
    (
        BucketReady(step=12, attempt=3, bucket=0, tensor_ids=(3, 4), groups=(ParamGroup(lr=0.5),)),
        4,
        FLAG_ONEWAY,
        header("544d 0b 04 0100 0000 04000000 ac000000"),
        b'{"step":12,"attempt":3,"bucket":0,"tensor_ids":[3,4],"grad_buffer":0,"groups":[{"lr":0.5,'
        b'"betas":[0.9,0.999],"eps":1e-08,"weight_decay":0.0,"adamw":true,"maximize":false}]}',
    ),
    (
        RegisterOk(slots=(TensorSlot(0, MemRef(1, 0, 128), (MemRef(1, 4096, 128),)),), storage_nbytes=8192),
        5,
        0,
        header("544d 0b 82 0000 0000 05000000 94000000"),
        b'{"slots":[[0,[1,0,128],[[1,4096,128]]]],"placement":"cpu","state_keys":["master","exp_avg","exp_avg_sq"],'
        b'"storage_nbytes":8192,"state_dtype":"fp32"}',
    ),
    (
        # a bf16 grad staged as it is: 1024 elements in 2048 bytes of the window, from element 1024 of the state
        StateWriteMany(spans=(WriteSpan(3, "grad", 4096, MemRef(1, 0, 2048), 0, True, "bfloat16"),)),
        7,
        0,
        header("544d 0b 0e 0000 0000 07000000 38000000"),
        b'{"spans":[[3,"grad",4096,[1,0,2048],0,true,"bfloat16"]]}',
    ),
    (
        ErrorReply.from_exception(BoundsError("reference [0, 8) of window 1 falls outside its 4 bytes")),
        6,
        0,
        header("544d 0b ff 0000 0000 06000000 65000000"),
        b'{"type":"BoundsError","message":"reference [0, 8) of window 1 falls outside its 4 bytes","fields":{}}',
    ),
]


@pytest.mark.parametrize(("msg", "request_id", "flags", "head", "payload"), GOLDEN, ids=lambda v: None)
def test_golden_frame_encodes_to_exact_bytes(msg, request_id, flags, head, payload):
    assert encode_message(msg, request_id, flags) == head + payload


@pytest.mark.parametrize(("msg", "request_id", "flags", "head", "payload"), GOLDEN, ids=lambda v: None)
def test_golden_frame_decodes_to_message(msg, request_id, flags, head, payload):
    frame = decode_frame(head + payload)
    assert (frame.type, frame.request_id, frame.flags) == (msg.TYPE, request_id, flags)
    assert decode_message(frame) == msg


def test_every_message_type_has_a_class_and_requests_have_reply_types():
    assert set(MESSAGE_CLASSES) == set(MsgType)
    for msg_type in MsgType:
        assert MESSAGE_CLASSES[msg_type].TYPE is msg_type
        assert (msg_type in REPLY_TYPES) == msg_type.is_request
    for request, reply in REPLY_TYPES.items():
        assert reply is None or reply == request | 0x80 or reply is MsgType.OK


# --------------------------------------------------------------------------- header errors

PING = encode_message(Ping(), 9)
STEP = encode_message(Step(step=1), 9)


def decode_error(buf: bytes, max_frame: int = 1 << 20) -> str:
    with pytest.raises(ProtocolError) as info:
        decode_message(decode_frame(buf, max_frame=max_frame))
    return str(info.value)


def test_bad_magic_is_named():
    assert decode_error(b"XX" + PING[2:]) == "bad magic b'XX': expected b'TM'; the peer does not speak tiermem"


def test_unsupported_version_lists_supported_versions():
    assert "unsupported protocol version 9; this side supports version(s) 11" in decode_error(
        PING[:2] + b"\x09" + PING[3:]
    )


def test_truncated_frame_says_expected_and_got():
    assert decode_error(STEP[:30]) == f"truncated frame: expected {len(STEP)} bytes, got 30"
    assert decode_error(STEP[:5]) == "truncated frame: expected at least 16 header bytes, got 5"


def test_trailing_bytes_are_refused():
    assert "1 trailing bytes" in decode_error(STEP + b" ")


def test_oversize_frame_is_refused_from_header_and_from_length():
    assert decode_error(STEP, max_frame=64) == f"oversize frame: {len(STEP)} bytes, max_frame is 64"
    assert "header announces" in decode_error(STEP[:40], max_frame=64)
    with pytest.raises(ProtocolError, match="exceeds max_frame 64"):
        encode_message(Step(step=1), 1, max_frame=64)


def test_unknown_type_flags_and_reserved_bits_are_refused():
    assert "unknown message type 0x55" in decode_error(PING[:3] + b"\x55" + PING[4:])
    assert "unknown flag bits 0x0100" in decode_error(PING[:4] + b"\x00\x01" + PING[6:])
    assert "reserved header field" in decode_error(PING[:6] + b"\x01\x00" + PING[8:])


def test_frame_nbytes_reads_length_from_header_for_stream_use():
    assert frame_nbytes(STEP[:HEADER_NBYTES]) == len(STEP)
    with pytest.raises(ProtocolError, match="oversize"):
        frame_nbytes(STEP[:HEADER_NBYTES], max_frame=32)


def test_peek_request_id_survives_an_undecodable_frame():
    broken = STEP[:2] + b"\x09" + STEP[3:]
    assert peek_request_id(broken) == 9
    assert peek_request_id(b"junk") is None
    assert peek_request_id(b"XX" + broken[2:]) is None


# --------------------------------------------------------------------------- payload and field errors


def frame_with(msg_type: MsgType, payload: object) -> Frame:
    return Frame(msg_type, 1, json.dumps(payload).encode())


def field_error(msg_type: MsgType, payload: object) -> str:
    with pytest.raises(ProtocolError) as info:
        decode_message(frame_with(msg_type, payload))
    return str(info.value)


def step_payload(**changes):
    payload = Step(step=3, groups=(ParamGroup(lr=1e-3),)).to_payload()
    payload.update(changes)
    return payload


def test_malformed_payloads_are_protocol_errors():
    assert "not UTF-8" in decode_error(encode_message(Ping(), 1)[:12] + b"\x02\x00\x00\x00\xff\xfe")
    with pytest.raises(ProtocolError, match="expected a JSON object, got list"):
        decode_message(Frame(MsgType.STEP, 1, b"[1]"))
    with pytest.raises(ProtocolError, match="nested too deeply"):
        decode_message(Frame(MsgType.STEP, 1, b"[" * 100_000))
    with pytest.raises(ProtocolError, match="malformed STEP payload"):
        decode_message(Frame(MsgType.STEP, 1, b'{"step": 1'))
    with pytest.raises(ProtocolError, match="malformed STEP payload"):
        decode_message(Frame(MsgType.STEP, 1, b'{"step": ' + b"9" * 5000 + b"}"))


def test_field_errors_name_message_field_expected_and_got():
    assert field_error(MsgType.STEP, step_payload(step=-1)) == (
        "malformed STEP: field step: expected an integer in [0, 4611686018427387903], got int -1"
    )
    assert field_error(MsgType.STEP, step_payload(step=True)).endswith("got bool True")
    assert "field groups[0].betas[1]: expected a number in [0.0, 1.0), got float 1.5" in field_error(
        MsgType.STEP, step_payload(groups=[dict(step_payload()["groups"][0], betas=[0.9, 1.5])])
    )
    assert "field loss_scale: expected a finite number" in field_error(MsgType.STEP, step_payload(loss_scale=math.inf))
    assert "field loss_scale: expected a positive number" in field_error(MsgType.STEP, step_payload(loss_scale=0))
    missing = step_payload()
    del missing["delayed"]
    assert "field delayed: expected a value, got nothing (missing)" in field_error(MsgType.STEP, missing)
    assert "field bogus: expected one of the fields" in field_error(MsgType.STEP, step_payload(bogus=1))


def register_payload(**tensor_changes):
    tensor = TensorSpec("w", (4, 4), "float16").to_payload()
    tensor.update(tensor_changes)
    return {
        "tensors": [tensor],
        "groups": [ParamGroup(lr=0.1).to_payload()],
        "grad_buffers": 1,
        "exchange": "shared",
        "grads_in_state": False,
        "state_dtype": "fp32",
    }


def test_register_refuses_an_unknown_state_dtype_by_name():
    payload = dict(register_payload(), state_dtype="int4")
    assert "field state_dtype: expected one of fp32, bf16, int8" in field_error(MsgType.REGISTER, payload)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"dtype": "float64"}, "field tensors[0].dtype: expected one of float32, float16, bfloat16"),
        ({"placement": "gpu"}, "field tensors[0].placement: expected one of cpu, nvme, auto"),
        ({"shape": [4, -1]}, "field tensors[0].shape[1]: expected an integer in [0, "),
        ({"shape": list(range(17))}, "field tensors[0].shape: expected a list of at most 16 items"),
        ({"name": "x" * 257}, "field tensors[0].name: expected a string of at most 256 characters"),
        ({"name": ""}, "field tensors[0].name: expected a non-empty string"),
        ({"group": 1}, "field tensors[0].group: expected a group index < 1"),
    ],
)
def test_register_fields_are_checked(change, expected):
    assert expected in field_error(MsgType.REGISTER, register_payload(**change))


def test_register_refuses_duplicate_names_and_no_groups():
    payload = register_payload()
    payload["tensors"].append(payload["tensors"][0])
    assert "tensors[1].name: expected a name not used before" in field_error(MsgType.REGISTER, payload)
    assert "field groups: expected a list of 1 to 4096 items" in field_error(
        MsgType.REGISTER, dict(payload, tensors=[], groups=[])
    )


def test_attach_checks_rank_against_world_size_and_job_id_charset():
    good = Attach(job_id="j", rank=0, world_size=1, window_nbytes=4096).to_payload()
    assert "field rank: expected an integer in [0, world_size=2)" in field_error(
        MsgType.ATTACH, dict(good, rank=2, world_size=2)
    )
    assert "field job_id: expected a string matching" in field_error(MsgType.ATTACH, dict(good, job_id="../etc"))
    assert "field window_nbytes" in field_error(MsgType.ATTACH, dict(good, window_nbytes=-1))


def test_memref_fields_and_slot_shapes_are_checked():
    read = {"tensor_id": 0, "key": "exp_avg", "offset": 0, "dest": [1, -5, 3]}
    assert "field dest[1]: expected an integer in [0, " in field_error(MsgType.STATE_READ, read)
    assert "field dest: expected a [window, offset, length] list" in field_error(
        MsgType.STATE_READ, dict(read, dest=[1, 2])
    )
    ok = RegisterOk(slots=()).to_payload()
    bad_slots = dict(ok, slots=[[0, [1, 0, 8], [[1, 8, "x"]]]])
    assert "field slots[0][2][0][2]" in field_error(MsgType.REGISTER_OK, bad_slots)
    assert "field state_keys[0]: expected one of" in field_error(MsgType.REGISTER_OK, dict(ok, state_keys=["momentum"]))


def test_bucket_ready_needs_tensors_and_the_groups_to_update_with():
    good = BucketReady(step=1, attempt=1, bucket=0, tensor_ids=(0,), groups=(ParamGroup(lr=0.1),)).to_payload()
    assert "field tensor_ids: expected a list of 1 to 1048576 items" in field_error(
        MsgType.BUCKET_READY, dict(good, tensor_ids=[])
    )
    assert "field groups: expected a list of 1 to 4096 items" in field_error(
        MsgType.BUCKET_READY, dict(good, groups=[])
    )


def test_state_chunk_range_is_within_total():
    good = StateChunk(tensor_id=0, key="exp_avg", offset=0, nbytes=8, total_nbytes=16, step=3).to_payload()
    assert "field nbytes: expected an integer in [0, 8]" in field_error(
        MsgType.STATE_CHUNK, dict(good, offset=8, nbytes=9)
    )
    assert "field key: expected one of master, exp_avg, exp_avg_sq" in field_error(
        MsgType.STATE_CHUNK, dict(good, key="momentum")
    )


def test_step_done_allows_an_infinite_grad_norm_but_not_bad_timings():
    done = StepDone(step=4, attempt=1, nonfinite=True, grad_norm=math.inf, timings=(("update", 0.5),))
    assert decode_message(decode_frame(encode_message(done, 1))) == done
    nan = StepDone(step=4, attempt=1, nonfinite=True, grad_norm=math.nan)
    nan_norm = decode_message(decode_frame(encode_message(nan, 1)))
    assert isinstance(nan_norm, StepDone) and math.isnan(nan_norm.grad_norm or 0.0)
    payload = dict(done.to_payload(), timings={"update": -1})
    assert "field timings.update: expected a number >= 0.0" in field_error(MsgType.STEP_DONE, payload)
    huge = dict(done.to_payload(), timings={"update": 10**400})
    assert "field timings.update: expected a number, got int" in field_error(MsgType.STEP_DONE, huge)


def test_stats_reply_is_typed_and_round_trips():
    reply = sample_reply(jobs=3)
    assert decode_message(decode_frame(encode_message(reply, 1))) == reply
    payload = reply.to_payload()
    assert set(payload) == {"node", "jobs", "rank"} and payload["node"]["pool"]["capacity_nbytes"] == 1 << 30
    bad = json.loads(json.dumps(payload))
    bad["node"]["pool"]["used_nbytes"] = "1"
    assert "field node.pool.used_nbytes: expected an integer" in field_error(MsgType.STATS_REPLY, bad)
    renamed = json.loads(json.dumps(payload))
    renamed["node"]["pool"]["pool_used_bytes"] = renamed["node"]["pool"].pop("used_nbytes")
    assert "pool_used_bytes" in field_error(MsgType.STATS_REPLY, renamed)


def test_check_message_lets_a_sender_fail_early():
    check_message(Step(step=1))
    with pytest.raises(ProtocolError, match=r"field groups\[0\]\.lr: expected a number >= 0.0, got float -1.0"):
        check_message(Step(step=1, groups=(ParamGroup(lr=-1.0),)))


def test_unencodable_value_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="cannot encode STATS_REPLY"):
        encode_message(StatsReply(node=sample_node(version=object())), 1)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- errors across the wire


@pytest.mark.parametrize(
    "error",
    [
        PoolExhausted(1 << 30, 1 << 20, 4096),
        SwapIOError("/swap/0", 8192, 4096, 5),
        UnknownKey("layer.0.weight", "job j"),
        BoundsError("out of window"),
        TiermemError("plain"),
    ],
)
def test_error_reply_reraises_the_same_type_with_its_facts(error):
    frame = decode_frame(encode_message(ErrorReply.from_exception(error), 3))
    reply = decode_message(frame)
    assert isinstance(reply, ErrorReply)
    rebuilt = reply.to_exception()
    assert type(rebuilt) is type(error)
    assert str(rebuilt) == str(error)
    for name in error.fields:
        assert getattr(rebuilt, name) == getattr(error, name)


def test_error_reply_of_unknown_type_becomes_base_error_naming_it():
    reply = decode_message(frame_with(MsgType.ERROR, {"type": "FutureError", "message": "m", "fields": {}}))
    assert isinstance(reply, ErrorReply)
    rebuilt = reply.to_exception()
    assert type(rebuilt) is TiermemError
    assert str(rebuilt) == "FutureError: m"


def test_error_reply_facts_must_be_scalars():
    payload = {"type": "UnknownKey", "message": "m", "fields": {"key": {"nested": 1}}}
    assert "field fields.key: expected a scalar" in field_error(MsgType.ERROR, payload)


# --------------------------------------------------------------------------- memory references


def test_memref_check_bounds():
    MemRef(1, 0, 4096).check_bounds(4096)
    MemRef(1, 4096, 0).check_bounds(4096)
    with pytest.raises(BoundsError, match=r"\[4000, 4097\) of window 1 falls outside its 4096 bytes"):
        MemRef(1, 4000, 97).check_bounds(4096)
    with pytest.raises(BoundsError, match="window 2, but this job's window is 1"):
        MemRef(2, 0, 1).check_bounds(4096, window=1)
    with pytest.raises(BoundsError):
        MemRef(1, -1, 1).check_bounds(4096)


def test_attach_ok_alignment_must_be_power_of_two():
    good = AttachOk(job_token="t", window_id=1, window_nbytes=8192, alignment=4096, max_frame=1 << 20).to_payload()
    assert "field alignment: expected a power of two" in field_error(MsgType.ATTACH_OK, dict(good, alignment=3000))


def test_flags_round_trip():
    frame = decode_frame(encode_message(AttachOk("t", 1, 4096, 4096, 1 << 20), 5, FLAG_FDS))
    assert frame.flags == FLAG_FDS


def test_register_round_trip_with_many_tensors():
    msg = Register(
        tensors=tuple(
            TensorSpec(f"layers.{i}.weight", (1024, 1024), "bfloat16", Placement.NVME, i % 2) for i in range(500)
        ),
        groups=(ParamGroup(lr=1e-3), ParamGroup(lr=1e-4, weight_decay=0.0, adamw=False)),
    )
    assert decode_message(decode_frame(encode_message(msg, 1))) == msg


def test_attach_create_needs_an_agreed_token_of_full_length():
    ok = Attach(job_id="j", rank=0, world_size=2, window_nbytes=0, token="a" * 32, create=True)
    assert decode_message(decode_frame(encode_message(ok, 1))) == ok
    for token in (None, "a" * 31):
        bad = Attach(job_id="j", rank=0, world_size=2, window_nbytes=0, token=token, create=True)
        with pytest.raises(ProtocolError, match="token"):
            decode_message(decode_frame(encode_message(bad, 1)))

"""Messages in parts (``tiermem.core.protocol.parts``): the split, the join, and what the joiner drops."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.core.errors import ProtocolError
from tiermem.core.protocol import (
    FLAG_FDS,
    FLAG_MORE,
    FLAG_ONEWAY,
    HEADER_NBYTES,
    Budget,
    Dropped,
    Frame,
    Joiner,
    MsgType,
    ParamGroup,
    Ping,
    Register,
    TensorSpec,
    decode_frame,
    decode_message,
    encode_message,
    encode_parts,
    split_frames,
)


def frames_of(data: list[bytes]) -> list[Frame]:
    return [decode_frame(raw, max_frame=1 << 20) for raw in data]


def join(joiner: Joiner, data: list[bytes]) -> list[Frame | Dropped]:
    return [got for frame in frames_of(data) for got in joiner.add(frame)]


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(0, 5000), part=st.integers(HEADER_NBYTES + 1, 700), fds=st.booleans())
def test_a_split_payload_joins_back_whole_with_its_flags(nbytes, part, fds):
    payload = bytes(i % 251 for i in range(nbytes))
    flags = FLAG_FDS if fds else 0
    data = split_frames(MsgType.REGISTER, 9, payload, flags, part_nbytes=part)
    room = part - HEADER_NBYTES
    assert len(data) == max(1, -(-nbytes // room))
    assert all(len(raw) <= part for raw in data)
    frames = frames_of(data)
    assert [f.flags & FLAG_MORE for f in frames] == [FLAG_MORE] * (len(data) - 1) + [0]
    assert [f.flags & FLAG_FDS for f in frames] == [0] * (len(data) - 1) + [flags]
    assert {(f.type, f.request_id) for f in frames} == {(MsgType.REGISTER, 9)}
    got = join(Joiner(), data)
    assert got == [Frame(MsgType.REGISTER, 9, payload, flags)]


def test_a_message_that_fits_is_one_frame_handed_on_as_it_came():
    data = encode_parts(Ping(), 3, part_nbytes=4096)
    assert data == [encode_message(Ping(), 3)]
    frame = frames_of(data)[0]
    assert Joiner().add(frame) == [frame]


def test_a_register_of_thousands_of_tensors_crosses_in_parts_and_decodes_equal():
    msg = Register(
        tensors=tuple(
            TensorSpec(f"model.layers.{i // 128}.mlp.experts.{i % 128}.up_proj.weight", (768, 2048), "bfloat16")
            for i in range(3000)
        ),
        groups=(ParamGroup(lr=1e-4),),
    )
    data = encode_parts(msg, 5, part_nbytes=4096)
    assert len(data) > 50
    (whole,) = join(Joiner(), data)
    assert isinstance(whole, Frame)
    assert decode_message(whole) == msg


def parts(msg_type: MsgType, request_id: int, nbytes: int, flags: int = 0) -> list[bytes]:
    return split_frames(msg_type, request_id, b"x" * nbytes, flags, part_nbytes=HEADER_NBYTES + 100)


def test_a_frame_of_another_request_ends_an_incomplete_message_and_is_taken_as_the_next():
    joiner = Joiner()
    head = parts(MsgType.REGISTER, 5, 250)[:2]  # the last part never comes (a client interrupted)
    ping = encode_message(Ping(), 6)
    got = join(joiner, [*head, ping])
    assert len(got) == 2
    dropped, frame = got
    assert isinstance(dropped, Dropped)
    assert (dropped.request_id, dropped.type, dropped.oneway) == (5, MsgType.REGISTER, False)
    assert str(dropped.error) == (
        "REGISTER request 5 was dropped: it ended after 2 part(s) (200 bytes): PING request 6 came before its last part"
    )
    assert frame == frames_of([ping])[0]
    assert not joiner.joining


def test_another_type_under_the_same_request_id_ends_it_too():
    got = join(Joiner(), [*parts(MsgType.REGISTER, 5, 250)[:1], *parts(MsgType.STEP, 5, 50)])
    assert [type(g) for g in got] == [Dropped, Frame]
    assert got[1].type is MsgType.STEP


def test_a_message_past_max_message_is_refused_once_its_other_parts_dropped_and_the_next_one_taken():
    joiner = Joiner(max_message=250)
    got = join(joiner, parts(MsgType.REGISTER, 5, 700))
    assert len(got) == 1
    (dropped,) = got
    assert isinstance(dropped, Dropped) and dropped.request_id == 5
    assert "longer than max_message 250 bytes" in str(dropped.error)
    assert "server.max_message" in str(dropped.error)
    after = join(joiner, parts(MsgType.STEP, 6, 230))
    assert [(f.type, f.request_id, len(f.payload)) for f in after] == [(MsgType.STEP, 6, 230)]


def test_a_message_past_max_message_in_its_last_part_drops_nothing_after_it():
    joiner = Joiner(max_message=250)
    got = join(joiner, [*parts(MsgType.REGISTER, 5, 300), *parts(MsgType.REGISTER, 5, 50)])
    assert [type(g) for g in got] == [Dropped, Frame]  # the same request id again is a new message


def test_a_dropped_one_way_message_says_so():
    got = join(Joiner(), [*parts(MsgType.BUCKET_READY, 5, 250, FLAG_ONEWAY)[:1], encode_message(Ping(), 6)])
    assert isinstance(got[0], Dropped) and got[0].oneway


def test_fds_before_the_last_part_are_refused():
    data = split_frames(MsgType.REGISTER_OK, 5, b"x" * 250, FLAG_FDS, part_nbytes=HEADER_NBYTES + 100)
    first = frames_of(data)[0]
    bad = Frame(first.type, first.request_id, first.payload, first.flags | FLAG_FDS)
    (dropped,) = Joiner().add(bad)
    assert isinstance(dropped, Dropped)
    assert "FLAG_FDS goes with the last part only" in str(dropped.error)


def test_a_part_size_with_no_room_after_the_header_is_refused():
    with pytest.raises(ProtocolError, match="leaves no room for a payload"):
        split_frames(MsgType.PING, 1, b"{}", part_nbytes=HEADER_NBYTES)


def test_one_users_connections_share_one_budget_of_incomplete_bytes_and_get_it_back():
    budget = Budget(250, "uid 1000")
    first, second, third = Joiner(1000, budget), Joiner(1000, budget), Joiner(1000, budget)
    held = parts(MsgType.REGISTER, 1, 400)  # 4 parts of 100 bytes: 300 held before the last
    assert join(first, held[:2]) == []
    assert budget.held == 200
    (dropped,) = join(second, parts(MsgType.REGISTER, 1, 400)[:2])
    assert isinstance(dropped, Dropped)
    assert str(dropped.error).endswith(
        "the incomplete messages of uid 1000 on all its connections would hold more than 250 bytes (250B, "
        "server.max_message) at once; send them one at a time"
    )
    assert budget.held == 200  # the refused part took nothing
    assert [type(g) for g in join(first, held[2:])] == [Dropped]  # its own third part is past the budget too
    assert budget.held == 0
    assert [len(f.payload) for f in join(first, parts(MsgType.REGISTER, 2, 250))] == [250]
    assert budget.held == 0
    assert join(third, parts(MsgType.REGISTER, 3, 400)[:2]) == []
    third.clear()  # its connection ended mid-message
    assert budget.held == 0
    assert [len(f.payload) for f in join(second, parts(MsgType.REGISTER, 4, 300))] == [300]

"""tiermemd against hostile and broken input on its socket, and its per-connection limits.

Frames are written byte by byte over raw SEQPACKET sockets (``RawConn``).  The
rule under test (docs/protocol.md): every bad request gets an ERROR reply or its
connection closed; a connection with a readable header stays usable; the
daemon itself never stops serving others.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import time

import numpy as np
import pytest
import torch
from conftest import MAX_CONNECTIONS_PER_UID, MAX_FRAME, DaemonProcess, RawConn, error_of
from daemon_client import Trainer, adamw_reference, grads_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiermem.core import protocol
from tiermem.core.errors import BoundsError, InvalidArgument, UnknownKey
from tiermem.core.protocol import MsgType, encode_message
from tiermem.core.protocol.frame import FLAG_ONEWAY, PROTOCOL_VERSION

HEADER = struct.Struct("<2sBBHHII")
SENTINEL = 0xFFFFFFFF
BUCKET = protocol.BucketReady(step=1, attempt=1, bucket=0, tensor_ids=(0,), groups=(protocol.ParamGroup(lr=0.1),))
"""A BUCKET_READY, sent one-way (``FLAG_ONEWAY``) below."""


def frame(
    msg_type: int,
    request_id: int,
    payload: bytes = b"",
    *,
    flags: int = 0,
    version: int = PROTOCOL_VERSION,
    magic: bytes = b"TM",
    reserved: int = 0,
    announced: int | None = None,
) -> bytes:
    size = len(payload) if announced is None else announced
    return HEADER.pack(magic, version, msg_type, flags, reserved, request_id, size) + payload


def assert_pong(reply, request_id: int) -> None:
    assert reply is not None, "the daemon closed a connection it should have kept"
    assert (reply.type, reply.request_id) == (MsgType.PONG, request_id)


# --------------------------------------------------------------------------- one malformed frame at a time

READABLE_BUT_BAD = {
    "truncated payload": frame(MsgType.STEP, 7, b'{"step":', announced=100),
    "trailing bytes": frame(MsgType.PING, 7, b"{}", announced=1),
    "unknown type": frame(0x55, 7),
    "a reply type": frame(MsgType.PONG, 7),
    "unknown flag bits": frame(MsgType.PING, 7, flags=0x8000),
    "reserved field set": frame(MsgType.PING, 7, reserved=1),
    "payload not JSON": frame(MsgType.STEP, 7, b"\xff\xfe{"),
    "payload not an object": frame(MsgType.STEP, 7, b"[1,2]"),
    "unknown field": frame(MsgType.STATS, 7, b'{"verbose":true}'),
    "field out of range": frame(MsgType.STEP, 7, b'{"step":-1}'),
    "announces more than max_frame": frame(MsgType.PING, 7, announced=MAX_FRAME),
    "deeply nested JSON": frame(MsgType.STEP, 7, b"[" * 5000 + b"]" * 5000),
    "huge unknown key": frame(MsgType.STATS, 7, json.dumps({"k" * 40000: 1}).encode()),
}


@pytest.mark.parametrize("case", sorted(READABLE_BUT_BAD))
def test_a_bad_frame_with_a_readable_header_gets_an_error_and_the_connection_goes_on(daemon, case):
    with RawConn(daemon.socket_path) as conn:
        request_id, kind, message = error_of(conn.request(READABLE_BUT_BAD[case]))
        assert request_id == 7
        assert kind == "ProtocolError", message
        assert_pong(conn.request(frame(MsgType.PING, 8)), 8)


UNREADABLE = {
    "shorter than a header": (b"TM\x02\x0a\x00", 0),
    "bad magic": (frame(MsgType.PING, 9, magic=b"XX"), 0),
    "newer version": (frame(MsgType.PING, 9, version=PROTOCOL_VERSION + 1), 9),
    "version zero": (frame(MsgType.PING, 9, version=0), 9),
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_a_frame_whose_header_is_unreadable_gets_an_error_then_the_connection_closes(daemon, case):
    data, expected_id = UNREADABLE[case]
    with RawConn(daemon.socket_path) as conn:
        request_id, kind, message = error_of(conn.request(data))
        assert (request_id, kind) == (expected_id, "ProtocolError")
        if "version" in case:
            assert f"this side supports version(s) {PROTOCOL_VERSION}" in message
        assert conn.recv() is None


def test_an_oversize_packet_is_discarded_whole_with_an_error_and_max_frame_is_exact(daemon):
    ping_of = lambda nbytes, rid: frame(MsgType.PING, rid, b"{" + b" " * (nbytes - 18) + b"}")  # noqa: E731
    with RawConn(daemon.socket_path) as conn:
        assert_pong(conn.request(ping_of(MAX_FRAME, 1)), 1)
        request_id, kind, message = error_of(conn.request(ping_of(MAX_FRAME + 1, 2)))
        assert (request_id, kind) == (0, "ProtocolError")
        assert "oversize" in message
        assert_pong(conn.request(ping_of(100, 3)), 3)


def test_attach_reports_the_daemons_max_frame(daemon):
    with daemon.connection() as conn:
        reply, fds = conn.request_fds(protocol.Attach(job_id="frame-limit", rank=0, world_size=1, window_nbytes=4096))
        for fd in fds:
            os.close(fd)
        assert isinstance(reply, protocol.AttachOk)
        assert reply.max_frame == MAX_FRAME
        conn.request(protocol.Detach(keep_state=False))


def daemon_fd_count(daemon: DaemonProcess) -> int:
    return len(os.listdir(f"/proc/{daemon.pid}/fd"))


def test_fds_sent_by_a_client_are_closed_and_refused(daemon):
    before = daemon_fd_count(daemon)
    with RawConn(daemon.socket_path) as conn:
        for round_ in range(20):
            r, w = os.pipe()
            extra = os.open("/dev/null", os.O_RDONLY)
            sent = conn.send(frame(MsgType.PING, 100 + round_), fds=[w, extra])
            os.close(w)
            os.close(extra)
            assert sent
            request_id, kind, message = error_of(conn.recv())
            assert (request_id, kind) == (0, "ProtocolError")
            assert "file descriptor" in message
            # the write end's only other copy was the daemon's: end-of-file proves it was closed
            ready, _, _ = select.select([r], [], [], 10.0)
            assert ready and os.read(r, 1) == b""
            os.close(r)
        assert_pong(conn.request(frame(MsgType.PING, 200)), 200)
    assert daemon_fd_count(daemon) <= before + 2


def test_an_error_from_a_one_way_message_fails_the_next_request_instead(daemon):
    with RawConn(daemon.socket_path, timeout_s=0.5) as conn:
        assert conn.send(encode_message(BUCKET, 5, FLAG_ONEWAY))
        with pytest.raises(TimeoutError):
            conn.recv()  # no reply to a one-way message, not even an error
        conn.sock.settimeout(10.0)
        request_id, kind, _ = error_of(conn.request(frame(MsgType.PING, 6)))
        assert (request_id, kind) == (6, "InvalidState")
        assert_pong(conn.request(frame(MsgType.PING, 7)), 7)


# --------------------------------------------------------------------------- fuzzing

VALID_BASES = [
    encode_message(protocol.Ping(), 1),
    encode_message(protocol.Stats(), 2),
    encode_message(protocol.Step(step=3, max_grad_norm=1.0), 3),
    encode_message(protocol.FetchParams(step=0, tensor_ids=(1, 2)), 4),
    encode_message(protocol.StateRead(tensor_id=0, key="master", offset=0, dest=protocol.MemRef(1, 0, 64)), 5),
    encode_message(BUCKET, 6, FLAG_ONEWAY),
    encode_message(protocol.Attach(job_id="fuzz", rank=0, world_size=1, window_nbytes=1 << 55), 7),
]


FIELD_NAMES = sorted(
    {"step", "tensor_ids", "job_id", "rank", "world_size", "window_nbytes", "token", "key", "offset", "dest"}
    | {"src", "groups", "tensors", "keep_state", "bucket", "refs", "grad_buffer", "loss_scale", "x"}
)
JSON_VALUES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.lists(st.integers(-1, 2**57), max_size=4)
)
JSON_OBJECTS = st.dictionaries(
    st.sampled_from(FIELD_NAMES), JSON_VALUES | st.lists(JSON_VALUES, max_size=3), max_size=5
)
"""Payloads in the shape of real messages (known field names, values of any type), cheap to draw."""


@st.composite
def hostile_frames(draw: st.DrawFn) -> bytes:
    # most cases keep a readable header, so the connection (and the probe's speed) survives them
    kind = draw(st.sampled_from(["bytes", "header", "header", "header", "mutated", "mutated", "mutated"]))
    if kind == "bytes":
        return draw(st.sampled_from([b"", b"TM", b"TM\x02"])) + draw(st.binary(min_size=1, max_size=300))
    if kind == "header":
        payload = draw(st.binary(max_size=200) | JSON_OBJECTS.map(lambda v: json.dumps(v).encode()))
        return frame(
            draw(st.sampled_from([int(t) for t in MsgType]) | st.integers(0, 255)),
            draw(st.integers(0, 2**32 - 1)),
            payload,
            flags=draw(st.sampled_from([0, 1, 2, 3]) | st.integers(0, 0xFFFF)),
            version=draw(st.sampled_from([2] * 12 + [0, 1, 3, 255])),
            reserved=draw(st.sampled_from([0, 0, 0, 1])),
            announced=draw(st.none() | st.integers(0, 2**32 - 1)),
        )
    data = bytearray(draw(st.sampled_from(VALID_BASES)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)) | st.integers(3, max(3, len(data) - 1)))
        pos = min(pos, len(data))
        if op == "flip" and pos < len(data):
            data[pos] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[pos:]
        else:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data) or b"\x00"


class Prober:
    """A raw connection that is reopened whenever the daemon closes it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.conn = RawConn(path)
        self.reopened = 0
        self.probes = 0

    def probe(self, data: bytes) -> None:
        """Send ``data``, then a PING; read until the PING's answer (or end of stream: reopen)."""
        self.probes += 1
        if self.conn.send(data) and self.conn.send(frame(MsgType.PING, SENTINEL)):
            while (reply := self.conn.recv()) is not None:
                if reply.request_id == SENTINEL:
                    assert reply.type in (MsgType.PONG, MsgType.ERROR)
                    return
        self.conn.close()
        self.conn = RawConn(self.path)
        self.reopened += 1


@pytest.fixture
def well_behaved(daemon):
    trainer = Trainer(daemon.socket_path, "well-behaved", [64, 8], seed=5)
    trainer.start_fresh()
    trainer.step(1, grads_for(5, 1, [64, 8]))
    yield trainer
    trainer.detach()


def check_still_serving(daemon: DaemonProcess, trainer: Trainer, step: int) -> None:
    assert daemon.process.poll() is None, daemon.log_text()[-3000:]
    with daemon.connection() as conn:
        assert isinstance(conn.request(protocol.Ping()), protocol.Pong)
    assert isinstance(trainer.conn.request(protocol.Ping()), protocol.Pong)
    trainer.step(step, grads_for(trainer.seed, step, trainer.sizes))
    expected = adamw_reference(trainer.seed, trainer.sizes, step)
    torch.testing.assert_close(torch.from_numpy(trainer.params()), torch.from_numpy(expected))


@pytest.mark.parametrize("examples", [1000, pytest.param(20000, marks=pytest.mark.slow)])
def test_fuzzed_frames_never_stop_the_daemon_serving_others(daemon, well_behaved, examples):
    prober = Prober(daemon.socket_path)

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(hostile_frames())
    def fuzz(data: bytes) -> None:
        if protocol.peek_request_id(data) == SENTINEL:
            return
        prober.probe(data)

    try:
        fuzz()
    finally:
        prober.conn.close()
    print(f"{prober.probes} fuzzed frames; the daemon closed the connection after {prober.reopened} of them")
    check_still_serving(daemon, well_behaved, 2)


# --------------------------------------------------------------------------- memory references


@pytest.fixture
def registered(daemon):
    trainer = Trainer(daemon.socket_path, "bounds", [1000, 24], seed=6)
    trainer.start_fresh()
    yield trainer
    trainer.detach()


REF_ERRORS = (BoundsError, InvalidArgument, UnknownKey)


def test_state_read_and_write_accept_exactly_the_references_inside_the_window(daemon, registered):
    """Every (window, offset, length, tensor, state offset) is either in bounds and served, or refused."""
    trainer = registered
    window_nbytes = trainer.window.nbytes
    numels = trainer.sizes
    counts = {"served": 0, "refused": 0}

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(
        write=st.booleans(),
        window=st.sampled_from([trainer.window_id, trainer.window_id + 1, 0, 2**32 - 1]),
        offset=st.integers(0, window_nbytes + 64) | st.sampled_from([2**56 - 1, window_nbytes - 4]),
        length=st.integers(0, 4200) | st.sampled_from([window_nbytes, 2**56 - 1]),
        tensor_id=st.integers(0, 3),
        key=st.sampled_from(["master", "exp_avg", "exp_avg_sq"]),
        state_offset=st.integers(0, 4200),
    )
    def check(write, window, offset, length, tensor_id, key, state_offset):
        ref = protocol.MemRef(window, offset, length)
        valid = (
            window == trainer.window_id
            and offset + length <= window_nbytes
            and offset % 4 == 0
            and length % 4 == 0
            and tensor_id < len(numels)
            and state_offset % 4 == 0
            and state_offset + length <= numels[tensor_id] * 4
        )
        msg = (
            protocol.StateWrite(tensor_id=tensor_id, key=key, offset=state_offset, src=ref, step=0)
            if write
            else protocol.StateRead(tensor_id=tensor_id, key=key, offset=state_offset, dest=ref)
        )
        if valid:
            trainer.conn.request(msg)
            counts["served"] += 1
        else:
            with pytest.raises(REF_ERRORS):
                trainer.conn.request(msg)
            counts["refused"] += 1

    check()
    # in-bounds references are rare among random ones: serve a known set as well, whatever was drawn
    for tensor_id, numel in enumerate(numels):
        nbytes = min(numel * 4, 1024)
        for write in (False, True):
            check.hypothesis.inner_test(  # type: ignore[attr-defined]
                write, trainer.window_id, 0, nbytes, tensor_id, "exp_avg", 0
            )
    print(f"memory references: {counts}")
    assert counts["served"] >= 2 * len(numels) and counts["refused"] > 10
    trainer.conn.request(protocol.Ping())


def test_a_state_read_returns_what_a_state_write_stored(daemon, registered):
    trainer = registered
    ref = protocol.MemRef(trainer.window_id, 0, 4000)
    staging = trainer.window[:4000].view(np.float32)
    staging[:] = torch.arange(1000, dtype=torch.float32).numpy()
    trainer.conn.request(protocol.StateWrite(tensor_id=0, key="exp_avg_sq", offset=0, src=ref, step=3))
    staging[:] = 0
    chunk = trainer.conn.request(
        protocol.StateRead(tensor_id=0, key="exp_avg_sq", offset=400, dest=protocol.MemRef(trainer.window_id, 0, 40))
    )
    assert (chunk.offset, chunk.nbytes, chunk.total_nbytes, chunk.step) == (400, 40, 4000, 3)
    assert staging[:10].tolist() == list(range(100, 110))


# --------------------------------------------------------------------------- limits


def test_connections_per_uid_are_limited_and_freed_on_close(daemon):
    held: list[RawConn] = []
    refused = None
    try:
        for i in range(MAX_CONNECTIONS_PER_UID + 5):
            conn = RawConn(daemon.socket_path)
            reply = conn.request(frame(MsgType.PING, i + 1))
            if reply is not None and reply.type == MsgType.PONG:
                held.append(conn)
                continue
            refused = error_of(reply)
            assert conn.recv() is None
            conn.close()
            break
        assert refused is not None, f"{len(held)} connections were all accepted"
        assert refused[1] == "AdmissionError" and "max_connections_per_uid" in refused[2]
        assert 0 < len(held) <= MAX_CONNECTIONS_PER_UID
        held.pop().close()
        deadline = time.monotonic() + 5.0
        while True:
            with RawConn(daemon.socket_path) as conn:
                reply = conn.request(frame(MsgType.PING, 1))
                if reply is not None and reply.type == MsgType.PONG:
                    break
            assert time.monotonic() < deadline, "a closed connection's slot was never freed"
            time.sleep(0.05)
    finally:
        for conn in held:
            conn.close()


def test_a_raw_socket_of_the_wrong_type_cannot_connect(daemon):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(OSError):
        sock.connect(daemon.socket_path)
    sock.close()


# --------------------------------------------------------------------------- messages in parts


def ping_in_parts(request_id: int, nbytes: int, part: int = MAX_FRAME) -> list[bytes]:
    """A PING whose payload is ``nbytes`` of JSON whitespace around ``{}``, split as the protocol says."""
    payload = b"{" + b" " * (nbytes - 2) + b"}"
    return protocol.split_frames(MsgType.PING, request_id, payload, part_nbytes=part)


def test_a_message_in_parts_is_joined_and_one_left_incomplete_is_answered_before_the_next(daemon):
    with RawConn(daemon.socket_path) as conn:
        whole = ping_in_parts(1, 3 * MAX_FRAME)
        assert len(whole) == 4
        for part in whole:
            assert conn.send(part)
        assert_pong(conn.recv(), 1)

        for part in ping_in_parts(2, 3 * MAX_FRAME)[:2]:  # a client stopped between two parts
            assert conn.send(part)
        request_id, kind, message = error_of(conn.request(frame(MsgType.PING, 3)))
        assert (request_id, kind) == (2, "ProtocolError")
        assert "PING request 2 was dropped: it ended after 2 part(s)" in message
        assert "PING request 3 came before its last part" in message
        assert_pong(conn.recv(), 3)


def test_a_message_past_server_max_message_is_refused_once_and_the_connection_goes_on(daemon_factory):
    small = daemon_factory({"server": {"max_message": 2 * MAX_FRAME}})
    with RawConn(small.socket_path) as conn:
        for part in ping_in_parts(1, 5 * MAX_FRAME):
            assert conn.send(part)
        request_id, kind, message = error_of(conn.recv())
        assert (request_id, kind) == (1, "ProtocolError")
        assert f"longer than max_message {2 * MAX_FRAME} bytes" in message
        assert "server.max_message" in message
        assert_pong(conn.request(frame(MsgType.PING, 2)), 2)  # the rest of request 1 was dropped, unanswered


def test_one_users_incomplete_messages_together_are_held_to_server_max_message(daemon_factory):
    """256 connections of one user, each holding all but the last part of a message, must not make the
    daemon hold 256 x server.max_message: the user's connections share one budget.  Each connection is read
    by its own daemon thread, so which of the two messages meets the full budget depends on their timing:
    exactly one of them is refused, and both connections go on."""
    small = daemon_factory({"server": {"max_message": 2 * MAX_FRAME}})
    with RawConn(small.socket_path) as first, RawConn(small.socket_path) as second:
        held = ping_in_parts(1, 2 * MAX_FRAME)  # 3 parts: all but the last hold about 2 x 64 KiB
        other = ping_in_parts(7, 2 * MAX_FRAME)
        for part in held[:-1]:
            assert first.send(part)
        assert second.send(other[0])  # together: one part more than the budget holds
        ready, _, _ = select.select([first.sock, second.sock], [], [], 10.0)
        assert len(ready) == 1, "exactly one of the two messages is refused"
        refused, kept = (first, second) if ready == [first.sock] else (second, first)
        request_id, kind, message = error_of(refused.recv())
        assert (request_id, kind) == ((1, "ProtocolError") if refused is first else (7, "ProtocolError"))
        assert f"the incomplete messages of uid {os.getuid()} on all its connections would hold more" in message
        if kept is first:
            assert first.send(held[-1])
            assert_pong(first.recv(), 1)
        else:  # the first's refused message: its last part is dropped unanswered
            assert first.send(held[-1])
            for part in other[1:]:
                assert second.send(part)
            assert_pong(second.recv(), 7)
        for conn, rid in ((first, 8), (second, 9)):  # the budget is back once the kept message is whole
            for part in ping_in_parts(rid, 2 * MAX_FRAME):
                assert conn.send(part)
            assert_pong(conn.recv(), rid)


def many_tensors(n: int) -> protocol.Register:
    """A REGISTER of ``n`` small tensors named as a mixture of experts names them (about 110 bytes each)."""
    return protocol.Register(
        tensors=tuple(
            protocol.TensorSpec(
                f"model.layers.{i // 384}.mlp.experts.{i // 3 % 128}.proj{i % 3}.weight", (4,), "float32"
            )
            for i in range(n)
        ),
        groups=(protocol.ParamGroup(lr=0.1),),
    )


def test_a_client_interrupted_between_two_parts_reads_the_error_and_registers_again(daemon):
    register = many_tensors(1500)  # about 165 KB: 3 parts of the daemon's 64 KiB frames; its reply 2
    with daemon.connection() as conn:
        reply, fds = conn.request_fds(
            protocol.Attach(job_id="parts-interrupted", rank=0, world_size=1, window_nbytes=4096)
        )
        for fd in fds:
            os.close(fd)
        assert conn.part_nbytes == MAX_FRAME  # learnt from ATTACH_OK

        real_send, sent = conn._frames.send, []

        def interrupted(data: bytes, fds=()) -> None:
            if sent:
                raise KeyboardInterrupt  # Ctrl-C after the first part went out
            sent.append(data)
            real_send(data, fds)

        conn._frames.send = interrupted
        with pytest.raises(KeyboardInterrupt):
            conn.request_fds(register)
        interrupted_id = conn.last_request_id
        conn._frames.send = real_send

        assert isinstance(conn.request(protocol.Ping()), protocol.Pong)
        late = conn.take_late(interrupted_id)
        assert "REGISTER request" in str(late) and "was dropped: it ended after 1 part(s)" in str(late)

        reply, fds = conn.request_fds(register)
        for fd in fds:
            os.close(fd)
        assert isinstance(reply, protocol.RegisterOk)
        assert [slot.tensor_id for slot in reply.slots] == list(range(1500))
        conn.request(protocol.Detach(keep_state=False))

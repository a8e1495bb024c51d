"""Frames: the fixed header, the payload encoding, and the frame decoder.

Owns the byte layout of one frame.  Pure: no sockets, no I/O.

Frame layout (little-endian, 16-byte header, then ``payload_nbytes`` bytes)::

     0      2      3      4             6             8                 12                16
     +------+------+------+-------------+-------------+-----------------+-----------------+---------
     | "TM" | ver  | type | flags (u16) | zero (u16)  | request id (u32)| payload nbytes  | payload
     +------+------+------+-------------+-------------+-----------------+-----------------+---------

- magic: the two bytes ``b"TM"``; version: ``PROTOCOL_VERSION`` (a frame with
  another version is refused, naming the supported ones); type: a ``MsgType``;
  flags: ``FLAG_*`` bits, unknown bits are an error; the reserved u16 is zero.
- request id: chosen by the client, echoed in the reply; 0 is never used by a
  client (reserved for messages the daemon sends unprompted).
- payload: a UTF-8 JSON object (an empty payload means ``{}``), at most
  ``max_frame - 16`` bytes; a longer message goes in parts (``FLAG_MORE``,
  ``tiermem.core.protocol.parts``), each a frame of its own.

Why JSON: the payloads are control messages of tens to hundreds of bytes,
a handful per training step.  ``json`` is implemented in C; with the encoder
and the checking decoder that ``tiermem.core.protocol.spec`` generates from each
message's declaration, a STEP costs about 10 us to encode and 13 us to decode
with every field checked, 1 and 5 us more than ``json`` alone, on a 2-vCPU
node (``benchmarks/bench_codec.py``), PING/PONG/OK nothing beyond the header,
against a step that takes tens of milliseconds or more.  A hand-written TLV in pure Python pays interpreter time
per field and is a larger attack surface; fixed ``struct`` layouts would be
about 5x cheaper for STEP but give two encodings to document, test and keep in
step, for microseconds per training step.  ``json.loads`` of untrusted bytes builds only dicts, lists, strings
and numbers: no code runs, nothing is imported (unlike pickle or marshal, which
must never see hostile input); its failures (bad UTF-8, bad syntax, nesting too
deep, integers too long) are all turned into ``ProtocolError`` here, and the
frame size bounds the work.  Every field is then checked by the message
classes (``tiermem.core.protocol.messages``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from tiermem.core.errors import ProtocolError
from tiermem.core.units import MiB

__all__ = [
    "DEFAULT_MAX_FRAME",
    "FLAG_FDS",
    "FLAG_MORE",
    "FLAG_ONEWAY",
    "HEADER",
    "HEADER_NBYTES",
    "KNOWN_FLAGS",
    "MAGIC",
    "MAX_REQUEST_ID",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "Frame",
    "MsgType",
    "decode_frame",
    "decode_payload",
    "encode_frame",
    "encode_payload",
    "frame_nbytes",
    "peek_request_id",
]

MAGIC = b"TM"
PROTOCOL_VERSION = 11
SUPPORTED_VERSIONS: tuple[int, ...] = (11,)
HEADER = struct.Struct("<2sBBHHII")
HEADER_NBYTES = HEADER.size  # 16
DEFAULT_MAX_FRAME = 1 * MiB
MAX_REQUEST_ID = 0xFFFFFFFF

FLAG_ONEWAY = 0x0001
"""The sender wants no reply (``BUCKET_READY``); an error it causes fails the next request instead."""
FLAG_FDS = 0x0002
"""File descriptors travel with this frame as SCM_RIGHTS (daemon to client only: ``ATTACH_OK``)."""
FLAG_MORE = 0x0004
"""The message goes on in the next frame (same type and request id): ``tiermem.core.protocol.parts``."""
KNOWN_FLAGS = FLAG_ONEWAY | FLAG_FDS | FLAG_MORE


class MsgType(IntEnum):
    """Message types.  Requests (client to daemon) are < 0x80; a reply is its request's type | 0x80."""

    ATTACH = 0x01
    REGISTER = 0x02
    STEP = 0x03
    BUCKET_READY = 0x04
    FETCH_PARAMS = 0x05
    STATE_READ = 0x06
    STATE_WRITE = 0x07
    STATS = 0x08
    DETACH = 0x09
    PING = 0x0A
    ABORT = 0x0B
    STATE_RESET = 0x0C
    STATE_READ_MANY = 0x0D
    STATE_WRITE_MANY = 0x0E
    GRAD_NORM = 0x0F

    OK = 0x80
    ATTACH_OK = 0x81
    REGISTER_OK = 0x82
    STEP_DONE = 0x83
    PARAMS_READY = 0x85
    STATE_CHUNK = 0x86
    STATS_REPLY = 0x88
    PONG = 0x8A
    ABORTED = 0x8B
    STATE_SPANS = 0x8D
    GRAD_NORM_REPLY = 0x8F
    ERROR = 0xFF

    @property
    def is_request(self) -> bool:
        return self < 0x80


_TYPES = {int(t): t for t in MsgType}


@dataclass(slots=True)
class Frame:
    """One decoded frame: header fields and the still-encoded payload."""

    type: MsgType
    request_id: int
    payload: bytes
    flags: int = 0
    version: int = PROTOCOL_VERSION


def encode_frame(
    msg_type: MsgType, request_id: int, payload: bytes, flags: int = 0, *, max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """Header + payload; raises ``ProtocolError`` when the frame would exceed ``max_frame``."""
    total = HEADER_NBYTES + len(payload)
    if total > max_frame:
        raise ProtocolError(
            f"{MsgType(msg_type).name} frame of {total} bytes exceeds max_frame {max_frame}; split the request"
        )
    if flags & ~KNOWN_FLAGS or not 0 <= request_id <= MAX_REQUEST_ID:
        raise ProtocolError(f"cannot encode flags {flags:#x} / request id {request_id}")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, msg_type, flags, 0, request_id, len(payload)) + payload


def frame_nbytes(header: bytes, *, max_frame: int = DEFAULT_MAX_FRAME) -> int:
    """Total length of the frame starting with ``header`` (for reading frames off a byte stream)."""
    if len(header) < HEADER_NBYTES:
        raise ProtocolError(f"truncated frame: expected at least {HEADER_NBYTES} header bytes, got {len(header)}")
    _check_prefix(header[:4])
    payload_nbytes = HEADER.unpack_from(header)[6]
    total = HEADER_NBYTES + payload_nbytes
    if total > max_frame:
        raise ProtocolError(f"oversize frame: header announces {total} bytes, max_frame is {max_frame}")
    return int(total)


def _check_prefix(prefix: bytes) -> None:
    if prefix[:2] != MAGIC:
        raise ProtocolError(f"bad magic {bytes(prefix[:2])!r}: expected {MAGIC!r}; the peer does not speak tiermem")
    version = prefix[2]
    if version not in SUPPORTED_VERSIONS:
        supported = ", ".join(str(v) for v in SUPPORTED_VERSIONS)
        raise ProtocolError(f"unsupported protocol version {version}; this side supports version(s) {supported}")


def peek_request_id(buf: bytes | bytearray | memoryview) -> int | None:
    """The request id of a frame that may fail to decode (to address the error reply).

    None when not even the header is readable (too short or bad magic): such a
    peer does not speak this protocol.
    """
    if len(buf) < HEADER_NBYTES or bytes(buf[:2]) != MAGIC:
        return None
    return int(HEADER.unpack_from(buf)[5])


def decode_frame(buf: bytes | bytearray | memoryview, *, max_frame: int = DEFAULT_MAX_FRAME) -> Frame:
    """Parse and check one whole frame; every failure is a ``ProtocolError`` saying what is wrong."""
    got = len(buf)
    if got > max_frame:
        raise ProtocolError(f"oversize frame: {got} bytes, max_frame is {max_frame}")
    if got < HEADER_NBYTES:
        raise ProtocolError(f"truncated frame: expected at least {HEADER_NBYTES} header bytes, got {got}")
    magic, version, raw_type, flags, reserved, request_id, payload_nbytes = HEADER.unpack_from(buf)
    if magic != MAGIC or version not in SUPPORTED_VERSIONS:
        _check_prefix(bytes(buf[:3]))  # raises, naming which
    expected = HEADER_NBYTES + payload_nbytes
    if expected > max_frame:
        raise ProtocolError(f"oversize frame: header announces {expected} bytes, max_frame is {max_frame}")
    if got < expected:
        raise ProtocolError(f"truncated frame: expected {expected} bytes, got {got}")
    if got > expected:
        raise ProtocolError(f"frame has {got - expected} trailing bytes: header announces {expected}, got {got}")
    msg_type = _TYPES.get(raw_type)
    if msg_type is None:
        raise ProtocolError(f"unknown message type {raw_type:#04x} in protocol version {version}")
    if flags & ~KNOWN_FLAGS:
        raise ProtocolError(f"unknown flag bits {flags & ~KNOWN_FLAGS:#06x} on {msg_type.name}")
    if reserved:
        raise ProtocolError(f"reserved header field is {reserved:#06x} on {msg_type.name}, expected 0")
    return Frame(msg_type, request_id, bytes(buf[HEADER_NBYTES:]), flags, version)


_ENCODER = json.JSONEncoder(separators=(",", ":"))


def encode_payload(obj: dict[str, Any]) -> bytes:
    """Compact JSON; an empty object is sent as no bytes at all."""
    if not obj:
        return b""
    return _ENCODER.encode(obj).encode("ascii")


def decode_payload(payload: bytes, what: str = "payload") -> dict[str, Any]:
    """The JSON object in ``payload``; anything else is a ``ProtocolError``."""
    if not payload:
        return {}
    try:
        obj = json.loads(payload.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"malformed {what}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise ProtocolError(f"malformed {what}: JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and integers longer than the interpreter's digit limit
        raise ProtocolError(f"malformed {what}: {exc}") from None
    if type(obj) is not dict:
        raise ProtocolError(f"malformed {what}: expected a JSON object, got {type(obj).__name__}")
    return obj

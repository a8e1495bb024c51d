"""The tiermem wire protocol: frames, typed messages, and their codec.

Pure: imports no sockets (``tiermem.net.frames`` moves the bytes).  The frame
layout is in ``frame``; the messages in ``session`` and ``step``, the values
inside them and the limits in ``records``, the registry in ``messages``.  Each
message's fields are declared once (``spec``: ``@wire`` and the field kinds of
``kinds``), and its encoder and validating decoder are generated from that;
``fields`` has the ``FieldError`` they raise.  docs/protocol.md is the
reference for both sides.

    data = encode_message(Step(step=3), request_id=7)
    frame = decode_frame(data, max_frame=1 << 20)      # header checks
    msg = decode_message(frame)                         # payload + field checks

Every failure while decoding is a ``ProtocolError`` whose message says what was
expected and what was found; nothing else escapes, whatever the bytes.
"""

from __future__ import annotations

from tiermem.core.errors import ProtocolError
from tiermem.core.protocol import frame, parts, report, session, step
from tiermem.core.protocol.fields import FieldError
from tiermem.core.protocol.frame import *  # noqa: F403
from tiermem.core.protocol.frame import DEFAULT_MAX_FRAME, Frame, decode_payload, encode_frame, encode_payload
from tiermem.core.protocol.messages import MESSAGE_CLASSES, REPLY_TYPES
from tiermem.core.protocol.parts import *  # noqa: F403
from tiermem.core.protocol.records import (
    DTYPES,
    PLACEMENTS,
    STATE_KEYS,
    MemRef,
    Message,
    ParamGroup,
    TensorSlot,
    TensorSpec,
)
from tiermem.core.protocol.report import *  # noqa: F403
from tiermem.core.protocol.session import *  # noqa: F403
from tiermem.core.protocol.step import *  # noqa: F403

__all__ = [
    "DTYPES",
    "MESSAGE_CLASSES",
    "PLACEMENTS",
    "REPLY_TYPES",
    "STATE_KEYS",
    "MemRef",
    "Message",
    "ParamGroup",
    "TensorSlot",
    "TensorSpec",
    "check_message",
    "decode_message",
    "encode_message",
]
__all__ += ["encode_parts"]
__all__ += frame.__all__
__all__ += parts.__all__
__all__ += session.__all__
__all__ += step.__all__
__all__ += report.__all__


def encode_message(msg: Message, request_id: int, flags: int = 0, *, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """One frame holding ``msg``.  Raises ``ProtocolError`` when it would exceed ``max_frame``.

    The sender's values are not re-checked here (the receiver checks every
    field); ``check_message`` does it where a sender wants to fail early.
    """
    return encode_frame(msg.TYPE, request_id, _payload(msg), flags, max_frame=max_frame)


def encode_parts(msg: Message, request_id: int, flags: int = 0, *, part_nbytes: int) -> list[bytes]:
    """The frames holding ``msg``: one, or parts of at most ``part_nbytes`` each (``parts.split_frames``)."""
    return parts.split_frames(msg.TYPE, request_id, _payload(msg), flags, part_nbytes=part_nbytes)


def _payload(msg: Message) -> bytes:
    try:
        return encode_payload(msg.to_payload())
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"cannot encode {msg.TYPE.name}: {exc}") from None


def decode_message(frame: Frame) -> Message:
    """The typed message in ``frame``, every field checked; ``ProtocolError`` names the bad field."""
    cls = MESSAGE_CLASSES[frame.type]
    payload = decode_payload(frame.payload, f"{frame.type.name} payload")
    try:
        return cls.from_payload(payload)
    except FieldError as exc:
        raise ProtocolError(f"malformed {frame.type.name}: {exc.describe()}") from None


def check_message(msg: Message) -> None:
    """Raise ``ProtocolError`` if the receiver would refuse ``msg`` (its fields out of range)."""
    decode_message(Frame(msg.TYPE, 1, encode_payload(msg.to_payload())))

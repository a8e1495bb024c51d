"""The message registry: which class decodes each ``MsgType``, and which reply each request gets.

The classes live in ``session`` (attach, register, stats, detach, ping, ok,
error) and ``step`` (step, buckets, params, state transfer); the values inside
them and the limits in ``records``.  Pure: no I/O.
"""

from __future__ import annotations

from tiermem.core.protocol import session, step
from tiermem.core.protocol.frame import MsgType
from tiermem.core.protocol.records import Message

__all__ = ["MESSAGE_CLASSES", "REPLY_TYPES"]

MESSAGE_CLASSES: dict[MsgType, type[Message]] = {
    cls.TYPE: cls for cls in (getattr(module, name) for module in (session, step) for name in module.__all__)
}
"""Which class decodes each type: every class that ``session`` and ``step`` export is a message."""

REPLY_TYPES: dict[MsgType, MsgType | None] = {
    MsgType.ATTACH: MsgType.ATTACH_OK,
    MsgType.REGISTER: MsgType.REGISTER_OK,
    MsgType.STEP: MsgType.STEP_DONE,
    MsgType.BUCKET_READY: None,
    MsgType.FETCH_PARAMS: MsgType.PARAMS_READY,
    MsgType.STATE_READ: MsgType.STATE_CHUNK,
    MsgType.STATE_WRITE: MsgType.OK,
    MsgType.STATE_RESET: MsgType.OK,
    MsgType.STATE_READ_MANY: MsgType.STATE_SPANS,
    MsgType.STATE_WRITE_MANY: MsgType.OK,
    MsgType.GRAD_NORM: MsgType.GRAD_NORM_REPLY,
    MsgType.ABORT: MsgType.ABORTED,
    MsgType.STATS: MsgType.STATS_REPLY,
    MsgType.DETACH: MsgType.OK,
    MsgType.PING: MsgType.PONG,
}
"""The successful reply to each request (None: one-way, no reply); any request may get ERROR instead."""

"""The message registry: which class decodes each ``MsgType``, and which reply each request gets.

The classes live in ``session`` (attach, register, stats, detach, ping, ok,
error) and ``step`` (step, buckets, params, state transfer); the values inside
them and the limits in ``records``.  Pure: no I/O.
"""

from __future__ import annotations

from tiermem.core.protocol.frame import MsgType
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
from tiermem.core.protocol.session import (
    Attach,
    AttachOk,
    Detach,
    ErrorReply,
    Ok,
    Ping,
    Pong,
    Register,
    RegisterOk,
    Stats,
    StatsReply,
)
from tiermem.core.protocol.step import (
    Abort,
    Aborted,
    BucketReady,
    FetchParams,
    ParamsReady,
    StateChunk,
    StateRead,
    StateReset,
    StateWrite,
    Step,
    StepDone,
)

__all__ = [
    "Abort",
    "Aborted",
    "DTYPES",
    "MESSAGE_CLASSES",
    "PLACEMENTS",
    "REPLY_TYPES",
    "STATE_KEYS",
    "Attach",
    "AttachOk",
    "BucketReady",
    "Detach",
    "ErrorReply",
    "FetchParams",
    "MemRef",
    "Message",
    "Ok",
    "ParamGroup",
    "ParamsReady",
    "Ping",
    "Pong",
    "Register",
    "RegisterOk",
    "StateChunk",
    "StateRead",
    "StateReset",
    "StateWrite",
    "Stats",
    "StatsReply",
    "Step",
    "StepDone",
    "TensorSlot",
    "TensorSpec",
]

MESSAGE_CLASSES: dict[MsgType, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Attach,
        AttachOk,
        Register,
        RegisterOk,
        Step,
        BucketReady,
        StepDone,
        FetchParams,
        ParamsReady,
        StateRead,
        StateChunk,
        StateWrite,
        StateReset,
        Abort,
        Aborted,
        Stats,
        StatsReply,
        Detach,
        Ping,
        Pong,
        Ok,
        ErrorReply,
    )
}

REPLY_TYPES: dict[MsgType, MsgType | None] = {
    MsgType.ATTACH: MsgType.ATTACH_OK,
    MsgType.REGISTER: MsgType.REGISTER_OK,
    MsgType.STEP: MsgType.STEP_DONE,
    MsgType.BUCKET_READY: None,
    MsgType.FETCH_PARAMS: MsgType.PARAMS_READY,
    MsgType.STATE_READ: MsgType.STATE_CHUNK,
    MsgType.STATE_WRITE: MsgType.OK,
    MsgType.STATE_RESET: MsgType.OK,
    MsgType.ABORT: MsgType.ABORTED,
    MsgType.STATS: MsgType.STATS_REPLY,
    MsgType.DETACH: MsgType.OK,
    MsgType.PING: MsgType.PONG,
}
"""The successful reply to each request (None: one-way, no reply); any request may get ERROR instead."""

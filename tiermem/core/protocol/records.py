"""Records inside messages, limits, shared field kinds, and the message base class.

Owns the values messages are made of: memory references (``MemRef``), Adam
hyper-parameters (``ParamGroup``), registered tensors (``TensorSpec``) and
their window slots (``TensorSlot``); the limits every field is checked
against, and the field kinds several messages share (``STEP_NO``,
``TENSOR_IDS``, ``NBYTES``...).  Pure: no I/O.

Every record and message is declared once with ``tiermem.core.protocol.spec``:
each field's ``Annotated`` kind is its range on the wire, and ``@wire``
derives ``to_payload``, the validating ``from_payload`` and ``KEYS`` from it.
Cross-field rules are in a record's ``validate``.

Memory is never sent, only named: a ``MemRef`` is (window id, byte offset,
byte length) inside a shared window the daemon created and handed over at
``ATTACH``.  The daemon checks every reference with ``MemRef.check_bounds``
before touching memory.  On the wire a MemRef is the list ``[window, offset,
length]`` and a TensorSlot ``[tensor_id, param_ref, [grad_ref, ...]]``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, ClassVar

from tiermem.core.errors import BoundsError
from tiermem.core.modes import Placement
from tiermem.core.protocol.frame import MsgType
from tiermem.core.protocol.spec import Choice, Float, Int, List, Str, Tuple, Wire, wire

__all__ = [
    "BETA",
    "DTYPES",
    "GRAD_BUFFER",
    "ID_PATTERN",
    "MAX_DIM",
    "MAX_GRAD_BUFFERS",
    "MAX_GROUPS",
    "DEFAULT_MAX_INFLIGHT",
    "MAX_ID",
    "MAX_MESSAGE",
    "MAX_NAME",
    "MAX_NBYTES",
    "MAX_NDIM",
    "MAX_STEP",
    "MAX_TENSORS",
    "MAX_TIMINGS",
    "MAX_WINDOW_ID",
    "MAX_WORLD",
    "NAME",
    "NBYTES",
    "NON_NEGATIVE",
    "PLACEMENTS",
    "STATE_KEY",
    "STATE_KEYS",
    "STEP_NO",
    "TENSOR_ID",
    "TENSOR_IDS",
    "MemRef",
    "Message",
    "ParamGroup",
    "TensorSlot",
    "TensorSpec",
]

# Limits of field values (docs/protocol.md, "Limits").
DTYPES = ("float32", "float16", "bfloat16")
PLACEMENTS = tuple(p.value for p in Placement)
"""The wire spellings of ``Placement`` (fields hold the members; this is for code that needs the names)."""
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq", "grad", "param")
MAX_NAME = 256
MAX_ID = 128
MAX_NDIM = 16
MAX_DIM = (1 << 48) - 1
MAX_NBYTES = (1 << 56) - 1
MAX_WORLD = 1 << 20
MAX_GROUPS = 4096
MAX_TENSORS = 1 << 20
MAX_STEP = (1 << 62) - 1
MAX_WINDOW_ID = 0xFFFFFFFF
MAX_TIMINGS = 64
MAX_GRAD_BUFFERS = 2
MAX_MESSAGE = 16384
DEFAULT_MAX_INFLIGHT = 4096
"""One-way messages a daemon takes in a row when ATTACH_OK does not say (``server.max_inflight``'s default)."""
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]*")

# Field kinds shared by several records and messages.
STEP_NO = Int(0, MAX_STEP)
TENSOR_ID = Int(0, MAX_TENSORS - 1)
TENSOR_IDS = List(TENSOR_ID, MAX_TENSORS)
NBYTES = Int(0, MAX_NBYTES)
GRAD_BUFFER = Int(0, MAX_GRAD_BUFFERS - 1)
NON_NEGATIVE = Float(ge=0.0)
BETA = Float(ge=0.0, lt=1.0)
NAME = Str(MAX_NAME)
STATE_KEY = Choice(STATE_KEYS)


class Message(Wire):
    """Base of all messages: ``TYPE`` is the wire type; ``@wire`` gives each its ``KEYS`` and codec."""

    __slots__ = ()
    TYPE: ClassVar[MsgType]


# --------------------------------------------------------------------------- memory references


@wire(array=True)
@dataclass(frozen=True, slots=True)
class MemRef(Wire):
    """``length`` bytes at byte ``offset`` of shared window ``window``."""

    window: Annotated[int, Int(0, MAX_WINDOW_ID)]
    offset: Annotated[int, NBYTES]
    length: Annotated[int, NBYTES]

    @property
    def end(self) -> int:
        return self.offset + self.length

    def check_bounds(self, window_nbytes: int, window: int | None = None) -> None:
        """Raise ``BoundsError`` unless the reference lies inside a window of ``window_nbytes`` (id ``window``)."""
        if window is not None and self.window != window:
            raise BoundsError(f"reference to window {self.window}, but this job's window is {window}")
        if self.offset < 0 or self.length < 0 or self.offset + self.length > window_nbytes:
            raise BoundsError(
                f"reference [{self.offset}, {self.offset + self.length}) of window {self.window} "
                f"falls outside its {window_nbytes} bytes"
            )


# --------------------------------------------------------------------------- records inside messages


@wire
@dataclass(frozen=True, slots=True)
class ParamGroup(Wire):
    """Adam hyper-parameters of one parameter group, as in ``torch.optim.Adam``/``AdamW``."""

    lr: Annotated[float, NON_NEGATIVE]
    betas: Annotated[tuple[float, float], Tuple(BETA, BETA)] = (0.9, 0.999)
    eps: Annotated[float, NON_NEGATIVE] = 1e-8
    weight_decay: Annotated[float, NON_NEGATIVE] = 0.0
    adamw: bool = True
    maximize: bool = False


@wire
@dataclass(frozen=True, slots=True)
class TensorSpec(Wire):
    """One tensor to register: its name, shape, dtype, where its state may live, and its param group."""

    name: Annotated[str, Str(MAX_NAME, min_len=1)]
    shape: Annotated[tuple[int, ...], List(Int(0, MAX_DIM), MAX_NDIM)]
    dtype: Annotated[str, Choice(DTYPES)]
    placement: Annotated[Placement, Choice(Placement)] = Placement.AUTO
    group: Annotated[int, Int(0, MAX_GROUPS - 1)] = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@wire(array=True)
@dataclass(frozen=True, slots=True)
class TensorSlot(Wire):
    """Where a registered tensor's working-precision param and grads live in the window.

    ``grads`` has one reference per grad buffer (two when the job uses the
    delayed update, so step t+1's grads land while step t's are read).
    """

    tensor_id: Annotated[int, TENSOR_ID]
    param: MemRef
    grads: Annotated[tuple[MemRef, ...], List(MemRef, MAX_GRAD_BUFFERS, min_len=1)]

"""Records inside messages, limits, and the message base class.

Owns the field rules of the values messages are made of: memory references
(``MemRef``), Adam hyper-parameters (``ParamGroup``), registered tensors
(``TensorSpec``) and their window slots (``TensorSlot``), and the limits every
field is checked against.  Pure: no I/O.

Memory is never sent, only named: a ``MemRef`` is (window id, byte offset,
byte length) inside a shared window the daemon created and handed over at
``ATTACH``.  The daemon checks every reference with ``MemRef.check_bounds``
before touching memory.  On the wire a MemRef is the list ``[window, offset, length]``.

Hot records have a fast path in ``from_payload``: one expression that accepts
the common, well-formed case; anything else goes through the field-by-field
checks (``_checked``), which accept exactly the same values and word the
errors.  A property test holds the two to the same answers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from tiermem.errors import BoundsError
from tiermem.protocol.fields import (
    FieldError,
    check_keys,
    get_bool,
    get_float,
    get_int,
    get_list,
    get_str,
    int_value,
    list_of,
)
from tiermem.protocol.frame import MsgType

__all__ = [
    "DTYPES",
    "EXCHANGES",
    "FLOAT_MAX",
    "ID_PATTERN",
    "MAX_DIM",
    "MAX_GRAD_BUFFERS",
    "MAX_GROUPS",
    "MAX_ID",
    "MAX_MESSAGE",
    "MAX_NAME",
    "MAX_NBYTES",
    "MAX_NDIM",
    "MAX_STATS",
    "MAX_STEP",
    "MAX_TENSORS",
    "MAX_TIMINGS",
    "MAX_WINDOW_ID",
    "MAX_WORLD",
    "PLACEMENTS",
    "STATE_KEYS",
    "MemRef",
    "Message",
    "ParamGroup",
    "TensorSlot",
    "TensorSpec",
    "as_item",
    "tensor_id_value",
]

# Limits of field values (docs/protocol.md, "Limits").
DTYPES = ("float32", "float16", "bfloat16")
PLACEMENTS = ("cpu", "nvme", "auto")
EXCHANGES = ("shared",)
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
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
MAX_STATS = 4096
MAX_MESSAGE = 16384
_NUMBER = (int, float)
FLOAT_MAX = 1.7976931348623157e308  # the largest finite float: "lo <= x <= FLOAT_MAX" also rejects inf and nan
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]*")


# --------------------------------------------------------------------------- memory references


@dataclass(frozen=True, slots=True)
class MemRef:
    """``length`` bytes at byte ``offset`` of shared window ``window``."""

    window: int
    offset: int
    length: int

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

    def to_wire(self) -> list[int]:
        return [self.window, self.offset, self.length]

    @staticmethod
    def from_wire(value: Any) -> MemRef:
        if type(value) is not list or len(value) != 3:
            raise FieldError("", "a [window, offset, length] list", value)
        return MemRef(
            int_value(value[0], 0, MAX_WINDOW_ID, "[0]"),
            int_value(value[1], 0, MAX_NBYTES, "[1]"),
            int_value(value[2], 0, MAX_NBYTES, "[2]"),
        )


def tensor_id_value(value: Any) -> int:
    return int_value(value, 0, MAX_TENSORS - 1)


def as_item(parse: Any) -> Any:
    """Adapt a ``from_payload`` (which takes a dict) to a list item parser."""

    def item(value: Any) -> Any:
        if type(value) is not dict:
            raise FieldError("", "an object", value)
        return parse(value)

    return item


# --------------------------------------------------------------------------- records inside messages


@dataclass(frozen=True, slots=True)
class ParamGroup:
    """Adam hyper-parameters of one parameter group, as in ``torch.optim.Adam``/``AdamW``."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw: bool = True
    maximize: bool = False

    KEYS: ClassVar[frozenset[str]] = frozenset({"lr", "betas", "eps", "weight_decay", "adamw", "maximize"})

    def to_payload(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "adamw": self.adamw,
            "maximize": self.maximize,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> ParamGroup:
        if d.keys() == cls.KEYS:
            lr, betas, eps, decay, adamw, maximize = (
                d["lr"],
                d["betas"],
                d["eps"],
                d["weight_decay"],
                d["adamw"],
                d["maximize"],
            )
            if (
                type(lr) is float
                and 0.0 <= lr <= FLOAT_MAX
                and type(eps) is float
                and 0.0 <= eps <= FLOAT_MAX
                and type(decay) is float
                and 0.0 <= decay <= FLOAT_MAX
                and type(betas) is list
                and len(betas) == 2
                and type(betas[0]) is float
                and 0.0 <= betas[0] < 1.0
                and type(betas[1]) is float
                and 0.0 <= betas[1] < 1.0
                and type(adamw) is bool
                and type(maximize) is bool
            ):
                return cls(lr, (betas[0], betas[1]), eps, decay, adamw, maximize)
        return cls._checked(d)

    @classmethod
    def _checked(cls, d: dict[str, Any]) -> ParamGroup:
        check_keys(d, cls.KEYS)
        betas = get_list(d, "betas", 2)
        if len(betas) != 2:
            raise FieldError("betas", "a list of two numbers", betas)
        beta1, beta2 = betas
        if type(beta1) not in _NUMBER or not 0.0 <= beta1 < 1.0:
            raise FieldError("betas[0]", "a number in [0, 1)", beta1)
        if type(beta2) not in _NUMBER or not 0.0 <= beta2 < 1.0:
            raise FieldError("betas[1]", "a number in [0, 1)", beta2)
        return cls(
            lr=get_float(d, "lr", 0.0),
            betas=(float(beta1), float(beta2)),
            eps=get_float(d, "eps", 0.0),
            weight_decay=get_float(d, "weight_decay", 0.0),
            adamw=get_bool(d, "adamw"),
            maximize=get_bool(d, "maximize"),
        )


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor to register: its name, shape, dtype, where its state may live, and its param group."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    placement: str = "auto"
    group: int = 0

    KEYS: ClassVar[frozenset[str]] = frozenset({"name", "shape", "dtype", "placement", "group"})

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_payload(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "placement": self.placement,
            "group": self.group,
        }

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> TensorSpec:
        check_keys(d, cls.KEYS)
        name = get_str(d, "name", MAX_NAME)
        if not name:
            raise FieldError("name", "a non-empty string", name)
        shape = list_of(d, "shape", MAX_NDIM, lambda v: int_value(v, 0, MAX_DIM))
        dtype = get_str(d, "dtype", 16)
        if dtype not in DTYPES:
            raise FieldError("dtype", f"one of {', '.join(DTYPES)}", dtype)
        placement = get_str(d, "placement", 16)
        if placement not in PLACEMENTS:
            raise FieldError("placement", f"one of {', '.join(PLACEMENTS)}", placement)
        return cls(name, shape, dtype, placement, get_int(d, "group", 0, MAX_GROUPS - 1))


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where a registered tensor's working-precision param and grads live in the window.

    ``grads`` has one reference per grad buffer (two when the job uses the
    delayed update, so step t+1's grads land while step t's are read).
    """

    tensor_id: int
    param: MemRef
    grads: tuple[MemRef, ...]

    def to_wire(self) -> list[Any]:
        return [self.tensor_id, self.param.to_wire(), [g.to_wire() for g in self.grads]]

    @staticmethod
    def from_wire(value: Any) -> TensorSlot:
        if type(value) is not list or len(value) != 3:
            raise FieldError("", "a [tensor_id, param_ref, [grad_ref, ...]] list", value)
        tensor_id = int_value(value[0], 0, MAX_TENSORS - 1, "[0]")
        try:
            param = MemRef.from_wire(value[1])
        except FieldError as exc:
            raise exc.within("[1]") from None
        grads = value[2]
        if type(grads) is not list or not 1 <= len(grads) <= MAX_GRAD_BUFFERS:
            raise FieldError("[2]", f"a list of 1 to {MAX_GRAD_BUFFERS} grad references", grads)
        refs = []
        for index, ref in enumerate(grads):
            try:
                refs.append(MemRef.from_wire(ref))
            except FieldError as exc:
                raise exc.within(f"[{index}]").within("[2]") from None
        return TensorSlot(tensor_id, param, tuple(refs))


class Message:
    """Base of all messages; ``TYPE`` is the wire type, ``KEYS`` the payload fields."""

    __slots__ = ()
    TYPE: ClassVar[MsgType]
    KEYS: ClassVar[frozenset[str]] = frozenset()

    def to_payload(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_payload(cls, d: dict[str, Any]) -> Message:
        check_keys(d, cls.KEYS)
        return cls()

    @classmethod
    def _checked(cls, d: dict[str, Any]) -> Message:
        """The field-by-field checks; a class with a fast path in ``from_payload`` overrides this."""
        return cls.from_payload(d)

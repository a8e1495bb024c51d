"""Field checks for decoded payloads: types, ranges, lengths, enumerations.

Owns the rules every message field is checked against and the wording of the
errors.  Pure: no I/O.  A failed check raises ``FieldError`` carrying the path
of the field inside the payload (``tensors[3].shape[1]``), what was expected
and what was found; ``decode_message`` turns it into a ``ProtocolError`` that
names the message type too.  Paths are assembled only on the error path, so a
valid payload pays for none of the string building.

Conventions: an int is a JSON integer (``true``/``false`` are not ints); a float
accepts a JSON integer or number; strings are bounded in length; lists are
bounded in length and become tuples.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "FieldError",
    "check_keys",
    "get_bool",
    "get_dict",
    "get_float",
    "get_int",
    "get_list",
    "get_opt_float",
    "get_opt_str",
    "get_str",
    "get_value",
    "int_value",
    "list_of",
    "str_value",
]

T = TypeVar("T")

_MISSING = object()


class FieldError(Exception):
    """A field failed its check; ``path`` grows as the error unwinds through containers."""

    def __init__(self, path: str, expected: str, got: Any) -> None:
        super().__init__(path, expected, got)
        self.path = path
        self.expected = expected
        self.got = got

    def within(self, parent: str) -> FieldError:
        """Prefix the path with the enclosing field (``parent.path`` or ``parent[i]``)."""
        if not self.path:
            self.path = parent
        elif self.path.startswith("["):
            self.path = parent + self.path
        else:
            self.path = f"{parent}.{self.path}"
        return self

    def describe(self) -> str:
        shown = "nothing (missing)" if self.got is _MISSING else _show(self.got)
        return f"field {self.path or '<payload>'}: expected {self.expected}, got {shown}"


def _show(value: Any) -> str:
    text = repr(value)
    kind = type(value).__name__
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind} {text}"


def check_keys(payload: dict[str, Any], known: frozenset[str]) -> None:
    """Reject fields this protocol version does not define (a typo must not pass silently)."""
    if payload.keys() <= known:
        return
    extra = sorted(str(k) for k in payload.keys() - known)
    raise FieldError(extra[0], f"one of the fields {sorted(known)}", "an unknown field")


def get_value(payload: dict[str, Any], key: str) -> Any:
    value = payload.get(key, _MISSING)
    if value is _MISSING:
        raise FieldError(key, "a value", _MISSING)
    return value


def int_value(value: Any, lo: int, hi: int, path: str = "") -> int:
    """An int in [lo, hi]."""
    if type(value) is not int or not lo <= value <= hi:
        raise FieldError(path, f"an integer in [{lo}, {hi}]", value)
    return value


def get_int(payload: dict[str, Any], key: str, lo: int, hi: int) -> int:
    try:
        value = payload[key]
    except KeyError:
        raise FieldError(key, "a value", _MISSING) from None
    if type(value) is not int or not lo <= value <= hi:
        raise FieldError(key, f"an integer in [{lo}, {hi}]", value)
    return value


def _float_value(value: Any, path: str, lo: float, hi: float, finite: bool) -> float:
    if type(value) is float:
        number = value
    elif type(value) is int:
        try:
            number = float(value)
        except OverflowError:
            raise FieldError(path, "a number", value) from None
    else:
        raise FieldError(path, "a number", value)
    if finite and not math.isfinite(number):
        raise FieldError(path, "a finite number", value)
    if not math.isnan(number) and not lo <= number <= hi:
        bound = f">= {lo}" if hi == math.inf else f"<= {hi}" if lo == -math.inf else f"in [{lo}, {hi}]"
        raise FieldError(path, f"a number {bound}", value)
    return number


def get_float(
    payload: dict[str, Any], key: str, lo: float = -math.inf, hi: float = math.inf, *, finite: bool = True
) -> float:
    return _float_value(get_value(payload, key), key, lo, hi, finite)


def get_opt_float(
    payload: dict[str, Any], key: str, lo: float = -math.inf, hi: float = math.inf, *, finite: bool = True
) -> float | None:
    value = get_value(payload, key)
    if value is None:
        return None
    return _float_value(value, key, lo, hi, finite)


def get_bool(payload: dict[str, Any], key: str) -> bool:
    value = payload.get(key)
    if type(value) is not bool:
        if key not in payload:
            raise FieldError(key, "a value", _MISSING)
        raise FieldError(key, "true or false", value)
    return value


def str_value(value: Any, max_len: int, path: str = "", pattern: re.Pattern[str] | None = None) -> str:
    if type(value) is not str or len(value) > max_len:
        raise FieldError(path, f"a string of at most {max_len} characters", value)
    if pattern is not None and not pattern.fullmatch(value):
        raise FieldError(path, f"a string matching {pattern.pattern}", value)
    return value


def get_str(payload: dict[str, Any], key: str, max_len: int, pattern: re.Pattern[str] | None = None) -> str:
    return str_value(get_value(payload, key), max_len, key, pattern)


def get_opt_str(payload: dict[str, Any], key: str, max_len: int) -> str | None:
    value = get_value(payload, key)
    if value is None:
        return None
    return str_value(value, max_len, key)


def get_list(payload: dict[str, Any], key: str, max_len: int) -> list[Any]:
    value = get_value(payload, key)
    if type(value) is not list or len(value) > max_len:
        raise FieldError(key, f"a list of at most {max_len} items", value)
    return value


def get_dict(payload: dict[str, Any], key: str, max_len: int) -> dict[str, Any]:
    value = get_value(payload, key)
    if type(value) is not dict or len(value) > max_len:
        raise FieldError(key, f"an object of at most {max_len} fields", value)
    return value


def list_of(payload: dict[str, Any], key: str, max_len: int, item: Callable[[Any], T]) -> tuple[T, ...]:
    """A bounded list whose items each pass ``item`` (which raises ``FieldError``)."""
    items = get_list(payload, key, max_len)
    out = []
    for index, value in enumerate(items):
        try:
            out.append(item(value))
        except FieldError as exc:
            raise exc.within(f"[{index}]").within(key) from None
    return tuple(out)

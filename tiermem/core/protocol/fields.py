"""Field errors: what a failed check of a decoded payload says, and the check of its keys.

Owns ``FieldError`` and the wording every check shares.  Pure: no I/O.  A
failed check raises ``FieldError`` carrying the path of the field inside the
payload (``tensors[3].shape[1]``), what was expected and what was found;
``decode_message`` turns it into a ``ProtocolError`` that names the message
type too.  The checks themselves are the field kinds of
``tiermem.core.protocol.kinds``, applied by the records ``tiermem.core.protocol.spec``
declares; paths are assembled only on the error path, so a valid payload pays
for none of the string building.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FieldError", "check_keys", "get_value"]

_MISSING = object()


class FieldError(Exception):
    """A field failed its check; ``path`` grows as the error unwinds through containers."""

    def __init__(self, path: str, expected: str, got: Any) -> None:
        super().__init__(path, expected, got)
        self.path = path
        self.expected = expected
        self.got = got

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
    """``payload[key]``; a missing key is a ``FieldError`` saying so."""
    value = payload.get(key, _MISSING)
    if value is _MISSING:
        raise FieldError(key, "a value", _MISSING)
    return value

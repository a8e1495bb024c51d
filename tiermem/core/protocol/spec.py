"""Declarative wire records: each field declared once, the encoder and the validating decoder derived from it.

Owns ``@wire``, the declaration of a record (``RecordSpec``: its fields,
their kinds, how it nests) and the code generated from it.  The field kinds
(``Int``, ``Float``, ``Bool``, ``Str``, ``Choice``, ``Opt``, ``List``,
``Tuple``, ``Map``) live in ``tiermem.core.protocol.kinds`` and are re-exported
here.  Pure: no I/O.

How to declare a message.  Write the dataclass as usual, give each field its
wire kind in ``Annotated`` (a field whose type is itself a wire record, or
``bool``, needs none), and put ``@wire`` above ``@dataclass``::

    @wire
    @dataclass(slots=True)
    class StateRead(Message):
        TYPE: ClassVar[MsgType] = MsgType.STATE_READ
        tensor_id: Annotated[int, Int(0, MAX_TENSORS - 1)]
        key: Annotated[str, Choice(STATE_KEYS)]
        offset: Annotated[int, Int(0, MAX_NBYTES)]
        dest: MemRef                                   # a @wire(array=True) record: [window, offset, length]

        def validate(self) -> None:                    # optional: checks across fields, run after each
            ...                                        # field passed its own; raise FieldError("field", ...)

``@wire`` adds ``to_payload()`` (a JSON-able dict, fields in declaration
order; a list for ``@wire(array=True)``), the classmethod ``from_payload(d)``
and ``KEYS``.  The Python type in ``Annotated`` is for the type checker; the
kind is what the wire sees.  Declare records at module level (their
annotations are resolved in the module's namespace).

Decoding rules (those of every message in ``tiermem.core.protocol``): every declared key
must be present and no other; an int is a JSON integer (``true`` is not an
int); a float accepts a JSON integer or number and is returned as ``float``;
non-finite floats are refused unless the kind says ``finite=False``; strings,
lists and objects are bounded; lists become tuples, objects of a ``Map``
tuples of ``(key, value)`` pairs.  A failed check raises ``FieldError`` with
the path of the field (``groups[1].betas[0]``, ``timings.update``); fields are
checked in declaration order, unknown keys first, ``validate`` last.

How the decoder runs.  At class creation ``@wire`` writes one Python function
per record that checks a well-formed payload and builds the object in one
pass, every nested record and list inlined, constants folded in (its source
is ``cls.__wire__.source``).  It answers "valid" or "not this way"; in the
second case (an error, or a value that needs converting, such as an int where
a float is declared) the interpreted checks (``Kind.check``) walk the payload,
assembling paths only then, and either raise the worded ``FieldError`` or
return the converted object.  Both are derived from the same kinds; a property
test holds them to the same answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, TypeVar, get_args, get_origin, get_type_hints, overload

from tiermem.core.protocol import kinds
from tiermem.core.protocol.fields import FieldError, check_keys, get_value
from tiermem.core.protocol.kinds import *  # noqa: F403
from tiermem.core.protocol.kinds import FAIL, Bool, Kind, Source, as_kind

__all__ = ["RecordSpec", "Wire", "WireName", "wire"]
__all__ += kinds.__all__

T = TypeVar("T")
W = TypeVar("W", bound="Wire")

_MAX_NESTING = 16


class Wire:
    """Base for wire records (optional): declares what ``@wire`` adds, for the type checker."""

    __slots__ = ()
    __wire__: ClassVar[RecordSpec]
    KEYS: ClassVar[frozenset[str]]

    def to_payload(self) -> Any:
        raise TypeError(f"{type(self).__name__} is not declared with @wire")

    @classmethod
    def from_payload(cls: type[W], d: Any) -> W:
        raise TypeError(f"{cls.__name__} is not declared with @wire")


class WireName:
    """``Annotated`` marker: the field's key on the wire differs from its attribute name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    attr: str
    key: str
    kind: Kind


def _join(parent: str, child: str) -> str:
    """How a path grows into a field: ``a.b``, ``a[0]``, and an empty side adds nothing."""
    if not child:
        return parent
    if not parent or child.startswith("["):
        return parent + child
    return f"{parent}.{child}"


class RecordSpec(Kind):
    """The declaration of one wire record (``cls.__wire__``), and the kind of a field holding one."""

    __slots__ = ("_fast", "array", "cls", "fields", "keys", "source", "validates")

    @property
    def plain(self) -> bool:
        return False

    def __init__(self, cls: type, fields: tuple[_Field, ...], array: bool) -> None:
        self.cls, self.fields, self.array = cls, fields, array
        self.keys = frozenset(f.key for f in fields)
        self.validates = callable(getattr(cls, "validate", None))
        self.source = ""
        self._fast: Callable[[type, Any], Any] = lambda cls, d: FAIL

    def decode_fast(self, cls: type, value: Any) -> Any | None:
        """The generated decoder alone: the object, or None where it leaves the answer to ``decode_checked``."""
        try:
            obj = self._fast(cls, value)
        except (KeyError, FieldError):
            return None
        return None if obj is FAIL else obj

    def decode_checked(self, cls: type, value: Any, path: str = "") -> Any:
        """The interpreted decoder: the worded ``FieldError``, or the object (of ``cls``)."""
        if self.array:
            if type(value) is not list or len(value) != len(self.fields):
                names = ", ".join(f.key for f in self.fields)
                raise FieldError(path, f"a [{names}] list", value)
            values = [f.kind.check(x, f"{path}[{i}]") for i, (f, x) in enumerate(zip(self.fields, value, strict=True))]
        else:
            if type(value) is not dict:
                raise FieldError(path, "an object", value)
            try:
                check_keys(value, self.keys)
            except FieldError as exc:
                exc.path = _join(path, exc.path)
                raise
            values = []
            for f in self.fields:
                where = _join(path, f.key)
                try:
                    raw = get_value(value, f.key)
                except FieldError as exc:
                    exc.path = where
                    raise
                values.append(f.kind.check(raw, where))
        obj = cls(*values)
        if self.validates:
            try:
                obj.validate()
            except FieldError as exc:
                exc.path = _join(path, exc.path)
                raise
        return obj

    def check(self, value: Any, path: str) -> Any:
        return self.decode_checked(self.cls, value, path)

    def emit(self, gen: Source, src: str, ind: str, ctor: str | None = None) -> str:
        gen.depth += 1
        if gen.depth > _MAX_NESTING:
            raise TypeError(f"{self.cls.__name__}: records nested more than {_MAX_NESTING} deep (or recursively)")
        names = [gen.var() for _ in self.fields]
        if self.array:
            gen.line(ind, f"if type({src}) is not list or len({src}) != {len(self.fields)}: return FAIL")
            if names:
                gen.line(ind, f"{', '.join(names)}, = {src}")
        else:
            gen.line(ind, f"if type({src}) is not dict or len({src}) != {len(self.fields)}: return FAIL")
            for f, n in zip(self.fields, names, strict=True):
                gen.line(ind, f"{n} = {src}[{f.key!r}]")  # a key that is not there: KeyError, caught by the caller
        values = [f.kind.emit(gen, n, ind) for f, n in zip(self.fields, names, strict=True)]
        obj = gen.var("obj")
        gen.line(ind, f"{obj} = {ctor or gen.const(self.cls)}({', '.join(values)})")
        if self.validates:
            gen.line(ind, f"{obj}.validate()")  # a FieldError: caught by the caller, which takes the checked path
        gen.depth -= 1
        return obj

    def encode(self, gen: Source, expr: str) -> str:
        parts = [f.kind.encode(gen, f"{expr}.{f.attr}") for f in self.fields]
        if self.array:
            return f"[{', '.join(parts)}]"
        return "{" + ", ".join(f"{f.key!r}: {p}" for f, p in zip(self.fields, parts, strict=True)) + "}"


def _field_kind(hint: Any, where: str) -> tuple[Kind, str | None]:
    if get_origin(hint) is Annotated:
        meta = get_args(hint)[1:]
        names = [m.name for m in meta if isinstance(m, WireName)]
        kinds = [m for m in meta if not isinstance(m, WireName)]
        if len(kinds) != 1:
            raise TypeError(f"{where}: expected one field kind in Annotated[...], got {kinds}")
        return as_kind(kinds[0]), names[0] if names else None
    if hint is bool:
        return Bool, None
    if isinstance(hint, type) and "__wire__" in hint.__dict__:
        return as_kind(hint), None
    raise TypeError(f"{where}: no wire kind; declare one, e.g. Annotated[int, Int(0, 10)]")


def _compile(spec: RecordSpec) -> None:
    cls = spec.cls
    gen = Source()
    gen.line("", "def _fast(cls, d):")
    gen.line("    ", f"return {spec.emit(gen, 'd', '    ', ctor='cls')}")
    gen.line("", "")
    gen.line("", "def to_payload(self):")
    gen.line("    ", f"return {spec.encode(gen, 'self')}")
    spec.source = "\n".join(gen.lines) + "\n"
    namespace = gen.ns
    # The source is built from the declaration alone (field names are identifiers, keys are repr()s, bounds
    # are numeric literals, everything else is a named constant): no payload ever reaches it.
    exec(compile(spec.source, f"<wire {cls.__module__}.{cls.__qualname__}>", "exec"), namespace)  # noqa: S102
    fast = namespace["_fast"]
    checked = spec.decode_checked

    def from_payload(cls: type, d: Any) -> Any:
        try:
            obj = fast(cls, d)
        except (KeyError, FieldError):
            obj = FAIL
        if obj is FAIL:
            return checked(cls, d)
        return obj

    from_payload.__doc__ = f"A {cls.__name__} from its wire form; ``FieldError`` names the first field that fails."
    spec._fast = fast
    cls.from_payload = classmethod(from_payload)  # type: ignore[attr-defined]
    cls.to_payload = namespace["to_payload"]  # type: ignore[attr-defined]


def _declare(cls: type[T], array: bool) -> type[T]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"@wire goes above @dataclass: {cls.__name__} is not a dataclass")
    hints = get_type_hints(cls, include_extras=True)
    fields = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        kind, key = _field_kind(hints[f.name], f"{cls.__name__}.{f.name}")
        fields.append(_Field(f.name, key or f.name, kind))
    spec = RecordSpec(cls, tuple(fields), array)
    cls.__wire__ = spec  # type: ignore[attr-defined]
    cls.KEYS = spec.keys  # type: ignore[attr-defined]
    _compile(spec)
    return cls


@overload
def wire(cls: type[T], /) -> type[T]: ...
@overload
def wire(*, array: bool = False) -> Callable[[type[T]], type[T]]: ...
def wire(cls: type[T] | None = None, /, *, array: bool = False) -> type[T] | Callable[[type[T]], type[T]]:
    """Derive ``to_payload``/``from_payload``/``KEYS`` from a dataclass's field kinds.

    ``array=True``: the record travels as a list of its fields in order (``MemRef`` is ``[window, offset, length]``).
    """
    if cls is None:
        return lambda c: _declare(c, array)
    return _declare(cls, array)

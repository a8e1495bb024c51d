"""Field kinds: how one wire value is checked, decoded, encoded, and compiled into a record's decoder.

Owns ``Int``, ``Float``, ``Bool``, ``Str``, ``Choice``, ``Opt``, ``List``,
``Tuple`` and ``Map``, and the small source writer the record compiler
(``tiermem.core.protocol.spec``) hands them.  Pure: no I/O.

Each kind has two faces that must agree (a property test holds them to it):
``check(value, path)``, the reference, which raises the worded ``FieldError``
or returns the decoded value; and the code it contributes to a record's
generated decoder, which only answers "this value, decoded" or ``FAIL``
("not this way": the record then runs the ``check``s to word the error or
convert the value).  ``tiermem.core.protocol.fields`` has the error they raise.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable
from enum import Enum
from typing import Any

from tiermem.core.protocol.fields import FieldError

__all__ = [
    "FAIL",
    "FLOAT_MAX",
    "Bool",
    "Choice",
    "Float",
    "Int",
    "Kind",
    "List",
    "Map",
    "Opt",
    "Source",
    "Str",
    "Tuple",
    "as_kind",
]

FLOAT_MAX = sys.float_info.max
FAIL: Any = object()
"""What generated decoder code answers for a value it does not take as it is."""

# --------------------------------------------------------------------------- code generation


class Source:
    """Source being written for one record: lines, fresh local names, and the constants it refers to."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.ns: dict[str, Any] = {"FAIL": FAIL, "FieldError": FieldError}
        self._count = 0
        self.depth = 0

    def var(self, stem: str = "v") -> str:
        self._count += 1
        return f"{stem}{self._count}"

    def const(self, value: Any) -> str:
        name = self.var("_k")
        self.ns[name] = value
        return name

    def line(self, indent: str, text: str) -> None:
        self.lines.append(indent + text)


def _size(name: str, value: Any) -> int:
    """A count that goes into generated source: a non-negative int, nothing else."""
    if type(value) is not int or value < 0:
        raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _lit(number: float) -> str:
    """A finite number as a literal (ints and finite floats round-trip through repr)."""
    if isinstance(number, float) and not math.isfinite(number):
        raise ValueError(f"bound {number} has no literal")
    return repr(number)


# --------------------------------------------------------------------------- kinds


class Kind:
    """How one value is checked, decoded and encoded.

    ``check`` is the reference: it raises ``FieldError(path, ...)`` or returns
    the decoded value.  A *plain* kind decodes to the wire value itself and
    gives ``test``, one boolean expression over a local name; other kinds
    override ``emit``, which appends statements to the generated decoder and
    returns the expression of the decoded value (``return FAIL`` where the
    value does not pass).  ``encode`` is the expression of the wire form.
    A kind of one's own may give ``check`` alone (and ``encode`` where its
    decoded form is not its wire form): the generated decoder then calls it.
    """

    __slots__ = ()

    @property
    def plain(self) -> bool:
        return type(self).test is not Kind.test

    def check(self, value: Any, path: str) -> Any:
        raise NotImplementedError

    def test(self, gen: Source, v: str) -> str:
        raise NotImplementedError

    def emit(self, gen: Source, src: str, ind: str) -> str:
        if type(self).test is Kind.test:  # a kind with check() alone
            dst = gen.var()
            gen.line(ind, "try:")
            gen.line(ind + "    ", f"{dst} = {gen.const(self.check)}({src}, '')")
            gen.line(ind, "except FieldError: return FAIL")
            return dst
        gen.line(ind, f"if not ({self.test(gen, src)}): return FAIL")
        return src

    def encode(self, gen: Source, expr: str) -> str:
        return expr


class Int(Kind):
    """An integer in [lo, hi]."""

    __slots__ = ("hi", "lo")

    def __init__(self, lo: int, hi: int) -> None:
        if type(lo) is not int or type(hi) is not int or lo > hi:
            raise ValueError(f"Int({lo!r}, {hi!r}): bounds must be ints, lo <= hi")
        self.lo, self.hi = lo, hi

    def check(self, value: Any, path: str) -> int:
        if type(value) is not int or not self.lo <= value <= self.hi:
            raise FieldError(path, f"an integer in [{self.lo}, {self.hi}]", value)
        return value

    def test(self, gen: Source, v: str) -> str:
        return f"type({v}) is int and {self.lo!r} <= {v} <= {self.hi!r}"


class Float(Kind):
    """A number, returned as ``float``, with optional bounds; non-finite values only with ``finite=False``.

    ``Float(ge=0.0)``, ``Float(gt=0.0)`` ("a positive number"), ``Float(ge=0.0, lt=1.0)``.
    With ``finite=False``, NaN passes and +-inf pass where the bounds allow them.
    """

    __slots__ = ("finite", "hi", "hi_open", "lo", "lo_open")

    def __init__(
        self,
        *,
        ge: float | None = None,
        gt: float | None = None,
        le: float | None = None,
        lt: float | None = None,
        finite: bool = True,
    ) -> None:
        if (ge is not None and gt is not None) or (le is not None and lt is not None):
            raise ValueError("Float: give at most one lower bound (ge/gt) and one upper bound (le/lt)")
        lo = ge if ge is not None else gt
        hi = le if le is not None else lt
        self.lo = -math.inf if lo is None else float(lo)
        self.hi = math.inf if hi is None else float(hi)
        self.lo_open, self.hi_open = gt is not None, lt is not None
        self.finite = finite

    def _bound(self) -> str:
        lo, hi = self.lo, self.hi
        if hi == math.inf:
            if lo == 0.0 and self.lo_open:
                return "positive number"
            return f"number {'>' if self.lo_open else '>='} {lo}"
        if lo == -math.inf:
            return f"number {'<' if self.hi_open else '<='} {hi}"
        return f"number in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"

    def _in_range(self, x: float) -> bool:
        above = x > self.lo if self.lo_open else x >= self.lo
        below = x < self.hi if self.hi_open else x <= self.hi
        return above and below

    def check(self, value: Any, path: str) -> float:
        if type(value) is float:
            number = value
        elif type(value) is int:
            try:
                number = float(value)
            except OverflowError:
                raise FieldError(path, "a number", value) from None
        else:
            raise FieldError(path, "a number", value)
        if self.finite and not math.isfinite(number):
            raise FieldError(path, "a finite number", value)
        if not math.isnan(number) and not self._in_range(number):
            raise FieldError(path, f"a {self._bound()}", value)
        return number

    def test(self, gen: Source, v: str) -> str:
        lo, hi = self.lo, self.hi
        if self.finite:  # the finite bounds refuse inf, and every comparison refuses NaN
            lo, hi = max(lo, -FLOAT_MAX), min(hi, FLOAT_MAX)
        lower = f"{_lit(lo)} {'<' if self.lo_open else '<='} " if lo != -math.inf else ""
        upper = f" {'<' if self.hi_open else '<='} {_lit(hi)}" if hi != math.inf else ""
        if not lower and not upper:
            return f"type({v}) is float"
        nan = "" if self.finite else f" or {v} != {v}"
        return f"type({v}) is float and ({lower}{v}{upper}{nan})"


class _Bool(Kind):
    __slots__ = ()

    def check(self, value: Any, path: str) -> bool:
        if type(value) is not bool:
            raise FieldError(path, "true or false", value)
        return value

    def test(self, gen: Source, v: str) -> str:
        return f"type({v}) is bool"


Bool = _Bool()
"""``true`` or ``false`` (a field annotated plain ``bool`` gets this kind)."""


class Str(Kind):
    """A string of ``min_len`` to ``max_len`` characters, optionally matching ``pattern`` in full."""

    __slots__ = ("max_len", "min_len", "pattern")

    def __init__(self, max_len: int, *, min_len: int = 0, pattern: str | re.Pattern[str] | None = None) -> None:
        self.max_len, self.min_len = _size("max_len", max_len), _size("min_len", min_len)
        self.pattern = re.compile(pattern) if isinstance(pattern, str) else pattern

    def check(self, value: Any, path: str) -> str:
        if type(value) is not str or len(value) > self.max_len:
            raise FieldError(path, f"a string of at most {self.max_len} characters", value)
        if len(value) < self.min_len:
            expected = "a non-empty string" if self.min_len == 1 else f"a string of at least {self.min_len} characters"
            raise FieldError(path, expected, value)
        if self.pattern is not None and not self.pattern.fullmatch(value):
            raise FieldError(path, f"a string matching {self.pattern.pattern}", value)
        return value

    def test(self, gen: Source, v: str) -> str:
        text = f"type({v}) is str and "
        text += f"{self.min_len} <= len({v}) <= {self.max_len}" if self.min_len else f"len({v}) <= {self.max_len}"
        if self.pattern is not None:
            text += f" and {gen.const(self.pattern.fullmatch)}({v}) is not None"
        return text


class Choice(Kind):
    """One of a few strings, ``Choice(("fp32", "bf16"))``, or the values of a str-valued ``Enum``, decoded to
    its members: all of them, ``Choice(Placement)``, or a few, ``Choice((Placement.CPU, Placement.NVME))``.

    ``blank=True`` (members only): the empty string passes too, decoded to ``None``, and ``None`` encodes as
    ``""`` (a field that is empty until it is known).
    """

    __slots__ = ("members", "names")

    def __init__(self, options: Iterable[str] | Iterable[Enum] | type[Enum], *, blank: bool = False) -> None:
        items: list[Any] = list(options)
        if items and all(isinstance(o, Enum) for o in items):
            members: dict[str, Any] = {m.value: m for m in items}
            if blank:
                members = {"": None, **members}
        elif blank:
            raise ValueError("Choice: blank=True is for Enum members; list '' among string options instead")
        else:
            members = {o: o for o in items}
        if not members or not all(type(k) is str for k in members):
            raise ValueError(f"Choice needs string options, got {list(members)}")
        self.members = members
        self.names = tuple(members)

    @property
    def plain(self) -> bool:
        return all(k is v for k, v in self.members.items())

    def check(self, value: Any, path: str) -> Any:
        if type(value) is not str or value not in self.members:
            raise FieldError(path, f"one of {', '.join(self.names)}", value)
        return self.members[value]

    def test(self, gen: Source, v: str) -> str:
        return f"type({v}) is str and {v} in {gen.const(frozenset(self.members))}"

    def emit(self, gen: Source, src: str, ind: str) -> str:
        gen.line(ind, f"if not ({self.test(gen, src)}): return FAIL")
        return src if self.plain else f"{gen.const(self.members)}[{src}]"

    def encode(self, gen: Source, expr: str) -> str:
        if self.plain:
            return expr
        if "" in self.members:
            return f"('' if {expr} is None else {expr}.value)"
        return f"{expr}.value"


class Opt(Kind):
    """``null`` or a value of ``kind``."""

    __slots__ = ("kind",)

    def __init__(self, kind: Any) -> None:
        self.kind = as_kind(kind)

    @property
    def plain(self) -> bool:
        return self.kind.plain

    def check(self, value: Any, path: str) -> Any:
        return None if value is None else self.kind.check(value, path)

    def test(self, gen: Source, v: str) -> str:
        return f"{v} is None or ({self.kind.test(gen, v)})"

    def emit(self, gen: Source, src: str, ind: str) -> str:
        if self.kind.plain:
            return super().emit(gen, src, ind)
        dst = gen.var()
        gen.line(ind, f"if {src} is None: {dst} = None")
        gen.line(ind, "else:")
        gen.line(ind + "    ", f"{dst} = {self.kind.emit(gen, src, ind + '    ')}")
        return dst

    def encode(self, gen: Source, expr: str) -> str:
        inner = self.kind.encode(gen, expr)
        return expr if inner == expr else f"(None if {expr} is None else {inner})"


class List(Kind):
    """A list of ``min_len`` to ``max_len`` values of ``item``, decoded to a tuple."""

    __slots__ = ("item", "max_len", "min_len")

    @property
    def plain(self) -> bool:
        return False

    def __init__(self, item: Any, max_len: int, *, min_len: int = 0) -> None:
        self.item, self.max_len, self.min_len = as_kind(item), _size("max_len", max_len), _size("min_len", min_len)

    def _expected(self) -> str:
        if self.min_len:
            return f"a list of {self.min_len} to {self.max_len} items"
        return f"a list of at most {self.max_len} items"

    def check(self, value: Any, path: str) -> tuple[Any, ...]:
        if type(value) is not list or not self.min_len <= len(value) <= self.max_len:
            raise FieldError(path, self._expected(), value)
        item = self.item
        return tuple([item.check(x, f"{path}[{i}]") for i, x in enumerate(value)])

    def emit(self, gen: Source, src: str, ind: str) -> str:
        length = (
            f"not {self.min_len} <= len({src}) <= {self.max_len}" if self.min_len else f"len({src}) > {self.max_len}"
        )
        gen.line(ind, f"if type({src}) is not list or {length}: return FAIL")
        x = gen.var("x")
        return _emit_each(gen, ind, f"{x} in {src}", src, self.item, x)

    def encode(self, gen: Source, expr: str) -> str:
        x = gen.var("x")
        inner = self.item.encode(gen, x)
        return f"list({expr})" if inner == x else f"[{inner} for {x} in {expr}]"


class Tuple(Kind):
    """A list of exactly ``len(items)`` values, each of its own kind (``Tuple(BETA, BETA)``), decoded to a tuple."""

    __slots__ = ("items",)

    @property
    def plain(self) -> bool:
        return False

    def __init__(self, *items: Any) -> None:
        if not items:
            raise ValueError("Tuple needs at least one item kind")
        self.items = tuple(as_kind(i) for i in items)

    def check(self, value: Any, path: str) -> tuple[Any, ...]:
        if type(value) is not list or len(value) != len(self.items):
            raise FieldError(path, f"a list of {len(self.items)} items", value)
        return tuple([k.check(x, f"{path}[{i}]") for i, (k, x) in enumerate(zip(self.items, value, strict=True))])

    def emit(self, gen: Source, src: str, ind: str) -> str:
        gen.line(ind, f"if type({src}) is not list or len({src}) != {len(self.items)}: return FAIL")
        names = [gen.var() for _ in self.items]
        gen.line(ind, f"{', '.join(names)}, = {src}")
        values = [k.emit(gen, n, ind) for k, n in zip(self.items, names, strict=True)]
        return f"({', '.join(values)},)"

    def encode(self, gen: Source, expr: str) -> str:
        parts = [k.encode(gen, f"{expr}[{i}]") for i, k in enumerate(self.items)]
        if all(p == f"{expr}[{i}]" for i, p in enumerate(parts)):
            return f"list({expr})"
        return f"[{', '.join(parts)}]"


class Map(Kind):
    """A JSON object of at most ``max_len`` entries, keys of kind ``key``, decoded to a tuple of (key, value) pairs."""

    __slots__ = ("key", "max_len", "value")

    @property
    def plain(self) -> bool:
        return False

    def __init__(self, key: Kind, value: Any, max_len: int) -> None:
        if not key.plain:
            raise ValueError("Map keys must be of a plain kind (Str, Choice of strings)")
        self.key, self.value, self.max_len = key, as_kind(value), _size("max_len", max_len)

    def check(self, value: Any, path: str) -> tuple[tuple[Any, Any], ...]:
        if type(value) is not dict or len(value) > self.max_len:
            raise FieldError(path, f"an object of at most {self.max_len} fields", value)
        out = []
        for k, x in value.items():
            where = f"{path}.{k}"
            out.append((self.key.check(k, where), self.value.check(x, where)))
        return tuple(out)

    def emit(self, gen: Source, src: str, ind: str) -> str:
        gen.line(ind, f"if type({src}) is not dict or len({src}) > {self.max_len}: return FAIL")
        k, x = gen.var("k"), gen.var("x")
        items = f"{src}.items()"
        return _emit_each(gen, ind, f"{k}, {x} in {items}", items, self.value, x, key=(k, self.key.test(gen, k)))

    def encode(self, gen: Source, expr: str) -> str:
        k, x = gen.var("k"), gen.var("x")
        inner = self.value.encode(gen, x)
        return f"dict({expr})" if inner == x else f"{{{k}: {inner} for {k}, {x} in {expr}}}"


def as_kind(value: Any) -> Kind:
    """A ``Kind`` as given, or the kind of a ``@wire`` class."""
    if isinstance(value, Kind):
        return value
    spec = getattr(value, "__dict__", {}).get("__wire__") if isinstance(value, type) else None
    if spec is None:
        raise TypeError(f"{value!r} is neither a field kind nor a @wire record (decorate it with @wire first)")
    if not isinstance(spec, Kind):
        raise TypeError(f"{value!r}'s __wire__ is a {type(spec).__name__}, not a field kind")
    return spec


def _emit_each(
    gen: Source, ind: str, loop: str, items: str, kind: Kind, x: str, *, key: tuple[str, str] | None = None
) -> str:
    """Decode every element of a list or an object: ``for {loop}:`` binds each value to ``x``, of ``kind``, and
    for an object each key to ``key[0]``, which must pass the test ``key[1]``.  Returns the decoded elements as
    a tuple expression: of ``items`` itself when ``kind`` is plain (each value only tested), else of a new list
    of the decoded values (or ``(key, value)`` pairs)."""
    body = ind + "    "
    keys = [] if key is None else [key[1]]
    if kind.plain:  # each value only tested: the elements are ``items`` as they are
        gen.line(ind, f"for {loop}:")
        gen.line(body, _fail_unless([*keys, kind.test(gen, x)]))
        return f"tuple({items})"
    out = gen.var("out")
    gen.line(ind, f"{out} = []")
    gen.line(ind, f"for {loop}:")
    if keys:
        gen.line(body, _fail_unless(keys))
    value = kind.emit(gen, x, body)
    gen.line(body, f"{out}.append({value if key is None else f'({key[0]}, {value})'})")
    return f"tuple({out})"


def _fail_unless(tests: list[str]) -> str:
    return f"if {' or '.join(f'not ({t})' for t in tests)}: return FAIL"

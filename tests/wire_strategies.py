"""Hypothesis strategies derived from declared field kinds (``tiermem.core.protocol.spec``), for the protocol tests.

``valid(kind)`` draws wire values that pass a kind's own checks, its edges
included; ``wrong(kind)`` values aimed at its edges and at its neighbours'
types; ``mutated(kind, value)`` one place changed inside a wire value (a value
replaced, a key removed or added), with that place's path.  ``shape`` is a
comparable picture of a decoded value (floats by repr, so NaN equals NaN).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hypothesis import strategies as st

from tiermem.core.protocol.fields import FieldError
from tiermem.core.protocol.session import Fact, PowerOfTwo
from tiermem.core.protocol.spec import Bool, Choice, Float, Int, Kind, List, Map, Opt, RecordSpec, Str, Tuple

__all__ = ["join", "json_values", "mutated", "passes", "shape", "valid", "wrong"]


def shape(x: Any) -> Any:
    """A comparable picture of a decoded value: classes by name, containers by type, floats by repr (NaN too)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, tuple((f.name, shape(getattr(x, f.name))) for f in dataclasses.fields(x)))
    if isinstance(x, tuple | list):
        return (type(x).__name__, tuple(shape(i) for i in x))
    if isinstance(x, float):
        return ("float", repr(x))
    return (type(x).__name__, x)


def passes(kind: Kind, value: Any) -> bool:
    try:
        kind.check(value, "")
    except FieldError:
        return False
    return True


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.sampled_from([lo, hi]) | st.integers(lo, min(hi, lo + 3)) | st.integers(lo, hi)


_scalars = st.none() | st.booleans() | st.integers(-(1 << 60), 1 << 60) | st.floats() | st.text(max_size=8)


def valid(kind: Kind) -> st.SearchStrategy[Any]:
    """Wire values that pass ``kind``'s own checks (a record's ``validate`` may still refuse them)."""
    if isinstance(kind, PowerOfTwo):
        return st.sampled_from([1 << b for b in range(63) if kind.lo <= 1 << b <= kind.hi])
    if isinstance(kind, Int):
        return _ints(kind.lo, kind.hi)
    if isinstance(kind, Float):
        lo, hi = max(kind.lo, -1e300), min(kind.hi, 1e300)
        floats = st.floats(lo, hi, exclude_min=kind.lo_open, exclude_max=kind.hi_open)
        some = [i for i in range(math.ceil(lo), math.ceil(lo) + 6) if passes(kind, i)]
        ints = st.sampled_from(some) if some else st.nothing()  # valid: float()ed
        non_finite = [x for x in (math.nan, math.inf) if passes(kind, x)] if not kind.finite else []
        extra = st.sampled_from(non_finite) if non_finite else st.nothing()  # inf only where the bounds allow
        return floats | ints | extra
    if kind is Bool:
        return st.booleans()
    if isinstance(kind, Str):
        text = st.text(min_size=kind.min_len, max_size=min(kind.max_len, 12))
        return text if kind.pattern is None else st.from_regex(kind.pattern, fullmatch=True)
    if isinstance(kind, Choice):
        return st.sampled_from(kind.names)
    if isinstance(kind, Opt):
        return st.none() | valid(kind.kind)
    if isinstance(kind, List):
        return st.lists(valid(kind.item), min_size=kind.min_len, max_size=max(kind.min_len, min(kind.max_len, 4)))
    if isinstance(kind, Tuple):
        return st.tuples(*(valid(k) for k in kind.items)).map(list)
    if isinstance(kind, Map):
        return st.dictionaries(valid(kind.key), valid(kind.value), max_size=min(kind.max_len, 4))
    if isinstance(kind, RecordSpec):
        if kind.array:
            return st.tuples(*(valid(f.kind) for f in kind.fields)).map(list)
        return st.fixed_dictionaries({f.key: valid(f.kind) for f in kind.fields})
    if isinstance(kind, Fact):
        return _scalars | st.lists(_scalars, max_size=4)
    raise AssertionError(f"no strategy for {kind!r}")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


def wrong(kind: Kind) -> st.SearchStrategy[Any]:
    """Values aimed at ``kind``'s edges and at its neighbours' types (most of them wrong)."""
    common: st.SearchStrategy[Any] = json_values | st.sampled_from([None, True, False, 0, 1.0, "", [], {}])
    if isinstance(kind, RecordSpec) and not kind.array:
        # Not another object: that would break several of its fields at once (see the key edits in ``mutated``).
        return common.filter(lambda v: type(v) is not dict)
    if isinstance(kind, Int):
        edges = [kind.lo - 1, kind.hi + 1, float(kind.lo), 10**400, -(10**400), 3, 96]
        return common | st.sampled_from(edges)
    if isinstance(kind, Float):
        edges = [kind.lo, kind.hi, math.nan, math.inf, -math.inf, -1e-300, 10**400, -1, "1.0"]
        return common | st.sampled_from(edges)
    if isinstance(kind, Str):
        return common | st.sampled_from(["x" * (kind.max_len + 1), "", 7, "../x"])
    if isinstance(kind, Choice):
        return common | st.sampled_from([n.upper() for n in kind.names] + ["bogus"])
    if isinstance(kind, List):
        return common | st.builds(lambda: [0] * (kind.max_len + 1)) | st.just([0] * max(kind.min_len - 1, 0))
    if isinstance(kind, Fact):
        return common | st.just([0] * 65) | st.just([[1]])
    return common


def join(parent: str, child: str) -> str:
    """How a record's key extends a path: ``a.b``, ``a[0]``, nothing for an empty side."""
    if not child:
        return parent
    return parent + child if not parent or child.startswith("[") else f"{parent}.{child}"


@st.composite
def mutated(draw: st.DrawFn, kind: Kind, value: Any, path: str = "", *, whole: bool = True) -> tuple[Any, str]:
    """``value`` with one place in it changed (a value replaced, a key removed or added); returns the place's path.

    ``whole=False``: ``value`` itself stays an object (a message payload always is one).
    """
    children: list[tuple[Any, Kind, str]] = []  # (key or index, its kind, its path)
    if isinstance(kind, RecordSpec) and type(value) is dict:
        children = [(f.key, f.kind, join(path, f.key)) for f in kind.fields if f.key in value]
    elif isinstance(kind, RecordSpec | Tuple) and type(value) is list:
        kinds = [f.kind for f in kind.fields] if isinstance(kind, RecordSpec) else list(kind.items)
        children = [(i, k, f"{path}[{i}]") for i, k in enumerate(kinds[: len(value)])]
    elif isinstance(kind, List) and type(value) is list and len(value) <= 64:  # not into an oversize one
        children = [(i, kind.item, f"{path}[{i}]") for i in range(len(value))]
    elif isinstance(kind, Map) and type(value) is dict:
        children = [(k, kind.value, f"{path}.{k}") for k in value]
    elif isinstance(kind, Opt) and value is not None:
        return draw(mutated(kind.kind, value, path))
    edit_keys = isinstance(kind, RecordSpec) and not kind.array and type(value) is dict
    descend = draw(st.integers(0, 3)) > 0
    if children and (descend or not (whole or edit_keys)):
        key, child, where = draw(st.sampled_from(children))
        new, at = draw(mutated(child, value[key], where))
        copy = list(value) if type(value) is list else dict(value)
        copy[key] = new
        return copy, at
    if edit_keys and (not whole or draw(st.booleans())):
        copy = dict(value)
        if value and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(value)))
            del copy[key]
        else:
            key = draw(st.sampled_from(["extra", "Step", "", "[0]"]))
            copy[key] = draw(json_values)
        return copy, join(path, key)
    return draw(wrong(kind)), path

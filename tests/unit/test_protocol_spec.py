"""Declarative wire records: the derived codec gives today's hand-written answers, and its two paths agree.

The declarations under test are in ``tests/spec_messages.py`` (today's STEP,
BUCKET_READY, STEP_DONE, REGISTER, REGISTER_OK, FETCH_PARAMS, STATE_READ and
the records inside them).  Payload strategies are derived from the declared
kinds, so every field's range, its edges and its wrong types are exercised.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any

import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from spec_messages import DECLARED

import tiermem.protocol as today
from tiermem.protocol.fields import FieldError
from tiermem.protocol.records import as_item
from tiermem.protocol.spec import (
    Bool,
    Choice,
    Float,
    Int,
    Kind,
    List,
    Map,
    Opt,
    RecordSpec,
    Str,
    Tuple,
    Wire,
    WireName,
    wire,
)

# --------------------------------------------------------------------------- today's codec, per declared class

TODAY: dict[str, tuple[type, Callable[[Any], Any]]] = {
    "MemRef": (today.MemRef, today.MemRef.from_wire),
    "TensorSlot": (today.TensorSlot, today.TensorSlot.from_wire),
    "ParamGroup": (today.ParamGroup, as_item(today.ParamGroup.from_payload)),
    "TensorSpec": (today.TensorSpec, as_item(today.TensorSpec.from_payload)),
    **{
        name: (getattr(today, name), getattr(today, name).from_payload)
        for name in ("Register", "RegisterOk", "Step", "BucketReady", "StepDone", "FetchParams", "StateRead")
    },
}


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _matches_today(cls: type) -> bool:
    return _field_names(cls) == _field_names(TODAY[cls.__name__][0])


PAIRS = [cls for cls in DECLARED if _matches_today(cls)]


@pytest.mark.parametrize("cls", DECLARED, ids=lambda c: c.__name__)
def test_declaration_has_todays_fields(cls: type) -> None:
    if not _matches_today(cls):
        pytest.skip(
            f"tiermem.protocol.{cls.__name__} now has fields {_field_names(TODAY[cls.__name__][0])}; "
            f"tests/spec_messages.py declares {_field_names(cls)}: declare it again"
        )


def _encode_today(obj: Any) -> Any:
    return obj.to_wire() if hasattr(obj, "to_wire") else obj.to_payload()


# --------------------------------------------------------------------------- outcomes


def shape(x: Any) -> Any:
    """A comparable picture of a decoded value: classes by name, containers by type, floats by repr (NaN too)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, tuple((f.name, shape(getattr(x, f.name))) for f in dataclasses.fields(x)))
    if isinstance(x, tuple | list):
        return (type(x).__name__, tuple(shape(i) for i in x))
    if isinstance(x, float):
        return ("float", repr(x))
    return (type(x).__name__, x)


def outcome(decode: Callable[[Any], Any], payload: Any) -> tuple[str, Any]:
    try:
        return "ok", shape(decode(payload))
    except FieldError as exc:
        return "error", exc.path
    except OverflowError:  # today's STEP_DONE timings, for an integer beyond float range
        return "crash", "OverflowError"


def both(cls: type, payload: Any) -> tuple[tuple[str, Any], tuple[str, Any]]:
    return outcome(TODAY[cls.__name__][1], payload), outcome(cls.from_payload, payload)  # type: ignore[attr-defined]


def assert_same_answer(cls: type, payload: Any) -> tuple[str, Any]:
    old, new = both(cls, payload)
    if old == ("crash", "OverflowError"):
        # Today's STEP_DONE lets OverflowError escape the decoder (float() of a huge int seconds value);
        # the declared Float refuses it as "a number", at the field's path.
        assert new[0] == "error" and new[1].startswith("timings."), (old, new)
        return new
    assert old == new, payload
    return new


# --------------------------------------------------------------------------- payloads derived from the kinds


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.sampled_from([lo, hi]) | st.integers(lo, min(hi, lo + 3)) | st.integers(lo, hi)


def valid(kind: Kind) -> st.SearchStrategy[Any]:
    """Wire values that pass ``kind``'s own checks (a record's ``validate`` may still refuse them)."""
    if isinstance(kind, Int):
        return _ints(kind.lo, kind.hi)
    if isinstance(kind, Float):
        lo, hi = max(kind.lo, -1e300), min(kind.hi, 1e300)
        floats = st.floats(lo, hi, exclude_min=kind.lo_open, exclude_max=kind.hi_open)
        ints = st.integers(math.ceil(lo), math.ceil(lo) + 5).filter(lambda i: _passes(kind, i))  # valid: float()ed
        extra = st.sampled_from([math.nan, math.inf]) if not kind.finite else st.nothing()
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
    raise AssertionError(f"no strategy for {kind!r}")


def _passes(kind: Kind, value: Any) -> bool:
    try:
        kind.check(value, "")
    except FieldError:
        return False
    return True


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
        return common | st.sampled_from([kind.lo - 1, kind.hi + 1, float(kind.lo), 10**400, -(10**400)])
    if isinstance(kind, Float):
        edges = [kind.lo, kind.hi, math.nan, math.inf, -math.inf, -1e-300, 10**400, -1, "1.0"]
        return common | st.sampled_from(edges)
    if isinstance(kind, Str):
        return common | st.sampled_from(["x" * (kind.max_len + 1), "", 7])
    if isinstance(kind, Choice):
        return common | st.sampled_from([n.upper() for n in kind.names] + ["bogus"])
    if isinstance(kind, List):
        return common | st.builds(lambda: [0] * (kind.max_len + 1)) | st.just([0] * max(kind.min_len - 1, 0))
    return common


def join(parent: str, child: str) -> str:
    """How a record's key extends a path (``FieldError.within``): ``a.b``, ``a[0]``, nothing for an empty side."""
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


def is_message(cls: type) -> bool:
    return hasattr(cls, "TYPE")


def spec_of(cls: type) -> RecordSpec:
    return cls.__wire__  # type: ignore[attr-defined]


def _related(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a)


CROSS_FIELD = re.compile(r"tensors\[\d+\]\.(group|name)")  # REGISTER's validate: group index, unique names


# --------------------------------------------------------------------------- the declared codec against today's


by_class = pytest.mark.parametrize("cls", PAIRS, ids=lambda c: c.__name__)


@by_class
@settings(max_examples=30)
@given(st.data())
def test_valid_payloads_decode_to_equal_objects_and_encode_to_the_same_bytes(cls: type, data: st.DataObject) -> None:
    payload = data.draw(valid(spec_of(cls)))
    answer = assert_same_answer(cls, payload)
    if answer[0] != "ok":  # a record's cross-field check refused it, as today's did
        return
    new = cls.from_payload(payload)  # type: ignore[attr-defined]
    old = TODAY[cls.__name__][1](payload)
    assert json.dumps(new.to_payload()) == json.dumps(_encode_today(old))
    assert shape(cls.from_payload(json.loads(json.dumps(new.to_payload())))) == shape(new)  # type: ignore[attr-defined]


@by_class
@settings(max_examples=120)
@given(st.data())
def test_one_defect_is_refused_at_the_same_field_or_accepted_alike(cls: type, data: st.DataObject) -> None:
    payload = data.draw(valid(spec_of(cls)))
    assume(_passes(spec_of(cls), payload))  # not refused already by a cross-field check
    payload, at = data.draw(mutated(spec_of(cls), payload, whole=not is_message(cls)))
    kind, path = assert_same_answer(cls, payload)
    event(f"{cls.__name__} {kind}")
    if kind == "error":
        assert _related(path, at) or CROSS_FIELD.fullmatch(path), (path, at)


@by_class
@settings(max_examples=50)
@given(st.data())
def test_several_defects_are_refused_alike_naming_a_broken_field(cls: type, data: st.DataObject) -> None:
    payload = data.draw(valid(spec_of(cls)))
    places = []
    for _ in range(data.draw(st.integers(2, 4))):
        payload, at = data.draw(mutated(spec_of(cls), payload, whole=not is_message(cls)))
        places.append(at)
    old, new = both(cls, payload)
    if old == ("crash", "OverflowError"):
        assert new[0] == "error"
        return
    assert old[0] == new[0]
    if new[0] == "ok":
        assert old == new
        return
    # Fields are checked in declaration order here, in each class's own order today: with several
    # defects the two may name different ones, but each names one that was broken.
    for path in (old[1], new[1]):
        assert any(_related(path, p) for p in places) or CROSS_FIELD.fullmatch(path), (path, places)


@by_class
@settings(max_examples=50)
@given(st.data())
def test_arbitrary_objects_are_accepted_alike(cls: type, data: st.DataObject) -> None:
    """Any JSON object, its keys mostly the declared ones: every field may be of any type at once."""
    keys = st.sampled_from(sorted(spec_of(cls).keys)) | st.text(max_size=6)
    payload = data.draw(st.dictionaries(keys, json_values, max_size=len(spec_of(cls).keys) + 1))
    old, new = both(cls, payload)
    assert old[0] == new[0] or old == ("crash", "OverflowError")
    if new[0] == "ok":
        assert old == new


def declared(name: str) -> Any:
    cls = next((c for c in PAIRS if c.__name__ == name), None)
    if cls is None:
        pytest.skip(f"tiermem.protocol.{name} is declared differently today")
    return cls


def step_payload() -> dict[str, Any]:
    group = declared("ParamGroup")(lr=1e-3, weight_decay=0.01)
    return declared("Step")(step=3, groups=(group, group), max_grad_norm=1.0, tensor_ids=(1, 2)).to_payload()


def error_path(name: str, payload: Any) -> str:
    old, new = both(declared(name), payload)
    assert old == new and old[0] == "error", (old, new)
    return str(new[1])


def test_huge_lists_are_refused_at_the_list() -> None:
    step = step_payload()
    assert error_path("Step", dict(step, tensor_ids=[0] * (today.records.MAX_TENSORS + 1))) == "tensor_ids"
    assert error_path("Step", dict(step, groups=step["groups"] * (today.records.MAX_GROUPS // 2 + 1))) == "groups"


def test_nested_paths_and_number_rules_match_today() -> None:
    step = step_payload()
    bad_beta = dict(step["groups"][1], betas=[0.9, 1.0])
    assert error_path("Step", dict(step, groups=[step["groups"][0], bad_beta])) == "groups[1].betas[1]"
    assert error_path("Step", dict(step, step=True)) == "step"
    assert error_path("Step", dict(step, loss_scale=math.nan)) == "loss_scale"
    assert error_path("Step", dict(step, loss_scale=0)) == "loss_scale"
    assert error_path("Step", dict(step, bogus=1, zz=2)) == "bogus"
    assert error_path("Step", {k: v for k, v in step.items() if k != "delayed"}) == "delayed"
    with_ints = dict(step, loss_scale=4, groups=[dict(step["groups"][0], lr=1)])
    new = declared("Step").from_payload(with_ints)
    assert type(new.loss_scale) is float and type(new.groups[0].lr) is float
    assert shape(new) == shape(today.Step.from_payload(with_ints))


def test_todays_step_done_lets_overflow_escape_where_the_declared_one_refuses() -> None:
    done = declared("StepDone")(step=1, attempt=0, found_inf=False).to_payload()
    huge = dict(done, timings={"update": 10**400})
    with pytest.raises(OverflowError):
        today.StepDone.from_payload(huge)
    with pytest.raises(FieldError) as info:
        declared("StepDone").from_payload(huge)
    assert (info.value.path, info.value.expected) == ("timings.update", "a number")


# --------------------------------------------------------------------------- the two paths of the declared codec


def _fast_answer(cls: type, payload: Any) -> Any:
    obj = spec_of(cls).decode_fast(cls, payload)
    return None if obj is None else shape(obj)


@pytest.mark.parametrize("cls", DECLARED, ids=lambda c: c.__name__)
@settings(max_examples=80)
@given(st.data())
def test_generated_decoder_agrees_with_the_checked_one(cls: type, data: st.DataObject) -> None:
    payload = data.draw(valid(spec_of(cls)))
    if data.draw(st.booleans()):
        payload, _ = data.draw(mutated(spec_of(cls), payload, whole=not is_message(cls)))
    fast = _fast_answer(cls, payload)
    checked = outcome(lambda d: spec_of(cls).decode_checked(cls, d), payload)
    if fast is not None:  # the generated decoder accepts only what the checks accept, as the same object
        assert checked == ("ok", fast)
    assert outcome(cls.from_payload, payload) == checked  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- the layer itself


class Phase(Enum):
    IDLE = "idle"
    FAILED = "failed"


@wire(array=True)
@dataclass(frozen=True, slots=True)
class Pair(Wire):
    a: Annotated[int, Int(0, 9)]
    b: Annotated[str, Str(4, pattern=r"[a-z]+")]


@wire
@dataclass(slots=True)
class Everything(Wire):
    phase: Annotated[Phase, Choice(Phase)]
    kind: Annotated[str, Str(8), WireName("type")]
    pair: Annotated[Pair | None, Opt(Pair)] = None
    pairs: Annotated[tuple[Pair, ...], List(Pair, 3)] = ()
    by_name: Annotated[tuple[tuple[str, Pair], ...], Map(Str(8), Pair, 4)] = ()
    maybe: Annotated[tuple[int, ...] | None, Opt(List(Int(0, 1), 2))] = None
    mixed: Annotated[tuple[Phase, Pair], Tuple(Choice(Phase), Pair)] = (Phase.IDLE, Pair(0, "a"))
    ratio: Annotated[float, Float(gt=0.0, le=1.0)] = 0.5
    any_norm: Annotated[float, Float(finite=False)] = 0.0
    flag: bool = False


EVERYTHING = Everything(
    Phase.FAILED,
    "k",
    Pair(1, "ab"),
    (Pair(2, "c"),),
    (("x", Pair(3, "d")),),
    (0, 1),
    (Phase.IDLE, Pair(4, "e")),
    1.0,
    -math.inf,
    True,
)
EVERYTHING_WIRE = {
    "phase": "failed",
    "type": "k",
    "pair": [1, "ab"],
    "pairs": [[2, "c"]],
    "by_name": {"x": [3, "d"]},
    "maybe": [0, 1],
    "mixed": ["idle", [4, "e"]],
    "ratio": 1.0,
    "any_norm": -math.inf,
    "flag": True,
}


def test_every_kind_encodes_and_decodes() -> None:
    assert EVERYTHING.to_payload() == EVERYTHING_WIRE
    assert Everything.from_payload(EVERYTHING_WIRE) == EVERYTHING
    assert frozenset(EVERYTHING_WIRE) == Everything.KEYS
    checked = Everything.__wire__.decode_checked(Everything, EVERYTHING_WIRE)
    assert checked == EVERYTHING and checked.phase is Phase.FAILED


@pytest.mark.parametrize(
    ("change", "path", "expected"),
    [
        ({"phase": "IDLE"}, "phase", "one of idle, failed"),
        ({"type": "x" * 9}, "type", "a string of at most 8 characters"),
        ({"pair": [1, "AB"]}, "pair[1]", "a string matching [a-z]+"),
        ({"pair": [1]}, "pair", "a [a, b] list"),
        ({"pairs": [[0, "a"], [10, "b"]]}, "pairs[1][0]", "an integer in [0, 9]"),
        ({"by_name": {"k": [1, 2]}}, "by_name.k[1]", "a string of at most 4 characters"),
        ({"maybe": [0, 2]}, "maybe[1]", "an integer in [0, 1]"),
        ({"mixed": ["idle"]}, "mixed", "a list of 2 items"),
        ({"ratio": 0.0}, "ratio", "a number in (0.0, 1.0]"),
        ({"ratio": math.inf}, "ratio", "a finite number"),
        ({"flag": 1}, "flag", "true or false"),
        ({"kind": "k"}, "kind", "one of the fields"),
    ],
)
def test_errors_name_the_field_and_what_was_expected(change: dict[str, Any], path: str, expected: str) -> None:
    payload = dict(EVERYTHING_WIRE, **change)
    for decode in (Everything.from_payload, lambda d: Everything.__wire__.decode_checked(Everything, d)):
        with pytest.raises(FieldError) as info:
            decode(payload)
        assert info.value.path == path
        assert info.value.expected.startswith(expected)


def test_nan_passes_only_where_non_finite_values_are_declared() -> None:
    assert math.isnan(Everything.from_payload(dict(EVERYTHING_WIRE, any_norm=math.nan)).any_norm)
    with pytest.raises(FieldError, match="ratio"):
        Everything.from_payload(dict(EVERYTHING_WIRE, ratio=math.nan))


def test_a_subclass_decodes_to_itself() -> None:
    @dataclass(slots=True)
    class Later(Everything):
        pass

    assert type(Later.from_payload(EVERYTHING_WIRE)) is Later


def test_declaration_mistakes_fail_at_class_creation() -> None:
    with pytest.raises(TypeError, match="no wire kind"):

        @wire
        @dataclass
        class Untyped:
            x: int

    with pytest.raises(TypeError, match="above @dataclass"):

        @wire
        class NotData:
            pass

    with pytest.raises(TypeError, match="decorate it with @wire"):
        List(dict, 3)
    with pytest.raises(ValueError, match="one lower bound"):
        Float(ge=0.0, gt=0.0)


class Number(Kind):
    """An int or a float, kept as sent (STATS_REPLY's values)."""

    __slots__ = ()

    def check(self, value: Any, path: str) -> Any:
        if type(value) not in (int, float):
            raise FieldError(path, "a number", value)
        return value


@wire
@dataclass(slots=True)
class Numbers(Wire):
    values: Annotated[tuple[tuple[str, float], ...], Map(Str(8), Number(), 4)]


def test_a_kind_of_ones_own_needs_only_check() -> None:
    assert Numbers.from_payload({"values": {"a": 1, "b": 2.5}}) == Numbers((("a", 1), ("b", 2.5)))
    assert Numbers.__wire__.decode_fast(Numbers, {"values": {"a": 1}}) == Numbers((("a", 1),))
    with pytest.raises(FieldError) as info:
        Numbers.from_payload({"values": {"a": "1"}})
    assert info.value.path == "values.a"
    assert Numbers((("a", 1),)).to_payload() == {"values": {"a": 1}}

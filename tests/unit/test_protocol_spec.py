"""Declarative wire records: the layer (``tiermem.core.protocol.spec``) on the product's messages, and on every kind.

Payload strategies are derived from the declared kinds (``tests/wire_strategies.py``), so every field's
range, its edges and its wrong types are exercised on each record and message of ``tiermem.core.protocol``:
a payload that passes its kinds decodes and encodes back to the same JSON (same keys, same order); one
defect is refused at that field (or by the record's cross-field check); no input raises anything but
``FieldError``.  ``test_protocol_fuzz.py`` holds the generated decoder to the interpreted checks.
"""

from __future__ import annotations

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
from wire_strategies import json_values, mutated, passes, shape, valid

from tiermem.core.modes import Placement
from tiermem.core.protocol import MESSAGE_CLASSES, MemRef, ParamGroup, Step, StepDone, TensorSlot, TensorSpec
from tiermem.core.protocol.fields import FieldError
from tiermem.core.protocol.records import MAX_GROUPS, MAX_TENSORS
from tiermem.core.protocol.spec import (
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

RECORDS: tuple[type[Wire], ...] = (MemRef, ParamGroup, TensorSpec, TensorSlot, *MESSAGE_CLASSES.values())

CROSS_FIELD = re.compile(r"tensors\[\d+\]\.(group|name)|rank|offset|nbytes|token")
"""Paths a record's ``validate`` names: REGISTER's group index and unique names, ATTACH's rank, STATE_CHUNK's range."""


def spec_of(cls: type) -> RecordSpec:
    return cls.__wire__  # type: ignore[attr-defined]


def is_message(cls: type) -> bool:
    return hasattr(cls, "TYPE")


def outcome(decode: Callable[[Any], Any], payload: Any) -> tuple[str, Any]:
    try:
        return "ok", shape(decode(payload))
    except FieldError as exc:
        return "error", exc.path


def same_json(a: Any, b: Any) -> bool:
    """Equal JSON values, an int equal to the float it was decoded to, NaN equal to NaN."""
    if type(a) is bool or type(b) is bool:
        return a is b
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and (a == b or (a != a and b != b))
    if type(a) is list and type(b) is list:
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is dict and type(b) is dict:
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def assert_round_trips(cls: type, payload: Any) -> None:
    """An accepted payload: the object encodes to the same JSON, keys in the same order, and decodes to itself."""
    obj = cls.from_payload(payload)  # type: ignore[attr-defined]
    again = json.loads(json.dumps(obj.to_payload()))
    assert same_json(again, payload), (again, payload)
    if type(again) is dict:
        assert list(again) == [f.key for f in spec_of(cls).fields]
    assert shape(cls.from_payload(again)) == shape(obj)  # type: ignore[attr-defined]


def _related(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a)


# --------------------------------------------------------------------------- the product's records and messages


def each_record(max_examples: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The test as a property of every record and message class ``cls``: ``max_examples`` draws of ``data`` each."""

    def decorate(test: Callable[..., None]) -> Callable[..., None]:
        by_class = pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
        return by_class(settings(max_examples=max_examples)(given(st.data())(test)))

    return decorate


def assert_refused_at_or_round_trips(cls: type, payload: Any, places: list[str]) -> None:
    """A defective ``payload`` is refused naming one of the broken ``places`` (or by a cross-field check), or
    accepted and then encoded back to the same JSON."""
    kind, detail = outcome(cls.from_payload, payload)  # type: ignore[attr-defined]
    event(f"{kind}")
    if kind == "error":
        assert any(_related(detail, p) for p in places) or CROSS_FIELD.fullmatch(detail), (detail, places)
    else:
        assert_round_trips(cls, payload)


@each_record(max_examples=30)
def test_valid_payloads_decode_and_encode_to_the_same_json(cls: type, data: st.DataObject) -> None:
    payload = data.draw(valid(spec_of(cls)))
    kind, detail = outcome(cls.from_payload, payload)  # type: ignore[attr-defined]
    event(f"{kind}")
    if kind == "error":  # only a cross-field check may refuse what every field's kind accepts
        assert CROSS_FIELD.fullmatch(detail), detail
        return
    assert_round_trips(cls, payload)


@each_record(max_examples=80)
def test_one_defect_is_refused_at_that_field_or_accepted(cls: type, data: st.DataObject) -> None:
    payload = data.draw(valid(spec_of(cls)))
    assume(passes(spec_of(cls), payload))  # not refused already by a cross-field check
    payload, at = data.draw(mutated(spec_of(cls), payload, whole=not is_message(cls)))
    assert_refused_at_or_round_trips(cls, payload, [at])


@each_record(max_examples=40)
def test_several_defects_are_refused_naming_a_broken_field(cls: type, data: st.DataObject) -> None:
    payload = data.draw(valid(spec_of(cls)))
    places = []
    for _ in range(data.draw(st.integers(2, 4))):
        payload, at = data.draw(mutated(spec_of(cls), payload, whole=not is_message(cls)))
        places.append(at)
    assert_refused_at_or_round_trips(cls, payload, places)


@each_record(max_examples=40)
def test_arbitrary_values_raise_only_field_errors(cls: type, data: st.DataObject) -> None:
    """Any JSON value (for a message, any object, its keys mostly the declared ones): every field may be wrong."""
    spec = spec_of(cls)
    keys = st.sampled_from(sorted(spec.keys)) if spec.keys else st.nothing()
    objects = st.dictionaries(keys | st.text(max_size=6), json_values, max_size=len(spec.keys) + 1)
    payload = data.draw(objects if is_message(cls) else objects | json_values)
    if outcome(cls.from_payload, payload)[0] == "ok":  # type: ignore[attr-defined]
        assert_round_trips(cls, payload)


def step_payload() -> dict[str, Any]:
    group = ParamGroup(lr=1e-3, weight_decay=0.01)
    return Step(step=3, groups=(group, group), max_grad_norm=1.0, tensor_ids=(1, 2)).to_payload()


def error_path(cls: type, payload: Any) -> str:
    kind, detail = outcome(cls.from_payload, payload)  # type: ignore[attr-defined]
    assert kind == "error", detail
    return str(detail)


def test_huge_lists_are_refused_at_the_list() -> None:
    step = step_payload()
    assert error_path(Step, dict(step, tensor_ids=[0] * (MAX_TENSORS + 1))) == "tensor_ids"
    assert error_path(Step, dict(step, groups=step["groups"] * (MAX_GROUPS // 2 + 1))) == "groups"


def test_nested_paths_and_number_rules() -> None:
    step = step_payload()
    bad_beta = dict(step["groups"][1], betas=[0.9, 1.0])
    assert error_path(Step, dict(step, groups=[step["groups"][0], bad_beta])) == "groups[1].betas[1]"
    assert error_path(Step, dict(step, step=True)) == "step"
    assert error_path(Step, dict(step, loss_scale=math.nan)) == "loss_scale"
    assert error_path(Step, dict(step, loss_scale=0)) == "loss_scale"
    assert error_path(Step, dict(step, bogus=1, zz=2)) == "bogus"
    assert error_path(Step, {k: v for k, v in step.items() if k != "delayed"}) == "delayed"
    with_ints = dict(step, loss_scale=4, groups=[dict(step["groups"][0], lr=1)])
    decoded = Step.from_payload(with_ints)
    assert type(decoded.loss_scale) is float and type(decoded.groups[0].lr) is float


def test_an_integer_beyond_float_range_is_refused_as_a_number() -> None:
    done = StepDone(step=1, attempt=0).to_payload()
    with pytest.raises(FieldError) as info:
        StepDone.from_payload(dict(done, timings={"update": 10**400}))
    assert (info.value.path, info.value.expected) == ("timings.update", "a number")


def test_every_message_has_its_declared_keys() -> None:
    for cls in MESSAGE_CLASSES.values():
        spec = spec_of(cls)
        assert spec.cls is cls
        assert frozenset(f.key for f in spec.fields) == cls.KEYS


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


@wire
@dataclass(frozen=True, slots=True)
class Where(Wire):
    known: Annotated[Placement | None, Choice(Placement, blank=True)]
    few: Annotated[Placement, Choice((Placement.CPU, Placement.NVME))] = Placement.CPU


def test_a_choice_of_enum_members_decodes_to_them_and_encodes_their_values() -> None:
    for where, payload in [
        (Where(None), {"known": "", "few": "cpu"}),
        (Where(Placement.AUTO, Placement.NVME), {"known": "auto", "few": "nvme"}),
    ]:
        assert where.to_payload() == payload
        for decode in (Where.from_payload, lambda d: Where.__wire__.decode_checked(Where, d)):
            assert decode(payload) == where
    with pytest.raises(FieldError) as info:
        Where.from_payload({"known": "", "few": "auto"})
    assert (info.value.path, info.value.expected) == ("few", "one of cpu, nvme")
    with pytest.raises(ValueError, match="blank=True"):
        Choice(("a", "b"), blank=True)


@pytest.mark.parametrize("cls", [Pair, Everything, Where], ids=lambda c: c.__name__)
@settings(max_examples=150)
@given(st.data())
def test_generated_decoder_agrees_with_the_checked_one(cls: type, data: st.DataObject) -> None:
    payload = data.draw(valid(spec_of(cls)))
    if data.draw(st.booleans()):
        payload, _ = data.draw(mutated(spec_of(cls), payload, whole=cls is not Everything))
    fast = spec_of(cls).decode_fast(cls, payload)
    checked = outcome(lambda d: spec_of(cls).decode_checked(cls, d), payload)
    if fast is not None:  # the generated decoder accepts only what the checks accept, as the same object
        assert checked == ("ok", shape(fast))
    assert outcome(cls.from_payload, payload) == checked  # type: ignore[attr-defined]


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
    """An int or a float, kept as sent, given by ``check`` alone (the product's ``session.Number`` has a ``test``)."""

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

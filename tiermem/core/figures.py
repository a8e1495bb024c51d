"""Figures: each statistic declared once, on the field of the owner's record that carries it.

A figure is a field of a stats record (``PoolStats.compactions``,
``SwapStats.bytes_read``, ``RankStats.updates``) whose annotation says what
it is, with ``counter``, ``gauge`` or ``histogram``::

    SWAP_BYTES = Family("tiermem_swap_bytes", "Bytes read from and written to swap.", label="direction")
    ...
    compactions: Annotated[int, counter(Family("tiermem_pool_compactions", "Compactions of the pool."))]
    bytes_read: Annotated[int, counter(SWAP_BYTES.at("read"), wire="read_nbytes")] = 0

The declaration is all its readers need, so none of them lists it again:

- Prometheus: the families it is exposed in (``Family``: name, help, the
  label that tells its series apart, histogram buckets).  A family's type is
  its figure's kind unless it says otherwise; ``per_job`` families are the
  figure per job; ``peak`` rolls ranks up by their maximum, not their sum.
  The daemon's collector walks ``declared`` and ``rollup``s each figure over
  the ranks of the node or of a job.
- The wire: its key in the STATS_REPLY records (``wire``; by default the
  field's name).  ``build`` fills a wire record from stats records by key.
- Sums over ranks: ``total`` adds records field by field (counters and
  gauges summed, bools counted, histograms merged, nested records recursed);
  ``ended`` keeps what outlives a rank (its counters), so that node counters
  never go down when a job ends.

Why on the owner's field: the owner is where the number is kept, so a figure
added there reaches the wire and Prometheus with no second list to update.
The wire records (``tiermem.core.protocol.report``) stay hand-declared: they
are the versioned protocol, decoded by clients that never see an owner, and
``build`` fails on a key no record carries.  Fields without a figure are
identities (a job id, a rank) or figures nothing sums: ``build`` reads them
by name, ``total`` leaves them zero.  Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Iterable, Sequence
from functools import reduce
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin, get_type_hints

from tiermem.core.histogram import HistogramSnapshot

__all__ = [
    "Family",
    "Figure",
    "Kind",
    "Series",
    "build",
    "counter",
    "declared",
    "ended",
    "gauge",
    "histogram",
    "rollup",
    "total",
    "value_at",
    "zero",
]

R = TypeVar("R")


class Kind(enum.Enum):
    COUNTER = "counter"
    """Counts since start; outlives the rank that counted it (in the node's totals)."""
    GAUGE = "gauge"
    """A level now; gone with the rank that holds it."""
    HISTOGRAM = "histogram"
    """Observations in buckets (a ``HistogramSnapshot``); a counter of each bucket."""


@dataclasses.dataclass(frozen=True, slots=True)
class Family:
    """One Prometheus metric family (its name without ``_total``: the exposition adds it to counters)."""

    name: str
    help: str
    label: str = ""
    """The label telling its series apart (``direction``), or the key of a field of ``(key, count)`` pairs."""
    per_job: bool = False
    """One series per job, labelled ``tiermem_job`` and ``uid`` (only with ``metrics.job_labels``)."""
    peak: bool = False
    """Ranks roll up by their maximum (the default: their sum)."""
    kind: Kind | None = None
    """Its type where it differs from its figure's (a job's highest step is a gauge of a step counter)."""
    buckets: tuple[float, ...] = ()
    """A histogram's upper bounds."""

    def at(self, value: str) -> Series:
        return Series(self, value)


@dataclasses.dataclass(frozen=True, slots=True)
class Series:
    family: Family
    value: str = ""
    """The value of ``family.label`` for this figure."""


@dataclasses.dataclass(frozen=True, slots=True)
class Figure:
    kind: Kind
    series: tuple[Series, ...]
    wire: str
    """Its key in the wire records ("": the field's name)."""

    def type_in(self, family: Family) -> Kind:
        return family.kind or self.kind


def counter(*series: Family | Series, wire: str = "") -> Figure:
    return Figure(Kind.COUNTER, _series(series), wire)


def gauge(*series: Family | Series, wire: str = "") -> Figure:
    return Figure(Kind.GAUGE, _series(series), wire)


def histogram(*series: Family | Series, wire: str = "") -> Figure:
    """A ``HistogramSnapshot`` field; the first family's ``buckets`` are its bounds."""
    return Figure(Kind.HISTOGRAM, _series(series), wire)


def _series(series: tuple[Family | Series, ...]) -> tuple[Series, ...]:
    return tuple(s if isinstance(s, Series) else Series(s) for s in series)


_Fields = tuple[tuple[dataclasses.Field[Any], Figure | None, type | None], ...]
_FIELDS: dict[type, _Fields] = {}


def _fields(cls: type) -> _Fields:
    """Each field, its figure, and the stats record type it holds (a nested record, optional or not)."""
    if cls not in _FIELDS:
        hints = get_type_hints(cls, include_extras=True)
        out = []
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            meta = get_args(hint)[1:] if get_origin(hint) is Annotated else ()
            hint = get_args(hint)[0] if meta else hint
            fig = next((m for m in meta if isinstance(m, Figure)), None)
            optional = get_args(hint) if isinstance(hint, types.UnionType) or get_origin(hint) is Union else ()
            record = next((t for t in (hint, *optional) if dataclasses.is_dataclass(t)), None)
            out.append((f, fig, record if fig is None and isinstance(record, type) else None))
        _FIELDS[cls] = tuple(out)
    return _FIELDS[cls]


def declared(cls: type) -> list[tuple[tuple[str, ...], Figure]]:
    """Every figure of ``cls`` and of the records nested in it, with its path (for ``value_at``)."""
    out: list[tuple[tuple[str, ...], Figure]] = []
    for f, fig, record in _fields(cls):
        if record is not None:
            out += [((f.name, *path), nested) for path, nested in declared(record)]
        elif fig is not None:
            out.append(((f.name,), fig))
    return out


def value_at(record: Any, path: tuple[str, ...]) -> Any:
    """The figure at ``path`` (from ``declared``), or None where a nested record is absent."""
    for name in path:
        if record is None:
            return None
        record = getattr(record, name)
    return record


def rollup(family: Family, kind: Kind, values: Sequence[Any]) -> Any:
    """One family's value over ranks: histograms merged, ``(key, count)`` pairs summed per key, else sum or max."""
    if kind is Kind.HISTOGRAM:
        return HistogramSnapshot.merge(family.buckets, values)
    if values and isinstance(values[0], tuple):
        keyed: dict[Any, Any] = {}
        for pairs in values:
            for key, n in pairs:
                keyed[key] = keyed.get(key, 0) + n
        return tuple(keyed.items())
    return max(values, default=0) if family.peak else sum(values)


def zero(cls: type[R]) -> R:
    """A record of ``cls`` with every figure zero (histograms empty, optional records and facts None)."""
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f, fig, record in _fields(cls):
        hint = get_origin(hints[f.name]) or hints[f.name]
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
        elif record is not None:
            values[f.name] = zero(record) if hint is record else None
        elif fig is not None and fig.kind is Kind.HISTOGRAM:
            values[f.name] = HistogramSnapshot.empty(fig.series[0].family.buckets)
        elif type(None) in get_args(hints[f.name]):  # an optional fact (``Placement | None``): not known
            values[f.name] = None
        else:
            values[f.name] = hint()
    return cls(**values)


def _add(a: R, b: R) -> R:
    values = {}
    for f, fig, record in _fields(type(a)):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if record is not None:
            values[f.name] = y if x is None else x if y is None else _add(x, y)
        elif fig is None:
            values[f.name] = x
        elif fig.kind is Kind.HISTOGRAM:
            values[f.name] = HistogramSnapshot.merge(x.bounds, (x, y))
        else:
            values[f.name] = x + y
    return type(a)(**values)


def total(cls: type[R], records: Iterable[R]) -> R:
    """The records summed (``bool`` figures count); fields that are not figures are those of ``zero(cls)``."""
    return reduce(_add, records, zero(cls))


def ended(record: R) -> R:
    """What outlives the rank: its gauges zeroed, its counters kept."""
    values = {}
    for f, fig, record_type in _fields(type(record)):
        value = getattr(record, f.name)
        if record_type is not None and value is not None:
            value = ended(value)
        elif fig is not None and fig.kind is Kind.GAUGE:
            value = type(value)()
        values[f.name] = value
    return type(record)(**values)


def build(cls: type[R], *records: Any, **values: Any) -> R:
    """A wire record of ``cls``: ``values``, then each of its keys the records carry (by ``wire`` key or name)."""
    keys = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for record in records:
        for f, fig, _ in _fields(type(record)):
            key = (fig.wire if fig is not None else "") or f.name
            if key in keys and key not in values:
                values[key] = getattr(record, f.name)
    return cls(**values)

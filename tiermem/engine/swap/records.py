"""Records of the swap store: one ``SwapRecord`` per key, one ``Version`` per written copy.

A key's lifecycle (``RecordState``; ``SwapRecord.move`` rejects anything else)::

    NEW ──ok──> STORED ──write──> WRITING ──ok or failed──> STORED
     │  └─failed─┐  │
     │           v  └──delete──> DELETED ──write──> NEW
     └─────────> DELETED

- NEW: the first write (or the first after a delete) is in flight; nothing readable.
- STORED: ``current`` is readable; no write in flight.
- WRITING: ``current`` stays readable while a newer version is written elsewhere
  (WRITING -> DELETED only when a failed commit took ``current`` away and the
  write then failed too).
- DELETED: nothing readable; the record lingers until the next commit so that
  the manifest's copy (``committed``) is freed only once no manifest names it.

A ``Version``'s extents are freed when it is neither ``current`` nor
``committed`` and nothing holds it (``holds`` counts in-flight reads and a
commit that is writing it into a manifest).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from tiermem.core.errors import InvalidState
from tiermem.core.histogram import IO_SECONDS, HistogramSnapshot
from tiermem.engine.swap.extents import Extent

__all__ = ["RecordState", "SwapRecord", "SwapStats", "Version"]


class RecordState(Enum):
    NEW = "new"
    STORED = "stored"
    WRITING = "writing"
    DELETED = "deleted"


_ALLOWED: dict[RecordState, frozenset[RecordState]] = {
    RecordState.NEW: frozenset({RecordState.STORED, RecordState.DELETED}),
    RecordState.STORED: frozenset({RecordState.WRITING, RecordState.DELETED}),
    RecordState.WRITING: frozenset({RecordState.STORED, RecordState.DELETED}),
    RecordState.DELETED: frozenset({RecordState.NEW}),
}


@dataclass(eq=False, slots=True)
class Version:
    """One written copy of a key: where its bytes are and their checksums (one per extent)."""

    number: int
    nbytes: int
    extents: tuple[Extent, ...]
    crcs: tuple[int, ...]
    holds: int = 0
    freed: bool = False


@dataclass(eq=False, slots=True)
class SwapRecord:
    """Everything the store knows about one key."""

    key: str
    state: RecordState
    current: Version | None = None
    """The version reads return."""
    committed: Version | None = None
    """The version the durable manifest names (None: not in the manifest)."""
    next_number: int = 1

    def move(self, target: RecordState) -> None:
        if target not in _ALLOWED[self.state]:
            raise InvalidState(f"swap key {self.key!r}: cannot go from {self.state.value} to {target.value}")
        self.state = target

    @property
    def readable(self) -> bool:
        return self.current is not None


@dataclass(frozen=True, slots=True)
class SwapStats:
    """A snapshot of a store's counters and space."""

    bytes_written: int = 0
    bytes_read: int = 0
    writes: int = 0
    reads: int = 0
    write_errors: int = 0
    read_errors: int = 0
    corruptions: int = 0
    commits: int = 0
    keys: int = 0
    used_nbytes: int = 0
    reserved_nbytes: int = 0
    read_seconds: HistogramSnapshot = field(default_factory=lambda: HistogramSnapshot.empty(IO_SECONDS))
    """Time from submitting a read to its verified completion (failed ones included)."""
    write_seconds: HistogramSnapshot = field(default_factory=lambda: HistogramSnapshot.empty(IO_SECONDS))
    """Time from submitting a write to its completion (failed ones included)."""

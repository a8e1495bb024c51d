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
from typing import Annotated

from tiermem.core.errors import InvalidState
from tiermem.core.figures import Family, counter, gauge, histogram
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


SWAP_BYTES = Family("tiermem_swap_bytes", "Bytes read from and written to swap.", label="direction")
SWAP_IO_ERRORS = Family(
    "tiermem_swap_io_errors",
    "Swap reads, writes and commits that failed with an I/O error (checksum failures are counted apart).",
    label="op",
)
CHECKSUM_FAILURES = Family("tiermem_swap_checksum_failures", "Swap reads whose checksum did not verify.")
SWAP_USED = Family("tiermem_swap_used_bytes", "Swap bytes holding optimizer state.")
SWAP_RESERVED = Family("tiermem_swap_reserved_bytes", "Bytes preallocated in the jobs' swap files.")
SWAP_IO_SECONDS = Family(
    "tiermem_swap_io_seconds",
    "Time from submitting a swap read or write to its (verified) completion.",
    label="op",
    buckets=IO_SECONDS,
)


@dataclass(frozen=True, slots=True)
class SwapStats:
    """A snapshot of a store's counters and space."""

    bytes_written: Annotated[int, counter(SWAP_BYTES.at("write"), wire="written_nbytes")] = 0
    bytes_read: Annotated[int, counter(SWAP_BYTES.at("read"), wire="read_nbytes")] = 0
    writes: Annotated[int, counter()] = 0
    reads: Annotated[int, counter()] = 0
    write_errors: Annotated[int, counter(SWAP_IO_ERRORS.at("write"))] = 0
    read_errors: Annotated[int, counter(SWAP_IO_ERRORS.at("read"))] = 0
    corruptions: Annotated[int, counter(CHECKSUM_FAILURES, wire="checksum_failures")] = 0
    commits: int = 0
    commit_errors: Annotated[int, counter(SWAP_IO_ERRORS.at("commit"))] = 0
    """Commits that failed: deferred (the manifest could not be written) or rolled back (``DataLostError``)."""
    keys: int = 0
    used_nbytes: Annotated[int, gauge(SWAP_USED)] = 0
    reserved_nbytes: Annotated[int, gauge(SWAP_RESERVED)] = 0
    read_seconds: Annotated[HistogramSnapshot, histogram(SWAP_IO_SECONDS.at("read"))] = field(
        default_factory=lambda: HistogramSnapshot.empty(IO_SECONDS)
    )
    """Time from submitting a read to its verified completion (failed ones included)."""
    write_seconds: Annotated[HistogramSnapshot, histogram(SWAP_IO_SECONDS.at("write"))] = field(
        default_factory=lambda: HistogramSnapshot.empty(IO_SECONDS)
    )
    """Time from submitting a write to its completion (failed ones included)."""

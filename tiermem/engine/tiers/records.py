"""Records of the tier manager: one ``TensorRecord`` per registered tensor.

States (``TensorState``; ``TensorRecord.move`` rejects anything else)::

    EMPTY ──page in (zero fill)──┐
                                 v
    NVME ──page in──> PAGING_IN ──ok──> CPU <──release── IN_USE
      ^                   │failed        │  ──acquire──>
      │                   v              │
      └──── (back to NVME or EMPTY) ─────┤
      ^                                  v
      └──────────ok────────────── PAGING_OUT ──failed──> CPU

    IN_USE ──release(discard)──> EMPTY   (contents no longer needed: no write)

- EMPTY: registered and never written, or discarded; its next page-in fills zeros.
- NVME: only the swap store holds it; no pool block.
- PAGING_IN / PAGING_OUT: a transfer is in flight; the block is pinned.
- CPU: resident in a pool block, idle: the only state eviction may pick.
- IN_USE: acquired ``users`` times; pinned; never evicted.

``on_nvme`` says the swap store holds a copy; ``dirty`` that the CPU copy
changed since (so eviction must write it back).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any

from tiermem.core.errors import InvalidState
from tiermem.core.figures import Family, counter
from tiermem.engine.tiers.sizing import CachePlan

__all__ = ["TensorRecord", "TensorState", "TierStats"]


class TensorState(Enum):
    EMPTY = "empty"
    NVME = "nvme"
    PAGING_IN = "paging_in"
    CPU = "cpu"
    IN_USE = "in_use"
    PAGING_OUT = "paging_out"


T = TensorState
_ALLOWED: dict[TensorState, frozenset[TensorState]] = {
    T.EMPTY: frozenset({T.PAGING_IN}),
    T.NVME: frozenset({T.PAGING_IN}),
    T.PAGING_IN: frozenset({T.CPU, T.NVME, T.EMPTY}),
    T.CPU: frozenset({T.IN_USE, T.PAGING_OUT}),
    T.IN_USE: frozenset({T.CPU, T.EMPTY}),
    T.PAGING_OUT: frozenset({T.NVME, T.CPU}),
}


@dataclass(eq=False)
class TensorRecord:
    """Everything the tier manager knows about one tensor."""

    key: str
    dtype: Any
    """A torch dtype."""
    shape: tuple[int, ...]
    nbytes: int
    """Bytes of the tensor's data."""
    padded_nbytes: int
    """``nbytes`` rounded up to whole pages: the size of its block and of its swap object."""
    state: TensorState = TensorState.EMPTY
    block: Any = None
    """The pool ``Block`` while resident (CPU, IN_USE, PAGING_OUT, and PAGING_IN once allocated)."""
    on_nvme: bool = False
    dirty: bool = False
    users: int = 0
    waiters: int = 0
    """Acquires waiting for this tensor: once paged in it is theirs, never a victim before they take it."""
    last_use: int = 0
    error: BaseException | None = None
    """The last failed page-in, raised to the next ``acquire``."""
    write_failed: bool = False
    """Its last page-out failed: not picked for eviction again until it is modified."""
    acquired_at: float = 0.0
    """When its current use began (the first of its concurrent acquires)."""
    skip_read: bool = False
    """The acquire waiting for it overwrites it whole (``acquire(overwrite=True)``): its next page-in gets a
    zeroed block and reads nothing."""
    kept: bool = False
    """Its last user will be back soon (``release(keep=True)``: a grad part written in pieces): a victim only
    when nothing else frees the room."""

    @property
    def resident(self) -> bool:
        return self.state in (T.CPU, T.IN_USE, T.PAGING_OUT)

    def move(self, target: TensorState) -> None:
        if target not in _ALLOWED[self.state]:
            raise InvalidState(f"tensor {self.key!r}: cannot go from {self.state.value} to {target.value}")
        self.state = target


ACQUIRES = Family(
    "tiermem_prefetch_acquires",
    "State chunk parts (params, moments, grads) acquired from the NVMe tier (updates, grad statistics, transfers).",
)
HITS = Family("tiermem_prefetch_hits", "Chunk part acquires that found the part resident.")
STALL = Family("tiermem_prefetch_stall_seconds", "Time chunk acquires waited for page-ins the prefetch did not hide.")
TIER_PAGES = Family("tiermem_tier_pages", "Chunk parts paged between pool and swap.", label="direction")


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of the tier manager's counters."""

    tensors: int
    cpu_nbytes: int
    """Bytes of pool blocks held (resident tensors and page-ins in flight)."""
    cpu_budget_nbytes: int
    acquires: Annotated[int, counter(ACQUIRES)]
    hits: Annotated[int, counter(HITS)]
    """Acquires that found the tensor resident."""
    page_ins: Annotated[int, counter(TIER_PAGES.at("in"))]
    page_outs: Annotated[int, counter(TIER_PAGES.at("out"))]
    bytes_in: Annotated[int, counter(wire="read_nbytes")]
    bytes_out: Annotated[int, counter(wire="written_nbytes")]
    evictions: int
    """Tensors dropped from CPU (written back or clean)."""
    wait_s: Annotated[float, counter(STALL, wire="stall_s")]
    """Time ``acquire`` spent waiting for page-ins (I/O the prefetch did not hide)."""
    io_errors: int
    ceiling_nbytes: int = 0
    """Most pool bytes it may hold, borrowing above ``cpu_budget_nbytes`` (its guaranteed floor)."""
    limit_nbytes: int = 0
    """What the pager plans to now: the ceiling, or what it held when borrowing last failed."""
    given_back: int = 0
    """Tensors paged out because another allocation of the node needed the memory."""
    grow_refused: int = 0
    """Page-ins above the floor that found no free pool room (the manager then evicts its own)."""
    discards: int = 0
    """Tensors dropped without a write because their contents were no longer needed (consumed grads)."""
    prefetch_depth: int = 0
    use_s: float = 0.0
    """Moving average of the seconds between two acquires (what prefetch must stay ahead of)."""
    hold_s: float = 0.0
    """Moving average of the seconds a tensor stays acquired (the update of a chunk, for the NVMe tier)."""
    plan: CachePlan | None = None
    """The sizing the owner decided (``set_plan``): queue depth, prefetch, cache, and why."""

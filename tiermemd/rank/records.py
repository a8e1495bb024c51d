"""What a rank is made of: one record per tensor, the rank's phase, and the step attempt in flight.

Pure: no threads, no I/O.

``TensorRecord``: a registered tensor, its place in the rank's flat state
space and in the shared storage (``tiermem.core.layout``), and its Adam step count
(torch counts steps per parameter: a tensor without a gradient in a step is
not updated and its count does not advance).

``RankPhase`` and its legal moves::

    UNREGISTERED --register--> IDLE
    IDLE --BUCKET_READY--> OVERLAPPING --STEP / ABORT--> IDLE
    IDLE --STEP(delayed)--> DELAYED --next request waits--> IDLE
    any registered phase --an update raised--> FAILED --every tensor reset--> IDLE

In FAILED every request but STATE_RESET, STATS and DETACH is refused with
``StepFailed`` naming the step: part of that step may be written, part not,
so nothing is read or stepped until the state is reloaded.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field

from tiermem.core.errors import InvalidState, StepFailed
from tiermem.core.layout import TensorSlot as LayoutSlot
from tiermem.core.protocol import ParamGroup, TensorSpec

__all__ = ["Attempt", "PhaseRecord", "RankPhase", "TensorRecord"]


@dataclass
class TensorRecord:
    index: int
    spec: TensorSpec
    slot: LayoutSlot
    """Flat range ``[slot.start, slot.stop)`` and byte offset inside each storage region."""
    step: int = 0
    """Adam's step count of this tensor (0: never stepped, its moments are zero)."""

    @property
    def start(self) -> int:
        return self.slot.start

    @property
    def stop(self) -> int:
        return self.slot.stop


class RankPhase(enum.Enum):
    UNREGISTERED = "unregistered"
    IDLE = "idle"
    OVERLAPPING = "overlapping"
    """Buckets of the open attempt are being updated as they land."""
    DELAYED = "delayed"
    """A delayed step's update runs in the background."""
    FAILED = "failed"


_MOVES: dict[RankPhase, frozenset[RankPhase]] = {
    RankPhase.UNREGISTERED: frozenset({RankPhase.IDLE}),
    RankPhase.IDLE: frozenset({RankPhase.OVERLAPPING, RankPhase.DELAYED, RankPhase.FAILED}),
    RankPhase.OVERLAPPING: frozenset({RankPhase.IDLE, RankPhase.FAILED}),
    RankPhase.DELAYED: frozenset({RankPhase.IDLE, RankPhase.FAILED}),
    RankPhase.FAILED: frozenset({RankPhase.IDLE, RankPhase.FAILED}),
}


@dataclass
class PhaseRecord:
    """The rank's phase; every change goes through ``move``."""

    phase: RankPhase = RankPhase.UNREGISTERED
    failed_step: int = 0
    failed_reason: str = ""

    def move(self, to: RankPhase) -> None:
        if to not in _MOVES[self.phase]:
            raise InvalidState(f"a rank cannot go from {self.phase.value} to {to.value}")
        self.phase = to

    def fail(self, step: int, reason: str) -> None:
        if self.phase is not RankPhase.FAILED:
            self.failed_step, self.failed_reason = step, reason
        self.move(RankPhase.FAILED)

    def check_usable(self) -> None:
        """Raise ``StepFailed`` when the rank is FAILED, ``InvalidState`` when it has no tensors yet."""
        if self.phase is RankPhase.FAILED:
            raise StepFailed(self.failed_step, self.failed_reason)
        if self.phase is RankPhase.UNREGISTERED:
            raise InvalidState("the rank has not registered its tensors yet")


@dataclass
class Attempt:
    """An overlapped step attempt: the buckets already handed to the update runner."""

    step: int
    attempt: int
    grad_buffer: int
    groups: tuple[ParamGroup, ...] = ()
    applied: set[int] = field(default_factory=set)
    """Tensors whose update of this step was queued (their step counts are advanced)."""
    futures: list[Future[None]] = field(default_factory=list)

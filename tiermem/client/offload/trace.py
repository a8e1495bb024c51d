"""The fetch trace of param paging: the order in which a step uses its params, recorded once, then followed.

Pure: no tensors, no threads.  A *use* is a group of tensor ids needed at one
moment: the params a submodule owns when its forward starts, or one param a
backward node needs again (a saved tensor unpacked).  The first step records
its uses in order; from the second step on each use is matched against the
recording, and ``upcoming`` names the next groups, which the pager fetches
ahead of compute (prefetch) and keeps instead of releasing.

Matching tolerates a step that differs from the recorded one (an inference
pass between two training steps, a branch taken once): a use that is not the
next recorded one is looked for a little further on, then from the start;
a use found nowhere leaves the trace *lost* (nothing upcoming, no prefetch)
until a later use is found again.

Invariant: ``position`` is the index of the last matched use, or -1 (before
the first use of a step, or ``lost``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FetchTrace"]

Group = tuple[int, ...]

LOOK_AHEAD = 8
"""Recorded uses skipped at most when the next use is not the expected one, before searching from the start."""


@dataclass
class FetchTrace:
    groups: list[Group] = field(default_factory=list)
    """The uses of the recorded step, in order."""
    recording: bool = True
    """The first step is being recorded."""
    position: int = -1
    matched: int = 0
    """Uses matched with the recording since it was made."""
    missed: int = 0
    """Uses not found in the recording."""
    lost: bool = False
    """The last use was not found in the recording."""

    def use(self, group: Group) -> bool:
        """Record or match one use; returns whether it is on the recorded trace."""
        if self.recording:
            self.groups.append(group)
            self.position = len(self.groups) - 1
            return True
        start = self.position + 1
        for at in (*range(start, min(start + LOOK_AHEAD, len(self.groups))), *range(len(self.groups))):
            if self.groups[at] == group:
                self.position = at
                self.matched += 1
                self.lost = False
                return True
        self.position = -1
        self.missed += 1
        self.lost = True
        return False

    def upcoming(self, depth: int) -> list[Group]:
        """The ``depth`` recorded uses after the current one (none while recording or lost)."""
        if self.recording or self.lost or depth <= 0:
            return []
        return self.groups[self.position + 1 : self.position + 1 + depth]

    def end_step(self) -> None:
        """A step ended: stop recording (when something was recorded) and expect the first use again."""
        if self.recording and self.groups:
            self.recording = False
        self.position = -1
        self.lost = False

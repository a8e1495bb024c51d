"""What a client accepts when it reattaches: never a state older than its own, unless it asked to roll back.

The daemon's ATTACH_OK says the step the rank's state is at (``state_step``)
and where it comes from (``state_from``: ``new``, ``live``, ``shutdown``,
``commit``).  A client that knows how far it got (``expected_step``: the step
of the trainer's own checkpoint, or the steps an optimizer already ran) and
finds the state older refuses it with ``StaleStateError`` naming both steps;
``rollback=True`` accepts it, and training goes on from the older step.
Pure: no I/O.
"""

from __future__ import annotations

from tiermem.client.link import AttachInfo
from tiermem.core.errors import InvalidArgument, StaleStateError

__all__ = ["check_resume"]

_WHY = {
    "new": "tiermemd holds no state of this job yet",
    "live": "tiermemd kept the state in memory",
    "shutdown": "tiermemd reopened the state committed when it last stopped",
    "commit": "tiermemd was stopped without a clean shutdown and reopened its last commit",
}


def check_resume(info: AttachInfo, *, expected_step: int | None, rollback: bool) -> None:
    """Raise ``StaleStateError`` when the attached state is older than ``expected_step`` and not ``rollback``."""
    if expected_step is None:
        return
    if expected_step < 0:
        raise InvalidArgument(f"expected_step must be >= 0 or None, got {expected_step}")
    if info.state_step < expected_step and not rollback:
        raise StaleStateError(
            info.job_id, info.rank, info.state_step, expected_step, _WHY.get(info.state_from, info.state_from)
        )

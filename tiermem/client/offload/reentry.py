"""Calls into an optimizer from inside one of its own calls, on the same thread: a signal handler's.

Python runs a signal handler on the main thread between two bytecodes of
whatever it interrupted, and handlers that save a checkpoint are common:
Lightning's SLURM auto-requeue handler calls ``trainer.save_checkpoint`` from
its SIGUSR1 handler, so ``optimizer.state_dict()`` runs wherever the signal
landed, ``step()`` included.  ``Calls`` notes which call of the optimizer the
thread is inside (the outermost) so that a call made from such a handler
knows it interrupted one:

- reading (``state_dict()``, ``flush()``, ``opt.state[p]``) is allowed: the
  optimizer settles what the interrupted call left in flight without taking
  it over (``OffloadAdam._settle``), and the state read is that of a whole
  step, before or after the interrupted one;
- anything that changes the optimizer (``step()``, ``zero_grad()``,
  ``load_state_dict()``, a state write, ``close()``) is refused with
  ``InvalidState``, naming both calls: half of the interrupted call has
  happened and the rest is still to come, so there is no state to change.

Only the outermost call marks the thread: the optimizer's own calls to its
internals (``_flush``, not ``flush``) are not reentries.  Another thread is
never inside: it waits for the connection as it always did.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from tiermem.core.errors import InvalidState

__all__ = ["Calls"]


class Calls:
    """The call of one optimizer this thread is inside, and whether a reentered call runs now."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._thread: int | None = None
        self._call = ""
        self.reentered = False
        """A call made from inside another (a signal handler's) is running on the thread inside."""
        self.reading = False
        """A call that only reads (``reads``) is running: param paging leases no param to a running forward for
        what it does with the params (``tiermem.client.offload.pagehooks.CatchParams``)."""

    def inside(self) -> str:
        """The outermost call this thread is inside ("" when none, or when another thread is)."""
        return self._call if self._thread == threading.get_ident() else ""

    @contextlib.contextmanager
    def enter(self, call: str, *, reads: bool) -> Iterator[None]:
        """Run ``call`` (a name as the user wrote it: ``state_dict()``); ``reads``: it changes nothing, so a
        signal handler may make it while this thread is inside another call."""
        me = threading.get_ident()
        if self._thread is not None and self._thread != me:
            yield  # another thread's call is under way: no reentry (torch's optimizers are not thread-safe either)
            return
        if self._thread is None:
            self._thread, self._call, self.reading = me, call, reads
            try:
                yield
            finally:
                self._thread, self._call, self.reading = None, "", False
            return
        if self.reentered:  # inside a reentered call already (its own reads)
            yield
            return
        if not reads:
            raise InvalidState(
                f"{self.owner}.{call} was called while this thread is inside {self.owner}.{self._call}, from a "
                f"signal handler (or a hook) that interrupted it: only state_dict() and reads of its state may "
                f"be made there; have the handler set a flag, and call {call} once {self._call} has returned"
            )
        self.reentered = self.reading = True
        try:
            yield
        finally:
            self.reentered = self.reading = False

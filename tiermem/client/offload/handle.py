"""The one owner of an ``OffloadAdam``'s daemon connection, registration and step records.

Frameworks copy and wrap optimizers: PyTorch Lightning's ``LightningOptimizer``
makes an instance of a dynamic subclass of the optimizer's class that forwards
attribute reads to the real one, ``copy.copy`` copies ``__dict__``, and both
copies are dropped while the real optimizer trains on.  So nothing an optimizer
object holds may be closed when *an* object is collected, and nothing it
changes while it trains may live in an object's own ``__dict__`` (a copy would
go on with the old value).

``OffloadHandle`` is that owner.  An ``OffloadAdam`` keeps exactly one
reference to it (``_h``); every attribute that changes after construction
(the client, the registered tensors and their feed, the step counts, the
interrupted-step records) is a field here, reached through ``InHandle``
descriptors on the optimizer's class, so an optimizer, its shallow copies and
its wrappers read and write the same values.  The connection is closed by the
optimizer's ``close()`` or, when the last owner of the handle is gone, by a
``weakref.finalize`` (which also runs at interpreter exit); never by
``__del__`` on an object others copy.  The finalizer detaches as ``close()``
does, so a script that ends without ``close()`` frees its job at once instead
of holding it (and a slot of ``jobs.max_jobs_per_uid``) for the grace period;
a program ending on an unhandled exception leaves it for a reattach.

Invariant: ``client`` is not None exactly while a registration is live or
being made; the finalizer, when armed, closes that one client and only when
the connection is this handle's own (``own_client``).
"""

from __future__ import annotations

import itertools
import logging
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiermem.client.offload.reentry import Calls

if TYPE_CHECKING:
    import torch

    from tiermem.client.link import Client
    from tiermem.client.offload.feeds import Feed
    from tiermem.client.offload.shared import SharedFeed
    from tiermem.client.offload.transfer import StateTransfer
    from tiermem.core.modes import Exchange, Placement

__all__ = ["InHandle", "OffloadHandle", "weak_method"]

log = logging.getLogger(__name__)


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) without a reference to its object: the grad hooks a feed leaves on the model's
    params call back into the optimizer through it, so the model does not keep a dropped optimizer alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call


def _ending_on_an_error() -> bool:
    """Whether an unhandled exception reached the top of the program (the interpreter set ``sys.last_value``
    when it printed it, before the exit's finalizers run)."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def _close_client(client: Client, feed: Feed | None) -> None:
    """The finalizer: unhook the feed from the model, detach as ``close()`` does (the job's state is freed),
    and close a connection whose owner is gone (a private daemon stops with it).  After an unhandled exception
    (a crash, Ctrl-C included) the job is not detached: like a killed trainer's, its state waits
    ``jobs.grace_period_s`` for a reattach with its token."""
    try:
        if feed is not None:
            feed.unhook()
        if not _ending_on_an_error():
            client.detach(keep_state=False)
    except Exception as exc:  # a finalizer must not raise
        log.debug("detaching an abandoned tiermemd connection failed: %s", exc)
    try:
        client.close()
    except Exception as exc:  # a finalizer must not raise
        log.debug("closing an abandoned tiermemd connection failed: %s", exc)


@dataclass(eq=False)
class OffloadHandle:
    """Everything of an ``OffloadAdam`` that changes after construction; see the module docstring."""

    client: Client | None = None
    """The connection (None: closed, or not yet registered)."""
    own_client: bool = True
    """Whether the connection is this optimizer's own (made by it, closed by it) or the caller's."""
    registered: bool = False
    closed: bool = False
    """``close()`` ran: the optimizer takes nothing more (a new group, a step)."""
    token: str | None = None
    expected_step: int | None = None
    tensors: list[torch.nn.Parameter] = field(default_factory=list)
    """The registered tensors, in tensor-id order (the daemon's ids are their indices)."""
    index: dict[int, int] = field(default_factory=dict)
    """``id(tensor)`` -> tensor id."""
    frozen: list[torch.nn.Parameter] = field(default_factory=list)
    """Params of the groups that are not registered: no grad wanted (``requires_grad=False``) and no state."""
    feed: Feed | None = None
    shared_feed: SharedFeed | None = None
    own_feed: bool = True
    transfer: StateTransfer | None = None
    exchange: Exchange | None = None
    placement_used: Placement | None = None
    state_keys: tuple[str, ...] = ()
    state_from: str = "new"
    pinned: bool = False
    steps_sent: int = 0
    """The last step the daemon numbered (its STEP sequence)."""
    step_lag: int = 0
    """How far that sequence is ahead of ``steps`` after a checkpoint of an earlier step was loaded."""
    skipped: int = 0
    attempts: Any = field(default_factory=lambda: itertools.count(1))
    sent: Any = None
    """A STEP whose reply was interrupted (``_SentStep``)."""
    open: Any = None
    """An overlapped step's open attempt (``_OpenAttempt``)."""
    inflight: list[int] = field(default_factory=list)
    """Tensors of a delayed update whose params are not installed yet."""
    receiving: tuple[list[int], bool] | None = None
    """Tensors whose new params are being copied into the model now (and whether the daemon is asked for them
    first): a signal handler's read that interrupts the copy makes it whole first (``Calls``)."""
    calls: Calls = field(default_factory=lambda: Calls("OffloadAdam"))
    """Which of the optimizer's calls this thread is inside (``tiermem.client.offload.reentry``)."""
    last_grad_norm: float | None = None
    last_found_inf: bool = False
    last_skipped: bool = False
    _finalizer: weakref.finalize | None = None

    def adopt(self, client: Client, *, own: bool) -> None:
        """Make ``client`` the connection; an own one is closed when this handle is collected."""
        self.disarm()
        self.client = client
        self.own_client = own
        if own:
            self._finalizer = weakref.finalize(self, _close_client, client, self.feed)

    def disarm(self) -> None:
        """Forget the finalizer (the connection is closed, or handed over, by the caller)."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None

    def release(self) -> Client | None:
        """Take the connection out of the handle (the caller closes or reuses it); None when there is none."""
        client, self.client = self.client, None
        self.registered = False
        self.disarm()
        return client


class InHandle:
    """A descriptor: the attribute of the same name without its leading underscore, in the object's ``_h``
    (an ``OffloadHandle``).  Reads and writes through any copy or wrapper of the object reach the one handle."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = name.lstrip("_")

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj._h, self.field)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj._h, self.field, value)

"""Messages larger than one frame: sent as parts (``FLAG_MORE``), joined again by the receiver.

Owns the rule for splitting a message across frames and the receiver's
joining of them.  Pure: no sockets.

Why: one SEQPACKET packet can be no larger than the sender's send buffer
(``net.core.wmem_max`` x 2 for a process without CAP_NET_ADMIN: about
415 KiB on a default kernel) nor the receiver's ``max_frame`` (1 MiB by
default).  ``OffloadAdam``'s REGISTER costs about 83 bytes a tensor and its
REGISTER_OK about 51, so a model of some thousands of tensors did not fit one
frame: a mixture of experts with one module per expert (48 layers of 128
experts of 3 projections, about 18,900 tensors) makes a REGISTER of 1.6 MB.  Raising
``wmem_max`` and ``server.max_frame`` on every node is no answer for a user
who only wants to train.

The rules (docs/protocol.md, "Messages in parts"):

- A message whose frame would be longer than the sender's part size goes as
  consecutive frames of the same type, request id and flags; every frame but
  the last carries ``FLAG_MORE``.  The message's payload is the frames'
  payloads joined in order.  fds travel with the last part only.
- The part size is the smaller of what the sender's kernel lets it send and
  the receiver's ``max_frame`` (the daemon's is in ATTACH_OK; a client's is
  ``DEFAULT_MAX_FRAME``).
- The receiver joins at most ``max_message`` payload bytes (the daemon's
  ``server.max_message``).  A message past it is answered with a
  ``ProtocolError`` naming the limit, and its remaining parts are dropped as
  they come: the channel stays in step.  The daemon holds at most
  ``max_message`` bytes of incomplete messages per user (uid) over all of
  that user's connections (``Budget``): else one local user's 256
  connections, each sending all but the last part of a 64 MiB message, would
  make the daemon hold 16 GiB outside its constant-size pool.
- A frame that does not continue an incomplete message (another request id,
  or another type) ends it: the incomplete request is answered with a
  ``ProtocolError``, and the frame starts the next message.  That is what a
  client interrupted between two parts leaves behind.

A whole message in one frame costs the receiver nothing more than before: the
joiner hands the frame on as it came.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiermem.core.errors import ProtocolError
from tiermem.core.protocol.frame import FLAG_FDS, FLAG_MORE, FLAG_ONEWAY, HEADER_NBYTES, Frame, MsgType, encode_frame
from tiermem.core.units import format_size

__all__ = ["DEFAULT_MAX_MESSAGE", "Budget", "Dropped", "Joiner", "split_frames"]

DEFAULT_MAX_MESSAGE = 64 << 20
"""Most payload bytes a receiver joins into one message (a REGISTER of about 800,000 tensors)."""


def split_frames(
    msg_type: MsgType, request_id: int, payload: bytes, flags: int = 0, *, part_nbytes: int
) -> list[bytes]:
    """The frames that carry ``payload``: one when it fits ``part_nbytes`` (header included), else parts of
    at most ``part_nbytes`` each, ``FLAG_MORE`` on all but the last and ``FLAG_FDS`` (if asked) on the last."""
    room = part_nbytes - HEADER_NBYTES
    if room <= 0:
        raise ProtocolError(
            f"part size {part_nbytes} leaves no room for a payload after the {HEADER_NBYTES}-byte header"
        )
    if len(payload) <= room:
        return [encode_frame(msg_type, request_id, payload, flags, max_frame=part_nbytes)]
    head_flags = (flags & ~FLAG_FDS) | FLAG_MORE
    cuts = range(0, len(payload), room)
    last = cuts[-1]
    return [
        encode_frame(
            msg_type,
            request_id,
            payload[at : at + room],
            flags if at == last else head_flags,
            max_frame=part_nbytes,
        )
        for at in cuts
    ]


@dataclass(frozen=True, slots=True)
class Dropped:
    """A message the joiner gave up on: answer ``error`` to ``request_id`` (or, ``oneway``, keep it for the
    sender's next request)."""

    request_id: int
    type: MsgType
    oneway: bool
    error: ProtocolError


class Budget:
    """Bytes of incomplete messages that several joiners (one user's connections) may hold together.
    Not thread-safe: the daemon, whose connections are read by a thread each, takes and gives under a lock
    (``tiermemd.server.UserBudget``)."""

    def __init__(self, limit: int, owner: str) -> None:
        self.limit = limit
        self.owner = owner
        """Whose budget, for the error (``uid 1000``)."""
        self.held = 0

    def take(self, nbytes: int) -> bool:
        if self.held + nbytes > self.limit:
            return False
        self.held += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.held -= nbytes


class Joiner:
    """Joins the parts of the messages read off one connection, in order.  Not thread-safe: one reader.

    ``budget``: shared with the joiners of the same user's other connections; the bytes of this
    connection's incomplete message are taken from it part by part and given back when the message
    completes or is dropped, or by ``clear()`` when the connection ends."""

    def __init__(self, max_message: int = DEFAULT_MAX_MESSAGE, budget: Budget | None = None) -> None:
        self.max_message = max_message
        self.budget = budget
        self._head: Frame | None = None
        self._parts: list[bytes] = []
        self._nbytes = 0
        self._dropping: tuple[MsgType, int] | None = None
        """The (type, request id) of an over-long message whose remaining parts are being dropped."""
        self._taken = 0
        """Bytes of the incomplete message taken from ``budget``."""

    @property
    def joining(self) -> bool:
        """Whether a message is incomplete (parts read, its last not yet)."""
        return self._head is not None

    def add(self, frame: Frame) -> list[Frame | Dropped]:
        """What ``frame`` completes, in order: nothing (a part), a whole message, or a dropped message
        (one this frame ended unfinished, or one past ``max_message``) possibly followed by the next."""
        out: list[Frame | Dropped] = []
        if self._dropping is not None:
            if self._dropping == (frame.type, frame.request_id):
                if not frame.flags & FLAG_MORE:
                    self._dropping = None
                return out
            self._dropping = None
        head = self._head
        if head is not None and (frame.type, frame.request_id) != (head.type, head.request_id):
            out.append(
                self._drop(
                    head,
                    f"it ended after {len(self._parts)} part(s) ({self._nbytes} bytes): "
                    f"{frame.type.name} request {frame.request_id} came before its last part",
                )
            )
            head = None
        more = bool(frame.flags & FLAG_MORE)
        if head is None and not more:
            out.append(frame)
            return out
        if more and frame.flags & FLAG_FDS:
            why = "a part before the last carries fds (FLAG_FDS goes with the last part only)"
            out.append(self._drop(head or frame, why))
            return out
        why = self._over(len(frame.payload), more)
        if why:
            out.append(self._drop(head or frame, why))
            if more:
                self._dropping = (frame.type, frame.request_id)
            return out
        if head is None:
            head = self._head = frame
        self._parts.append(frame.payload)
        self._nbytes += len(frame.payload)
        if more:
            return out
        whole = Frame(head.type, head.request_id, b"".join(self._parts), frame.flags, head.version)
        self._reset()
        out.append(whole)
        return out

    def _over(self, nbytes: int, more: bool) -> str:
        """Why a part of ``nbytes`` cannot be joined ("" when it can; the bytes of a part before the last are
        then taken from the budget)."""
        if self._nbytes + nbytes > self.max_message:
            return (
                f"it is longer than max_message {self.max_message} bytes ({format_size(self.max_message)}); "
                "send less in one message, or raise the receiver's limit (the daemon's server.max_message)"
            )
        budget = self.budget
        if budget is None or not more:
            return ""  # a last part is joined and handed on at once: nothing is held past this call
        if not budget.take(nbytes):
            return (
                f"the incomplete messages of {budget.owner} on all its connections would hold more than "
                f"{budget.limit} bytes ({format_size(budget.limit)}, server.max_message) at once; send them "
                "one at a time"
            )
        self._taken += nbytes
        return ""

    def clear(self) -> None:
        """Forget an incomplete message (the connection ended), giving its bytes back to the budget."""
        self._reset()
        self._dropping = None

    def _drop(self, first: Frame, why: str) -> Dropped:
        """Give up on the message whose first part is ``first`` (the incomplete one, else the one it starts)."""
        self._reset()
        return Dropped(
            first.request_id,
            first.type,
            bool(first.flags & FLAG_ONEWAY),
            ProtocolError(f"{first.type.name} request {first.request_id} was dropped: {why}"),
        )

    def _reset(self) -> None:
        self._head = None
        self._parts = []
        self._nbytes = 0
        if self._taken and self.budget is not None:
            self.budget.give(self._taken)
        self._taken = 0

"""Step-path messages: step, bucket ready, step done, abort, fetch params; state read, write and reset.

Owns what these messages mean and the range of every field, each declared
once with ``tiermem.core.protocol.spec`` (``@wire`` derives the codec; the shared
kinds and limits are in ``records``).  Unknown fields are refused: a payload
change is a protocol version change (docs/protocol.md).  Pure: no I/O.
``from_payload`` raises ``FieldError``, which ``decode_message`` reports as a
``ProtocolError`` naming the message and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

from tiermem.core.protocol.fields import FieldError
from tiermem.core.protocol.frame import MsgType
from tiermem.core.protocol.records import (
    DTYPES,
    GRAD_BUFFER,
    MAX_GROUPS,
    MAX_TENSORS,
    MAX_TIMINGS,
    NAME,
    NBYTES,
    NON_NEGATIVE,
    STATE_KEY,
    STEP_NO,
    TENSOR_ID,
    TENSOR_IDS,
    MemRef,
    Message,
    ParamGroup,
)
from tiermem.core.protocol.spec import Choice, Float, Int, List, Map, Opt, Wire, wire

__all__ = [
    "Abort",
    "Aborted",
    "BucketReady",
    "FetchParams",
    "GradNorm",
    "GradNormReply",
    "ParamsReady",
    "StateChunk",
    "StateSpans",
    "StateRead",
    "StateReadMany",
    "StateReset",
    "StateWrite",
    "StateWriteMany",
    "Step",
    "StepDone",
]

GROUPS = List(ParamGroup, MAX_GROUPS)
POSITIVE = Float(gt=0.0)
CLIP_COEF = Float(ge=0.0, le=1.0, finite=False)
"""``clip_grad_norm_``'s coefficient: in [0, 1], or NaN (a NaN norm; torch applies it too)."""


@wire
@dataclass(slots=True)
class Step(Message):
    """Apply step ``step`` (attempt ``attempt``) using the grads now in the rank's grad buffer.

    ``groups``: the hyper-parameters for this step (empty: unchanged since the
    last step or REGISTER).  ``tensor_ids``: tensors whose grads are present
    (empty: all registered), in grad buffer ``grad_buffer``.  ``attempt``: the
    client's id for this try of the step (an ABORT names it; a reply echoes it).
    The gradient rules are ``tiermem.core.step_rules``'s, on both sides:
    ``loss_scale``: the grads are divided by it (``GradScaler``'s scale).
    ``max_grad_norm``: the daemon takes the rank's grad statistics and clips to
    this global norm (``clip_grad_norm_``; a world of one).  ``clip_coef``: a
    clip coefficient the trainer decided from global statistics (the sharded
    optimizers); not with ``max_grad_norm``.  ``skip``: the trainer decided to
    skip this step (``GradScaler`` found an inf/nan): only the rank's skip count
    changes.  ``delayed``: reply once the gradient statistics are known; the
    update runs on, and the next STEP or FETCH_PARAMS waits for it.
    """

    TYPE: ClassVar[MsgType] = MsgType.STEP
    step: Annotated[int, STEP_NO]
    attempt: Annotated[int, STEP_NO] = 0
    groups: Annotated[tuple[ParamGroup, ...], GROUPS] = ()
    loss_scale: Annotated[float, POSITIVE] = 1.0
    max_grad_norm: Annotated[float | None, Opt(POSITIVE)] = None
    clip_coef: Annotated[float | None, Opt(CLIP_COEF)] = None
    skip: bool = False
    tensor_ids: Annotated[tuple[int, ...], TENSOR_IDS] = ()
    delayed: bool = False
    grad_buffer: Annotated[int, GRAD_BUFFER] = 0


@wire
@dataclass(slots=True)
class GradNorm(Message):
    """The rank's part of a global grad norm: the statistics of the grads of ``tensor_ids`` (empty: all
    registered) now in grad buffer ``grad_buffer``, divided by ``loss_scale``, as a STEP with
    ``max_grad_norm`` takes them.  Changes nothing.

    A sharded optimizer's trainer computes each reduced grad's figures as it sends it; where a step added
    several backward passes' grads in the daemon (gradient accumulation), only the daemon holds their sum, so
    the trainer asks it, all-reduces the ranks' figures and sends the STEP with the ``clip_coef`` decided.
    """

    TYPE: ClassVar[MsgType] = MsgType.GRAD_NORM
    loss_scale: Annotated[float, POSITIVE] = 1.0
    tensor_ids: Annotated[tuple[int, ...], TENSOR_IDS] = ()
    grad_buffer: Annotated[int, GRAD_BUFFER] = 0


@wire
@dataclass(slots=True)
class GradNormReply(Message):
    """GRAD_NORM's figures: ``sq_norm``, the sum of squares of the unscaled grads (inf or NaN where an
    element is), and ``nonfinite``, whether an element is inf or NaN."""

    TYPE: ClassVar[MsgType] = MsgType.GRAD_NORM_REPLY
    sq_norm: Annotated[float, Float(ge=0.0, finite=False)]
    nonfinite: bool = False


@wire
@dataclass(slots=True)
class BucketReady(Message):
    """The grads of ``tensor_ids`` are final for step ``step`` (attempt ``attempt``): update them now (one-way).

    The overlapped update: the daemon applies Adam to these tensors with ``groups`` (the client's
    hyper-parameters when backward started) while backward computes the next buckets.  Only for steps
    without loss scaling, clipping or accumulation, which the client checks before it sends any.
    """

    TYPE: ClassVar[MsgType] = MsgType.BUCKET_READY
    step: Annotated[int, STEP_NO]
    attempt: Annotated[int, STEP_NO]
    bucket: Annotated[int, Int(0, MAX_TENSORS)]
    tensor_ids: Annotated[tuple[int, ...], List(TENSOR_ID, MAX_TENSORS, min_len=1)]
    grad_buffer: Annotated[int, GRAD_BUFFER] = 0
    groups: Annotated[tuple[ParamGroup, ...], List(ParamGroup, MAX_GROUPS, min_len=1)] = ()


@wire
@dataclass(slots=True)
class Abort(Message):
    """Drop attempt ``attempt`` of step ``step`` (the client was interrupted before or during it).

    What was not started is dropped; an update already running ends first (state is never left
    half-stepped).  Buckets already updated by an overlapped attempt stay applied, with their
    per-tensor step counts, as torch leaves a param whose grad was None un-stepped.
    """

    TYPE: ClassVar[MsgType] = MsgType.ABORT
    step: Annotated[int, STEP_NO]
    attempt: Annotated[int, STEP_NO]


@wire
@dataclass(slots=True)
class Aborted(Message):
    """Reply to ABORT: ``last_step`` is the rank's last applied step now, ``tensors_applied`` how many
    tensors of the aborted attempt had been updated (overlap) and keep it."""

    TYPE: ClassVar[MsgType] = MsgType.ABORTED
    step: Annotated[int, STEP_NO]
    attempt: Annotated[int, STEP_NO]
    last_step: Annotated[int, STEP_NO]
    tensors_applied: Annotated[int, Int(0, MAX_TENSORS)]


@wire
@dataclass(slots=True)
class StateReset(Message):
    """Zero the Adam state of ``tensor_ids`` (empty: all) and set their step counts to 0.

    A load of a checkpoint resets the tensors it has no state for (as ``torch.optim`` does), and a
    rank that is FAILED becomes usable again once all its tensors are reset (then loaded).
    """

    TYPE: ClassVar[MsgType] = MsgType.STATE_RESET
    tensor_ids: Annotated[tuple[int, ...], TENSOR_IDS] = ()


@wire
@dataclass(slots=True)
class StepDone(Message):
    """Attempt ``attempt`` of step ``step`` is done: applied, or ``skipped`` (params, state and the step count
    unchanged).  ``step``: the rank's applied step count now (``step - 1`` after a skip).
    ``skipped_steps``: the rank's skip count now.  ``nonfinite``: the grads the daemon examined hold an
    inf/nan (False when it did not look).  ``grad_norm``: the unclipped global norm (None when the step
    needed none)."""

    TYPE: ClassVar[MsgType] = MsgType.STEP_DONE
    step: Annotated[int, STEP_NO]
    attempt: Annotated[int, STEP_NO]
    skipped: bool = False
    nonfinite: bool = False
    skipped_steps: Annotated[int, STEP_NO] = 0
    grad_norm: Annotated[float | None, Opt(Float(ge=0.0, finite=False))] = None
    params_ready: bool = True
    timings: Annotated[tuple[tuple[str, float], ...], Map(NAME, NON_NEGATIVE, MAX_TIMINGS)] = ()
    """(phase, seconds) pairs, e.g. ("update", 0.12)."""


@wire
@dataclass(slots=True)
class FetchParams(Message):
    """Write the params of ``tensor_ids`` (empty: all) as of ``step`` into their window slots."""

    TYPE: ClassVar[MsgType] = MsgType.FETCH_PARAMS
    step: Annotated[int, STEP_NO]
    tensor_ids: Annotated[tuple[int, ...], TENSOR_IDS] = ()


@wire
@dataclass(slots=True)
class ParamsReady(FetchParams):
    """The params of ``tensor_ids`` (empty: all) as of ``step`` are in their window slots."""

    TYPE: ClassVar[MsgType] = MsgType.PARAMS_READY


@dataclass(slots=True)
class _StateRange(Message):
    """The fields that open every state transfer: fp32 state ``key`` of ``tensor_id``, from byte ``offset``."""

    tensor_id: Annotated[int, TENSOR_ID]
    key: Annotated[str, STATE_KEY]
    offset: Annotated[int, NBYTES]


@wire
@dataclass(slots=True)
class StateRead(_StateRange):
    """Copy fp32 state ``key`` of ``tensor_id``, from byte ``offset``, into ``dest`` (a staging area)."""

    TYPE: ClassVar[MsgType] = MsgType.STATE_READ
    dest: MemRef


@wire
@dataclass(slots=True)
class StateChunk(_StateRange):
    """``nbytes`` of ``total_nbytes`` bytes of state, from ``offset``, are in the staging area; ``step``: its count."""

    TYPE: ClassVar[MsgType] = MsgType.STATE_CHUNK
    nbytes: Annotated[int, NBYTES]
    total_nbytes: Annotated[int, NBYTES]
    step: Annotated[int, STEP_NO]

    def validate(self) -> None:
        """The chunk lies within the state: ``offset <= total_nbytes``, ``nbytes <= total_nbytes - offset``."""
        if self.offset > self.total_nbytes:
            raise FieldError("offset", f"an integer in [0, {self.total_nbytes}]", self.offset)
        if self.nbytes > self.total_nbytes - self.offset:
            raise FieldError("nbytes", f"an integer in [0, {self.total_nbytes - self.offset}]", self.nbytes)


@wire
@dataclass(slots=True)
class StateWrite(_StateRange):
    """Load fp32 state ``key`` of ``tensor_id`` from ``src`` at byte ``offset``; ``step`` sets Adam's count
    (for a moment).  ``accumulate``: add into the state instead of replacing it (a grad landing again in
    the same step, gradient accumulation)."""

    TYPE: ClassVar[MsgType] = MsgType.STATE_WRITE
    src: MemRef
    step: Annotated[int, STEP_NO]
    accumulate: bool = False


STAGED_DTYPE = Choice(DTYPES)
"""How a span's elements are staged in the window: fp32, or a working dtype (2 bytes an element)."""
MAX_SPANS = 1024
"""Ranges one batched state transfer carries at most (a staging slot's worth of tensors, many of them small)."""


@wire(array=True)
@dataclass(frozen=True, slots=True)
class StateSpan(Wire):
    """One range of a batched state transfer: state ``key`` of ``tensor_id`` from byte ``offset`` of its fp32
    values (element ``offset // 4``), staged at ``area`` as ``dtype`` (``area.length`` bytes: ``area.length //
    itemsize`` elements).  A 2-byte ``dtype`` is the working dtype crossing as it is (a param read, a grad
    written): the daemon narrows or widens it, where the state is."""

    tensor_id: Annotated[int, TENSOR_ID]
    key: Annotated[str, STATE_KEY]
    offset: Annotated[int, NBYTES]
    area: MemRef
    dtype: Annotated[str, STAGED_DTYPE] = "float32"


@wire(array=True)
@dataclass(frozen=True, slots=True)
class WriteSpan(Wire):
    """A ``StateSpan`` to write: ``step`` sets Adam's count (for a moment); ``accumulate`` adds instead."""

    tensor_id: Annotated[int, TENSOR_ID]
    key: Annotated[str, STATE_KEY]
    offset: Annotated[int, NBYTES]
    area: MemRef
    step: Annotated[int, STEP_NO]
    accumulate: bool
    dtype: Annotated[str, STAGED_DTYPE] = "float32"


@wire
@dataclass(slots=True)
class StateReadMany(Message):
    """STATE_READ of several ranges in one request: each span's state into its staging area, in order (the
    pieces of several tensors that share one staging slot)."""

    TYPE: ClassVar[MsgType] = MsgType.STATE_READ_MANY
    spans: Annotated[tuple[StateSpan, ...], List(StateSpan, MAX_SPANS, min_len=1)]


@wire
@dataclass(slots=True)
class StateSpans(Message):
    """The spans of a STATE_READ_MANY are in their staging areas; ``steps``: each span's tensor's step count."""

    TYPE: ClassVar[MsgType] = MsgType.STATE_SPANS
    steps: Annotated[tuple[int, ...], List(STEP_NO, MAX_SPANS)]


@wire
@dataclass(slots=True)
class StateWriteMany(Message):
    """STATE_WRITE of several ranges in one request, in order; every span is checked before any is written."""

    TYPE: ClassVar[MsgType] = MsgType.STATE_WRITE_MANY
    spans: Annotated[tuple[WriteSpan, ...], List(WriteSpan, MAX_SPANS, min_len=1)]

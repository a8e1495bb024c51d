"""``OffloadOptions``: everything of an ``OffloadAdam`` that is tiermem's rather than torch's, in one checked,
frozen record.  Pure.

``OffloadAdam(params, lr=..., options=OffloadOptions(offload="nvme", state_dtype="int8"))`` and
``OffloadAdam(params, lr=..., offload="nvme", state_dtype="int8")`` build the same optimizer: the keywords
are a shorthand that makes this record.  Torch's own arguments (``lr``, ``betas``, ``eps``,
``weight_decay``, ``foreach``, ...) stay keywords of the optimizer, as in ``torch.optim.AdamW``.  A record
can be built once and shared (a sharding strategy makes one per rank), and ``replace`` derives another.

Checks happen here, once, at construction: a bad value raises ``InvalidArgument`` naming the field.
The connection itself (``client=``) is not an option: it is a resource, passed to the optimizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tiermem.client.offload.args import check_state_dtype, step_mode
from tiermem.core.errors import InvalidArgument
from tiermem.core.modes import Exchange, Placement, StepMode
from tiermem.core.pool_plan import PoolPlan, padded_numel, private_pool_plan
from tiermem.core.units import MiB

__all__ = ["OffloadOptions"]


@dataclass(frozen=True, kw_only=True)
class OffloadOptions:
    """tiermem's settings of one ``OffloadAdam`` (see the module docstring)."""

    offload: Placement = Placement.AUTO
    """Where the daemon keeps the Adam state: ``"cpu"`` (its pool), ``"nvme"`` (its swap files), ``"auto"``."""
    exchange: Exchange = Exchange.AUTO
    """How params and grads cross: ``"shared"`` (CPU params live in memory shared with the daemon),
    ``"staged"`` (copies through the staging window; GPU params), ``"auto"`` (by the params' device)."""
    overlap_update: bool = False
    """Update each bucket as soon as its grads land during backward (no clipping)."""
    delayed_update: bool = False
    """The one-step delayed update: after ``warmup_steps``, step t's update overlaps step t+1's compute."""
    warmup_steps: int = 10
    """Synchronous steps before the delayed update starts."""
    max_grad_norm: float | None = None
    """Clip the global grad norm to this (``clip_grad_norm_``), in the daemon; None: no clipping."""
    release_grads: bool = False
    """Grads go to the daemon as they land and the model keeps none (no ``GradScaler``, no delayed update; clip
    with ``max_grad_norm``: ``clip_grad_norm_`` finds no grads, returns 0 and clips nothing; not under DDP, whose
    averaged grads come after the release: ``GradsAfterRelease``)."""
    window_nbytes: int | None = None
    """The staging window's bytes; None: the daemon's default (which ``offload_params`` may grow)."""
    bucket_nbytes: int = 32 * MiB
    """Grads are grouped into buckets of about this many bytes (the overlapped update's unit)."""
    state_dtype: str = "fp32"
    """The Adam moments' format: ``"fp32"`` (exact AdamW), ``"bf16"`` or ``"int8"`` (block-wise)."""
    pin_window: bool | None = None
    """Register the staging window with CUDA; None: when the params are on a GPU."""
    job_id: str | None = None
    """The daemon job's name; None: host, pid and a random suffix."""
    token: str | None = None
    """A job's token, to reattach to its state after a crash."""
    rank: int | None = None
    world_size: int | None = None
    expected_step: int | None = None
    """The step the trainer has reached: a reattached state older than it raises ``StaleStateError``."""
    rollback: bool = False
    """Accept a reattached state older than ``expected_step``."""
    create_job: bool = False
    """Ranks of one job agreed on a token: whichever attaches first creates the job with it."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: the parsed forms replace what was given
        set_(self, "offload", Placement.parse(self.offload, "offload"))
        set_(self, "exchange", Exchange.parse(self.exchange, "exchange"))
        set_(self, "state_dtype", check_state_dtype(self.state_dtype))
        self.mode  # noqa: B018 - checks the step settings together
        if self.window_nbytes is not None and self.window_nbytes <= 0:
            raise InvalidArgument(f"window_nbytes must be > 0 or None (the daemon's default), got {self.window_nbytes}")
        if self.bucket_nbytes <= 0:
            raise InvalidArgument(f"bucket_nbytes must be > 0, got {self.bucket_nbytes}")
        for name in ("rank", "world_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise InvalidArgument(f"{name} must be an int >= 0 or None, got {value!r}")

    @property
    def mode(self) -> StepMode:
        return step_mode(
            overlap_update=self.overlap_update,
            delayed_update=self.delayed_update,
            max_grad_norm=self.max_grad_norm,
            warmup_steps=self.warmup_steps,
        )

    def pool_plan(self, numels: Sequence[int], *, dtype: str) -> PoolPlan:
        """The pool a private daemon needs for an ``OffloadAdam`` made with this record over tensors of
        ``numels`` elements of ``dtype`` (the exchange must be the one it will use, not ``auto``)."""
        if self.exchange is Exchange.AUTO:
            raise InvalidArgument("a pool plan needs the exchange the optimizer will use (shared or staged), not auto")
        return private_pool_plan(
            max(padded_numel(numels, self.state_dtype), 1),
            dtype=dtype,
            placement=self.offload,
            mode=self.mode,
            exchange=self.exchange,
            release_grads=self.release_grads,
            window_nbytes=self.window_nbytes,
            state_dtype=self.state_dtype,
        )

    def replace(self, **changes: Any) -> OffloadOptions:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def merge(cls, options: OffloadOptions | None, keywords: dict[str, Any]) -> OffloadOptions:
        """``options`` or the record the shorthand keywords make; both only when the keywords say what the
        record says (a conflict would leave one of them silently ignored)."""
        if options is None:
            return cls(**keywords)
        if not isinstance(options, cls):
            raise InvalidArgument(f"options must be an OffloadOptions, got {type(options).__name__}")
        defaults = cls()
        given = {k: v for k, v in keywords.items() if cls(**{k: v}) != defaults}
        conflict = sorted(k for k, v in given.items() if getattr(options.replace(**{k: v}), k) != getattr(options, k))
        if conflict:
            raise InvalidArgument(
                f"{', '.join(conflict)} given both as keywords and in options= with other values; give each once"
            )
        return options

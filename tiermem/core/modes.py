"""Enums shared by the client and the daemon: where state lives, how a step runs, how tensors are exchanged.

Their ``value`` is the wire spelling.
"""

from __future__ import annotations

import enum
from typing import TypeVar

from tiermem.core.errors import InvalidArgument

_T = TypeVar("_T", bound="_Named")

__all__ = ["STATE_DTYPES", "Exchange", "Placement", "StepMode"]

STATE_DTYPES = ("fp32", "bf16", "int8")
"""How the daemon may store the Adam moments (``tiermem.core.lowbit`` defines each)."""


class _Named(enum.Enum):
    @classmethod
    def parse(cls: type[_T], value: object, what: str) -> _T:
        if isinstance(value, cls):
            return value
        for member in cls:
            if member.value == value:
                return member
        choices = ", ".join(repr(m.value) for m in cls)
        raise InvalidArgument(f"{what} must be one of {choices}, got {value!r}")


class Placement(_Named):
    """Where a rank's fp32 Adam state lives."""

    CPU = "cpu"
    """In the daemon's pool."""
    NVME = "nvme"
    """On the swap store, paged through a chunk cache in the pool."""
    AUTO = "auto"
    """The pool when the node's pool budget has room at registration, else NVMe."""


class StepMode(_Named):
    """How the Adam update of a step is scheduled against the trainer's compute."""

    SYNC = "sync"
    """``step()`` returns once the update is applied (torch's semantics)."""
    OVERLAP = "overlap"
    """Each bucket of grads is updated as soon as backward produces it (no clipping, no loss scaling,
    no accumulation: checked up front)."""
    DELAYED = "delayed"
    """Step t's update runs while step t+1 computes (ZeRO-Offload's one-step delayed update)."""


class Exchange(_Named):
    """How params and grads move between trainer and daemon."""

    SHARED = "shared"
    """CPU params: the params' and grads' storage is shared memory the daemon updates in place."""
    STAGED = "staged"
    """Params on a device (CUDA): grads in and params out through the bounded staging window."""
    AUTO = "auto"
    """``shared`` when every param is on the CPU, else ``staged``."""

"""One place where a collective's failure becomes ``RankLost``.

Every sharded optimizer runs its collectives through ``guarded``: a rank that
died or a timeout surfaces in torch as a ``RuntimeError`` (or
``torch.distributed.DistError``) from whichever collective met it, and the
caller gets ``RankLost`` naming what was being done, this rank and its step,
instead of a low-level error (or a hang: the collectives have the process
group's timeout).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from tiermem.core.errors import RankLost

__all__ = ["guarded"]


def guarded(during: str, rank: int, step: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; a failure of the collective is ``RankLost(during, rank, step)``."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, dist.DistError) as exc:
        raise RankLost(during, rank, step, exc) from exc

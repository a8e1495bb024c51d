"""``eager_under_compile``: a method that ``torch.compile`` runs eagerly, without importing dynamo for it.

``torch.compiler.disable`` imports ``torch._dynamo`` (and sympy with it) when it
decorates, which costs every trainer about 75 MB of memory and a second of
start-up even if it never compiles anything.  This decorator defers that: the
wrapper calls the method directly while dynamo is not loaded (nothing can be
compiling then), and once it is loaded (``torch.compile`` imports it before it
traces anything) it calls the ``torch._dynamo.disable`` form of the method,
made once.  The wrapper carries dynamo's own "do not trace" mark, so a
compiled caller does not inline it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["eager_under_compile"]


def eager_under_compile(fn: Callable[..., Any]) -> Any:
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(dynamo.disable(fn))
        return disabled[0](*args, **kwargs)

    wrapper._torchdynamo_disable = True  # type: ignore[attr-defined]
    return wrapper

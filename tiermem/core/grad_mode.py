"""``without_grad``: a method run with grad mode off, and the mode restored however it ends.

``@torch.no_grad()`` enters a context manager, and ``with`` calls ``__exit__``
only once ``__enter__`` has returned.  An exception raised by a signal handler
(Ctrl-C's ``KeyboardInterrupt``, a preemption handler's) after ``__enter__``
turned grad mode off and before it returned leaves the mode off for good: the
training loop that catches the exception fails at its next backward with
"element 0 of tensors does not require grad", and a notebook whose training
cell was interrupted is left so.  torch's own optimizers restore the mode in a
``finally`` (``_use_grad_for_differentiable``); so does this, with the mode
read before the ``try`` and set inside it.

The mode is set with torch's C function (``torch._C._set_grad_enabled``, what
``torch.set_grad_enabled`` calls), not through ``torch.set_grad_enabled``'s
Python class: CPython runs a signal handler where a Python function is
entered or a call returns, and a call into C has neither, so no handler can
run between the ``finally`` and the mode being restored.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

__all__ = ["without_grad"]

P = ParamSpec("P")
R = TypeVar("R")

_is_enabled = torch._C.is_grad_enabled
_set_enabled = torch._C._set_grad_enabled


def without_grad(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` under grad mode off, the caller's mode restored in a ``finally`` (see the module docstring)."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        before = _is_enabled()
        try:
            _set_enabled(False)
            return fn(*args, **kwargs)
        finally:
            _set_enabled(before)

    return call

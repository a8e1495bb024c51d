"""``without_grad`` leaves grad mode as it found it, wherever an asynchronous exception lands in the call.

A trace function raises ``KeyboardInterrupt`` at the k-th call or return of a Python function during the call,
for every k until the call completes: CPython runs a signal handler where a Python function is entered and
where a call returns, so these are the places a handler's exception (Ctrl-C's) can land, in torch's own frames
too.  ``@torch.no_grad()`` fails this (an exception as ``torch.set_grad_enabled`` returns inside its
``__enter__``, the mode already off, skips its ``__exit__``), which the last test shows, so the sweep can see
what it looks for.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from tiermem.core.grad_mode import without_grad


def _interrupted_at(k: int, call: Callable[[], Any]) -> bool:
    """Run ``call`` with ``KeyboardInterrupt`` raised at its k-th traced event; whether it was raised."""
    seen = [0]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event in ("call", "return"):
            seen[0] += 1
            if seen[0] == k:
                raise KeyboardInterrupt
        return tracer

    sys.settrace(tracer)
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def _sweep(step: Callable[[], Any]) -> list[int]:
    """The k at which an interrupted call left grad mode off."""
    leaks = []
    for k in range(1, 10_000):
        torch.set_grad_enabled(True)
        raised = _interrupted_at(k, step)
        if not torch.is_grad_enabled():
            leaks.append(k)
        if not raised:
            break
    torch.set_grad_enabled(True)
    return leaks


def _work() -> float:
    t = torch.ones(3, requires_grad=True)
    return float((t * 2).sum())


def test_without_grad_runs_with_grad_off_and_restores_the_mode_wherever_it_is_interrupted():
    seen = []

    @without_grad
    def step() -> float:
        seen.append(torch.is_grad_enabled())
        return _work()

    assert step() == 6.0 and seen == [False] and torch.is_grad_enabled()
    with torch.no_grad():
        step()
        assert not torch.is_grad_enabled()  # the caller's mode, not always "on"
    assert _sweep(step) == []


def test_torch_no_grad_as_a_decorator_leaves_grad_off_when_interrupted_in_its_enter():
    @torch.no_grad()
    def step() -> float:
        return _work()

    assert _sweep(step), "no interruption point left grad mode off: the sweep would not see a leak"

"""Param paging's hooks into torch: the ``Probe`` plug-in point, the ``TorchFunctionMode`` that catches a
param used outside the submodule owning it, and a running forward's ``Frame``.

Pure helpers of ``ParamPager`` (``tiermem.client.offload.paging``): they hold
no state of their own beyond a frame's leases; the pager owns every record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tiermem.client.offload.eager import eager_under_compile
from tiermem.client.offload.pagedparam import PagedParam
from tiermem.core.uncopyable import Uncopyable

if TYPE_CHECKING:
    from tiermem.client.offload.paging import ParamPager

__all__ = [
    "CatchParams",
    "Frame",
    "ModelHook",
    "Probe",
    "dedup",
    "flat_args",
    "in_backward",
    "in_checkpoint_region",
    "probed",
]


class Probe(Protocol):
    """A declared point where a caller watches the pager's schedule, or slows it down (the schedule-fuzzing
    tests inject random delays through one), called at each ``point``:

    - ``fetch``: the trainer's thread is about to submit a fetch (``what``: the params' names);
    - ``grad``: a grad landed in its hook (``what``: the param's name);
    - ``io``: the I/O thread is about to run a transfer (``what``: ``fetch`` or ``push``, and the params);
    - ``collective``: a collective is about to be issued (``tiermem.distributed``: its kind and submodule)."""

    def at(self, point: str, what: str) -> None: ...


def probed(probe: Probe, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """I/O thread: ``fn(*args)`` after the probe's ``io`` point."""
    probe.at("io", what)
    return fn(*args)


class CatchParams(TorchFunctionMode):
    """During forward: a paged param used by a torch function while absent is leased to the running module."""

    def __init__(self, pager: ParamPager) -> None:
        super().__init__()
        self.pager = pager

    @eager_under_compile
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        pager = self.pager
        if pager._saving or pager.calls.reading:
            # a state dict being saved reads the params itself (``PagedState._saving_state``), and the optimizer's
            # reads of its state (a signal handler's, in the middle of a forward) use none of them
            return func(*args, **kwargs)
        wanted = [e for e in map(pager._absent_entry, flat_args(args, kwargs)) if e is not None]
        if wanted:
            pager._use(dedup(wanted), lease=True)
        return func(*args, **kwargs)


def flat_args(args: Any, kwargs: dict[str, Any]) -> Iterable[Any]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, list | tuple):
            yield from a
        else:
            yield a


def dedup(entries: Iterable[PagedParam]) -> list[PagedParam]:
    return list({id(e): e for e in entries}.values())


class ModelHook(Uncopyable):
    """A forward or backward hook on a module of a model whose params tiermem holds (paged, or sharded by
    layer): ``fn`` run as Python between compiled pieces (``torch.compiler.disable``: it swaps the params'
    data and talks to the daemon, so a graph traced through it would be built around placeholders), and
    a refusal of ``copy.deepcopy`` and pickling.  A module's hooks are copied and pickled with it, so this is
    where ``copy.deepcopy(model)`` (an EMA copy) and ``torch.save(model)`` stop, with what to copy instead:
    the copy would hold placeholders, and hooks bound to the original's pager.  ``held``: how the params
    are held, as the message says it (``paged by offload_params``); ``ranks``: the model is sharded across
    ranks, so gathering its values is a collective."""

    __slots__ = ("_fn", "_held", "_ranks")

    def __init__(self, fn: Callable[..., Any], held: str, *, ranks: bool = False) -> None:
        self._fn = torch.compiler.disable(fn)
        self._held = held
        self._ranks = ranks

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    def _not_copyable(self) -> TypeError:
        who = " (every rank calls it)" if self._ranks else ""
        return TypeError(
            f"this model's params are {self._held}: between forwards the model holds placeholders, and the "
            "values live in tiermemd, so a copy.deepcopy or pickle (torch.save(model)) of it would hold none. "
            f"Copy the values instead: model.state_dict() gathers them{who}; load them into a model built "
            "alike, or save them"
        )


def in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() >= 0)


def in_checkpoint_region() -> bool:
    """Whether the innermost saved-tensor hooks are ``torch.utils.checkpoint``'s (a non-reentrant checkpoint's
    forward): it saves nothing there, and recomputes in backward.  A forward that starts there (a checkpointed
    function over submodules, called without their parent: Lightning's ``training_step``) must not push the
    pager's hooks over the checkpoint's: they would take the region's saved tensors from it in the forward but
    not in the recompute, and the checkpoint refuses the mismatch (``Recomputed values ... have different
    metadata``).  Other hooks (``save_on_cpu``, which would keep a param's buffer by reference) stay under
    the pager's.  torch names its hooks by where they are made; there is no public way to ask."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and getattr(top[0], "__qualname__", "").startswith("_checkpoint_hook.")


@dataclass
class Frame:
    """A running forward of one hooked module: what it leased."""

    module: nn.Module
    leased: list[PagedParam] = field(default_factory=list)
    contexts: list[Any] = field(default_factory=list)

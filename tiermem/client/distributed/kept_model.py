"""``consolidate_model_state``: a ZeRO-3 model's state dict gathered by every rank, for a save on one rank.

A ZeRO-3 model holds placeholders; ``model.state_dict()`` gathers each
param's values from the ranks that hold them, a collective every rank must
call.  Frameworks that save the model from one process alone (HF Trainer's
checkpoints and ``save_model()``: ``model.state_dict()`` on the saving
process only) would leave that process in a collective no other rank joins,
until ``collective_timeout_s`` ends it with ``RankLost``.

``opt.consolidate_model_state(to)`` is the model's twin of
``consolidate_state_dict``: every rank calls ``model.state_dict()`` (the
collectives, in module order), and rank ``to`` keeps the values.  Its next
``model.state_dict()`` then takes them from here, with no collective, once:
the hooks that gather each param (``LayerStrategy._save_unit``,
``PagedState._gather_state``) ask ``KeptModelState.value`` first, and a hook
on the model drops the values when that ``state_dict()`` ends.  A step, a
load of the optimizer or of the model, or ``close()`` drops them too, so they
are never older than the params.  The other ranks keep nothing and behave as
before.

One use, not a standing cache: a later ``model.state_dict()`` on every rank
must find every rank gathering again, or rank ``to`` would skip the
collectives the others run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["KeptModelState"]


class KeptModelState:
    """The values ``consolidate_model_state`` gathered, on the rank that keeps them, until used or stale."""

    def __init__(self) -> None:
        self._values: dict[int, torch.Tensor] | None = None

    def gather(self, model: nn.Module, *, keep: bool) -> None:
        """Collective (every rank): ``model.state_dict()``; kept by param where ``keep``."""
        self._values = None  # this rank's own gather must run the collectives like every other rank's
        state = model.state_dict()
        if keep:
            named = model.named_parameters(remove_duplicate=False)
            self._values = {id(p): state[name] for name, p in named if name in state}

    def value(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s gathered value, if this rank keeps one."""
        return None if self._values is None else self._values.get(id(p))

    @property
    def kept(self) -> bool:
        return self._values is not None

    def drop(self, *_: Any) -> None:
        """Used (a hook at the end of ``model.state_dict()``), or stale (a step, a load, ``close()``)."""
        self._values = None

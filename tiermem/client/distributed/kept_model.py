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
``model.state_dict()`` then takes them from here, with no collective: the
hooks that gather each param (``LayerStrategy._save_unit``,
``PagedState._gather_state``) ask ``KeptModelState.value`` first.  A step, a
load of the optimizer or of the model, or ``close()`` drops them, so they
are never older than the params.

How long rank ``to`` takes its state dicts from here:

- once (the default): a hook at the end of that ``model.state_dict()``
  drops the values.  For a save the framework is about to make (Trainer's
  checkpoint); a later ``model.state_dict()`` on every rank gathers on every
  rank again.  The other ranks cannot know whether rank ``to`` has used its
  values yet, so they keep nothing and behave as before.
- ``until_step``: every one of rank ``to``'s ``model.state_dict()`` calls,
  until the next step, load or ``close()``.  For saves whose number nobody
  knows (``trainer.save_model()`` after training, then ``push_to_hub()``,
  which saves again).  Those ends are the same on every rank, so every rank
  knows that rank ``to`` holds the values: a ``model.state_dict()`` on
  another rank, which would gather without rank ``to`` and wait out
  ``collective_timeout_s``, is refused at once, naming
  ``release_model_state()``, which drops the values on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tiermem.core.errors import InvalidState

__all__ = ["KeptModelState"]


class KeptModelState:
    """The values ``consolidate_model_state`` gathered, on the rank that keeps them, until used or stale."""

    def __init__(self) -> None:
        self._values: dict[int, torch.Tensor] | None = None
        self._until_step = False
        self._keeper: int | None = None
        """With ``until_step``, on the other ranks: the rank that holds the values."""

    def gather(self, model: nn.Module, *, keep: bool, keeper: int, until_step: bool = False) -> None:
        """Collective (every rank): ``model.state_dict()``; kept by param where ``keep`` (rank ``keeper``)."""
        self.drop()  # this rank's own gather must run the collectives like every other rank's
        state = model.state_dict()
        self._until_step = until_step
        if keep:
            named = model.named_parameters(remove_duplicate=False)
            self._values = {id(p): state[name] for name, p in named if name in state}
        elif until_step:
            self._keeper = keeper

    def value(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s gathered value, if this rank keeps one."""
        return None if self._values is None else self._values.get(id(p))

    @property
    def kept(self) -> bool:
        return self._values is not None

    def check_gather(self, *_: Any) -> None:
        """A hook at the start of ``model.state_dict()``: refused on a rank whose gather rank ``_keeper``, which
        takes its state dicts from its kept values, would never join."""
        if self._keeper is not None:
            raise InvalidState(
                f"rank {self._keeper} holds the model's values gathered by consolidate_model_state(until_step=True)"
                " (WholeOptimizerState calls it as train() ends, for trainer.save_model()), and takes its "
                "model.state_dict() from them with no collective until the next step or load; here "
                "model.state_dict() would gather without it. Save on that rank alone, or call "
                "opt.release_model_state() on every rank first"
            )

    def used(self, *_: Any) -> None:
        """A hook at the end of ``model.state_dict()``: the values served once, unless kept ``until_step``."""
        if not self._until_step:
            self.drop()

    def drop(self, *_: Any) -> None:
        """Stale (a step, a load, ``close()``), or released (``release_model_state``)."""
        self._values = None
        self._keeper = None
        self._until_step = False

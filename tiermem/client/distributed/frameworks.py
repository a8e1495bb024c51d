"""What a framework's callback finds in the optimizer it was given, and the clip it hands over.

HF Trainer (``hf_trainer``) and PyTorch Lightning (``lightning``) hand the
user's optimizer to their callbacks, sometimes wrapped (accelerate's
``AcceleratedOptimizer`` and Lightning's ``LightningOptimizer`` hold it as
``.optimizer``).  Both frameworks clip after backward with
``clip_grad_norm_`` over the params; where the grads never reach ``p.grad``
that clip finds none and clips nothing, silently:

- a ZeRO-3 model (``LayerShardedAdam``, ``ShardedPagedAdam``) holds
  placeholders; its grads are reduced into the daemons as they land;
- an ``OffloadAdam`` under ``offload_params`` or ``release_grads`` hands its
  grads to the daemon during backward.

``hand_over_clip`` gives such an optimizer the framework's clip
(``set_max_grad_norm``: the same rule, by the global norm, which the daemons
take), as the frameworks' DeepSpeed integrations pass theirs to DeepSpeed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tiermem.client.offload.optimizer import OffloadAdam
from tiermem.core.errors import InvalidArgument

__all__ = ["grads_elsewhere", "hand_over_clip", "sharded_optimizer", "zero3_optimizer"]

log = logging.getLogger(__name__)


def _inside(optimizer: Any, found: Callable[[Any], bool]) -> Any:
    """The optimizer ``found`` accepts, ``optimizer`` itself or one it wraps as ``.optimizer``; or None."""
    seen = 0
    while optimizer is not None and seen < 8:
        if found(optimizer):
            return optimizer
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return None


def sharded_optimizer(optimizer: Any) -> Any:
    """The optimizer with ``consolidate_state_dict`` inside ``optimizer``, or None."""
    return _inside(optimizer, lambda opt: hasattr(opt, "consolidate_state_dict"))


def zero3_optimizer(optimizer: Any) -> Any:
    """``sharded_optimizer``'s, where it is ZeRO-3 (its model holds placeholders), or None."""
    opt = sharded_optimizer(optimizer)
    return opt if opt is not None and opt.strategy.reduced_model() is not None else None


def _releases_grads(opt: OffloadAdam) -> bool:
    feed = getattr(opt, "feed", None)  # (registered: it has one)
    return feed is not None and bool(feed.releases_grads)


def grads_elsewhere(optimizer: Any) -> Any:
    """The optimizer inside ``optimizer`` whose grads never reach ``p.grad``, so that a framework's clip finds
    none (see the module docstring); None otherwise."""
    released = _inside(optimizer, lambda opt: isinstance(opt, OffloadAdam) and _releases_grads(opt))
    return released if released is not None else zero3_optimizer(optimizer)


def hand_over_clip(opt: Any, clip: float | None, *, framework: str, knob: str, off: str) -> None:
    """``framework``'s clip at ``clip`` (its setting ``knob``; ``off``: that setting turned off) to ``opt``, an
    optimizer whose grads that clip cannot see (``grads_elsewhere``; None: nothing to do), unless it clips
    itself.  Where it cannot clip (``LayerShardedAdam`` without ``paged=True``), a warning says so."""
    if opt is None or not clip or clip <= 0 or opt.max_grad_norm is not None:
        return
    name = type(opt).__name__
    try:
        opt.set_max_grad_norm(clip)
    except InvalidArgument as e:
        log.warning(
            "%s clips at %s=%s, but %s holds no grads in the trainer: %s's clip finds none and clips nothing, "
            "and the optimizer cannot clip for it (%s); set %s",
            framework,
            knob,
            clip,
            name,
            framework,
            e,
            off,
        )
        return
    log.info(
        "%s clips at %s's %s=%s: %s's own clip finds no grads, so the grad norm %s logs is 0; the optimizer's "
        "last_grad_norm is each step's norm",
        name,
        framework,
        knob,
        clip,
        framework,
        framework,
    )

"""``OffloadAdam`` and its parts: arguments, step policy, grad feed, state transfer, the ``opt.state`` view."""

from tiermem.offload.optimizer import OffloadAdam

__all__ = ["OffloadAdam"]

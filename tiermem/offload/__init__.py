"""``OffloadAdam`` and its parts: arguments, step policy, grad feed, state transfer, the ``opt.state`` view;
param paging (``offload_params``)."""

from tiermem.offload.optimizer import OffloadAdam
from tiermem.offload.paging import ParamPager, offload_params

__all__ = ["OffloadAdam", "ParamPager", "offload_params"]

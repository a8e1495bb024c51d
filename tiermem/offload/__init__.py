"""``OffloadAdam`` and its parts: arguments, step policy, grad feed, state transfer, the ``opt.state`` view;
param paging (``offload_params``); ``OptimizerStats``, what ``OffloadAdam.stats()`` returns."""

from tiermem.offload.optimizer import OffloadAdam
from tiermem.offload.paging import ParamPager, offload_params
from tiermem.offload.stats import OptimizerStats

__all__ = ["OffloadAdam", "OptimizerStats", "ParamPager", "offload_params"]

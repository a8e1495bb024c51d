"""``OffloadAdam`` and its parts: arguments and options (``OffloadOptions``), step policy, grad feed, state
transfer, the ``opt.state`` view; param paging (``offload_params``); ``OptimizerStats``, what
``OffloadAdam.stats()`` returns."""

from tiermem.client.offload.optimizer import OffloadAdam
from tiermem.client.offload.options import OffloadOptions
from tiermem.client.offload.paging import ParamPager, offload_params
from tiermem.client.offload.stats import OptimizerStats

__all__ = ["OffloadAdam", "OffloadOptions", "OptimizerStats", "ParamPager", "offload_params"]

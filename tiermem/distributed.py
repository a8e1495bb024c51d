"""The public name of the sharded optimizers (defined in ``tiermem.client.distributed``):
``tiermem.distributed.ShardedOffloadAdam``, ``LayerShardedAdam``, ``ShardedPagedAdam``, ``ShardedGradScaler``."""

from tiermem.client.distributed import *  # noqa: F403
from tiermem.client.distributed import __all__  # noqa: F401  (the same public names)

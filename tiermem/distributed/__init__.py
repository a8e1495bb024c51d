"""Many ranks, one daemon per node: ZeRO-2 sharding over ``torch.distributed``.

``ShardedOffloadAdam`` shards the Adam state across the process group's ranks
(each rank's shard in its node's tiermemd); ``ShardedGradScaler`` is
``torch.amp.GradScaler`` with its overflow check made global; ``layout`` is
the pure plan of who owns which elements.
"""

from tiermem.distributed.layout import Bucket, Piece, ShardLayout, plan_shards
from tiermem.distributed.optimizer import ShardedOffloadAdam
from tiermem.distributed.scaler import ShardedGradScaler

__all__ = ["Bucket", "Piece", "ShardLayout", "ShardedGradScaler", "ShardedOffloadAdam", "plan_shards"]

"""Many ranks, one daemon per node: ZeRO sharding over ``torch.distributed``.

One facade, ``ShardedOptimizer`` (``sharded``), owns the start, the step, the
counters, the checkpoints and ``close()``; the three optimizers below are
thin constructors that hand it their strategy object (``ShardStrategy``).

``ShardedOffloadAdam`` shards the Adam state across the process group's ranks
(each rank's shard in its node's tiermemd); ``ShardedGradScaler`` is
``torch.amp.GradScaler`` with its overflow check made global; ``layout`` is
the pure plan of who owns which elements; ``LayerShardedAdam`` is ZeRO-3 by
layer (each layer's params and state on its owner rank, gathered for use,
updated by the owner's daemon during the backward of the layers before it);
``ShardedPagedAdam`` is ZeRO-3 with param paging: every param sharded across
the ranks, each shard only in its rank's daemon, a submodule's params
all-gathered just before they are used.  Both ZeRO-3 optimizers checkpoint
per rank (``save_shard``/``load_shards``, ``reshard``'s format) and load at any
world size; ``tiermem consolidate`` merges the rank files offline.
"""

from tiermem.client.distributed.optimizer import ShardedOffloadAdam
from tiermem.client.distributed.paged import ShardedPagedAdam
from tiermem.client.distributed.scaler import ShardedGradScaler
from tiermem.client.distributed.zero3 import LayerShardedAdam
from tiermem.core.shard_plan import Bucket, Piece, ShardLayout, plan_shards

__all__ = [
    "Bucket",
    "LayerShardedAdam",
    "Piece",
    "ShardLayout",
    "ShardedGradScaler",
    "ShardedOffloadAdam",
    "ShardedPagedAdam",
    "plan_shards",
]

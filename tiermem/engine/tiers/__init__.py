"""The tier manager: one job's tensors across pool blocks (CPU) and the swap store (NVMe).

- ``records``: ``TensorRecord``, ``TensorState``, ``TierStats``;
- ``policy``: pure eviction/prefetch policy (``AccessOrder``, ``choose_victims``);
- ``manager``: ``TierManager`` (acquire/release, prefetch, the pool's evict callback);
- ``shares``: ``PoolShares``, the node's owner of pool memory borrowed above the managers' floors.
"""

from tiermem.engine.tiers.manager import TierManager
from tiermem.engine.tiers.policy import AccessOrder, Candidate, NodeCandidate, choose_node_victims, choose_victims
from tiermem.engine.tiers.records import TensorRecord, TensorState, TierStats
from tiermem.engine.tiers.shares import PoolShares, SharesStats

__all__ = [
    "AccessOrder",
    "Candidate",
    "NodeCandidate",
    "PoolShares",
    "SharesStats",
    "TensorRecord",
    "TensorState",
    "TierManager",
    "TierStats",
    "choose_node_victims",
    "choose_victims",
]

"""The tier manager: one job's tensors across pool blocks (CPU) and the swap store (NVMe).

- ``records``: ``TensorRecord``, ``TensorState``, ``TierStats``;
- ``policy``: pure eviction/prefetch policy (``AccessOrder``, ``choose_victims``);
- ``manager``: ``TierManager`` (acquire/release, prefetch, the pool's evict callback).
"""

from tiermem.tiers.manager import TierManager
from tiermem.tiers.policy import AccessOrder, Candidate, choose_victims
from tiermem.tiers.records import TensorRecord, TensorState, TierStats

__all__ = ["AccessOrder", "Candidate", "TensorRecord", "TensorState", "TierManager", "TierStats", "choose_victims"]

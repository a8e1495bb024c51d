"""tiermem.engine.pool: the daemon's host memory, allocated once and reused (ZeRO-R).

- ``arena``: sealed, pre-faulted, mlocked memfd segments that travel as an fd;
- ``allocator``: the pure best-fit / coalescing / compacting allocator and its
  ``Block`` records; ``compaction``: the pure move planner;
- ``pool``: ``BufferPool``, the thread-safe binding of allocators to arenas;
- ``pinning``: registering host memory with CUDA (a swappable ``Pinner``).
"""

from tiermem.engine.pool.allocator import (
    Allocator,
    Block,
    BlockState,
    EvictFn,
    MoverFn,
    PoolStats,
    allocate,
    fragmentation,
)
from tiermem.engine.pool.arena import Arena, MlockRefusal, memlock_warning
from tiermem.engine.pool.compaction import Move, plan_compaction, plan_evacuation, plan_for, plan_local_slide
from tiermem.engine.pool.pinning import CudaPinner, NullPinner, Pinner, PinResult, PinStatus, default_pinner
from tiermem.engine.pool.pool import BufferPool, arena_sizes, auto_pool_size

__all__ = [
    "Allocator",
    "Arena",
    "Block",
    "BlockState",
    "BufferPool",
    "CudaPinner",
    "EvictFn",
    "MlockRefusal",
    "Move",
    "MoverFn",
    "NullPinner",
    "PinResult",
    "PinStatus",
    "PoolStats",
    "Pinner",
    "allocate",
    "arena_sizes",
    "auto_pool_size",
    "default_pinner",
    "fragmentation",
    "memlock_warning",
    "plan_compaction",
    "plan_evacuation",
    "plan_for",
    "plan_local_slide",
]

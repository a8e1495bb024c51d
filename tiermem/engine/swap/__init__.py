"""The NVMe tier: I/O engines and the per-job swap store.

- ``engine``: the ``IOEngine`` protocol and ``IORequest``; ``engine_libaio``
  (O_DIRECT + Linux AIO), ``engine_threads`` (fallback), ``engine_select``
  (``open_engine`` picks one from a ``SwapConfig``).
- ``store``: ``SwapStore``, keyed, checksummed, out-of-place objects with a
  crash-consistent manifest; ``extents`` (pure allocator and striping),
  ``manifest`` (codec and atomic writes), ``records``, ``files``.
"""

from tiermem.engine.swap.engine import IOEngine, IOOp, IORequest, make_request
from tiermem.engine.swap.engine_select import open_engine
from tiermem.engine.swap.engine_threads import ThreadEngine
from tiermem.engine.swap.records import RecordState, SwapRecord, SwapStats
from tiermem.engine.swap.store import SwapStore

__all__ = [
    "IOEngine",
    "IOOp",
    "IORequest",
    "RecordState",
    "SwapRecord",
    "SwapStats",
    "SwapStore",
    "ThreadEngine",
    "make_request",
    "open_engine",
]

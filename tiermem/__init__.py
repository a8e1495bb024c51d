"""tiermem: a per-node offload runtime for large-model training.

The library half: the host-memory pool, the NVMe swap store and tier manager,
the CPU Adam engine, the wire protocol and the client.  The service half is the
``tiermemd`` package.  Heavy parts are imported on first use, so that
``import tiermem`` stays cheap for command-line tools.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "BufferPool": "tiermem.engine.pool",
    "CPUAdam": "tiermem.engine.optim",
    "Client": "tiermem.client.link",
    "OffloadAdam": "tiermem.client.offload",
    "OffloadOptions": "tiermem.client.offload",
    "ParamPager": "tiermem.client.offload",
    "ShardedOffloadAdam": "tiermem.client.distributed",
    "connect": "tiermem.client.link",
    "offload_params": "tiermem.client.offload",
}

__all__ = [
    "BufferPool",
    "CPUAdam",
    "Client",
    "OffloadAdam",
    "OffloadOptions",
    "ParamPager",
    "ShardedOffloadAdam",
    "__version__",
    "connect",
    "offload_params",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tiermem' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

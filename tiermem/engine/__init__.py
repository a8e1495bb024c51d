"""tiermem.engine: the host mechanisms the service composes.

- ``pool``: the constant-size, pre-faulted, defragmenting host-memory pool (``BufferPool``) and its arenas;
- ``swap``: NVMe swap files, O_DIRECT extents, the libaio and thread I/O engines, the manifest;
- ``tiers``: the tier manager paging state chunks between the pool and swap;
- ``optim``: the CPU Adam engine (compiled one-pass kernels, threads) and ``CPUAdam``, the in-process
  optimizer on the same engine.

Engines import the pure cores (``tiermem.core``), never the trainer side or the service.
"""

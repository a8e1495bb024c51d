"""What state a rank keeps per element, and how its chunks are cut into parts.  Pure: one home for these
facts, used by the daemon (``tiermemd.state``, ``tiermemd.nvme``, the rank) and by the trainer side's
sizing of a private daemon's pool (``tiermem.client.offload.args``) and the estimator.

Keys: ``master``, ``exp_avg``, ``exp_avg_sq`` and ``grad`` are fp32; ``param`` is the params in their
working dtype, kept apart from the master by a staged rank on the NVMe tier whose params are below fp32
(a param fetch then reads 2 bytes a param, not 4).  A chunk's parts (``chunk_parts``) are each stored and
paged as a unit: ``param`` (what a fetch reads and a step writes), ``state`` (the fp32 state only an
update and a checkpoint touch), ``grad``.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiermem.core import dtypes

__all__ = [
    "ALL_KEYS",
    "MOMENTS",
    "PAGED_KEYS",
    "STAGED_KEYS",
    "chunk_parts",
    "key_nbytes",
    "part_element_nbytes",
    "state_keys_for",
]

MOMENTS = ("exp_avg", "exp_avg_sq")
ALL_KEYS = ("master", *MOMENTS)
STAGED_KEYS = (*ALL_KEYS, "grad")
"""A rank whose params do not live in the shared storage (the staged exchange) also keeps its grads."""
PAGED_KEYS = ("param", *STAGED_KEYS)
"""A staged rank on the NVMe tier whose params are below fp32 also keeps them in their working dtype."""


def state_keys_for(
    dtype: str, placement: str, grad_buffers: int, exchange: str = "shared", grads_in_state: bool = False
) -> tuple[str, ...]:
    """The state a rank keeps: no master when its fp32 params in the pool-backed storage can be it.

    NVMe-placed state keeps the master (what a restarted daemon reopens); a delayed update keeps it
    (the trainer reads the old params while the update writes the new master); the staged exchange
    (params on a device, not in the storage) keeps the master and the grads, and on the NVMe tier, where
    the params are below fp32, the params in their working dtype too (``param``: what a fetch reads)."""
    if exchange == "staged":
        return PAGED_KEYS if placement == "nvme" and dtype != "float32" else STAGED_KEYS
    grad = ("grad",) if grads_in_state else ()
    if dtype == "float32" and placement == "cpu" and grad_buffers == 1:
        return (*MOMENTS, *grad)
    return (*ALL_KEYS, *grad)


def key_nbytes(key: str, dtype: str) -> int:
    """Bytes one element of ``key`` takes for a rank of working dtype ``dtype``."""
    return dtypes.by_name(dtype).torch.itemsize if key == "param" else 4


def part_element_nbytes(keys: Sequence[str], dtype: str) -> dict[str, int]:
    """Bytes one element takes in each part of a chunk (``chunk_parts``) of a rank of working dtype ``dtype``."""
    return {part: sum(key_nbytes(key, dtype) for key in held) for part, held in chunk_parts(keys).items()}


def chunk_parts(keys: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The parts of a chunk of a rank that keeps ``keys``, each stored and paged as a unit, with the keys each
    holds in order: ``param`` (the working-dtype ``param`` where kept, else the ``master``), ``state`` (the
    master where ``param`` is kept, and the moments), ``grad``.  Parts holding none of ``keys`` are left out."""
    if "param" in keys:
        table = {"param": ("param",), "state": ("master", *MOMENTS), "grad": ("grad",)}
    else:
        table = {"param": ("master",), "state": MOMENTS, "grad": ("grad",)}
    parts = {part: tuple(k for k in held if k in keys) for part, held in table.items()}
    return {part: held for part, held in parts.items() if held}

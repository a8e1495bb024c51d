"""The pool a daemon lays out, planned once for both sides of the socket: how a pool is cut into arenas
(``arena_sizes``, what ``BufferPool`` allocates), how tightly blocks placed by best fit pack into them
(``packed_pool_nbytes``), and the pool a private daemon is started with for one optimizer
(``private_pool_plan``: its state chunks or NVMe chunk cache, and its staging window, counted as the
daemon's state format, cache and window defaults count them).  Pure: sizes in, sizes out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiermem.core.config import AdamConfig, JobLimits, PoolConfig
from tiermem.core.errors import InvalidArgument
from tiermem.core.estimate import NVME_CACHE_CHUNKS
from tiermem.core.layout import tensor_starts
from tiermem.core.modes import Exchange, Placement, StepMode
from tiermem.core.statekeys import StateFormat, element_align, state_keys_for
from tiermem.core.units import PAGE_SIZE, MiB, align_up

__all__ = ["PoolPlan", "arena_sizes", "packed_pool_nbytes", "padded_numel", "private_pool_plan"]


def arena_sizes(total: int, arena_size: int, alignment: int = PAGE_SIZE) -> list[int]:
    """Split ``total`` (rounded up to ``alignment``) into arenas of at most ``arena_size``."""
    if total <= 0 or arena_size < alignment:
        raise InvalidArgument(f"pool of {total} bytes in arenas of {arena_size}: both must be >= {alignment}")
    total = align_up(total, alignment)
    arena_size -= arena_size % alignment
    sizes = [arena_size] * (total // arena_size)
    if total % arena_size:
        sizes.append(total % arena_size)
    return sizes


@dataclass(frozen=True)
class PoolPlan:
    """A private daemon's pool: its size and the arena size its blocks tile."""

    nbytes: int
    arena_size: int


def private_pool_plan(
    numel: int,
    *,
    dtype: str,
    placement: Placement,
    mode: StepMode,
    exchange: Exchange,
    release_grads: bool,
    window_nbytes: int | None,
    state_dtype: str = "fp32",
) -> PoolPlan:
    """The pool a private daemon needs for one optimizer: its state chunks (or NVMe chunk cache) and its
    staging window, packed as the daemon's allocator will place them (``packed_pool_nbytes``).  The pool is
    allocated and pre-faulted at once, so every byte of slack costs memory for nothing: the arenas are made
    a whole number of chunk blocks (at most ``pool.arena_size``), so the blocks tile them.  The chunks are
    counted in their exact bytes (``StateFormat``: compressed moments take what they take), and ``numel``
    includes the gaps an int8 rank's layout leaves (``padded_numel``)."""
    grad_buffers = 2 if mode is StepMode.DELAYED else 1
    released = release_grads and exchange is Exchange.SHARED  # the released grads, in the daemon's grad key
    keys = state_keys_for(dtype, placement, grad_buffers, exchange, released)
    fmt = StateFormat(keys, dtype, state_dtype)
    chunk_numel = fmt.chunk_numel(AdamConfig().chunk_numel)
    chunks = [min(chunk_numel, numel - start) for start in range(0, numel, chunk_numel)]
    blocks = [window_nbytes or JobLimits().window_size]
    if placement is Placement.NVME:
        # the NVMe tier's chunk cache (6 chunks, tiermemd.nvme) and one chunk more: chunks of unequal size
        # (the last one is short) leave holes between pinned blocks that compaction cannot close; each
        # chunk is one block per part (tiermem.core.statekeys.chunk_parts)
        parts = [fmt.part_nbytes(part, chunk_numel) for part in fmt.parts]
        blocks += parts * min(len(chunks), NVME_CACHE_CHUNKS)
    else:
        blocks += [fmt.chunk_nbytes(n) for n in chunks]
    largest = align_up(max(blocks), PAGE_SIZE)
    arena = PoolConfig().arena_size
    arena = max(largest, arena - arena % largest)
    return PoolPlan(packed_pool_nbytes(blocks, arena) + MiB, arena)


def padded_numel(numels: Sequence[int], state_dtype: str) -> int:
    """The elements of a rank's flat space for tensors of ``numels`` elements, as the daemon lays them out
    (``plan_layout``: an int8 rank starts each tensor on a quantization block)."""
    return tensor_starts(list(numels), element_align(state_dtype))[1]


def packed_pool_nbytes(blocks: list[int], arena_size: int, alignment: int = PAGE_SIZE) -> int:
    """The smallest pool into which ``blocks``, allocated in this order by best fit, all fit.

    A pool is cut into arenas of ``arena_size`` (the last one shorter, ``arena_sizes``) and a block cannot
    span two, so blocks that do not tile an arena leave its end unused; this counts that exactly instead of
    adding a percentage.  Without frees each arena's free space is one extent at its end, so best fit is
    the arena with the least free space that holds the block."""
    sizes = [align_up(max(b, 1), alignment) for b in blocks]
    if any(size > arena_size for size in sizes):
        raise InvalidArgument(f"a block of {max(sizes)} bytes does not fit an arena of {arena_size}")
    total = sum(sizes)
    step = max(alignment, align_up(min(sizes), alignment))
    while True:
        free = arena_sizes(total, arena_size, alignment)
        for size in sizes:
            fitting = [i for i, left in enumerate(free) if left >= size]
            if not fitting:
                break
            best = min(fitting, key=free.__getitem__)
            free[best] -= size
        else:
            return total
        total += step

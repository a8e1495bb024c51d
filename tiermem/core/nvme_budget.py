"""What a rank's state on the NVMe tier takes: its chunks in whole pages, its chunk cache in the pool and the
swap its admission reserves.  Pure: the one home of these figures, used by the daemon's admission
(``tiermemd.nvme.make_nvme_state``) and by the estimator (``tiermem.core.estimate``), so that
``tiermem estimate`` counts what the daemon then reserves.

- Each part of a chunk (``StateFormat.parts``: ``param``, ``state``, ``grad``) is its own block in the pool
  and its own record in the swap store, in whole pages.
- The cache is ``cache_chunks`` whole chunks (the rank's cache plan, ``tiermem.engine.tiers.sizing``), never
  more than the state.
- The swap is ``SWAP_STATE_COPIES`` copies of the state and the cache: the store writes out of place and
  commits only at ``persist()``, so the committed copy stays until the next commit while a new one is
  written, and the chunks being written back (at most the cache's) need room beside both.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiermem.core.errors import InvalidArgument
from tiermem.core.statekeys import StateFormat
from tiermem.core.units import align_up

__all__ = ["SWAP_STATE_COPIES", "NvmeReservation", "chunk_nbytes", "nvme_reservation", "part_nbytes", "state_nbytes"]

SWAP_STATE_COPIES = 2
"""Copies of a rank's state its swap holds: the committed one and the one being written."""


def part_nbytes(numel: int, fmt: StateFormat) -> list[int]:
    """Pool (and swap) bytes of each part of a chunk of ``numel`` elements, in whole pages (each part is its
    own block)."""
    return [align_up(fmt.part_nbytes(part, numel)) for part in fmt.parts]


def chunk_nbytes(numel: int, fmt: StateFormat) -> int:
    """Pool (and swap) bytes one chunk of ``numel`` elements takes: all of its parts."""
    return sum(part_nbytes(numel, fmt))


def state_nbytes(numel: int, chunk_numel: int, fmt: StateFormat) -> int:
    """Pool bytes of all of a rank's chunks (what a cache that holds all of its state takes)."""
    full, rest = divmod(numel, chunk_numel)
    last = chunk_nbytes(rest, fmt) if rest else 0
    return full * chunk_nbytes(chunk_numel, fmt) + last


@dataclass(frozen=True)
class NvmeReservation:
    """What admitting a rank's state to the NVMe tier reserves."""

    state_nbytes: int
    """All of its chunks, each part in whole pages (``state_nbytes``)."""
    cache_nbytes: int
    """Its chunk cache, in the pool budget."""
    swap_nbytes: int
    """Its swap files, in the swap budget: two copies of the state and the cache."""


def nvme_reservation(numel: int, chunk_numel: int, fmt: StateFormat, cache_chunks: int) -> NvmeReservation:
    """The pool and swap reserved for a rank of ``numel`` elements in chunks of ``chunk_numel`` (already a
    whole number of ``fmt``'s blocks), stored as ``fmt``, with a cache of ``cache_chunks`` chunks."""
    if numel < 0 or chunk_numel <= 0 or cache_chunks < 0:
        raise InvalidArgument(
            f"need numel >= 0, chunk_numel > 0 and cache_chunks >= 0, got {numel}, {chunk_numel} and {cache_chunks}"
        )
    state = state_nbytes(numel, chunk_numel, fmt)
    cache = min(state, cache_chunks * chunk_nbytes(chunk_numel, fmt))
    return NvmeReservation(state, cache, SWAP_STATE_COPIES * state + cache)

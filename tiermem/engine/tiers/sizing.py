"""Sizing the NVMe tier from measurements: queue depth, prefetch depth, chunk cache.  Pure: no I/O, no clock.

Inputs are what was measured: a ``DiskProbe`` of the swap device (bandwidth
of reads and writes at several queue depths, and one block's read latency),
the update kernel's seconds per chunk once a pass has run (``None`` before),
and the memory the cache may take (the job's room in the pool budget).

Rules (``plan_cache``):
- queue depth (``choose_queue_depth``): the smallest measured depth whose
  read and write bandwidth both reach ``within`` (0.9) of the best measured
  (more requests in flight only add latency), doubled, up to the deepest
  measured: completions are reaped by a Python thread, and on a busy CPU a
  late reaper must not leave the device idle.
- prefetch depth, in chunks: enough chunks in flight to fill that queue
  (``queue_depth`` requests of at most a block each: ``ceil(queue_depth /
  ceil(chunk / block))`` chunks), at least 2 (one read is always
  queued while the previous one is verified); and when the update is slower
  than the disk (compute-bound), enough to cover one read and its latency
  with the updates of the chunks before it (``ceil((read + latency) /
  update)``).  When the disk is slower (I/O-bound) deeper prefetch cannot
  help: the disk is already busy all the time.
- cache: the chunks being updated (``acquired``: 2, one updated while the
  next waits for its CPU slot), the prefetched ones, and the ones being
  written back (as many as fill the queue, at least 1).  When the memory, or
  the state itself (never more chunks than it has), cannot hold that,
  prefetch and write-back share what is left after one or two updating
  chunks, prefetch first, down to 1 + 1 + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tiermem.core.errors import InvalidArgument
from tiermem.core.units import PAGE_SIZE, align_up, format_size
from tiermem.engine.swap.probe import DiskPoint, DiskProbe

__all__ = ["CachePlan", "DiskPoint", "DiskProbe", "choose_queue_depth", "plan_cache", "with_overrides"]

ACQUIRED = 2


@dataclass(frozen=True, slots=True)
class CachePlan:
    """What the NVMe tier of one rank runs with, and why."""

    queue_depth: int
    prefetch_depth: int
    """Chunks read ahead of the one being updated."""
    acquired: int
    """Chunks the update pipeline may hold at once."""
    writeback: int
    """Chunks being written back at once."""
    chunk_nbytes: int
    bound: str
    """``"io"`` (the disk is slower than the update), ``"compute"``, ``"unmeasured"`` (no update timed yet, or
    no probe), or ``"configured"`` (the cache size was set in the configuration)."""

    @property
    def cache_chunks(self) -> int:
        return self.acquired + self.prefetch_depth + self.writeback

    @property
    def cache_nbytes(self) -> int:
        return self.cache_chunks * self.chunk_nbytes

    def describe(self) -> str:
        return (
            f"queue depth {self.queue_depth}, prefetch {self.prefetch_depth} chunk(s), cache {self.cache_chunks} "
            f"chunks ({format_size(self.cache_nbytes)}: {self.acquired} updating, {self.prefetch_depth} "
            f"prefetched, {self.writeback} writing back), {self.bound}-bound"
        )


def choose_queue_depth(probe: DiskProbe, *, within: float = 0.9) -> int:
    """Twice the smallest measured queue depth within ``within`` of the best read and write bandwidth."""
    best_read = max(p.read_bps for p in probe.points)
    best_write = max(p.write_bps for p in probe.points)
    deepest = max(p.queue_depth for p in probe.points)
    for p in sorted(probe.points, key=lambda p: p.queue_depth):
        if p.read_bps >= within * best_read and p.write_bps >= within * best_write:
            return min(2 * p.queue_depth, deepest)
    return deepest


def plan_cache(
    probe: DiskProbe | None,
    *,
    chunk_nbytes: int,
    nchunks: int,
    memory_nbytes: int,
    update_s: float | None = None,
    queue_depth: int | None = None,
) -> CachePlan:
    """The plan for one rank (see the module docstring); ``queue_depth`` given: use it (configured or
    already decided).  Without a probe (no libaio, or it failed) the plan is the unmeasured minimum: two
    chunks prefetched, one written back."""
    if chunk_nbytes <= 0 or nchunks <= 0:
        raise InvalidArgument(f"need chunk_nbytes > 0 and nchunks > 0, got {chunk_nbytes} and {nchunks}")
    if update_s is not None and update_s < 0:
        raise InvalidArgument(f"update_s must be >= 0, got {update_s}")
    chunk = align_up(chunk_nbytes, PAGE_SIZE)
    if probe is None:
        qd = queue_depth or 1
        fill, read_s, io_s, latency_s = 1, 0.0, math.inf, 0.0
    else:
        qd = queue_depth if queue_depth is not None else choose_queue_depth(probe)
        point = probe.at(qd)
        fill = max(1, math.ceil(qd / math.ceil(chunk / probe.block_nbytes)))  # chunks holding qd requests
        read_s = chunk / point.read_bps
        io_s = read_s + chunk / point.write_bps
        latency_s = probe.latency_s
    prefetch = max(2, fill)
    if update_s is None or probe is None:
        bound = "unmeasured"
    elif update_s > io_s:
        bound = "compute"
        prefetch = max(prefetch, math.ceil((read_s + latency_s) / update_s))
    else:
        bound = "io"
    acquired, writeback = ACQUIRED, fill
    # bounded by the memory, then by the state itself (no point caching more chunks than there are)
    limit = min(max(memory_nbytes // chunk, 3), nchunks)
    acquired = max(1, min(acquired, limit - 2))
    room = max(limit - acquired, 2)
    if prefetch + writeback > room:  # share what is left, prefetch first
        prefetch = max(1, min(prefetch, -(-room // 2)))
        writeback = max(1, min(writeback, room - prefetch))
    return CachePlan(qd, prefetch, acquired, writeback, chunk, bound)


def with_overrides(plan: CachePlan, *, cache_chunks: int = 0, prefetch_depth: int = 0, nchunks: int) -> CachePlan:
    """``plan`` with the configured cache size and/or prefetch depth (0: keep the measured one).

    A configured cache keeps one chunk writing back and gives the update pipeline what prefetch leaves;
    never more chunks than the state has."""
    if cache_chunks < 0 or prefetch_depth < 0:
        raise InvalidArgument(f"overrides must be >= 0, got cache_chunks={cache_chunks} prefetch={prefetch_depth}")
    if not cache_chunks:
        if not prefetch_depth:
            return plan
        return replace(plan, prefetch_depth=prefetch_depth)
    total = max(min(cache_chunks, nchunks), 3)
    prefetch = min(prefetch_depth or plan.prefetch_depth, total - 2)
    return replace(plan, prefetch_depth=prefetch, writeback=1, acquired=total - prefetch - 1, bound="configured")

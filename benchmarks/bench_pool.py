"""Host-memory pool under a training-shaped churn trace.

One seeded trace of alloc/free operations (sizes 4 KiB .. 256 MiB, log-uniform;
many small long-lived blocks, big short-lived ones; when the live set would
pass the capacity the trace frees the blocks due soonest, as the tier manager
would page them out) is replayed against:

- ``pool``: tiermem's BufferPool (one pre-faulted, locked arena of --capacity, default 3 GiB;
  best fit, coalescing, compaction with real memmove);
- ``first-fit``: a first-fit free list with coalescing and no compaction,
  bookkeeping only (the swap files' ``ExtentAllocator``, as the baseline);
- ``torch.empty``: a fresh tensor per request, dropped on free.

Reported per allocator: the share of requests that fit the total free space
and were satisfied (goal for the pool: 100%), alloc and free latency p50/p99
(goal: alloc p99 <= 50 us when no compaction runs), compactions and bytes
moved.  A second table gives the bandwidth of the first write into a fresh
256 MiB block from the pool against a fresh ``torch.empty`` (median of 5).

    .venv/bin/python benchmarks/bench_pool.py [--capacity 3GiB] [--ops 100000] [--json out.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tiermem.core.units import PAGE_SIZE, KiB, MiB, align_up, format_size, parse_size
from tiermem.engine.pool import BufferPool
from tiermem.engine.swap.extents import ExtentAllocator

MIN_SIZE, MAX_SIZE = 4 * KiB, 256 * MiB


# --------------------------------------------------------------------------- the trace


def make_trace(n_ops: int, capacity: int, seed: int, low_watermark: float = 0.85) -> list[tuple[str, int, int]]:
    """``("a", id, nbytes)`` and ``("f", id, 0)`` operations; live bytes never exceed ``capacity``.

    When an allocation would pass the capacity, blocks due soonest are freed
    until live bytes are under ``low_watermark`` of it (eviction in batches).
    """
    rng = random.Random(seed)
    ops: list[tuple[str, int, int]] = []
    due: list[tuple[int, int]] = []  # (step at which it is freed, id)
    sizes: dict[int, int] = {}
    live = 0
    next_id = 0
    log_lo, log_hi = math.log(MIN_SIZE), math.log(MAX_SIZE)

    def free_one() -> None:
        nonlocal live
        _, victim = heapq.heappop(due)
        live -= align_up(sizes.pop(victim), PAGE_SIZE)
        ops.append(("f", victim, 0))

    while len(ops) < n_ops:
        if due and due[0][0] <= len(ops):
            free_one()
            continue
        nbytes = int(math.exp(rng.uniform(log_lo, log_hi)))
        # Small blocks (per-parameter state) are mostly long-lived; big ones (buckets,
        # prefetched layers, temporaries) mostly short-lived.
        long_share, long_life = (0.6, 20_000) if nbytes < 1 * MiB else (0.01, 5_000)
        mean_life = long_life if rng.random() < long_share else 40
        if live + align_up(nbytes, PAGE_SIZE) > capacity:  # page out down to the low watermark
            while due and live + align_up(nbytes, PAGE_SIZE) > low_watermark * capacity:
                free_one()
        heapq.heappush(due, (len(ops) + 1 + int(rng.expovariate(1 / mean_life)), next_id))
        sizes[next_id] = nbytes
        live += align_up(nbytes, PAGE_SIZE)
        ops.append(("a", next_id, nbytes))
        next_id += 1
    return ops[:n_ops]


# --------------------------------------------------------------------------- replay


@dataclass
class Result:
    name: str
    requests: int = 0
    fit: int = 0
    satisfied_fit: int = 0
    alloc_ns: list[int] = field(default_factory=list)
    alloc_plain_ns: list[int] = field(default_factory=list)
    free_ns: list[int] = field(default_factory=list)
    compactions: int = 0
    bytes_moved: int = 0
    compaction_s: float = 0.0
    wall_s: float = 0.0
    max_live_blocks: int = 0

    def figures(self) -> dict[str, Any]:
        def pct(values: list[int], q: float) -> float:
            if not values:
                return float("nan")
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0

        return {
            "requests": self.requests,
            "fit_total_free": self.fit,
            "satisfied_of_fit": self.satisfied_fit,
            "satisfied_share": self.satisfied_fit / self.fit if self.fit else float("nan"),
            "alloc_p50_us": pct(self.alloc_ns, 0.50),
            "alloc_p99_us": pct(self.alloc_ns, 0.99),
            "alloc_p99_no_compaction_us": pct(self.alloc_plain_ns, 0.99),
            "alloc_max_us": max(self.alloc_ns, default=0) / 1000.0,
            "free_p50_us": pct(self.free_ns, 0.50),
            "free_p99_us": pct(self.free_ns, 0.99),
            "compactions": self.compactions,
            "bytes_moved": self.bytes_moved,
            "compaction_s": self.compaction_s,
            "max_live_blocks": self.max_live_blocks,
            "wall_s": self.wall_s,
        }


def replay(
    name: str,
    trace: list[tuple[str, int, int]],
    alloc: Callable[[int], Any],
    free: Callable[[Any], None],
    free_bytes: Callable[[], int],
    compactions: Callable[[], int] = lambda: 0,
) -> Result:
    result = Result(name)
    handles: dict[int, Any] = {}
    clock = time.perf_counter_ns
    start = time.perf_counter()
    for kind, ident, nbytes in trace:
        if kind == "a":
            result.requests += 1
            fits = align_up(nbytes, PAGE_SIZE) <= free_bytes()
            before = compactions()
            t0 = clock()
            handle = alloc(nbytes)
            elapsed = clock() - t0
            result.alloc_ns.append(elapsed)
            if compactions() == before:
                result.alloc_plain_ns.append(elapsed)
            else:
                result.compaction_s += elapsed / 1e9
            if fits:
                result.fit += 1
                result.satisfied_fit += handle is not None
            if handle is not None:
                handles[ident] = handle
                result.max_live_blocks = max(result.max_live_blocks, len(handles))
        else:
            handle = handles.pop(ident, None)
            if handle is None:
                continue  # its allocation failed
            t0 = clock()
            free(handle)
            result.free_ns.append(clock() - t0)
    result.wall_s = time.perf_counter() - start
    return result


def run_pool(trace: list[tuple[str, int, int]], capacity: int) -> Result:
    with BufferPool.create(capacity, arena_size=capacity, name="bench") as pool:
        (allocator,) = pool.allocators
        result = replay(
            "pool",
            trace,
            pool.try_alloc,
            pool.free,
            lambda: allocator.free_bytes,
            lambda: allocator.compactions,
        )
        result.compactions, result.bytes_moved = pool.compactions, pool.bytes_moved
    return result


def run_first_fit(trace: list[tuple[str, int, int]], capacity: int) -> Result:
    """The baseline: the swap files' ``ExtentAllocator`` over the pool's bytes (first fit over an offset-ordered
    free list, coalescing on free, never compacting), bookkeeping only."""
    extents = ExtentAllocator(align_up(capacity, PAGE_SIZE))

    def alloc(nbytes: int) -> tuple[int, int] | None:
        nbytes = align_up(nbytes, PAGE_SIZE)
        offset = extents.alloc(nbytes)
        return None if offset is None else (offset, nbytes)

    def free(handle: tuple[int, int]) -> None:
        extents.free(*handle)

    return replay("first-fit", trace, alloc, free, lambda: extents.free_nbytes)


def run_torch(trace: list[tuple[str, int, int]], capacity: int) -> Result:
    live = {"bytes": 0}

    def alloc(nbytes: int) -> torch.Tensor:
        live["bytes"] += align_up(nbytes, PAGE_SIZE)
        return torch.empty(nbytes, dtype=torch.uint8)

    def free(t: torch.Tensor) -> None:
        live["bytes"] -= align_up(t.numel(), PAGE_SIZE)
        del t

    return replay("torch.empty", trace, alloc, free, lambda: capacity - live["bytes"])


def first_write_gbps(capacity: int, nbytes: int = 256 * MiB, repeats: int = 5) -> dict[str, float]:
    """Median GB/s of the first fill of a fresh block: pool (pre-faulted) against torch.empty."""
    pool_s, torch_s = [], []
    with BufferPool.create(max(capacity, nbytes), arena_size=max(capacity, nbytes), name="bench-touch") as pool:
        for _ in range(repeats):
            block = pool.alloc(nbytes)
            t = pool.tensor(block, torch.uint8, (nbytes,))
            t0 = time.perf_counter()
            t.fill_(1)
            pool_s.append(time.perf_counter() - t0)
            del t
            pool.free(block)
    for _ in range(repeats):
        t = torch.empty(nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        t.fill_(1)
        torch_s.append(time.perf_counter() - t0)
        del t
    return {
        "pool_gbps": nbytes / statistics.median(pool_s) / 1e9,
        "torch_empty_gbps": nbytes / statistics.median(torch_s) / 1e9,
    }


# --------------------------------------------------------------------------- report


def table(results: list[Result], touch: dict[str, float], args: argparse.Namespace, live_peak: int) -> str:
    head = (
        f"{'allocator':<12} {'satisfied (fit free)':>22} {'alloc p50':>10} {'alloc p99':>10} "
        f"{'p99 no-cmp':>10} {'alloc max':>10} {'free p50':>9} {'free p99':>9} {'compactions':>11} {'moved':>9}"
    )
    lines = [
        f"bench_pool: {args.ops} ops, capacity {format_size(args.capacity)}, seed {args.seed}, "
        f"peak live blocks {live_peak}",
        head,
        "-" * len(head),
    ]
    for r in results:
        f = r.figures()
        share = f"{100 * f['satisfied_share']:.2f}% ({f['satisfied_of_fit']}/{f['fit_total_free']})"
        lines.append(
            f"{r.name:<12} {share:>22} {f['alloc_p50_us']:>8.1f}us {f['alloc_p99_us']:>8.1f}us "
            f"{f['alloc_p99_no_compaction_us']:>8.1f}us {f['alloc_max_us']:>8.0f}us {f['free_p50_us']:>7.1f}us "
            f"{f['free_p99_us']:>7.1f}us {f['compactions']:>11} {format_size(f['bytes_moved']):>9}"
        )
    lines.append("")
    lines.append(
        f"first write into a fresh 256MiB block (median of 5): pool {touch['pool_gbps']:.1f} GB/s, "
        f"torch.empty {touch['torch_empty_gbps']:.1f} GB/s"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", type=parse_size, default=3 * 1024 * MiB, help="pool capacity (default 3GiB)")
    parser.add_argument("--ops", type=int, default=100_000, help="operations in the trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    trace = make_trace(args.ops, args.capacity, args.seed)
    live_peak = peak_live(trace)
    results = [run_pool(trace, args.capacity), run_first_fit(trace, args.capacity), run_torch(trace, args.capacity)]
    touch = first_write_gbps(args.capacity)
    print(table(results, touch, args, live_peak))
    if args.json:
        payload = {
            "benchmark": "bench_pool",
            "config": {"ops": args.ops, "capacity": args.capacity, "seed": args.seed},
            "trace": {"allocs": sum(op[0] == "a" for op in trace), "peak_live_blocks": live_peak},
            "results": {r.name: r.figures() for r in results},
            "first_write": touch,
            "goals": {"pool_satisfied_share": 1.0, "alloc_p99_no_compaction_us": 50.0},
        }
        with open(args.json, "w") as out:
            json.dump(payload, out, indent=2)
    return 0


def peak_live(trace: list[tuple[str, int, int]]) -> int:
    live = peak = 0
    for kind, _, _ in trace:
        live += 1 if kind == "a" else -1
        peak = max(peak, live)
    return peak


if __name__ == "__main__":
    sys.exit(main())

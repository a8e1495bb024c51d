"""Streaming Adam over NVMe-resident state: params/s against the bound the disk sets.

The fp32 state (master, exp_avg, exp_avg_sq: 12 B/param) lives in swap files;
a chunk cache of a few chunks in a pool streams it through the CPU Adam engine
exactly as tiermemd's NVMe placement does: the TierManager reads chunk i+1
(prefetch) while chunk i is updated, and writes chunk i-1 back as its room is
needed.  fp16 grads come in and fp16 params go out in memory.

The disk bound: every step must read and write the whole state once, so at
best it takes ``state/read_bw + state/write_bw`` when reads and writes share
the device (``max`` of the two when they overlap perfectly).  The bandwidths
are measured in the same run, on the same store, with the same chunk objects:
the same number of chunk-sized objects written (and committed), then read,
straight through the store.
The in-memory engine's params/s on the same buffers is printed for scale.

    .venv/bin/python benchmarks/bench_adam_streaming.py --params 64M --dir /var/tmp [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from tiermem.core.config import SwapConfig
from tiermem.core.units import MiB, align_up, format_size, parse_size
from tiermem.engine.optim import AdamEngine, AdamHyper
from tiermem.engine.pool import BufferPool
from tiermem.engine.swap import open_engine
from tiermem.engine.swap.store import SwapStore
from tiermem.engine.tiers import TierManager

STATE_BYTES = 12
CACHE_CHUNKS = 6
PREFETCH_DEPTH = 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="64M", help="parameters (K/M/G = 2**10/20/30; default 64M: 768 MiB state)")
    ap.add_argument("--chunk", default="2M", help="elements per chunk (default 2M = 24 MiB of state)")
    ap.add_argument("--dir", default="/var/tmp", help="swap directory (a disk with O_DIRECT)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    numel = parse_size(args.params)  # binary suffixes: 64M = 64 * 2**20
    chunk = parse_size(args.chunk)
    nchunks = -(-numel // chunk)
    sizes = [min(chunk, numel - c * chunk) for c in range(nchunks)]
    keys = [f"chunk{c}" for c in range(nchunks)]
    state = numel * STATE_BYTES
    cache = CACHE_CHUNKS * align_up(chunk * STATE_BYTES)
    torch.set_num_threads(args.threads)
    adam = AdamEngine(threads=args.threads, warmup=[(torch.float16, torch.float16)])
    io = open_engine(SwapConfig(), args.dir)
    pool_nbytes = cache + align_up(chunk * STATE_BYTES) + 16 * MiB
    pool = BufferPool.create(pool_nbytes, arena_size=align_up(pool_nbytes), mlock=True)
    grads = torch.randn(numel, dtype=torch.float16) * 1e-3
    out = torch.empty(numel, dtype=torch.float16)
    hyper = AdamHyper(lr=1e-3, weight_decay=0.01)
    with tempfile.TemporaryDirectory(prefix="tiermem-stream-", dir=args.dir) as d:
        store = SwapStore.open([d], "bench", io, 3 * state + 2 * cache)
        tiers = TierManager(pool, store, cache)
        for key, n in zip(keys, sizes, strict=True):
            tiers.register(key, torch.float32, (3 * n,))
        print(
            f"state {format_size(state)} in {nchunks} chunks of {format_size(chunk * STATE_BYTES)}, "
            f"cache {format_size(cache)}, engine {type(io).__name__}, threads {args.threads}"
        )

        # raw bandwidth of the same store and object size: write, commit, then read every chunk once
        staging = pool.alloc(align_up(chunk * STATE_BYTES), owner="bench")
        pool.pin(staging)
        memory = (pool.address(staging), align_up(chunk * STATE_BYTES))
        raw = [f"raw{c}" for c in range(nchunks)]

        def raw_pass(op: str) -> float:
            t = time.perf_counter()
            futures = [getattr(store, op)(key, memory) for key in raw[:nchunks]]
            for f in futures:
                f.result()
            if op == "write":
                store.commit()
            return time.perf_counter() - t

        write_s = statistics.median(raw_pass("write") for _ in range(2))
        read_s = statistics.median(raw_pass("read") for _ in range(2))
        for key in raw:
            store.delete(key)
        store.commit()
        pool.unpin(staging)
        pool.free(staging)
        object_bytes = nchunks * align_up(chunk * STATE_BYTES)
        read_s, write_s = read_s * state / object_bytes, write_s * state / object_bytes
        tiers.prefetch(keys, PREFETCH_DEPTH)

        def cold() -> None:
            tiers.flush()
            tiers.evict(cache)  # every chunk back to NVMe only: the pass reads all of them

        def step_pass(step: int) -> float:
            cold()
            t = time.perf_counter()
            for c, key in enumerate(keys):
                flat = tiers.acquire(key)
                n = sizes[c]
                a = c * chunk
                adam.update(flat[:n], flat[n : 2 * n], flat[2 * n :], grads[a : a + n], out[a : a + n],
                            group=hyper, step=step)  # fmt: skip
                tiers.release(key, dirty=True)
            tiers.flush()
            return time.perf_counter() - t

        step_pass(1)  # creates the state on disk (first page-ins are zero-filled)
        stream_s = statistics.median(step_pass(s) for s in range(2, args.steps + 2))
        tstats = tiers.stats()
        tiers.close()
        store.close(remove=True)
    # in-memory engine on the same sizes, for scale
    p, m, v = (torch.zeros(chunk) for _ in range(3))
    t = time.perf_counter()
    for c in range(nchunks):
        n = sizes[c]
        adam.update(p[:n], m[:n], v[:n], grads[c * chunk : c * chunk + n], out[c * chunk : c * chunk + n],
                    group=hyper, step=1)  # fmt: skip
    memory_s = time.perf_counter() - t
    io.close()
    adam.close()
    pool.close()
    read_bw, write_bw = state / read_s, state / write_s
    bound_serial = state / read_bw + state / write_bw
    bound_overlap = max(state / read_bw, state / write_bw)
    rows: dict[str, Any] = {
        "params": numel,
        "state_bytes": state,
        "read_GBps": read_bw / 1e9,
        "write_GBps": write_bw / 1e9,
        "stream_params_per_s": numel / stream_s,
        "bound_serial_params_per_s": numel / bound_serial,
        "bound_overlap_params_per_s": numel / bound_overlap,
        "memory_params_per_s": numel / memory_s,
        "stream_vs_serial_bound": bound_serial / stream_s,
        "nvme_wait_s_total": tstats.wait_s,
    }
    print(f"disk (same store, same chunks): read {read_bw / 1e9:.2f} GB/s, write {write_bw / 1e9:.2f} GB/s")
    print(f"{'':32} {'Mparam/s':>10}")
    print(f"{'streaming Adam (NVMe state)':32} {numel / stream_s / 1e6:>10.1f}")
    print(f"{'disk bound, reads+writes serial':32} {numel / bound_serial / 1e6:>10.1f}")
    print(f"{'disk bound, perfect overlap':32} {numel / bound_overlap / 1e6:>10.1f}")
    print(f"{'in-memory engine':32} {numel / memory_s / 1e6:>10.1f}")
    print(f"streaming / serial disk bound: {bound_serial / stream_s:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

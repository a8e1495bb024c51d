"""Compressed-moment Adam on the CPU: the fused pass against the memory bound and against 8-bit AdamW peers.

The job: one AdamW step (weight decay 0.01) over N parameters, fp16 grads in,
fp16 params out, fp32 master, moments in ``state_dtype``.  Bytes per param:

    fp32   grad 2 + master, m, v read 12 + written 12 + fp16 copy 2   = 28 B
    bf16   grad 2 + master 4 + 4, m, v 2 + 2 read and written, copy 2 = 20 B
    int8   grad 2 + master 4 + 4, m, v 1 + 1 read and written, copy 2
           + the block scales (8 B per 256 params, read and written)  = 16.06 B

Rows (N = 16M and 64M by default, ``--threads`` threads each):

- ``probe <fmt>``: one C loop built with the kernel's compiler and flags and
  cut into the same pieces on the same threads, reading and writing exactly
  the bytes of that format's job with no arithmetic, prefetching two blocks
  ahead as the kernel does.  The bound.
- ``tiermem <fmt>``: ``AdamEngine.update_lowbit`` (bf16, int8) and
  ``AdamEngine.update`` (fp32).
- ``torchao AdamW8bit``: torchao's block-wise 8-bit AdamW on the CPU, fp32
  params with fp32 grads (the fp16 grads cast in, the fp16 copy cast out:
  the passes it needs around it), where torchao imports.
- ``bitsandbytes AdamW8bit``: likewise, where it imports and runs on the CPU.

params/s are medians over ``--repeats`` rounds; in each round every row runs
``--steps`` steps, round-robin, so all rows see the same machine state.
Goal: tiermem int8 and bf16 >= 0.9x their probe.

    .venv/bin/python benchmarks/bench_lowbit_adam.py [--sizes 16M,64M] [--threads 2] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_cpu_adam import add_sweep_args, parse_count, time_rows, write_json

BYTES = {"fp32": 28.0, "bf16": 20.0, "int8": 16.0 + 16.0 / 256}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_args(ap)
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from tiermem.engine.optim import AdamEngine
    from tiermem.engine.optim.lowbit_native import build_library

    t0 = time.perf_counter()
    engine = AdamEngine(threads=args.threads, warmup=[(torch.float16, torch.float16)])
    kernel = engine.lowbit_kernel()
    build_s = time.perf_counter() - t0
    if not kernel.native:
        print(f"the fused kernel did not build ({kernel.error}); nothing to measure")
        return 1
    probe_lib = ctypes.CDLL(build_library(Path(__file__).with_name("lowbit_probe.c"), "lowbit-probe"))
    probe_fn = probe_lib.tm_probe
    probe_fn.restype = None
    probe_fn.argtypes = [ctypes.c_int64, *[ctypes.c_void_p] * 3, ctypes.c_int, *[ctypes.c_void_p] * 4]
    peers = load_peers(torch)
    print(f"machine: {os.cpu_count()} cpus, threads {args.threads}, torch {torch.__version__}")
    print(f"engine warm-up and kernel build: {build_s:.1f} s ({kernel.path})")
    for name, (_, note) in peers.items():
        print(f"{name}: {note}")
    results: dict[str, Any] = {"threads": args.threads, "torch": torch.__version__, "bytes_per_param": BYTES}
    results["peers"] = {name: note for name, (_, note) in peers.items()}
    results["sizes"] = {}
    for n in (parse_count(s) for s in args.sizes.split(",")):
        results["sizes"][str(n)] = run_size(torch, n, args, engine, probe_fn, peers)
    engine.close()
    write_json(args.json, results)
    return 0


def load_peers(torch: Any) -> dict[str, tuple[Any, str]]:
    peers: dict[str, tuple[Any, str]] = {}
    try:
        import torchao
        from torchao.optim import AdamW8bit

        AdamW8bit([torch.nn.Parameter(torch.zeros(4096))], lr=1e-3)
        peers["torchao AdamW8bit"] = (AdamW8bit, f"torchao {torchao.__version__}")
    except Exception as exc:
        peers["torchao AdamW8bit"] = (None, f"not importable ({type(exc).__name__}: {exc})")
    try:
        import bitsandbytes as bnb

        p = torch.nn.Parameter(torch.zeros(4096))
        p.grad = torch.zeros(4096)
        bnb.optim.AdamW8bit([p], lr=1e-3, min_8bit_size=1).step()
        peers["bitsandbytes AdamW8bit"] = (bnb.optim.AdamW8bit, f"bitsandbytes {bnb.__version__}")
    except Exception as exc:
        peers["bitsandbytes AdamW8bit"] = (None, f"not usable on the CPU ({type(exc).__name__}: {exc})")
    return peers


def run_size(
    torch: Any, n: int, args: argparse.Namespace, engine: Any, probe_fn: Any, peers: dict[str, tuple[Any, str]]
) -> dict[str, Any]:
    from tiermem.core.adam_math import AdamHyper
    from tiermem.core.lowbit import LowbitMoments

    hyper = AdamHyper(lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    g16 = (torch.randn(n, generator=gen) * 1e-2).half()
    out16 = torch.empty(n, dtype=torch.float16)
    rows: dict[str, Callable[[], None]] = {}
    for fmt in ("bf16", "int8"):
        p = p0.clone()
        moments = LowbitMoments.zeros(n, fmt)
        box = [0]

        def ours(p: Any = p, moments: Any = moments, box: list[int] = box) -> None:
            box[0] += 1
            engine.update_lowbit(p, moments, g16, out16, group=hyper, step=box[0])

        rows[f"probe {fmt}"] = probe_rows(engine, probe_fn, p0.clone(), g16, out16, LowbitMoments.zeros(n, fmt))
        rows[f"tiermem {fmt}"] = ours
    p32, m32, v32 = p0.clone(), torch.zeros(n), torch.zeros(n)
    box32 = [0]

    def fp32() -> None:
        box32[0] += 1
        engine.update(p32, m32, v32, g16, out16, group=hyper, step=box32[0])

    rows["tiermem fp32"] = fp32
    for name, (cls, _) in peers.items():
        if cls is not None:
            rows[name] = peer_row(torch, cls, p0.clone(), g16, out16)
    times = time_rows(rows, args.repeats, args.steps)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    rate = {name: n / t for name, t in med.items()}
    print(f"\nN = {n / (1 << 20):.0f}M params, fp16 grads in, fp16 params out; medians of {args.repeats}x{args.steps}")
    print(f"{'row':<26}{'ms/step':>9}{'Gparam/s':>10}{'B/param':>9}{'GB/s':>8}{'vs probe':>10}")
    out: dict[str, Any] = {}
    for name in rows:
        fmt = name.split()[-1]
        nbytes = BYTES.get(fmt)
        probe = f"probe {fmt}"
        vs_probe = rate[name] / rate[probe] if probe in rate and not name.startswith("probe") else None
        gbs = rate[name] * nbytes / 1e9 if nbytes else None
        print(
            f"{name:<26}{med[name] * 1e3:>9.1f}{rate[name] / 1e9:>10.3f}"
            f"{'' if nbytes is None else f'{nbytes:.2f}':>9}{'' if gbs is None else f'{gbs:.1f}':>8}"
            f"{'' if vs_probe is None else f'{vs_probe:.2f}x':>10}"
        )
        out[name] = {"seconds": med[name], "params_per_s": rate[name], "all_seconds": times[name]}
        if nbytes:
            out[name].update(bytes_per_param=nbytes, gb_s=gbs)
        if vs_probe is not None:
            out[name]["vs_probe"] = vs_probe
    for peer in peers:
        if peer in rate:
            print(f"tiermem int8 / {peer}: {rate['tiermem int8'] / rate[peer]:.2f}x")
            out[peer]["tiermem_int8_ratio"] = rate["tiermem int8"] / rate[peer]
    for fmt in ("bf16", "int8"):
        ratio = out[f"tiermem {fmt}"]["vs_probe"]
        print(f"goal: tiermem {fmt} >= 0.9x its probe: {ratio:.2f}x {'met' if ratio >= 0.9 else 'NOT met'}")
    return out


def probe_rows(engine: Any, probe_fn: Any, p: Any, g: Any, out: Any, moments: Any) -> Callable[[], None]:
    """The probe cut into the engine's pieces, run on the engine's threads like the kernel."""
    from tiermem.core.lowbit import BLOCK

    kind = 1 if moments.state_dtype == "bf16" else 2
    n = p.numel()
    cuts = engine._cuts(0, n, compiled=True, align=BLOCK)
    pool = engine._pool

    def piece(a: int, b: int) -> None:
        m, v = moments.exp_avg, moments.exp_avg_sq
        ms = moments.exp_avg_scale.data_ptr() + 4 * (a // BLOCK) if kind == 2 else 0
        vs = moments.exp_avg_sq_scale.data_ptr() + 4 * (a // BLOCK) if kind == 2 else 0
        probe_fn(
            b - a,
            p.data_ptr() + 4 * a,
            g.data_ptr() + 2 * a,
            out.data_ptr() + 2 * a,
            kind,
            m.data_ptr() + m.element_size() * a,
            v.data_ptr() + v.element_size() * a,
            ms,
            vs,
        )

    def run() -> None:
        ranges = list(itertools.pairwise(cuts))
        futures = [pool.submit(piece, a, b) for a, b in ranges[1:]] if pool is not None else []
        for a, b in ranges if pool is None else ranges[:1]:
            piece(a, b)
        for f in futures:
            f.result()

    return run


def peer_row(torch: Any, cls: Any, p: Any, g16: Any, out16: Any) -> Callable[[], None]:
    """A torch-style 8-bit AdamW over fp32 params: cast the fp16 grads in, step, cast the params out."""
    param = torch.nn.Parameter(p)
    opt = cls([param], lr=1e-3, weight_decay=0.01)
    param.grad = torch.empty_like(p)

    def run() -> None:
        param.grad.copy_(g16)
        opt.step()
        out16.copy_(param.detach())

    return run


if __name__ == "__main__":
    sys.exit(main())

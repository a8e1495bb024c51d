"""CPU Adam: params/s of tiermem's engine against torch and DeepSpeed, and against the memory bound.

The job: one AdamW step (weight decay 0.01) over N parameters whose grads
arrive in fp16 and whose fp16 copy must be written back, fp32 master /
momentum / variance.  The bytes the job must move per parameter:

    fp16 grad read 2 + p, m, v read 12 + p, m, v write 12 + fp16 copy write 2 = 28 B

Rows (N = 16M and 64M by default, ``--threads`` threads each):

- ``bound: triad``: STREAM triad a = b + s*c in torch (12 B/element), GB/s.
- ``bound: same-bytes probe``: one compiled loop (same compiler, options and
  threading as the engine) that reads and writes exactly the 28 B/param of the
  job with no arithmetic (p, m, v negated in place, grad copied to the copy).
  It is the reference for "at the speed of memory".
- ``tiermem``: ``AdamEngine.update`` (one pass, 28 B/param).
- ``tiermem fp32 scaled`` and ``compiled fp32 scaled``: an fp32 job's update
  with a grad scale (loss scaling or clipping), fp32 grads, no copy (4 + 12 +
  12 = 28 B/param): the engine's native path (torch's fused kernel over
  1 MiB blocks of the scaled grad) against its compiled kernel
  (``native=False``; the path it takes where ``adam.warmup`` lists float32).
- ``torch foreach`` / ``torch fused``: ``torch.optim.AdamW(foreach=True)`` and
  ``(fused=True)`` on fp32 params, plus the passes they need around them:
  cast fp16 grads to fp32 ``.grad`` (2 + 4 B) and copy params to fp16 (4 + 2 B):
  40 B/param at least.
- ``deepspeed``: ``DeepSpeedCPUAdam(adamw_mode=True)`` with the same cast and
  copy passes, when ``deepspeed`` is importable and its op builds (else the
  reason is printed).

params/s are medians over ``--repeats`` rounds; in each round every row runs
``--steps`` steps, round-robin, so all rows see the same machine state.  "GB/s
@28B" is params/s x 28 (the job's bytes); "GB/s moved" uses each row's own
byte count.  Ratios: tiermem / probe and tiermem / each peer, same run.

Goals: tiermem >= 1.1x deepspeed, >= 1.3x torch fused, >= 0.9x the probe.

    .venv/bin/python benchmarks/bench_cpu_adam.py [--sizes 16M,64M] [--threads 2] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

JOB_BYTES = 28
PEER_BYTES = 40


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def add_sweep_args(ap: argparse.ArgumentParser) -> None:
    """The flags of a sweep over sizes (also ``bench_lowbit_adam``'s): sizes, threads, rounds, steps a round."""
    ap.add_argument("--sizes", default="16M,64M", help="parameter counts, comma-separated (K/M suffixes)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per row per round")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_args(ap)
    ap.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam even if importable")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # DeepSpeed's OpenMP loop

    import torch

    torch.set_num_threads(args.threads)
    from tiermem.engine.optim import AdamEngine, AdamHyper

    t0 = time.perf_counter()
    engine = AdamEngine(threads=args.threads, warmup=[(torch.float16, torch.float16)])
    compile_s = time.perf_counter() - t0
    compiled = AdamEngine(threads=args.threads, native=False, warmup=[(torch.float32, None)])
    probe, probe_compile_s = make_probe(torch, args.threads)
    ds_cls, ds_note = load_deepspeed(args.no_deepspeed)
    print(f"machine: {os.cpu_count()} cpus, threads {args.threads}, torch {torch.__version__}")
    print(f"engine warm-up (first compile): {compile_s:.1f} s; probe compile {probe_compile_s:.1f} s")
    print(f"deepspeed: {ds_note}")

    results: dict[str, Any] = {
        "threads": args.threads,
        "torch": torch.__version__,
        "engine_compile_s": compile_s,
        "deepspeed": ds_note,
        "bytes_per_param": {"tiermem": JOB_BYTES, "probe": JOB_BYTES, "peers": PEER_BYTES},
        "sizes": {},
    }
    for n in (parse_count(s) for s in args.sizes.split(",")):
        results["sizes"][str(n)] = run_size(
            torch, n, args, engine, AdamHyper(lr=1e-3, weight_decay=0.01), probe, ds_cls, compiled
        )
    engine.close()
    compiled.close()
    write_json(args.json, results)
    return 0


def write_json(path: str | None, results: dict[str, Any]) -> None:
    """The figures to ``path`` (``--json``; None: not asked for)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {path}")


def make_probe(torch: Any, threads: int) -> tuple[Callable[..., None], float]:
    """A compiled loop moving exactly the job's bytes, split over ``threads`` like the engine."""

    def same_bytes(p: Any, g: Any, m: Any, v: Any, out: Any) -> None:
        p.copy_(-p)
        m.copy_(-m)
        v.copy_(-v)
        out.copy_(g)

    fn = torch.compile(same_bytes, dynamic=True, fullgraph=True, options={"cpp_wrapper": True, "cpp.threads": 1})
    t0 = time.perf_counter()
    x = [torch.zeros(1024) for _ in range(3)]
    fn(x[0], torch.zeros(1024, dtype=torch.float16), x[1], x[2], torch.zeros(1024, dtype=torch.float16))
    pool = ThreadPoolExecutor(threads)

    def run(p: Any, g: Any, m: Any, v: Any, out: Any) -> None:
        n = p.numel()
        size = -(-n // threads)
        futs = [
            pool.submit(fn, p[a : a + size], g[a : a + size], m[a : a + size], v[a : a + size], out[a : a + size])
            for a in range(0, n, size)
        ]
        for f in futs:
            f.result()

    return run, time.perf_counter() - t0


def load_deepspeed(skip: bool) -> tuple[Any, str]:
    if skip:
        return None, "skipped (--no-deepspeed)"
    try:
        import deepspeed  # noqa: F401
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:
        return None, f"not importable ({type(exc).__name__}: {exc})"
    try:
        import torch

        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(16))], lr=1e-3)  # builds/loads the op
    except Exception as exc:
        return None, f"importable but its cpu_adam op did not build/load ({type(exc).__name__}: {exc})"
    import deepspeed as ds

    return DeepSpeedCPUAdam, f"DeepSpeedCPUAdam from deepspeed {ds.__version__}"


def time_rows(rows: dict[str, Callable[[], None]], repeats: int, steps: int) -> dict[str, list[float]]:
    """Seconds a step of each row, ``repeats`` rounds of ``steps`` steps, round-robin so that every row sees
    the same machine state; each row runs once first (touching its buffers, building its state)."""
    for fn in rows.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - t0) / steps)
    return times


def run_size(
    torch: Any,
    n: int,
    args: argparse.Namespace,
    engine: Any,
    hyper: Any,
    probe: Callable[..., None],
    ds_cls: Any,
    compiled: Any,
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    m = torch.zeros(n)
    v = torch.zeros(n)
    g16 = (torch.randn(n, generator=gen) * 1e-2).half()
    out16 = torch.empty(n, dtype=torch.float16)
    a, b, c = torch.empty(n), torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    step_box = [0]

    def ours() -> None:
        step_box[0] += 1
        engine.update(p, m, v, g16, out16, group=hyper, step=step_box[0])

    g32 = torch.randn(n, generator=gen) * 1e-2
    fp32_ops = {name: (p.clone(), torch.zeros(n), torch.zeros(n)) for name in ("native", "compiled")}

    def fp32_scaled(which: Any, ops: tuple[Any, Any, Any]) -> Callable[[], None]:
        box = [0]

        def run() -> None:
            box[0] += 1
            which.update(*ops, g32, None, group=hyper, step=box[0], grad_scale=0.5)

        return run

    rows: dict[str, Callable[[], None]] = {
        "bound: triad": lambda: torch.add(b, c, alpha=0.5, out=a),
        "bound: same-bytes probe": lambda: probe(p, g16, m, v, out16),
        "tiermem": ours,
        "tiermem fp32 scaled": fp32_scaled(engine, fp32_ops["native"]),
        "compiled fp32 scaled": fp32_scaled(compiled, fp32_ops["compiled"]),
    }
    pieces = 16  # a model's worth of tensors for the torch optimizers
    for name, kwargs in (("torch foreach", {"foreach": True}), ("torch fused", {"fused": True})):
        rows[name] = torch_peer(
            torch,
            p.clone(),
            g16,
            out16,
            pieces,
            lambda ps, kw=kwargs: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **kw),
        )
    if ds_cls is not None:
        rows["deepspeed"] = torch_peer(
            torch, p.clone(), g16, out16, pieces, lambda ps: ds_cls(ps, lr=1e-3, weight_decay=0.01, adamw_mode=True)
        )
    times = time_rows(rows, args.repeats, args.steps)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    rate = {name: n / t for name, t in med.items()}

    print(
        f"\nN = {n / (1 << 20):.0f}M params, fp16 grads in, fp16 params out; medians of {args.repeats} x {args.steps}"
    )
    print(
        f"{'row':<26}{'ms/step':>9}{'Gparam/s':>10}{'GB/s @28B':>11}{'B moved':>9}{'GB/s moved':>12}{'tiermem x':>11}"
    )
    out: dict[str, Any] = {}
    for name in rows:
        if name == "bound: triad":
            gbs = 12 * n / med[name] / 1e9
            print(f"{name:<26}{med[name] * 1e3:>9.1f}{'':>10}{'':>11}{12:>9}{gbs:>12.1f}{'':>11}")
            out[name] = {"seconds": med[name], "gb_s": gbs, "bytes_per_element": 12}
            continue
        ours_bytes = ("tiermem", "bound: same-bytes probe", "tiermem fp32 scaled", "compiled fp32 scaled")
        moved = JOB_BYTES if name in ours_bytes else PEER_BYTES
        ratio = rate["tiermem"] / rate[name]
        print(
            f"{name:<26}{med[name] * 1e3:>9.1f}{rate[name] / 1e9:>10.3f}{rate[name] * JOB_BYTES / 1e9:>11.1f}"
            f"{moved:>9}{rate[name] * moved / 1e9:>12.1f}{ratio:>10.2f}x"
        )
        out[name] = {
            "seconds": med[name],
            "params_per_s": rate[name],
            "gb_s_at_28": rate[name] * JOB_BYTES / 1e9,
            "bytes_moved_per_param": moved,
            "gb_s_moved": rate[name] * moved / 1e9,
            "tiermem_ratio": ratio,
            "all_seconds": times[name],
        }
    goals = [
        ("probe", "bound: same-bytes probe", 0.9),
        ("torch fused", "torch fused", 1.3),
        ("deepspeed", "deepspeed", 1.1),
    ]
    print(
        f"fp32 scaled, native path / compiled kernel: {rate['tiermem fp32 scaled'] / rate['compiled fp32 scaled']:.2f}x"
    )
    for label, row, goal in goals:
        if row in rate:
            got = rate["tiermem"] / rate[row]
            print(f"goal tiermem >= {goal}x {label}: {got:.2f}x {'met' if got >= goal else 'NOT met'}")
    return out


def torch_peer(
    torch: Any, flat: Any, g16: Any, out16: Any, pieces: int, make: Callable[[list[Any]], Any]
) -> Callable[[], None]:
    """A torch-style optimizer over ``pieces`` fp32 params: cast grads in, step, copy params out."""
    params = [torch.nn.Parameter(t) for t in flat.chunk(pieces)]
    g_parts, o_parts = g16.chunk(pieces), out16.chunk(pieces)
    for prm in params:
        prm.grad = torch.empty_like(prm)
    opt = make(params)

    def step() -> None:
        for prm, g in zip(params, g_parts, strict=True):
            prm.grad.copy_(g)
        opt.step()
        with torch.no_grad():
            for prm, o in zip(params, o_parts, strict=True):
                o.copy_(prm)

    return step


if __name__ == "__main__":
    sys.exit(main())

"""State transfer through the staging window: ``state_dict`` and ``load_state_dict`` time by window size.

The staging window is the only memory of a rank that is not the model's own
(params and grads live in the shared storage): state moves through it piece
by piece, one STATE_READ / STATE_WRITE round trip per window-full.  A small
window costs round trips, a large one pins memory per rank (it is mlocked
and counted in ``jobs.window_budget``).  This measures, for one model, the
time of ``state_dict()`` and ``load_state_dict()`` through a real private
tiermemd at each window size, against a plain in-process copy of the same
bytes (the bound: the transfer is two copies, into and out of the window),
and picks the smallest window within 10% of the best time: that is the
default of ``jobs.window_size``.

    .venv/bin/python benchmarks/bench_window.py [--params 20e6] [--windows 256KiB,1MiB,2MiB] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tiermem.client.link import connect
from tiermem.client.offload import OffloadAdam
from tiermem.core.units import format_size, parse_size


def measure(params: int, window: int, repeats: int, socket_path: str) -> dict[str, float]:
    model = torch.nn.Linear(params // 1000, 1000, bias=False)
    opt = OffloadAdam(model.parameters(), lr=1e-3, offload="cpu", window_nbytes=window, client=connect(socket_path))
    try:
        model(torch.randn(2, params // 1000)).sum().backward()
        opt.step()
        saves, loads = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sd = opt.state_dict()
            t1 = time.perf_counter()
            opt.load_state_dict(sd)
            t2 = time.perf_counter()
            saves.append(t1 - t0)
            loads.append(t2 - t1)
        return {"window_bytes": window, "state_dict_s": statistics.median(saves), "load_s": statistics.median(loads)}
    finally:
        opt.close()


def copy_bound(params: int, repeats: int) -> float:
    """Two plain copies of the state_dict's bytes (into and out of a buffer), in process."""
    src = torch.randn(2 * params)
    mid = torch.empty_like(src)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mid.copy_(src)
        dst.copy_(mid)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=20e6)
    parser.add_argument("--windows", default="256KiB,1MiB,2MiB,4MiB,16MiB,64MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    params = int(args.params)
    windows = [parse_size(w) for w in args.windows.split(",")]
    torch.set_num_threads(1)
    owner = connect(pool_size=params * 8 + sum(windows) + (256 << 20), settings={"adam.compile": False})
    try:
        rows = [measure(params, w, args.repeats, owner.socket_path) for w in windows]
    finally:
        owner.close()
    bound = copy_bound(params, args.repeats)
    best = min(r["state_dict_s"] + r["load_s"] for r in rows)
    pick = next(r for r in rows if r["state_dict_s"] + r["load_s"] <= 1.1 * best)
    print(f"{params / 1e6:.0f}M fp32 params: state_dict moves {format_size(8 * params)} (two moments)")
    print(f"{'window':>10} {'state_dict s':>13} {'load s':>8} {'vs 2 copies':>12}")
    for r in rows:
        total = r["state_dict_s"] + r["load_s"]
        print(
            f"{format_size(int(r['window_bytes'])):>10} {r['state_dict_s']:>13.3f} {r['load_s']:>8.3f} "
            f"{total / (2 * bound):>11.2f}x"
        )
    print(
        f"two plain copies of the bytes: {bound:.3f} s; smallest window within 10% of the best: "
        f"{format_size(int(pick['window_bytes']))}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"params": params, "rows": rows, "copy_bound_s": bound, "pick": pick["window_bytes"]}, indent=2)
        )


if __name__ == "__main__":
    main()

"""The CUDA paths on a machine with an NVIDIA GPU: parity, copy bandwidth from the window, overlap.

One script, a few minutes, figures as JSON under the directory given on the
command line (``gpu_check.json``), a table on stdout:

1. parity: a small MLP on CUDA trained by ``OffloadAdam`` (the staged
   exchange: grads in and params out through the CUDA-registered staging
   window) against ``torch.optim.AdamW`` on the same GPU, synchronous and with
   the delayed update (against the same one-step-late rule in plain torch),
   the overlapped update (grads pushed as they land, a CUDA event per grad,
   each bucket updated during backward) and ``release_grads=True``;
2. bandwidth: H2D and D2H copies of 64 MiB between a GPU tensor and (a) the
   staging window, registered with ``cudaHostRegister``, (b) a
   ``torch.empty(pin_memory=True)`` buffer, (c) pageable memory;
3. overlap: the step time (CUDA events around forward + backward + step) of a
   larger MLP, synchronous against delayed, overlapped and released grads,
   with the daemon's update time;
4. paging: the demo GPT on CUDA with its params paged by
   ``tiermem.offload_params`` (copy stream and events) through a device budget
   a quarter of its params, against the same optimizer without paging: the
   largest difference of the params after the steps, the pager's peak of
   materialized params, and ``torch.cuda.max_memory_allocated`` over the paged
   steps against the unpaged ones;
5. sharded: ``tiermem.distributed.ShardedOffloadAdam`` in a one-rank NCCL
   process group on the GPU (collectives and statistics on device tensors),
   with clipping, against ``torch.optim.AdamW`` + ``clip_grad_norm_``;
6. sharded_paged: ``tiermem.distributed.ShardedPagedAdam`` in a one-rank
   NCCL group, the model on the GPU paged through a device budget of half its
   params (all-gathers and reduce-scatters on the pager's copy stream), with
   clipping and ``ShardedGradScaler``, against ``GradScaler`` +
   ``clip_grad_norm_`` + ``torch.optim.AdamW``; the pager's peak against its
   budget;
7. layers: ``tiermem.distributed.LayerShardedAdam`` (host params only) refuses
   a model on the GPU at construction, naming the optimizer to use instead.

    python benchmarks/gpu_check.py OUT_DIR [--steps 20] [--parts parity,paging] [--part-timeout 240]

Each part's figures are written to ``gpu_check.json`` as soon as the part
ends; a part that raises records its traceback and the others still run; a
part that hangs past ``--part-timeout`` seconds dumps every thread's stack to
stderr and ends the process, leaving the parts before it on disk.

Without CUDA it writes ``{"cuda": false}`` and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import json
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tiermem.client.link import connect
from tiermem.client.offload import OffloadAdam
from tiermem.engine.pool.pinning import default_pinner

MiB = 1 << 20


def mlp(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 8))


def batches(n: int, width: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(64, width, generator=g).to(device), torch.randn(64, 8, generator=g).to(device)) for _ in range(n)
    ]


@torch.no_grad()
def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def parity(socket: str, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    data = batches(steps, 64, "cuda")
    base = mlp(64, 3).cuda()
    for mode in ("sync", "delayed"):
        m_off, m_ref = copy.deepcopy(base), copy.deepcopy(base)
        opt = OffloadAdam(
            m_off.parameters(), lr=1e-3, client=connect(socket), delayed_update=mode == "delayed", warmup_steps=2
        )
        ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-3)
        master = copy.deepcopy(m_ref)  # the delayed rule: update t computed on grads taken at update t-1's params
        ref_master = torch.optim.AdamW(master.parameters(), lr=1e-3)
        for i, (x, y) in enumerate(data):
            F.mse_loss(m_off(x), y).backward()
            opt.step()
            opt.zero_grad()
            F.mse_loss(m_ref(x), y).backward()
            if mode == "sync":
                ref.step()
                ref.zero_grad()
                continue
            for p, q in zip(m_ref.parameters(), master.parameters(), strict=True):
                q.grad, p.grad = p.grad, None
            if i < 2:
                ref_master.step()
                with torch.no_grad():
                    for p, q in zip(m_ref.parameters(), master.parameters(), strict=True):
                        p.copy_(q)
            else:
                with torch.no_grad():
                    for p, q in zip(m_ref.parameters(), master.parameters(), strict=True):
                        p.copy_(q)
                ref_master.step()
            ref_master.zero_grad()
        opt.flush()
        if mode == "delayed":
            with torch.no_grad():
                for p, q in zip(m_ref.parameters(), master.parameters(), strict=True):
                    p.copy_(q)
        out[mode] = {"max_abs_param_diff": max_diff(m_off, m_ref), "exchange": opt.exchange.value}
        opt.close()
    for mode, kwargs in (
        ("overlap", {"overlap_update": True, "bucket_nbytes": 16 << 10}),
        ("release", {"release_grads": True}),
    ):
        m_off, m_ref = copy.deepcopy(base), copy.deepcopy(base)
        opt = OffloadAdam(m_off.parameters(), lr=1e-3, client=connect(socket), **kwargs)
        ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-3)
        for x, y in data:
            for model, o in ((m_off, opt), (m_ref, ref)):
                F.mse_loss(model(x), y).backward()
                o.step()
                o.zero_grad()
        stats = opt.stats()
        out[mode] = {
            "max_abs_param_diff": max_diff(m_off, m_ref),
            "exchange": opt.exchange.value,
            "overlapped_tensors": stats.rank.overlapped_tensors,
        }
        opt.close()
    return out


def bandwidth(socket: str, nbytes: int = 64 * MiB, repeats: int = 10) -> dict[str, Any]:
    client = connect(socket)
    client.attach("gpu-check-bandwidth", window_nbytes=nbytes)
    window = client.window[:nbytes]
    pin = default_pinner().register(window.data_ptr(), window.numel())
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    hosts = {
        "window (cudaHostRegister)": window,
        "torch pinned": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
        "pageable": torch.empty(nbytes, dtype=torch.uint8),
    }
    rows: dict[str, Any] = {"registered": pin.registered, "nbytes": nbytes}
    for name, host in hosts.items():
        for direction in ("h2d", "d2h"):
            src, dst = (host, dev) if direction == "h2d" else (dev, host)
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            rows[f"{name} {direction} GB/s"] = nbytes * repeats / (start.elapsed_time(end) / 1e3) / 1e9
    if pin.registered:
        default_pinner().unregister(window.data_ptr())
    client.detach()
    client.close()
    return rows


def overlap(socket: str, steps: int) -> dict[str, Any]:
    data = batches(steps, 1024, "cuda")
    out: dict[str, Any] = {}
    modes: dict[str, dict[str, Any]] = {
        "sync": {},
        "delayed": {"delayed_update": True, "warmup_steps": 1},
        "overlap": {"overlap_update": True},
        "release": {"release_grads": True},
    }
    for mode, kwargs in modes.items():
        model = mlp(1024, 8).cuda()
        opt = OffloadAdam(model.parameters(), lr=1e-4, client=connect(socket), **kwargs)
        times = []
        for i, (x, y) in enumerate(data):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
        stats = opt.stats()
        out[mode] = {
            "step_ms_median": sorted(times)[len(times) // 2],
            "daemon_update_s_total": stats.rank.update_s,
            "params": sum(p.numel() for p in model.parameters()),
        }
        opt.close()
    for mode in ("delayed", "overlap", "release"):
        out[f"{mode}_over_sync"] = out[mode]["step_ms_median"] / out["sync"]["step_ms_median"]
    return out


def paging(socket: str, steps: int) -> dict[str, Any]:
    from tiermem.client.demo.model import GPT, GPTConfig
    from tiermem.client.offload import offload_params

    cfg = GPTConfig(n_layer=8, n_head=8, n_embd=512, block_size=128)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=g).cuda() for _ in range(steps)]
    out: dict[str, Any] = {}
    models = {}
    windows = {"unpaged": None, "paged": None, "paged_16MiB_window": 16 * MiB}
    for name, window in windows.items():
        torch.manual_seed(0)
        model = GPT(cfg).cuda()
        param_nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        extra = {} if window is None else {"window_nbytes": window}
        opt = OffloadAdam(model.parameters(), lr=1e-4, exchange="staged", client=connect(socket), **extra)
        pager = offload_params(model, opt, device_budget=param_nbytes // 4) if name != "unpaged" else None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for tokens in data:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        out[name] = {
            "step_s": (time.perf_counter() - t0) / steps,
            "param_nbytes": param_nbytes,
            "max_allocated_over_start": torch.cuda.max_memory_allocated() - base,
            "max_allocated": torch.cuda.max_memory_allocated(),
        }
        if pager is not None:
            out[name]["pager"] = pager.stats()
            out[name]["peak_within_budget"] = pager.peak_nbytes <= pager.budget
        models[name] = {k: v.float().cpu() for k, v in model.state_dict().items()}
        opt.close()
    for name in windows:
        if name != "unpaged":
            out[name]["max_param_diff"] = max(
                float((models[name][k] - v).abs().max()) for k, v in models["unpaged"].items()
            )
            out[name]["step_over_unpaged"] = out[name]["step_s"] / out["unpaged"]["step_s"]
    return out


@contextlib.contextmanager
def one_rank_group(backend: str) -> Iterator[None]:
    import tempfile

    import torch.distributed as dist

    with tempfile.TemporaryDirectory(prefix="tiermem-gpu-check-") as where:
        dist.init_process_group(backend, init_method=f"file://{where}/rendezvous", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def sharded_paged(socket: str, steps: int, device: str = "cuda", backend: str = "nccl") -> dict[str, Any]:
    """``ShardedPagedAdam`` on ``device`` in a one-rank group, paged within half the params, clipped and
    loss-scaled; against GradScaler + ``clip_grad_norm_`` + AdamW on the same device."""
    from tiermem.client.distributed import ShardedGradScaler, ShardedPagedAdam

    data = batches(steps, 64, device)
    base = mlp(64, 4).to(device)
    budget = sum(p.numel() * p.element_size() for p in base.parameters()) // 2
    with one_rank_group(backend):
        ours, ref = copy.deepcopy(base), copy.deepcopy(base)
        opt = ShardedPagedAdam(
            ours, lr=1e-3, offload="cpu", device_budget=budget, max_grad_norm=0.5, client=connect(socket)
        )
        try:
            scaler = ShardedGradScaler(device, init_scale=2.0**10)
            times = []
            for x, y in data:
                t0 = time.perf_counter()
                scaler.scale(F.mse_loss(ours(x), y)).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
            ref_scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
            for x, y in data:
                ref_scaler.scale(F.mse_loss(ref(x), y)).backward()
                ref_scaler.unscale_(ref_opt)
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                ref_scaler.step(ref_opt)
                ref_scaler.update()
                ref_opt.zero_grad()
            state = ours.state_dict()  # gathered from the daemon
            return {
                "backend": backend,
                "max_param_diff": max(
                    float((state[k].to(v.device) - v).abs().max()) for k, v in ref.state_dict().items()
                ),
                "last_grad_norm": opt.last_grad_norm,
                "scale": scaler.get_scale(),
                "ref_scale": ref_scaler.get_scale(),
                "peak_nbytes": opt.pager.peak_nbytes,
                "budget": budget,
                "first_step_ms": times[0] * 1e3,  # the daemon compiles its kernel for a scaled step here
                "step_ms_median": sorted(times[1:])[len(times[1:]) // 2] * 1e3 if len(times) > 1 else None,
            }
        finally:
            opt.close()


def layers(socket: str, steps: int, device: str = "cuda", backend: str = "nccl") -> dict[str, Any]:
    """``LayerShardedAdam`` gathers each layer into host memory: a model on ``device`` (a GPU) is refused at
    construction, naming the optimizer for a GPU, before any collective."""
    from tiermem.client.distributed import LayerShardedAdam
    from tiermem.core.errors import InvalidArgument

    model = mlp(64, 2).to(device)
    with one_rank_group(backend):
        try:
            opt = LayerShardedAdam(model, lr=1e-3, paged=True, client=connect(socket))
        except InvalidArgument as exc:
            return {"refused": True, "message": str(exc)}
        opt.close()
        return {"refused": False, "error": f"LayerShardedAdam accepted a model on {device}"}


def sharded(socket: str, steps: int, device: str = "cuda", backend: str = "nccl") -> dict[str, Any]:
    """``ShardedOffloadAdam`` in a one-rank process group on ``device``: reduce-scatter, statistics and
    all-gather on device tensors, the shard's grads and params copied between the device and the daemon's
    storage, with clipping; against ``torch.optim.AdamW`` + ``clip_grad_norm_`` on the same device."""
    from tiermem.client.distributed import ShardedOffloadAdam

    data = batches(steps, 64, device)
    base = mlp(64, 3).to(device)
    with one_rank_group(backend):
        ours, ref = copy.deepcopy(base), copy.deepcopy(base)
        opt = ShardedOffloadAdam(ours.parameters(), lr=1e-3, max_grad_norm=0.5, client=connect(socket))
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        t0 = time.perf_counter()
        for x, y in data:
            F.mse_loss(ours(x), y).backward()
            opt.step()
            opt.zero_grad()
        seconds = time.perf_counter() - t0
        for x, y in data:
            F.mse_loss(ref(x), y).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
        result = {
            "backend": backend,
            "max_param_diff": max_diff(ours, ref),
            "last_grad_norm": opt.last_grad_norm,
            "step_ms": seconds / steps * 1e3,
        }
        opt.close()
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--parts", default="", help="comma-separated parts to run (default: all)")
    parser.add_argument(
        "--part-timeout", type=float, default=240.0, help="seconds before a hung part is dumped and ended"
    )
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / "gpu_check.json"
    result: dict[str, Any] = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
    if not result["cuda"]:
        print("no CUDA device: nothing to check")
        out_file.write_text(json.dumps(result, indent=2) + "\n")
        return
    result["device"] = torch.cuda.get_device_name()
    t0 = time.perf_counter()
    owner = connect(pool_size=4 << 30, settings={"swap.fsync": False})
    parts: dict[str, Any] = {
        "parity": lambda: parity(owner.socket_path, args.steps),
        "bandwidth": lambda: bandwidth(owner.socket_path),
        "overlap": lambda: overlap(owner.socket_path, args.steps),
        "paging": lambda: paging(owner.socket_path, args.steps),
        "sharded": lambda: sharded(owner.socket_path, args.steps),
        "sharded_paged": lambda: sharded_paged(owner.socket_path, args.steps),
        "layers": lambda: layers(owner.socket_path, args.steps),
    }
    chosen = [p for p in args.parts.split(",") if p] or list(parts)
    unknown = sorted(set(chosen) - set(parts))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {sorted(parts)}")
    try:
        for name in chosen:
            faulthandler.dump_traceback_later(args.part_timeout, exit=True)
            started = time.perf_counter()
            try:
                result[name] = parts[name]()
            except Exception as exc:  # one failing part must not hide the others' figures
                result[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            finally:
                faulthandler.cancel_dump_traceback_later()
            if isinstance(result[name], dict):
                result[name]["part_s"] = time.perf_counter() - started
            print(f"{name}: {json.dumps(result[name], indent=2, default=str)}", flush=True)
            out_file.write_text(json.dumps(result, indent=2, default=str) + "\n")
    finally:
        owner.close()
    result["seconds"] = time.perf_counter() - t0
    out_file.write_text(json.dumps(result, indent=2, default=str) + "\n")
    failed = [name for name in chosen if "error" in result.get(name, {})]
    if failed:
        print(f"failed parts: {failed}", file=sys.stderr)


if __name__ == "__main__":
    main()

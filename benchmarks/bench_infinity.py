"""The paged NVMe step side by side with DeepSpeed ZeRO-Infinity, on the demo GPT, in one run.

Both systems keep everything of the model on NVMe that ZeRO-Infinity can:
the params (paged to the trainer a submodule at a time) and the fp32 Adam
state, and run the update on the CPU.  Trials, each a fresh process, in one
run on the same disk (``--swap-dir``), per size of ``--sizes``:

- ``adamw``: ``torch.optim.AdamW`` in process, the reference losses (the
  same init and batches);
- ``tiermem``: ``OffloadAdam(offload="nvme", exchange="staged")`` and
  ``offload_params(model, opt, device_budget=--device-budget, prefetch=2)``
  on a model made on the meta device (``bench_scale.py``'s
  ``offload-nvme-paged`` mode), a private tiermemd with a ``--pool-size``
  pool;
- ``deepspeed-<config>``: ``deepspeed.initialize`` with ZeRO stage 3,
  ``offload_param`` and ``offload_optimizer`` on NVMe (DeepSpeedCPUAdam,
  libaio), for each config of ``--ds-configs``:

  - ``docs``: the settings of DeepSpeed's ZeRO-Infinity tutorial
    (aio 1 MiB blocks, queue depth 8, overlapped events; 5 param buffers of
    1e8 elements, 4 optimizer buffers, sub-groups of 1e9 elements);
  - ``qd32``: the same at queue depth 32 and 2 I/O threads (what
    ``bench_swap.py`` finds fastest for its ``aio_handle`` on this disk);
  - ``pipelined``: ``qd32`` with ``pipeline_read``/``pipeline_write`` on and
    sub-groups of 1e8 elements, so the optimizer's swap overlaps its update.

The model is the demo GPT with seed 0, fp32, every system's params the same:
initialized as the pager initializes a model made on the meta device (one
submodule at a time, ``reset_parameters()`` then ``GPT._init``), eagerly for
AdamW and DeepSpeed (which partitions it at ``initialize``).  ``--steps``
steps of batch ``--batch`` x ``--seq`` tokens of the demo's text corpus at
``--lr``, so the loss falls.  Per trial: the step time (the median of the
steps after the first), the disk bytes a step moves (``/proc/<pid>/io`` read
and write bytes of the process doing the I/O: tiermem's daemon, or
DeepSpeed's trainer, so O_DIRECT I/O counts and the page cache does not),
the peak resident memory (trainer and daemon, each one's peak, summed), and each step's loss against ``adamw``'s:
``loss_gap`` is the largest difference after the first step, where updates
show.  tiermem's update is AdamW's to the bit, so its gap is rounding.

What the run of ``results/infinity.json`` showed of DeepSpeed (0.19.8):

- none of its runs follows AdamW: its losses leave AdamW's from the first
  update on NVMe (gap 0.98 at 100M).  With ``offload_*: cpu`` (stage 2 or
  3) its first step equals AdamW's and its second does not, so its CPU Adam
  itself departs from ``torch.optim.AdamW`` here;
- ``max_in_cpu`` (1e9 elements, its default) keeps every param of these
  models in host memory, so its params never touch the disk: it moves 16 +
  16 B/param (the optimizer state) where the paged step moves the params
  too, and its peak resident memory is 3-7x ours;
- ``pipelined`` fails at 300M (an assertion in its pipelined optimizer
  swapper) and is reported as failed.

The figure: tiermem's step over each DeepSpeed config's, and over the best
config that matched AdamW.  Goal: <= 1.0x at 100M and 300M.

    PYTHONPATH=<deepspeed> .venv/bin/python benchmarks/bench_infinity.py [--sizes 100M,300M] [--json out.json]

DeepSpeed (0.19.8 measured) is not a dependency of the project: put it on
``PYTHONPATH`` with its ``cpu_adam`` and ``async_io`` ops buildable (g++,
``libaio-dev``); without it the DeepSpeed trials report why they did not run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_scale import _io, _memory  # noqa: E402  (/proc readers, shared)

MiB, GiB = 1 << 20, 1 << 30

DS_CONFIGS: dict[str, dict[str, Any]] = {
    "docs": {"queue_depth": 8, "threads": 1, "pipeline": False, "sub_group_size": 1_000_000_000},
    "qd32": {"queue_depth": 32, "threads": 2, "pipeline": False, "sub_group_size": 1_000_000_000},
    "pipelined": {"queue_depth": 32, "threads": 2, "pipeline": True, "sub_group_size": 100_000_000},
}


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMBG")) * scale)


def ds_config(name: str, nvme_path: str, batch: int, lr: float) -> dict[str, Any]:
    knobs = DS_CONFIGS[name]
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": knobs["sub_group_size"],
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme_path,
                "pin_memory": True,
                "buffer_count": 5,
                "buffer_size": 100_000_000,
                "max_in_cpu": 1_000_000_000,
            },
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme_path,
                "pin_memory": True,
                "buffer_count": 4,
                "pipeline_read": knobs["pipeline"],
                "pipeline_write": knobs["pipeline"],
                "fast_init": False,
            },
        },
        "aio": {
            "block_size": MiB,
            "queue_depth": knobs["queue_depth"],
            "intra_op_parallelism": knobs["threads"],
            "single_submit": False,
            "overlap_events": True,
        },
        "wall_clock_breakdown": False,
        "steps_per_print": 1 << 30,
    }


def batches(spec: dict[str, Any]) -> list[tuple[Any, Any]]:
    """The trial's batches: text of the demo's corpus (its loss falls, so a wrong update shows), seeded."""
    import torch

    from tiermem.client.demo.model import CharCorpus

    corpus = CharCorpus(seed=0)
    g = torch.Generator().manual_seed(1)
    return [corpus.batch(spec["batch"], spec["seq"], g) for _ in range(spec["steps"])]


def build(spec: dict[str, Any], *, meta: bool) -> Any:
    """The demo GPT of ``spec["params"]`` with seed 0, initialized as the pager initializes a model made on the
    meta device: one submodule at a time in module order, ``reset_parameters()`` then ``GPT._init``.  With
    ``meta`` the model stays on the meta device (the pager does the same into the daemon); else it gets CPU
    memory and those values here, so every system starts from the same params."""
    import torch

    from tiermem.client.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig.for_params(spec["params"], block_size=spec["seq"])
    with torch.device("meta"):
        model = GPT(cfg)
    if meta:
        return model
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if any(p is not None for p in module._parameters.values()):
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
                GPT._init(module)
    return model


def torch_step(model: Any, opt: Any) -> Any:
    """A torch optimizer's training step: forward, backward, update; returns the loss."""

    def step(x: Any, y: Any) -> Any:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def setup(spec: dict[str, Any]) -> tuple[Any, Any, int, Any]:
    """The trial's model, its step function (forward, backward, update), the pid whose disk I/O a step counts,
    and what to close after."""
    import torch

    system = spec["system"]
    if system == "adamw":
        model = build(spec, meta=False)
        opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.01)
        return model, torch_step(model, opt), os.getpid(), None
    if system == "tiermem":
        import tiermem
        from tiermem.client.demo.model import GPT

        model = build(spec, meta=True)
        client = tiermem.connect(pool_size=spec["pool_size"])  # a private daemon: no node daemon is named
        opt = tiermem.OffloadAdam(model.parameters(), lr=spec["lr"], offload="nvme", exchange="staged", client=client)
        tiermem.offload_params(model, opt, device_budget=spec["device_budget"], prefetch=2, init=GPT._init)
        return model, torch_step(model, opt), client.daemon.process.pid, opt
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=spec["port"])
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    model = build(spec, meta=False)  # initialize partitions it onto NVMe
    config = ds_config(spec["config"], spec["nvme_path"], spec["batch"], spec["lr"])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def ds_step(x: Any, y: Any) -> Any:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return engine, ds_step, os.getpid(), None


def train(spec: dict[str, Any]) -> dict[str, Any]:
    _model, step, io_pid, closing = setup(spec)  # the model is kept alive while it trains
    steps = []
    for x, y in batches(spec):
        io0 = _io(io_pid)
        t0 = time.perf_counter()
        loss = step(x, y)
        step_s = time.perf_counter() - t0
        io1 = _io(io_pid)
        steps.append(
            {
                "step_s": step_s,
                "loss": float(loss.detach()),
                "read_nbytes": io1[0] - io0[0],
                "write_nbytes": io1[1] - io0[1],
            }
        )
    memory = {"trainer": _memory(os.getpid())}
    if io_pid != os.getpid():
        memory["daemon"] = _memory(io_pid)
    numel = sum(p.numel() for p in build(spec, meta=True).parameters())
    if closing is not None:
        closing.close()
    out: dict[str, Any] = {"numel": numel, "steps": steps, "memory": memory}
    if spec["system"] == "deepspeed":
        import deepspeed

        out["deepspeed"] = deepspeed.__version__
    return out


def worker(spec: dict[str, Any]) -> int:
    try:
        result = train(spec)
    except Exception as exc:  # reported as the trial's reason
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


def run_trial(args: argparse.Namespace, name: str, params: int, log_dir: Path) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "params": params,
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "lr": args.lr,
        "device_budget": args.device_budget,
        "pool_size": args.pool_size,
    }
    if name.startswith("deepspeed-"):
        nvme = Path(tempfile.mkdtemp(prefix="ds-infinity-", dir=args.swap_dir))
        spec.update(system="deepspeed", config=name.removeprefix("deepspeed-"), nvme_path=str(nvme))
        spec["port"] = str(29500 + os.getpid() % 1000)
    else:
        nvme = None
        spec["system"] = name
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    env["TIERMEM_SOCKET_PATH"] = str(log_dir / "no-such-daemon.sock")  # a private daemon
    env["TMPDIR"] = str(args.swap_dir)  # where the private daemon puts its swap files
    env["PYTHONUNBUFFERED"] = "1"
    log_path = log_dir / f"{name}-{params}.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            timeout=args.timeout_s,
            check=False,
        )
    if nvme is not None:
        subprocess.run(["rm", "-rf", str(nvme)], check=False)
    trial: dict[str, Any] = {"name": name, "params": params, "wall_s": time.monotonic() - t0}
    for line in proc.stdout.decode(errors="replace").splitlines():
        if line.startswith("RESULT "):
            trial.update(json.loads(line[len("RESULT ") :]))
    if "steps" not in trial:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        trial["error"] = trial.get("error") or f"exit {proc.returncode}: {' | '.join(tail)}"[:400]
    return trial


def summarize(trial: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    if "steps" not in trial:
        return {"name": trial["name"], "error": trial.get("error", "no result")}
    steps = trial["steps"]
    timed = steps[1:] or steps
    numel = trial["numel"]
    median = statistics.median(s["step_s"] for s in timed)
    row: dict[str, Any] = {
        "name": trial["name"],
        "numel": numel,
        "step_s": median,
        "step_s_all": [s["step_s"] for s in steps],
        "losses": [s["loss"] for s in steps],
        "read_per_param": statistics.median(s["read_nbytes"] for s in timed) / numel,
        "write_per_param": statistics.median(s["write_nbytes"] for s in timed) / numel,
        "peak_rss": sum(m.get("peak_rss", 0) for m in trial.get("memory", {}).values()),
    }
    if reference is not None and "steps" in reference:
        ref = [s["loss"] for s in reference["steps"]]
        row["loss_gap_first"] = abs(row["losses"][0] - ref[0])
        row["loss_gap"] = max((abs(a - b) for a, b in zip(row["losses"][1:], ref[1:], strict=True)), default=0.0)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100M,300M", help="model sizes in params (K/M/B suffixes)")
    ap.add_argument("--ds-configs", default=",".join(DS_CONFIGS), help=f"of {', '.join(DS_CONFIGS)}")
    ap.add_argument("--steps", type=int, default=4, help="steps per trial; the first is not timed")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device-budget", type=int, default=512 * MiB, help="tiermem pager's budget (bytes)")
    ap.add_argument("--pool-size", type=int, default=GiB, help="tiermem private daemon's pool (bytes)")
    ap.add_argument("--swap-dir", default=None, help="a directory on the disk to measure (default: $TMPDIR)")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--json", default=None, help="write the figures as JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return worker(json.loads(args.worker))
    args.swap_dir = Path(args.swap_dir or tempfile.gettempdir())
    configs = [c for c in args.ds_configs.split(",") if c]
    for c in configs:
        if c not in DS_CONFIGS:
            ap.error(f"--ds-configs: unknown config {c!r}; the configs are {', '.join(DS_CONFIGS)}")
    log_dir = Path(tempfile.mkdtemp(prefix="bench-infinity-"))
    print(f"machine: {os.cpu_count()} cpus; swap dir {args.swap_dir}; logs {log_dir}", flush=True)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items() if k != "worker"}, "sizes": {}}
    for params in (parse_count(s) for s in args.sizes.split(",")):
        trials = {}
        for name in ["adamw", "tiermem", *(f"deepspeed-{c}" for c in configs)]:
            trials[name] = run_trial(args, name, params, log_dir)
            t = trials[name]
            done = f"{t['steps'][-1]['step_s']:.2f} s last step" if "steps" in t else f"failed: {t['error']}"
            print(f"  {params / 1e6:.0f}M {name:<20} {done}", flush=True)
        ref = trials["adamw"]
        rows = [summarize(t, ref) for name, t in trials.items() if name != "adamw"]
        report["sizes"][str(params)] = {"rows": rows, "adamw_losses": [s["loss"] for s in ref.get("steps", [])]}
        print_table(params, rows, report["sizes"][str(params)]["adamw_losses"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def print_table(params: int, rows: list[dict[str, Any]], adamw_losses: list[float]) -> None:
    ours = next((r for r in rows if r["name"] == "tiermem" and "step_s" in r), None)
    last = f"{adamw_losses[-1]:.4f}" if adamw_losses else "-"
    print(f"\n{params / 1e6:.0f}M params, fp32; step: median after the first; AdamW's last loss {last}")
    head = ("system", "step s", "read B/p", "write B/p", "peak RSS", "last loss", "loss gap", "tiermem x")
    print(
        f"{head[0]:<22} {head[1]:>7} {head[2]:>9} {head[3]:>10} {head[4]:>9} {head[5]:>10} {head[6]:>9} {head[7]:>10}"
    )
    for r in rows:
        if "step_s" not in r:
            print(f"{r['name']:<22} {r['error']}")
            continue
        ratio = f"{ours['step_s'] / r['step_s']:.2f}x" if ours is not None else "-"
        print(
            f"{r['name']:<22} {r['step_s']:>7.2f} {r['read_per_param']:>9.1f} {r['write_per_param']:>10.1f} "
            f"{r['peak_rss'] / GiB:>8.2f}G {r['losses'][-1]:>10.4f} {r.get('loss_gap', float('nan')):>9.2e} {ratio:>10}"
        )


if __name__ == "__main__":
    sys.exit(main())

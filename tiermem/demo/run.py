"""``tiermem demo``: the same GPT trained under each optimizer, compared side by side."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Iterable

import torch

from tiermem.demo.model import CharCorpus, GPTConfig
from tiermem.demo.train import RunResult, train_run

__all__ = ["run_demo"]

RUNS = ("adamw", "cpuadam", "offload-cpu", "offload-nvme", "offload-dpu")


def _factories(args: argparse.Namespace, swap_dir: str) -> dict[str, Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]]:
    lr = args.lr
    factories: dict[str, Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]] = {
        "adamw": lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True),
    }
    from tiermem.optim import CPUAdam

    factories["cpuadam"] = lambda params: CPUAdam(params, lr=lr, weight_decay=0.01, adamw=True)
    return factories


def run_demo(args: argparse.Namespace) -> int:
    wanted = RUNS if args.runs == "all" else tuple(r.strip() for r in args.runs.split(","))
    unknown = [r for r in wanted if r not in RUNS]
    if unknown:
        print(f"tiermem demo: unknown run(s) {unknown}; choose from {', '.join(RUNS)}", file=sys.stderr)
        return 2
    cfg = GPTConfig.for_params(int(args.params))
    corpus = CharCorpus(nbytes=1 << 20)
    print(
        f"model: GPT {cfg.n_layer} layers x {cfg.n_embd} wide, {cfg.num_params() / 1e6:.1f}M params; "
        f"{args.steps} steps of batch {args.batch_size} x {cfg.block_size} tokens",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(prefix="tiermem-demo-", dir=args.swap_dir or "/var/tmp") as swap_dir:
        factories = _factories(args, swap_dir)
        results: list[RunResult] = []
        for name in wanted:
            if name not in factories:
                print(f"tiermem demo: skipping {name}: not available in this build", file=sys.stderr)
                continue
            results.append(
                train_run(
                    name,
                    factories[name],
                    cfg=cfg,
                    corpus=corpus,
                    steps=args.steps,
                    batch_size=args.batch_size,
                    show=not args.quiet,
                )
            )
    _report(results)
    return 0


def _report(results: list[RunResult]) -> None:
    if not results:
        return
    base = results[0]
    print(f"\n{'run':<14} {'final loss':>10} {'vs ' + base.name:>12} {'step ms':>9} {'vs ' + base.name:>12}")
    for r in results:
        dl = (r.final_loss - base.final_loss) / base.final_loss * 100
        ratio = r.median_step_s / base.median_step_s
        print(f"{r.name:<14} {r.final_loss:>10.4f} {dl:>+11.2f}% {r.median_step_s * 1e3:>9.1f} {ratio:>11.2f}x")

"""Fidelity of compressed Adam moments (``tiermem.core.lowbit``): the demo GPT trained with exact AdamW and
with bf16 and int8 moments, same data and seed, final loss side by side.

Rows, for each learning rate (``--lrs``, default 3e-4 and 3e-5):

- ``adamw``: ``torch.optim.AdamW(fused=True)`` (the reference);
- ``fp32``, ``bf16``, ``int8``: the same AdamW step through ``lowbit_update``
  (the reference implementation the fused kernel is held to) with the moments
  kept in that form; ``fp32`` is a check of the harness (torch's
  single-tensor Adam arithmetic: equal to ``adamw`` but for the last bits);
- ``torchao int8``: ``torchao.optim.AdamW8bit`` where torchao imports and
  runs on the CPU (else the reason is printed).

The loss is the mean of the last 10 steps (the demo's), the gap relative to
``adamw``'s; ``diverged`` marks a non-finite loss.  Goals (issue text): within
1% (bf16) and 2% (int8) of exact AdamW after 1,000 steps, no divergence.

    .venv/bin/python benchmarks/bench_lowbit_fidelity.py [--steps 1000] [--lrs 3e-4,3e-5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tiermem.client.demo.model import GPT, CharCorpus, GPTConfig
from tiermem.core.adam_math import AdamHyper, step_scalars
from tiermem.core.lowbit import LowbitMoments, lowbit_update


class ReferenceLowbitAdamW(torch.optim.Optimizer):
    """AdamW over ``lowbit_update``, in process (one ``LowbitMoments`` per param): the harness of this
    benchmark, not an optimizer to train with (it runs the reference, op by op)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float, state_dtype: str):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "betas": (0.9, 0.999), "eps": 1e-8})
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            hyper = AdamHyper.of(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["moments"] = LowbitMoments.zeros(p.numel(), self.state_dtype)
                state["step"] += 1
                step = state["step"]
                flat = p.data.view(-1)
                lowbit_update(flat, p.grad.view(-1), state["moments"], step_scalars(hyper, step), step=step)


def _train(
    make: Callable[[Any], torch.optim.Optimizer], *, cfg: GPTConfig, steps: int, seed: int = 0
) -> dict[str, Any]:
    corpus = CharCorpus(nbytes=1 << 20)
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = make(model.parameters())
    data = torch.Generator().manual_seed(seed + 1)
    losses: list[float] = []
    started = time.perf_counter()
    for _ in range(steps):
        x, y = corpus.batch(16, cfg.block_size, data)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    tail = losses[-10:]
    final = sum(tail) / len(tail)
    return {"final_loss": final, "diverged": not math.isfinite(final), "seconds": time.perf_counter() - started}


def _torchao(lr: float) -> Callable[[Any], torch.optim.Optimizer] | str:
    try:
        from torchao.optim import AdamW8bit  # type: ignore[import-not-found]
    except Exception as exc:
        return f"torchao does not import: {type(exc).__name__}: {exc}"
    try:
        probe = torch.nn.Parameter(torch.zeros(4096))
        opt = AdamW8bit([probe], lr=lr)
        probe.grad = torch.ones(4096)
        opt.step()
    except Exception as exc:
        return f"torchao AdamW8bit does not run on the CPU here: {type(exc).__name__}: {exc}"
    return lambda params: AdamW8bit(params, lr=lr, weight_decay=0.01)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--params", type=float, default=2e6, help="approximate model size (the demo's: 2e6)")
    ap.add_argument("--lrs", default="3e-4,3e-5")
    ap.add_argument("--forms", default="fp32,bf16,int8", help="moment forms besides adamw")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    cfg = GPTConfig.for_params(int(args.params))
    print(f"GPT {cfg.num_params() / 1e6:.1f}M params, {args.steps} steps, batch 16 x {cfg.block_size}", file=sys.stderr)
    results: list[dict[str, Any]] = []
    for lr in (float(x) for x in args.lrs.split(",")):
        rows: dict[str, Any] = {}
        rows["adamw"] = _train(
            lambda ps, lr=lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01, fused=True), cfg=cfg, steps=args.steps
        )
        for form in args.forms.split(","):
            rows[form] = _train(
                lambda ps, form=form, lr=lr: ReferenceLowbitAdamW(ps, lr=lr, weight_decay=0.01, state_dtype=form),
                cfg=cfg,
                steps=args.steps,
            )
        ao = _torchao(lr)
        if isinstance(ao, str):
            print(f"lr {lr:g}: {ao}", file=sys.stderr)
        else:
            rows["torchao int8"] = _train(ao, cfg=cfg, steps=args.steps)
        base = rows["adamw"]["final_loss"]
        print(f"\nlr {lr:g}")
        print(f"{'run':<14} {'final loss':>10} {'vs adamw':>9} {'diverged':>9} {'s':>7}")
        for name, row in rows.items():
            row["gap"] = (row["final_loss"] - base) / base
            gap = f"{row['gap'] * 100:+.2f}%"
            print(f"{name:<14} {row['final_loss']:>10.4f} {gap:>9} {row['diverged']!s:>9} {row['seconds']:>7.1f}")
            results.append({"lr": lr, "run": name, **row})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "params": cfg.num_params(), "rows": results}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

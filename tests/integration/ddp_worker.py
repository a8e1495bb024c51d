"""One rank of ``OffloadAdam`` under plain DDP (``torch.nn.parallel.DistributedDataParallel``, gloo), beside
``torch.optim.AdamW`` under DDP on a copy of the same model: each rank its own job, DDP averaging the grads.

``--release``: ``release_grads=True``, whose hooks hand each local grad to the daemon before DDP writes the
average into ``p.grad``; the first ``step()`` must refuse that (``GradsAfterRelease``) with nothing applied.
Each rank writes, as JSON: the largest difference from the AdamW side after ``--steps`` steps, or the error.
"""

from __future__ import annotations

import argparse

import torch
from scenarios import end_run, join_group, leave, write_json
from torch.nn.parallel import DistributedDataParallel

from tiermem import OffloadAdam
from tiermem.core.errors import GradsAfterRelease


def make_model() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--release", action="store_true")
    ap.add_argument("--exchange", default="shared")
    args = ap.parse_args(argv)
    rank, _, owned = join_group()
    ours, ref = DistributedDataParallel(make_model()), DistributedDataParallel(make_model())
    opt = OffloadAdam(ours.parameters(), lr=1e-2, release_grads=args.release, exchange=args.exchange)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in ours.parameters()]
    result: dict = {"rank": rank, "error": None}
    try:
        for step in range(args.steps):
            x = torch.randn(6, 12, generator=torch.Generator().manual_seed(10 * step + rank))
            for model, o in ((ours, opt), (ref, ref_opt)):
                model(x).pow(2).mean().backward()
                o.step()
                o.zero_grad()
        pairs = zip(ours.parameters(), ref.parameters(), strict=True)
        result["diff"] = max(float((p - q).abs().max()) for p, q in pairs)
    except GradsAfterRelease as exc:
        result.update(error=type(exc).__name__, message=str(exc), steps=opt.steps)
        result["unchanged"] = all(torch.equal(p, q) for p, q in zip(ours.parameters(), before, strict=True))
    write_json(f"{args.out}.{rank}", result)
    return end_run(owned, opt)


if __name__ == "__main__":
    leave(main())

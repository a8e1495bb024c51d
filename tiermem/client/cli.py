"""``tiermem``: the user-facing command line.

Subcommands:
  demo      train a small GPT with its Adam state offloaded through tiermem and
            compare with in-process torch.optim.AdamW
  estimate  memory per GPU, host and NVMe for a model under each ZeRO stage and
            offload choice, and whether it fits this node
  status    one screen of the node's tiermemd: pool, swap, jobs per tier,
            throughput, errors (--json, --watch)
  doctor    whether this node can train through tiermem: the daemon a trainer
            would reach and whether it may attach, memlock, libaio, swap dirs,
            kernel caches, torch and CUDA, each problem with a fix (--json;
            exit 0 can train, 1 cannot)
  consolidate
            merge a ZeRO-3 checkpoint's rank files into one model state dict
            and one torch.optim.AdamW state dict
  version   print the version

The CLI configures logging for itself; the library never prints.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys

from tiermem import __version__
from tiermem.client.subcommand import add_command
from tiermem.core.errors import TiermemError

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from tiermem.client.demo import openmp

    updates, args.openmp = openmp.choose(os.environ, torch_loaded="torch" in sys.modules)
    os.environ.update(updates)  # before torch loads: libgomp reads it once
    from tiermem.client.demo.run import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiermem", description="tiermem: offload runtime for large-model training")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = add_command(
        sub,
        "demo",
        help="train a small GPT through tiermem and compare with torch.optim.AdamW",
        run=_demo,
        description=(
            "Trains the same small GPT-style model on a generated text corpus several times from the same "
            "seed: with in-process torch.optim.AdamW (the reference), and with its Adam state offloaded "
            "through tiermem. The runs take turns, ten steps at a time, so their step times compare on a machine "
            "whose speed drifts. Shows each run's progress, prints loss and step time side by side, and writes "
            "the runs' loss curves to a PNG. Unless the environment sets GOMP_SPINCOUNT or OMP_WAIT_POLICY, the "
            "demo runs with GOMP_SPINCOUNT=20000, so that torch's idle OpenMP workers give the cores to the "
            "daemon's update sooner (AdamW's own step measured unchanged; see the README's limitations)."
        ),
    )
    demo.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    demo.add_argument("--params", type=float, default=2e6, help="approximate model size in parameters (default 2e6)")
    demo.add_argument("--batch-size", type=int, default=16)
    demo.add_argument("--lr", type=float, default=1e-3)
    demo.add_argument(
        "--runs",
        default="all",
        help="comma-separated subset of: adamw, cpuadam, offload-cpu, offload-nvme, offload-dpu, offload-bf16, "
        "offload-int8 (default all)",
    )
    demo.add_argument("--swap-dir", help="directory for the NVMe tier (default: a temporary directory on disk)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.add_argument(
        "--plot",
        default="tiermem-demo-loss.png",
        metavar="PATH",
        help="loss-curve PNG of the runs, written after the table (default tiermem-demo-loss.png in the current "
        "directory; needs matplotlib)",
    )
    demo.add_argument("--no-plot", dest="plot", action="store_const", const="", help="write no loss-curve PNG")
    for module in ("estimate_cli", "status", "doctor", "consolidate"):
        importlib.import_module(f"tiermem.client.{module}").add_parser(sub)
    add_command(sub, "version", help="print the version", run=lambda _args: print(f"tiermem {__version__}") or 0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:  # Ctrl-C: the command's own cleanup ran on the way out; no traceback for it
        print(f"tiermem {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except TiermemError as exc:  # says what was wrong and what to do (a full swap disk, no daemon, ...)
        logging.getLogger("tiermem").debug("tiermem %s failed", args.command, exc_info=True)
        print(f"tiermem {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

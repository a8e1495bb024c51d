"""``tiermem estimate``: the arguments, the node probe and the output of the memory estimator.

The arithmetic is ``tiermem.core.estimate``; what the node has, ``tiermem.client.capacity``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from tiermem.client.subcommand import Subparsers, add_command
from tiermem.core.errors import TiermemError

__all__ = ["add_parser", "node_config_path"]

DEFAULT_NODE_CONFIG = "/etc/tiermem/tiermemd.toml"
"""The node daemon's settings when neither --config nor TIERMEM_CONFIG names a file (as ``tiermemd`` reads)."""


def node_config_path(config_path: str | None, env: Mapping[str, str]) -> str | None:
    """The node daemon's settings file as ``tiermemd`` finds it: ``config_path`` (``--config``), else
    ``$TIERMEM_CONFIG``, else ``DEFAULT_NODE_CONFIG`` where it exists; None: no file (the defaults)."""
    path = config_path or env.get("TIERMEM_CONFIG")
    if path is None and Path(DEFAULT_NODE_CONFIG).exists():
        path = DEFAULT_NODE_CONFIG
    return path


DESCRIPTION = """\
Model-state bytes of mixed-precision Adam (fp16 params and grads, fp32 master, momentum
and variance: 16 bytes per parameter) per device under each ZeRO stage (0: 16P;
1: 4P + 12P/N; 2: 2P + 14P/N; 3: 16P/N, for P parameters on N GPUs) and each offload
choice (none; cpu: the optimizer states in tiermemd's pool; nvme: on its swap files,
paged through a chunk cache), with what tiermem then keeps on the host and on NVMe per
rank and per node (on NVMe what the daemon reserves: two copies of the state, written
out of place, and the chunk cache), and whether that fits this node: its GPU memory,
its available host memory (or its memory cgroup's headroom when lower), or the free pool
budget of a running tiermemd, and the free disk of the swap directories (or the daemon's
swap budget). Figures are in
GB = 1e9 bytes, as the ZeRO paper counts them; activations and temporary buffers are not
included. Example (the paper's): tiermem estimate --params 7.5e9 --gpus 64 --offload none
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _params(text: str) -> int:
    from tiermem.core.estimate import parse_params

    try:
        return parse_params(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> int:
    from tiermem.core.units import parse_size

    try:
        nbytes = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if nbytes <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return nbytes


def add_parser(sub: Subparsers) -> None:
    help_line = "memory per GPU, host and NVMe for a model under each ZeRO stage and offload, and whether it fits"
    p = add_command(sub, "estimate", help=help_line, description=DESCRIPTION, run=_run)
    p.add_argument(
        "--params",
        type=_params,
        required=True,
        metavar="N",
        help="model parameters: 7.5e9, 7500000000 or 7.5B (K, M, B, T)",
    )
    p.add_argument(
        "--gpus", type=_positive_int, required=True, metavar="N", help="GPUs in the data-parallel group, all nodes"
    )
    p.add_argument(
        "--nodes",
        type=_positive_int,
        default=1,
        metavar="N",
        help="nodes they run on, the same number per node (default 1)",
    )
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="one ZeRO stage (default: all four)")
    p.add_argument("--offload", choices=("none", "cpu", "nvme"), help="one offload choice (default: all three)")
    p.add_argument(
        "--state-dtype",
        choices=("fp32", "bf16", "int8"),
        default="fp32",
        help="how the daemon stores the offloaded Adam moments (OffloadAdam's state_dtype; default fp32)",
    )
    p.add_argument(
        "--gpu-memory",
        type=_size,
        metavar="SIZE",
        help="memory of one GPU, e.g. 80GB (default: the first CUDA device's, when torch sees one)",
    )
    p.add_argument(
        "--swap-dir",
        action="append",
        metavar="DIR",
        help="swap directory to check for free disk (repeatable; default: the node settings' swap.dirs, or with "
        "no settings file a private daemon's, under $TMPDIR)",
    )
    p.add_argument(
        "--config",
        metavar="PATH",
        help=f"tiermemd settings to read swap.dirs, swap.cache_chunks, jobs.window_size and adam.chunk_numel from "
        f"(default: $TIERMEM_CONFIG, else {DEFAULT_NODE_CONFIG} when it exists)",
    )
    p.add_argument(
        "--socket", metavar="PATH", help="tiermemd socket to ask for its budget (default: the one the client would use)"
    )
    p.add_argument("--no-daemon", action="store_true", help="do not ask a running tiermemd for its budget")
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of the table")


def _run(args: argparse.Namespace) -> int:
    from tiermem.client import capacity
    from tiermem.core.config import load_config
    from tiermem.core.estimate import (
        NVME_CACHE_CHUNKS,
        STAGES,
        Offload,
        RunShape,
        estimate_all,
        fit,
        render_table,
        to_json,
    )
    from tiermem.net import privatedir

    parser: argparse.ArgumentParser = args.parser
    env = os.environ
    try:
        config_path = node_config_path(args.config, env)
        config = load_config(config_path, env=env)
        shape = RunShape(
            params=args.params,
            gpus=args.gpus,
            nodes=args.nodes,
            window_nbytes=config.jobs.window_size,
            chunk_numel=config.adam.chunk_numel,
            state_dtype=args.state_dtype,
            cache_chunks=config.swap.cache_chunks or NVME_CACHE_CHUNKS,
        )
    except (TiermemError, ValueError) as exc:
        parser.error(str(exc))
    daemon = None
    if not args.no_daemon:
        try:
            daemon = capacity.probe_daemon(args.socket)
        except TiermemError as exc:
            print(f"tiermem estimate: not using the daemon's budget: {exc}", file=sys.stderr)
    if args.gpu_memory is not None:
        gpu: tuple[int, str] | None = (args.gpu_memory, "--gpu-memory")
    else:
        gpu = capacity.gpu_memory()
    swap_dirs = args.swap_dir or capacity.training_swap_dirs(config_path, config.swap.dirs)
    node = capacity.node_capacity(swap_dirs=swap_dirs, daemon=daemon, gpu=gpu)
    if daemon is None and not args.swap_dir and config_path is None:
        node = dataclasses.replace(node, nvme_from=f"{node.nvme_from} ({privatedir.PRIVATE_SWAP})")
    stages = STAGES if args.stage is None else (args.stage,)
    offloads = tuple(Offload) if args.offload is None else (Offload(args.offload),)
    rows = [(est, fit(est, node)) for est in estimate_all(shape, stages, offloads)]
    if args.json:
        print(json.dumps(to_json(shape, rows, node), indent=1))
    else:
        print(render_table(shape, rows, node))
    return 0

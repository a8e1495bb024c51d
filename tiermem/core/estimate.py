"""How much memory mixed-precision Adam needs per device and per node, by ZeRO stage and offload tier.

Pure arithmetic: no I/O (``tiermem.client.capacity`` reads what a node has).

Model states of mixed-precision Adam, per parameter (the ZeRO paper, Rajbhandari
et al., SC20, section 3; the K = 12 of its Figure 1):

- fp16 param 2 B, fp16 grad 2 B, fp32 master, momentum and variance 12 B:
  16 B in all.

Data parallelism over N devices with ZeRO shards them (``ceil(P / N)``
elements per device):

=====  ======================  =======================
stage  what is sharded          bytes per device
=====  ======================  =======================
0      nothing                  16P
1      optimizer states         4P + 12P/N
2      + gradients              2P + 14P/N
3      + parameters             16P/N
=====  ======================  =======================

For P = 7.5e9 and N = 64 these are 120, 31.4, 16.6 and 1.9 GB, with
GB = 1e9 bytes as the paper counts them.

Offload (ZeRO-Offload, ZeRO-Infinity, done by ``tiermemd``): the optimizer
states leave the device; the fp16 params and grads of the device's stage stay
(the staged exchange moves grads to the daemon at ``step()``, so the device
holds them until then).  What tiermem keeps instead, per element of the
device's optimizer shard (``tiermem.client.offload.staged``; ``offload.args``'s
``tiermem.core.pool_plan.private_pool_plan`` counts the same):

- ``cpu``: fp32 master, exp_avg, exp_avg_sq and an fp32 grad accumulator
  (16 B) in the daemon's pool, plus one staging window per rank;
- ``nvme``: the same 16 B and the fp16 params again (2 B, kept apart from
  the master so a param fetch reads only them: ``tiermem.core.statekeys``),
  18 B of state; the pool holds the NVMe tier's chunk cache
  (``RunShape.cache_chunks`` chunks of ``adam.chunk_numel`` elements at most)
  and the window.  The swap holds what the daemon's admission reserves
  (``tiermem.core.nvme_budget.nvme_reservation``, the same function): two
  copies of the state, each chunk's parts in whole pages (the store writes
  out of place and keeps the committed copy until the next commit), and the
  cache: 36 B a param and the cache, not 18.

With compressed moments (``RunShape.state_dtype``, ``tiermem.core.lowbit``)
the two moments take 2 + 2 B (bf16) or 1 + 1 B and their block scales
(int8): 12 and 10.03 B in the pool, 14 and 12.03 B of NVMe-tier state (twice
that on the swap).  The no-offload rows stay the paper's (plain ZeRO keeps
AdamW's fp32 state).

A node runs ``gpus / nodes`` ranks and one daemon; the daemon process itself
(Python, torch, the compiled kernels) was measured at about 0.3 GiB
(``benchmarks/README.md``, bench_memory).  Activations, temporary buffers and
fragmentation (ZeRO-R's residual states) are not counted: the figures are the
model states a run cannot do without.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from tiermem.core.errors import InvalidArgument
from tiermem.core.lowbit import STATE_DTYPES
from tiermem.core.nvme_budget import nvme_reservation
from tiermem.core.statekeys import PAGED_KEYS, STAGED_KEYS, StateFormat, key_nbytes
from tiermem.core.units import MiB

__all__ = [
    "DAEMON_PROCESS_NBYTES",
    "DAEMON_STATE_BYTES",
    "NVME_STATE_BYTES",
    "NVME_CACHE_CHUNKS",
    "STAGES",
    "Estimate",
    "Fit",
    "NodeCapacity",
    "Offload",
    "RunShape",
    "estimate",
    "estimate_all",
    "fit",
    "daemon_state_bytes",
    "format_count",
    "format_gb",
    "parse_params",
    "nvme_state_bytes",
    "render_table",
    "to_json",
    "zero_device_nbytes",
]

PARAM_BYTES = 2
"""fp16 param."""
GRAD_BYTES = 2
"""fp16 grad."""
OPTIMIZER_BYTES = 12
"""fp32 master, momentum and variance (the paper's K)."""
DAEMON_STATE_BYTES = 16
"""What tiermemd keeps per element of an offloaded shard: fp32 master, exp_avg, exp_avg_sq and grad."""
NVME_STATE_BYTES = DAEMON_STATE_BYTES + PARAM_BYTES
"""On the NVMe tier, the fp16 params too (the ``param`` key, apart from the master)."""
NVME_CACHE_CHUNKS = 7
"""Chunks of a rank's NVMe-tier cache counted where the daemon measures its plan (``swap.cache_chunks = 0``):
a measured plan for chunks of the default size takes 5 or 6 (2 updating, 2 or more prefetched, 1 or more
written back: ``tiermem.engine.tiers.sizing``), and a private daemon's pool holds six and one block more for
unequal chunk sizes (``private_pool_plan``)."""
DAEMON_PROCESS_NBYTES = 320 * MiB
"""The daemon process itself, measured (bench_memory: about 0.3 GiB beside the state)."""
STAGES = (0, 1, 2, 3)


class Offload(enum.Enum):
    """Where the optimizer states go."""

    NONE = "none"
    """They stay on the device (plain ZeRO)."""
    CPU = "cpu"
    """The daemon's pool in host memory (ZeRO-Offload)."""
    NVME = "nvme"
    """The daemon's swap files, paged through a chunk cache in the pool (ZeRO-Infinity's optimizer offload)."""


@dataclass(frozen=True, kw_only=True)
class RunShape:
    """A data-parallel training run."""

    params: int
    """Model parameters (P)."""
    gpus: int
    """Devices in the data-parallel group (N), across every node."""
    nodes: int = 1
    """Nodes the devices are spread over, evenly."""
    window_nbytes: int = 2 * MiB
    """Staging window per rank (the daemon's ``jobs.window_size``)."""
    chunk_numel: int = 1 << 22
    """Elements per Adam chunk (the daemon's ``adam.chunk_numel``): the NVMe cache is counted in chunks."""
    state_dtype: str = "fp32"
    """How the daemon stores the moments (``OffloadAdam(state_dtype=...)``): fp32, bf16 or int8."""
    cache_chunks: int = NVME_CACHE_CHUNKS
    """Chunks of each rank's NVMe-tier cache: the daemon's ``swap.cache_chunks`` where it sets one (then the
    figures are what admission reserves, to the byte), else ``NVME_CACHE_CHUNKS``, at least what a measured
    plan takes."""

    def __post_init__(self) -> None:
        for name in ("params", "gpus", "nodes", "chunk_numel", "cache_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgument(f"{name} must be an integer, got {value!r}")
            if value <= 0:
                raise InvalidArgument(f"{name} must be positive, got {value}")
        if self.state_dtype not in STATE_DTYPES:
            raise InvalidArgument(f"state_dtype must be one of {list(STATE_DTYPES)}, got {self.state_dtype!r}")
        if self.window_nbytes < 0:
            raise InvalidArgument(f"window_nbytes must be >= 0, got {self.window_nbytes}")
        if self.gpus % self.nodes:
            raise InvalidArgument(
                f"gpus ({self.gpus}) must be a multiple of nodes ({self.nodes}): every node runs as many ranks"
            )

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def shard_numel(self) -> int:
        """Elements of one device's shard, ``ceil(P / N)``."""
        return -(-self.params // self.gpus)


def _check_stage(stage: int) -> None:
    if isinstance(stage, bool) or stage not in STAGES:
        raise InvalidArgument(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")


def _sharded(shape: RunShape, stage: int) -> tuple[int, int, int]:
    """Elements of params, grads and optimizer states one device holds at ``stage``."""
    _check_stage(stage)
    p, s = shape.params, shape.shard_numel
    return (s if stage >= 3 else p, s if stage >= 2 else p, s if stage >= 1 else p)


def zero_device_nbytes(shape: RunShape, stage: int) -> int:
    """Model-state bytes per device with no offload: the paper's 16P, 4P + 12P/N, 2P + 14P/N, 16P/N."""
    params, grads, states = _sharded(shape, stage)
    return PARAM_BYTES * params + GRAD_BYTES * grads + OPTIMIZER_BYTES * states


@dataclass(frozen=True)
class Estimate:
    """Bytes one configuration needs: per device (rank) and per node."""

    shape: RunShape
    stage: int
    offload: Offload
    gpu_nbytes: int
    """Model states on each device."""
    host_nbytes: int
    """Host memory per rank in the daemon's pool (state or NVMe chunk cache, plus the staging window)."""
    nvme_nbytes: int
    """Swap bytes per rank."""

    @property
    def node_host_nbytes(self) -> int:
        """Host memory of one node: every rank's pool share, and the daemon process when there is one."""
        if self.offload is Offload.NONE:
            return 0
        return self.shape.gpus_per_node * self.host_nbytes + DAEMON_PROCESS_NBYTES

    @property
    def node_pool_nbytes(self) -> int:
        """What the node's daemon pool must hold (the ranks' shares, not the process)."""
        return self.shape.gpus_per_node * self.host_nbytes

    @property
    def node_nvme_nbytes(self) -> int:
        return self.shape.gpus_per_node * self.nvme_nbytes


def estimate(shape: RunShape, stage: int, offload: Offload | str) -> Estimate:
    """Bytes per device, per rank on the host and on NVMe for ``shape`` at ``stage`` with ``offload``."""
    offload = _offload(offload)
    params, grads, states = _sharded(shape, stage)
    if offload is Offload.NONE:
        return Estimate(shape, stage, offload, zero_device_nbytes(shape, stage), 0, 0)
    gpu = PARAM_BYTES * params + GRAD_BYTES * grads
    if offload is Offload.CPU:
        state = math.ceil(daemon_state_bytes(shape.state_dtype) * states)
        return Estimate(shape, stage, offload, gpu, state + shape.window_nbytes, 0)
    reserved = nvme_reservation(states, *_nvme_chunking(shape), shape.cache_chunks)
    return Estimate(shape, stage, offload, gpu, reserved.cache_nbytes + shape.window_nbytes, reserved.swap_nbytes)


def _nvme_chunking(shape: RunShape) -> tuple[int, StateFormat]:
    """The chunk size and the format of an NVMe-placed rank of mixed-precision training: fp16 params kept
    apart from the master (the staged exchange), moments in ``shape.state_dtype``."""
    fmt = StateFormat(PAGED_KEYS, "float16", shape.state_dtype)
    return fmt.chunk_numel(shape.chunk_numel), fmt


def daemon_state_bytes(state_dtype: str = "fp32") -> float:
    """Bytes the daemon keeps per element of an offloaded shard on the CPU tier (``DAEMON_STATE_BYTES`` for
    fp32 moments)."""
    return sum(key_nbytes(key, "float16", state_dtype) for key in STAGED_KEYS)


def nvme_state_bytes(state_dtype: str = "fp32") -> float:
    """Bytes of state per element on the NVMe tier: the CPU tier's and the fp16 params (``NVME_STATE_BYTES``);
    the swap holds two copies of it, and the cache (``estimate``)."""
    return sum(key_nbytes(key, "float16", state_dtype) for key in PAGED_KEYS)


def estimate_all(
    shape: RunShape, stages: tuple[int, ...] = STAGES, offloads: tuple[Offload, ...] = tuple(Offload)
) -> list[Estimate]:
    """One estimate per (offload, stage), offload-major."""
    return [estimate(shape, stage, offload) for offload in offloads for stage in stages]


def _offload(value: Offload | str) -> Offload:
    if isinstance(value, Offload):
        return value
    for member in Offload:
        if member.value == value:
            return member
    raise InvalidArgument(f"offload must be one of {', '.join(m.value for m in Offload)}, got {value!r}")


# --------------------------------------------------------------------------- does it fit


@dataclass(frozen=True)
class NodeCapacity:
    """What one node offers; ``None`` where it is not known.  Each ``*_from`` says where a figure came from."""

    gpu_nbytes: int | None = None
    gpu_from: str = "unknown"
    host_nbytes: int | None = None
    """Host memory a daemon could still take (without a daemon, the process included)."""
    host_from: str = "unknown"
    pool_nbytes: int | None = None
    """Free budget of a running daemon's pool: the ranks' state must fit in it."""
    pool_from: str = "no daemon"
    nvme_nbytes: int | None = None
    nvme_from: str = "unknown"


@dataclass(frozen=True)
class Fit:
    """Per resource: True (fits), False (does not) or None (not known, or not needed)."""

    gpu: bool | None
    host: bool | None
    nvme: bool | None
    reasons: tuple[str, ...]
    """One line per resource that does not fit."""

    @property
    def fits(self) -> bool | None:
        verdicts = (self.gpu, self.host, self.nvme)
        if False in verdicts:
            return False
        if None in verdicts:
            return None
        return True


def _compare(need: int, have: int | None, what: str, source: str, reasons: list[str]) -> bool | None:
    if need == 0:
        return True
    if have is None:
        return None
    if need > have:
        reasons.append(f"{what}: needs {need / 1e9:.2f} GB, {source} has {have / 1e9:.2f} GB")
        return False
    return True


def fit(est: Estimate, node: NodeCapacity) -> Fit:
    """Whether ``est`` fits one node of ``node``'s kind."""
    reasons: list[str] = []
    gpu = _compare(est.gpu_nbytes, node.gpu_nbytes, "GPU memory per device", node.gpu_from, reasons)
    if node.pool_nbytes is not None:
        host = _compare(est.node_pool_nbytes, node.pool_nbytes, "daemon pool", node.pool_from, reasons)
    else:
        host = _compare(est.node_host_nbytes, node.host_nbytes, "host memory", node.host_from, reasons)
    nvme = _compare(est.node_nvme_nbytes, node.nvme_nbytes, "NVMe swap", node.nvme_from, reasons)
    return Fit(gpu, host, nvme, tuple(reasons))


# --------------------------------------------------------------------------- output


def parse_params(text: str) -> int:
    """A parameter count: ``7.5e9``, ``7500000000`` or with a suffix ``K``/``M``/``B``/``T`` (``7.5B``)."""
    scales = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
    raw = text.strip()
    scale = scales.get(raw[-1:].lower(), 1) if raw else 1
    number = raw[:-1] if scale != 1 else raw
    try:
        value = float(number) * scale
    except ValueError:
        raise InvalidArgument(f"params must be a number of parameters such as 7.5e9 or 7.5B, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise InvalidArgument(f"params must be positive, got {text!r}")
    if value < 1 or value != int(value):
        raise InvalidArgument(f"params must be a whole number of parameters, got {text!r} ({value!r})")
    return int(value)


def format_gb(nbytes: int) -> str:
    """Decimal units, as the ZeRO paper counts: 120.0 GB, 31.4 GB, 450.0 MB."""
    if nbytes == 0:
        return "-"
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def format_count(n: int) -> str:
    """A parameter count as people write it: 7.5B, 350M, 1.2T, 125K."""
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)


def _verdict(f: Fit) -> str:
    failed = [name for name, ok in (("GPU", f.gpu), ("host", f.host), ("NVMe", f.nvme)) if ok is False]
    if failed:
        return "no: " + ", ".join(failed)
    unknown = [name for name, ok in (("GPU", f.gpu), ("host", f.host), ("NVMe", f.nvme)) if ok is None]
    if unknown:
        return "? " + ", ".join(unknown) + " unknown"
    return "yes"


def render_table(shape: RunShape, rows: list[tuple[Estimate, Fit]], node: NodeCapacity) -> str:
    """The human report: one line per configuration, then what the node offers."""
    head = (
        f"{format_count(shape.params)} params, {shape.gpus} GPUs on {shape.nodes} node(s) "
        f"({shape.gpus_per_node} ranks per node); mixed-precision Adam, 16 B/param of model states"
    )
    if shape.state_dtype != "fp32":
        head += (
            f"; offloaded moments in {shape.state_dtype}: {daemon_state_bytes(shape.state_dtype):g} B/param in the "
            f"pool, {nvme_state_bytes(shape.state_dtype):g} of NVMe-tier state"
        )
    columns = ("offload", "stage", "GPU/device", "host/rank", "NVMe/rank", "host/node", "NVMe/node", "fits this node")
    table = [columns]
    for est, f in rows:
        table.append(
            (
                est.offload.value,
                str(est.stage),
                format_gb(est.gpu_nbytes),
                format_gb(est.host_nbytes),
                format_gb(est.nvme_nbytes),
                format_gb(est.node_host_nbytes),
                format_gb(est.node_nvme_nbytes),
                _verdict(f),
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    lines = [head, ""]
    for r in table:
        cells = [r[0].ljust(widths[0]), r[1].rjust(widths[1])]
        cells += [c.rjust(w) for c, w in zip(r[2:7], widths[2:7], strict=True)]
        cells.append(r[7])
        lines.append("  ".join(cells).rstrip())

    def have(nbytes: int | None, source: str) -> str:
        return f"unknown ({source})" if nbytes is None else f"{format_gb(nbytes)} ({source})"

    lines += [
        "",
        "GB = 1e9 bytes, as in the ZeRO paper. Model states only: activations and temporary buffers come on top.",
        "host/node: every rank's share of the daemon's pool (fp32 state, or the NVMe chunk cache, and a staging",
        f"window) and the daemon process ({format_gb(DAEMON_PROCESS_NBYTES)}). NVMe: the swap the daemon reserves,",
        f"two copies of the state (written out of place) and a cache of {shape.cache_chunks} chunks. This node:",
        f"  GPU   {have(node.gpu_nbytes, node.gpu_from)}",
    ]
    if node.pool_nbytes is not None:
        lines.append(f"  host  {have(node.pool_nbytes, 'free pool budget of ' + node.pool_from)}")
    else:
        lines.append(f"  host  {have(node.host_nbytes, node.host_from)}")
    lines.append(f"  NVMe  {have(node.nvme_nbytes, node.nvme_from)}")
    return "\n".join(lines)


def to_json(shape: RunShape, rows: list[tuple[Estimate, Fit]], node: NodeCapacity) -> dict[str, object]:
    """The same as ``render_table``, in bytes, for machines."""
    return {
        "params": shape.params,
        "gpus": shape.gpus,
        "nodes": shape.nodes,
        "gpus_per_node": shape.gpus_per_node,
        "window_nbytes": shape.window_nbytes,
        "chunk_numel": shape.chunk_numel,
        "cache_chunks": shape.cache_chunks,
        "state_dtype": shape.state_dtype,
        "daemon_process_nbytes": DAEMON_PROCESS_NBYTES,
        "node": dataclasses.asdict(node),
        "estimates": [
            {
                "offload": est.offload.value,
                "stage": est.stage,
                "gpu_nbytes": est.gpu_nbytes,
                "host_nbytes_per_rank": est.host_nbytes,
                "nvme_nbytes_per_rank": est.nvme_nbytes,
                "node_host_nbytes": est.node_host_nbytes,
                "node_pool_nbytes": est.node_pool_nbytes,
                "node_nvme_nbytes": est.node_nvme_nbytes,
                "fits": {"gpu": f.gpu, "host": f.host, "nvme": f.nvme, "all": f.fits},
                "reasons": list(f.reasons),
            }
            for est, f in rows
        ],
    }

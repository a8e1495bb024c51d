"""What state a rank keeps per element, and how its chunks are cut into parts and laid out.  Pure: one home
for these facts, used by the daemon (``tiermemd.state``, ``tiermemd.nvme``, the rank) and by the trainer
side's sizing of a private daemon's pool (``tiermem.client.offload.args``) and the estimator.

Keys: ``master`` and ``grad`` are fp32; ``exp_avg`` and ``exp_avg_sq`` are in the rank's ``state_dtype``
(``tiermem.core.lowbit``: fp32, bf16, or int8 codes with one fp32 scale a block of ``lowbit.BLOCK``
elements); ``param`` is the params in their working dtype, kept apart from the master by a staged rank on
the NVMe tier whose params are below fp32 (a param fetch then reads 2 bytes a param, not 4).  A chunk's
parts (``chunk_parts``) are each stored and paged as a unit: ``param`` (what a fetch reads and a step
writes), ``state`` (what only an update and a checkpoint touch), ``grad``.

``StateFormat`` lays a part out as sections, one per stored tensor (a key, or an int8 moment's scales),
packed densely in order of falling element size (fp32 first), so every section is naturally aligned
without padding; with fp32 moments that is the keys in order, each ``n`` elements.  A part is its exact
byte count, so the pool and the swap hold the compressed bytes and nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from tiermem.core import dtypes
from tiermem.core.errors import InvalidArgument
from tiermem.core.lowbit import BLOCK, STATE_DTYPES, blocks_of, moment_nbytes
from tiermem.core.modes import Exchange, Placement

__all__ = [
    "ALL_KEYS",
    "MOMENTS",
    "PAGED_KEYS",
    "STAGED_KEYS",
    "Section",
    "StateFormat",
    "chunk_parts",
    "element_align",
    "key_nbytes",
    "part_element_nbytes",
    "state_keys_for",
]

MOMENTS = ("exp_avg", "exp_avg_sq")
ALL_KEYS = ("master", *MOMENTS)
STAGED_KEYS = (*ALL_KEYS, "grad")
"""A rank whose params do not live in the shared storage (the staged exchange) also keeps its grads."""
PAGED_KEYS = ("param", *STAGED_KEYS)
"""A staged rank on the NVMe tier whose params are below fp32 also keeps them in their working dtype."""

_MOMENT_DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "int8": (torch.int8, torch.uint8),
}
"""The element dtypes of (exp_avg, exp_avg_sq) per state dtype."""


def state_keys_for(
    dtype: str,
    placement: Placement,
    grad_buffers: int,
    exchange: Exchange = Exchange.SHARED,
    grads_in_state: bool = False,
) -> tuple[str, ...]:
    """The state a rank keeps: no master when its fp32 params in the pool-backed storage can be it.

    NVMe-placed state keeps the master (what a restarted daemon reopens); a delayed update keeps it
    (the trainer reads the old params while the update writes the new master); the staged exchange
    (params on a device, not in the storage) keeps the master and the grads, and on the NVMe tier, where
    the params are below fp32, the params in their working dtype too (``param``: what a fetch reads).
    ``placement`` and ``exchange`` may also be given by their wire spellings."""
    placement = Placement.parse(placement, "placement")
    exchange = Exchange.parse(exchange, "exchange")
    if exchange is Exchange.STAGED:
        return PAGED_KEYS if placement is Placement.NVME and dtype != "float32" else STAGED_KEYS
    grad = ("grad",) if grads_in_state else ()
    if dtype == "float32" and placement is Placement.CPU and grad_buffers == 1:
        return (*MOMENTS, *grad)
    return (*ALL_KEYS, *grad)


def element_align(state_dtype: str) -> int:
    """Elements a rank's tensors start on, its chunks and an update's pieces are a multiple of: int8 moments
    are quantized in blocks of the flat space, which must not hold two tensors' elements."""
    return BLOCK if state_dtype == "int8" else 1


def key_nbytes(key: str, dtype: str, state_dtype: str = "fp32") -> float:
    """Bytes one element of ``key`` takes for a rank of working dtype ``dtype`` (an int8 moment's share of
    its block scales included)."""
    if key == "param":
        return float(dtypes.by_name(dtype).torch.itemsize)
    return moment_nbytes(state_dtype) if key in MOMENTS else 4.0


def part_element_nbytes(keys: Sequence[str], dtype: str, state_dtype: str = "fp32") -> dict[str, float]:
    """Bytes one element takes in each part of a chunk (``chunk_parts``) of a rank of working dtype ``dtype``."""
    return {part: sum(key_nbytes(key, dtype, state_dtype) for key in held) for part, held in chunk_parts(keys).items()}


def chunk_parts(keys: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The parts of a chunk of a rank that keeps ``keys``, each stored and paged as a unit, with the keys each
    holds in order: ``param`` (the working-dtype ``param`` where kept, else the ``master``), ``state`` (the
    master where ``param`` is kept, and the moments), ``grad``.  Parts holding none of ``keys`` are left out."""
    if "param" in keys:
        table = {"param": ("param",), "state": ("master", *MOMENTS), "grad": ("grad",)}
    else:
        table = {"param": ("master",), "state": MOMENTS, "grad": ("grad",)}
    parts = {part: tuple(k for k in held if k in keys) for part, held in table.items()}
    return {part: held for part, held in parts.items() if held}


@dataclass(frozen=True)
class Section:
    """One stored tensor of a part: ``name`` is a key, or ``<moment>_scale`` (an int8 moment's block scales)."""

    name: str
    key: str
    """The state key it belongs to (what a caller acquires)."""
    dtype: torch.dtype
    blocked: bool = False
    """One element a block of ``lowbit.BLOCK`` elements (the scales), else one an element."""

    def count(self, n: int) -> int:
        return blocks_of(n) if self.blocked else n


@dataclass(frozen=True)
class StateFormat:
    """How a rank's chunks hold its ``keys``: working dtype ``dtype``, moments in ``state_dtype``."""

    keys: tuple[str, ...]
    dtype: str = "float32"
    state_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.state_dtype not in STATE_DTYPES:
            raise InvalidArgument(f"state_dtype must be one of {list(STATE_DTYPES)}, got {self.state_dtype!r}")
        dtypes.by_name(self.dtype)  # refuses an unknown one

    @property
    def block(self) -> int:
        """Elements a chunk, a tensor's start and an update's piece must be a multiple of (``element_align``)."""
        return element_align(self.state_dtype)

    @cached_property
    def parts(self) -> dict[str, tuple[str, ...]]:
        return chunk_parts(self.keys)

    @cached_property
    def section_keys(self) -> dict[str, str]:
        """The state key each section of every part belongs to, by section name (what a caller acquires)."""
        return {sec.name: sec.key for part in self.parts for sec in self.sections(part)}

    def key_sections(self, key: str) -> tuple[Section, ...]:
        if key == "param":
            return (Section(key, key, dtypes.by_name(self.dtype).torch),)
        if key not in MOMENTS:
            return (Section(key, key, torch.float32),)
        dtype = _MOMENT_DTYPES[self.state_dtype][MOMENTS.index(key)]
        if self.state_dtype != "int8":
            return (Section(key, key, dtype),)
        return (Section(key, key, dtype), Section(f"{key}_scale", key, torch.float32, blocked=True))

    def sections(self, part: str) -> tuple[Section, ...]:
        """The sections of ``part`` in stored order: by falling element size, then key order."""
        found = [s for key in self.parts[part] for s in self.key_sections(key)]
        return tuple(sorted(found, key=lambda s: -s.dtype.itemsize))

    def layout(self, part: str, n: int) -> list[tuple[Section, int, int]]:
        """``(section, byte offset, elements)`` of each section of ``part`` in a chunk of ``n`` elements."""
        out, offset = [], 0
        for section in self.sections(part):
            count = section.count(n)
            out.append((section, offset, count))
            offset += count * section.dtype.itemsize
        return out

    def part_nbytes(self, part: str, n: int) -> int:
        """Exact bytes of ``part`` in a chunk of ``n`` elements."""
        return sum(s.count(n) * s.dtype.itemsize for s in self.sections(part))

    def chunk_nbytes(self, n: int) -> int:
        return sum(self.part_nbytes(part, n) for part in self.parts)

    def nbytes(self, numel: int, chunk_numel: int) -> int:
        """Bytes of all chunks of a state of ``numel`` elements (each part exact, no page rounding)."""
        full, rest = divmod(numel, chunk_numel)
        return full * self.chunk_nbytes(chunk_numel) + (self.chunk_nbytes(rest) if rest else 0)

    def chunk_numel(self, configured: int) -> int:
        """The chunk size a rank of this format uses for the configured one: a whole number of blocks."""
        return -(-configured // self.block) * self.block

    def split(
        self, part: str, raw: torch.Tensor, n: int, wanted: Sequence[str] | set[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """The sections of ``part`` (``raw``: its uint8 bytes, of a chunk of ``n`` elements) by name, for the
        keys in ``wanted`` (None: all)."""
        out = {}
        for section, offset, count in self.layout(part, n):
            if wanted is None or section.key in wanted:
                size = count * section.dtype.itemsize
                out[section.name] = raw[offset : offset + size].view(section.dtype)
        return out

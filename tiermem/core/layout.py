"""Where each registered tensor lives: flat state ranges and its place in a rank's shared storage.

Pure.  The daemon plans it once at REGISTER (``tiermemd.rank``) and hands the
client the result as slots (``REGISTER_OK``); the client never plans it.

Given tensors in registration order, ``plan_layout`` assigns:

- a range ``[start, stop)`` of the rank's flat fp32 element space (each state
  key, master, exp_avg, exp_avg_sq, grad, is a flat buffer indexed the same way);
- buckets: consecutive runs of tensors of about ``bucket_nbytes`` of gradient,
  in reverse registration order (the daemon plans with one bucket; the client
  groups its own for the overlapped update, ``tiermem.client.offload.policy``);
- the storage layout (regions 4 KiB aligned, tensors packed densely inside,
  or each starting on a multiple of ``element_align`` elements: a rank with
  int8 moments starts every tensor on a quantization block)::

      +-------------------+-------------------+-------------------+
      | params (working)  | grads, buffer 0   | grads, buffer 1   |
      +-------------------+-------------------+-------------------+
      0                   grad_offset[0]      grad_offset[1]      nbytes

  The param region is the model's params themselves (the client's tensors are
  views of it, and the daemon updates them in place); a grad buffer holds the
  working-precision grads of one step.  Two grad buffers exist when the job
  uses the delayed update (the next step's grads land while the previous
  step's are still being read).  Inside a region a tensor's bytes sit at
  ``slot_offset`` = ``start * itemsize`` (the same in every region), so region
  + slot_offset addresses it, and a run of tensors is one contiguous range of
  both the flat state and each region.

A bucket covers a contiguous element range of the flat space and a contiguous
byte range of each region, so the update of a bucket is one chunked call.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from tiermem.core.errors import DTypeError, InvalidArgument

__all__ = [
    "DTYPE_NBYTES",
    "Bucket",
    "Layout",
    "TensorSlot",
    "TensorSpec",
    "group_buckets",
    "plan_layout",
    "tensor_starts",
]

DTYPE_NBYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_REGION_ALIGN = 4096


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as the client registers it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """Working precision (the model's dtype): float32, float16 or bfloat16."""
    group: int = 0
    """Index of its param group (hyper-parameters)."""

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class TensorSlot:
    spec: TensorSpec
    index: int
    start: int
    """First element in the flat state space."""
    slot_offset: int
    """Byte offset of this tensor inside each region."""
    bucket: int

    @property
    def stop(self) -> int:
        return self.start + self.spec.numel

    @property
    def nbytes(self) -> int:
        return self.spec.numel * DTYPE_NBYTES[self.spec.dtype]


@dataclass(frozen=True)
class Bucket:
    index: int
    tensors: tuple[int, ...]
    """Tensor indices, ascending."""
    start: int
    stop: int
    """Flat element range covered (contiguous)."""
    slot_offset: int
    nbytes: int
    """Byte range inside each region."""


@dataclass(frozen=True)
class Layout:
    slots: tuple[TensorSlot, ...]
    buckets: tuple[Bucket, ...]
    """In the order they fill during backward (bucket 0 holds the last tensors)."""
    numel: int
    region_nbytes: int
    param_offset: int
    grad_offsets: tuple[int, ...]
    nbytes: int
    """Window bytes this layout needs."""
    dtype: str

    def slot(self, name: str) -> TensorSlot:
        for slot in self.slots:
            if slot.spec.name == name:
                return slot
        raise InvalidArgument(f"no tensor named {name!r} is registered")


def group_buckets(nbytes: list[int], bucket_nbytes: int) -> list[list[int]]:
    """Buckets of tensor indices: walk the tensors from the last to the first (backward produces the last
    layers' grads first), closing a bucket once it reaches ``bucket_nbytes``; members ascending, buckets in
    that (backward) order."""
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in range(len(nbytes) - 1, -1, -1):
        current.append(index)
        size += nbytes[index]
        if size >= bucket_nbytes:
            groups.append(sorted(current))
            current, size = [], 0
    if current:
        groups.append(sorted(current))
    return groups


def tensor_starts(numels: list[int], element_align: int = 1) -> tuple[list[int], int]:
    """Where each tensor of ``numels`` elements starts in the flat space, each on a multiple of
    ``element_align``, and the space's size (the end of the last)."""
    starts, end = [], 0
    for n in numels:
        end = _align(end, element_align)
        starts.append(end)
        end += n
    return starts, end


def plan_layout(
    specs: list[TensorSpec], *, bucket_nbytes: int, grad_buffers: int = 1, element_align: int = 1
) -> Layout:
    """Lay out ``specs``; all tensors share one working dtype (a job's model precision).  Each tensor starts
    on a multiple of ``element_align`` elements of the flat space (the gaps are never written)."""
    if not specs:
        raise InvalidArgument("register at least one tensor")
    if element_align <= 0:
        raise InvalidArgument(f"element_align must be > 0, got {element_align}")
    if bucket_nbytes <= 0:
        raise InvalidArgument(f"bucket_nbytes must be > 0, got {bucket_nbytes}")
    if grad_buffers not in (1, 2):
        raise InvalidArgument(f"grad_buffers must be 1 or 2, got {grad_buffers}")
    dtypes = {s.dtype for s in specs}
    for dtype in dtypes:
        if dtype not in DTYPE_NBYTES:
            raise DTypeError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPE_NBYTES)}")
    if len(dtypes) > 1:
        raise DTypeError(f"all tensors of one rank must share a working dtype, got {sorted(dtypes)}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise InvalidArgument(f"tensor name {dup!r} is registered twice")
    (dtype,) = dtypes
    itemsize = DTYPE_NBYTES[dtype]

    groups = group_buckets([s.numel * itemsize for s in specs], bucket_nbytes)
    bucket_of = {i: b for b, members in enumerate(groups) for i in members}

    for spec in specs:
        if any(d < 0 for d in spec.shape):
            raise InvalidArgument(f"tensor {spec.name!r} has a negative dimension: {spec.shape}")
    starts, numel = tensor_starts([s.numel for s in specs], element_align)
    slots = [
        TensorSlot(spec, index, start, start * itemsize, bucket_of[index])
        for index, (spec, start) in enumerate(zip(specs, starts, strict=True))
    ]
    buckets = []
    for b, members in enumerate(groups):
        first, last = slots[members[0]], slots[members[-1]]
        buckets.append(
            Bucket(
                b,
                tuple(members),
                first.start,
                last.stop,
                first.slot_offset,
                last.slot_offset + last.nbytes - first.slot_offset,
            )
        )
    region = _align(max(numel * itemsize, 1), _REGION_ALIGN)
    grad_offsets = tuple(region * (1 + i) for i in range(grad_buffers))
    return Layout(
        slots=tuple(slots),
        buckets=tuple(buckets),
        numel=numel,
        region_nbytes=region,
        param_offset=0,
        grad_offsets=grad_offsets,
        nbytes=region * (1 + grad_buffers),
        dtype=dtype,
    )

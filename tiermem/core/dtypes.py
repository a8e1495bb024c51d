"""The one table of working dtypes: wire name, torch dtype, bytes per element.

A job's params are float32, float16 or bfloat16 (the model's precision, its
"working" dtype); the daemon's Adam state is always float32.  Every part that
names a dtype on the wire, sizes a region or views memory as a tensor reads
this table, so adding a dtype is one line here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiermem.core.errors import DTypeError

__all__ = ["DTYPES", "WorkingDType", "by_name", "by_torch", "names"]


@dataclass(frozen=True, slots=True)
class WorkingDType:
    name: str
    """Wire name (``"bfloat16"``)."""
    torch: torch.dtype
    itemsize: int

    @property
    def is_low_precision(self) -> bool:
        """Lower than fp32: the daemon keeps an fp32 master beside it."""
        return self.itemsize < 4


DTYPES: tuple[WorkingDType, ...] = (
    WorkingDType("float32", torch.float32, 4),
    WorkingDType("float16", torch.float16, 2),
    WorkingDType("bfloat16", torch.bfloat16, 2),
)
_BY_NAME = {d.name: d for d in DTYPES}
_BY_TORCH = {d.torch: d for d in DTYPES}


def names() -> tuple[str, ...]:
    return tuple(_BY_NAME)


def by_name(name: str) -> WorkingDType:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise DTypeError(f"unsupported dtype {name!r}; expected one of {', '.join(_BY_NAME)}") from None


def by_torch(dtype: torch.dtype) -> WorkingDType:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise DTypeError(f"unsupported dtype {dtype}; tiermem trains float32, float16 or bfloat16 params") from None

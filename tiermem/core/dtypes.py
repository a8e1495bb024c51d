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

__all__ = ["DTYPES", "WorkingDType", "adopt_edits", "by_name", "by_torch", "names"]


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


def adopt_edits(master: torch.Tensor, params: torch.Tensor) -> int:
    """Take the params' values (their working dtype) into the fp32 ``master`` where they differ from the master
    cast to their dtype; returns how many.  The one rule for a param's values reaching its master, in the daemon
    (in-place edits of shared params) and in the trainer (a model's state dict loaded, a staged param edited): a
    master element that rounds to the param's value is kept, so a value the param already had costs the
    master none of its precision, and only what was edited is written."""
    edited = params != master.to(params.dtype)
    count = int(edited.sum())
    if count:
        master[edited] = params[edited].to(torch.float32)  # only the edited elements are written
    return count

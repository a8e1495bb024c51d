"""The staged exchange: params that live on a device (CUDA), exchanged through the bounded staging window.

Params on a device cannot be shared memory, so the daemon keeps each one's
fp32 master and grad as state keys, and they move piece by piece through the
staging window (``StateTransfer``): at ``step()`` the grads go in
(``grad``), the daemon updates, and the new params come back out of the
master (cast to the param's dtype on the copy).  The window is registered
with CUDA once (``cudaHostRegister``), so these copies are DMA, and it is
unregistered before it is unmapped.  Host memory per param is the daemon's
state only; nothing of the model is mirrored.

Edits: a param changed between steps (by autograd-visible in-place ops, by
``.data``, or rebound) is noticed by its fingerprint (version counter, data
pointer and a checksum of its bits) and pushed as the new master before the
update.  A fp16/bf16 master pushed that way is the param's value widened.

Not yet: the overlapped update (per-bucket readiness on the device),
``release_grads``.  Grads go in at ``step()``, after backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tiermem.errors import DTypeError, InvalidArgument, InvalidState
from tiermem.offload.transfer import StateTransfer

__all__ = ["StagedEntry", "StagedFeed"]


def fingerprint(p: torch.Tensor) -> tuple[int, int, int]:
    flat = p.detach().reshape(-1)
    bits = flat.view(torch.int32 if flat.element_size() == 4 else torch.int16)
    return (p._version, p.data_ptr(), int(bits.sum(dtype=torch.int64)))


@dataclass
class StagedEntry:
    index: int
    param: torch.nn.Parameter
    dtype: torch.dtype
    device: torch.device
    shape: torch.Size
    mark: tuple[int, int, int] = (0, 0, 0)
    """The param's fingerprint when its values last matched the daemon's master."""

    def describe(self) -> str:
        return f"param {self.index} (shape {tuple(self.shape)}, {self.dtype} on {self.device})"


@dataclass
class StagedFeed:
    entries: list[StagedEntry]
    transfer: StateTransfer
    _by_param: dict[int, StagedEntry] = field(default_factory=dict)
    accumulated: bool = False
    changed_after_landing: bool = False
    buffer: int = 0

    def __post_init__(self) -> None:
        self._by_param = {id(e.param): e for e in self.entries}

    # the GradFeed interface the optimizer uses
    def hook(self) -> None:
        """Nothing to hook: grads are staged at ``step()``."""

    def unhook(self) -> None:
        """Nothing was hooked."""

    def reset(self) -> None:
        """Nothing lands before ``step()``."""

    def check(self) -> list[int]:
        ids = []
        for e in self.entries:
            p = e.param
            if p.dtype != e.dtype:
                raise DTypeError(
                    f"param {e.index} was registered as {e.dtype} and is now {p.dtype}; create the optimizer "
                    "after changing the model's dtype"
                )
            if p.device != e.device or p.shape != e.shape:
                raise InvalidState(f"{e.describe()} is now {tuple(p.shape)} on {p.device}; it may not change")
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse or grad.layout is not torch.strided:
                raise InvalidArgument(
                    f"{e.describe()} has a sparse gradient; OffloadAdam, like torch.optim.AdamW, takes dense ones"
                )
            if grad.dtype != p.dtype:
                raise DTypeError(f"{e.describe()} has a {grad.dtype} gradient; params and grads must share a dtype")
            ids.append(e.index)
        return ids

    def zero(self, *, set_to_none: bool) -> None:
        for e in self.entries:
            if e.param.grad is None:
                continue
            if set_to_none:
                e.param.grad = None
            else:
                e.param.grad.detach_()
                e.param.grad.zero_()

    # the exchange
    def push_params(self, entries: list[StagedEntry] | None = None, *, only_edited: bool = True) -> int:
        """Push params whose fingerprint changed (``only_edited``) as their new master; returns how many."""
        pushed = 0
        for e in entries if entries is not None else self.entries:
            mark = fingerprint(e.param)
            if only_edited and mark == e.mark:
                continue
            self.transfer.push(e.index, "master", e.param.detach(), step=0)
            e.mark = mark
            pushed += 1
        return pushed

    def push_grads(self, ids: list[int]) -> None:
        for tid in ids:
            grad = self.entries[tid].param.grad
            if grad is not None:
                self.transfer.push(tid, "grad", grad.detach(), step=0)

    def pull_params(self, ids: list[int] | range) -> None:
        """The updated params: the daemon's master, cast into each param on the copy."""
        for tid in ids:
            e = self.entries[tid]
            self.transfer.pull_into(tid, "master", e.param.data)
            e.mark = fingerprint(e.param)

"""Param-paging copies between the staging window and the "device": this process's memory, or a CUDA GPU.

The pager's I/O thread runs every transfer (``StateTransfer`` through the
bounded staging window, piece by piece); the trainer's thread only waits for
what it needs.  Two engines share one interface:

- ``HostCopies``: the device is the trainer's memory.  A fetch is a read of
  the ``master`` state key into a fresh tensor; a grad push is a write of the
  ``grad`` key (accumulating after the first landing of a step).
- ``CudaCopies``: the same on a copy stream.  A fetch copies each piece from
  the (CUDA-registered) window to the device on the copy stream and records
  an event; the compute stream waits on it before the param is used.  A grad
  push waits on an event recorded on the compute stream where the grad was
  produced, and the grad is marked used by the copy stream
  (``record_stream``) so the caching allocator does not hand its memory out
  before the copy read it.  Materialized params are allocated on the compute
  stream, written on the copy stream only before the event the compute
  stream waits on, so their memory is never reused early either.

Each piece goes through the window synchronously (the window is reused for
the next piece), which ``Tensor.copy_`` between pinned host memory and the
device guarantees on the stream it runs on.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tiermem.client.offload.transfer import StateTransfer

__all__ = ["CudaCopies", "HostCopies", "ParamCopies", "copies_for"]


class ParamCopies(Protocol):
    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor to fetch a param into (trainer's thread)."""
        ...

    def fetch(self, transfer: StateTransfer, tid: int, dest: torch.Tensor) -> Any:
        """Read the param (its ``param`` key) into ``dest`` (I/O thread); returns what ``ready`` needs."""
        ...

    def ready(self, token: Any) -> None:
        """Before the trainer uses a fetched param (trainer's thread)."""
        ...

    def grad_token(self, grad: torch.Tensor) -> Any:
        """When a grad lands (trainer's thread): what ``push`` waits on."""
        ...

    def push(self, transfer: StateTransfer, tid: int, grad: torch.Tensor, accumulate: bool, token: Any) -> None:
        """Write the grad into the daemon's ``grad`` key (I/O thread)."""
        ...

    def read_master(self, transfer: StateTransfer, tid: int, out: torch.Tensor) -> None:
        """Read the param's whole value into the host tensor ``out`` (I/O thread; ``model.state_dict``)."""
        ...

    def write_master(self, transfer: StateTransfer, tid: int, values: torch.Tensor) -> None:
        """Write ``values`` as the param's master (I/O thread; a load or an initialization)."""
        ...


class _DirectMaster:
    """Where the daemon's tensor is the whole param: the master is read and written as it is."""

    def read_master(self, transfer: StateTransfer, tid: int, out: torch.Tensor) -> None:
        transfer.pull_into(tid, "param", out)

    def write_master(self, transfer: StateTransfer, tid: int, values: torch.Tensor) -> None:
        transfer.push(tid, "master", values, step=0)


class HostCopies(_DirectMaster):
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def fetch(self, transfer: StateTransfer, tid: int, dest: torch.Tensor) -> Any:
        transfer.pull_into(tid, "param", dest)
        return None

    def ready(self, token: Any) -> None:
        """Host copies are complete when ``fetch`` returns."""

    def grad_token(self, grad: torch.Tensor) -> Any:
        return None

    def push(self, transfer: StateTransfer, tid: int, grad: torch.Tensor, accumulate: bool, token: Any) -> None:
        transfer.push(tid, "grad", grad, step=0, accumulate=accumulate)


class CudaCopies(_DirectMaster):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def fetch(self, transfer: StateTransfer, tid: int, dest: torch.Tensor) -> Any:
        with torch.cuda.stream(self.stream):
            transfer.pull_into(tid, "param", dest)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def ready(self, token: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(token)

    def grad_token(self, grad: torch.Tensor) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        grad.record_stream(self.stream)
        return event

    def push(self, transfer: StateTransfer, tid: int, grad: torch.Tensor, accumulate: bool, token: Any) -> None:
        self.stream.wait_event(token)
        with torch.cuda.stream(self.stream):
            transfer.push(tid, "grad", grad, step=0, accumulate=accumulate)


def copies_for(device: torch.device) -> ParamCopies:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"params on {device}, but CUDA is not available")
        return CudaCopies(device)
    return HostCopies(device)

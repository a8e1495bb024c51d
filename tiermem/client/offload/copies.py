"""Param-paging copies between the staging window and the "device": this process's memory, or a CUDA GPU.

The pager's I/O thread runs every transfer (``StateTransfer`` through the
bounded staging window, piece by piece); the trainer's thread only waits for
what it needs.  Two engines share one interface:

- ``HostCopies``: the device is the trainer's memory.  A fetch is a read of
  the ``param`` state key (the params in their working dtype, staged in it:
  2 bytes an element for bf16) into fresh tensors; a grad push is a write of
  the ``grad`` key (staged in the grads' dtype, widened by the daemon;
  accumulating after the first landing of a step).  Both take several params at once: a submodule's
  params, the grads that landed while the I/O thread was busy; they share the
  window's slots, so they cost a request per slot filled, not one per param.
- ``CudaCopies``: the same on a copy stream.  A fetch copies each piece from
  the (CUDA-registered) window to the device on the copy stream and records
  an event; the compute stream waits on it before the param is used.  A grad
  push waits on an event recorded on the compute stream where the grad was
  produced, and the grad is marked used by the copy stream
  (``record_stream``) so the caching allocator does not hand its memory out
  before the copy read it.  Materialized params are allocated on the compute
  stream, written on the copy stream only before the event the compute
  stream waits on, so their memory is never reused early either.  A buffer
  the pager reuses (a released param's) is written only after the compute
  stream reached the point where the fetch was submitted (``mark``): the
  kernels that read the released param were enqueued before it.

Each piece goes through the window synchronously (the window is reused for
the next piece), which ``Tensor.copy_`` between pinned host memory and the
device guarantees on the stream it runs on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from tiermem.client.offload.transfer import StateTransfer

__all__ = [
    "CudaCopies",
    "FetchItem",
    "GradItem",
    "HostCopies",
    "ParamCopies",
    "compute_mark",
    "copies_for",
    "param_buffer",
]

FetchItem = tuple[int, torch.Tensor]
"""``(tensor id, destination)``: a param to fetch."""
GradItem = tuple[int, torch.Tensor, bool, Any]
"""``(tensor id, grad, accumulate, token)``: a grad to push, after ``token`` (from ``grad_token``)."""


class ParamCopies(Protocol):
    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor to fetch a param into (trainer's thread)."""
        ...

    def mark(self) -> Any:
        """Where the compute stream is (trainer's thread), taken as a fetch's buffers are chosen: the fetch
        writes them only after it, so a buffer reused from a released param is not overwritten while kernels
        enqueued before still read it (None on the host, where work is done when it returns)."""
        ...

    def fetch_many(self, transfer: StateTransfer, items: Sequence[FetchItem], after: Any = None) -> Any:
        """Read each param (its ``param`` key) into its destination (I/O thread), after ``after`` (a ``mark``);
        returns what ``ready`` needs."""
        ...

    def ready(self, token: Any) -> None:
        """Before the trainer uses a fetched param (trainer's thread)."""
        ...

    def grad_token(self, grad: torch.Tensor) -> Any:
        """When a grad lands (trainer's thread): what ``push`` waits on."""
        ...

    def push_many(self, transfer: StateTransfer, items: Sequence[GradItem]) -> None:
        """Write each grad into the daemon's ``grad`` key (I/O thread)."""
        ...

    def read_master(self, transfer: StateTransfer, tid: int, out: torch.Tensor) -> None:
        """Read the param's whole value into the host tensor ``out`` (I/O thread; ``model.state_dict``)."""
        ...

    def write_master(self, transfer: StateTransfer, tid: int, values: torch.Tensor) -> None:
        """Write ``values`` as the param's master (I/O thread; an initialization)."""
        ...

    def adopt_master(self, transfer: StateTransfer, tid: int, values: torch.Tensor) -> None:
        """Take ``values`` (the param's, loaded into the model) into its master where they differ from it at
        the param's precision (I/O thread; ``StateTransfer.adopt_many``)."""
        ...


class _DirectMaster:
    """Where the daemon's tensor is the whole param: the master is read and written as it is."""

    def read_master(self, transfer: StateTransfer, tid: int, out: torch.Tensor) -> None:
        transfer.pull_into(tid, "param", out)

    def write_master(self, transfer: StateTransfer, tid: int, values: torch.Tensor) -> None:
        transfer.push(tid, "master", values, step=0)

    def adopt_master(self, transfer: StateTransfer, tid: int, values: torch.Tensor) -> None:
        transfer.adopt_many([(tid, values)])


class HostCopies(_DirectMaster):
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return param_buffer(shape, dtype, self.device)

    def mark(self) -> Any:
        return None

    def fetch_many(self, transfer: StateTransfer, items: Sequence[FetchItem], after: Any = None) -> Any:
        transfer.pull_many_into([(tid, "param", dest) for tid, dest in items])
        return None

    def ready(self, token: Any) -> None:
        """Host copies are complete when ``fetch`` returns."""

    def grad_token(self, grad: torch.Tensor) -> Any:
        return None

    def push_many(self, transfer: StateTransfer, items: Sequence[GradItem]) -> None:
        transfer.push_many([(tid, "grad", grad, 0, accumulate) for tid, grad, accumulate, _ in items])


class CudaCopies(_DirectMaster):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return param_buffer(shape, dtype, self.device)

    def mark(self) -> Any:
        return compute_mark(self.device)

    def fetch_many(self, transfer: StateTransfer, items: Sequence[FetchItem], after: Any = None) -> Any:
        if after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            transfer.pull_many_into([(tid, "param", dest) for tid, dest in items])
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

    def push_many(self, transfer: StateTransfer, items: Sequence[GradItem]) -> None:
        for _, _, _, token in items:
            self.stream.wait_event(token)
        with torch.cuda.stream(self.stream):
            transfer.push_many([(tid, "grad", grad, 0, accumulate) for tid, grad, accumulate, _ in items])


def compute_mark(device: torch.device) -> Any:
    """An event recorded on ``device``'s current (compute) stream: what a copy stream waits on before it
    writes a buffer that kernels enqueued so far may still read."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def param_buffer(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer a param is materialized in: never an inference tensor, though a use under
    ``torch.inference_mode()`` (an evaluation) may be what asks for it.  Buffers outlive that use (they are
    reused, and written on the I/O thread, outside the mode): an inference tensor there refused the write
    (``Inplace update to inference tensor outside InferenceMode``), and as a param's data in training it
    made autograd give the param no grad at all."""
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=dtype, device=device)


def copies_for(device: torch.device) -> ParamCopies:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"params on {device}, but CUDA is not available")
        return CudaCopies(device)
    return HostCopies(device)

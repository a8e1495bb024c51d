"""Registering host memory with CUDA, so GPU copies from it are DMA (the "pinner").

Owns nothing but the calls.  A ``Pinner`` registers an address range with the
GPU driver and unregisters it; it never raises for an environment that cannot
pin: it returns a ``PinResult`` saying what happened and why (``SKIPPED`` when
CUDA is unavailable, ``FAILED`` with the CUDA error when the driver refused).

``CudaPinner`` goes through ``torch.cuda.cudart()`` (``cudaHostRegister`` with
``cudaHostRegisterPortable``, so every device sees the range as pinned).
``NullPinner`` does nothing and says so.  ``default_pinner()`` picks one.
torch is imported on first use only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from tiermem.core.units import format_size

__all__ = ["CudaPinner", "NullPinner", "PinResult", "PinStatus", "Pinner", "default_pinner"]

_HOST_REGISTER_PORTABLE = 1


class PinStatus(enum.Enum):
    REGISTERED = "registered"
    UNREGISTERED = "unregistered"
    SKIPPED = "skipped"
    FAILED = "failed"


@dataclass(frozen=True)
class PinResult:
    """What a register/unregister call did to ``[address, address + nbytes)``."""

    status: PinStatus
    address: int
    nbytes: int
    reason: str = ""

    @property
    def registered(self) -> bool:
        return self.status is PinStatus.REGISTERED

    def __str__(self) -> str:
        where = f"{format_size(self.nbytes)} at {self.address:#x}"
        if self.status is PinStatus.REGISTERED:
            return f"registered {where} with CUDA"
        if self.status is PinStatus.UNREGISTERED:
            return f"unregistered {where} from CUDA"
        return f"not {'registered' if self.nbytes else 'unregistered'}: {self.reason} ({where})"


@runtime_checkable
class Pinner(Protocol):
    """Registers host memory with the GPU driver for DMA and unregisters it."""

    def register(self, address: int, nbytes: int) -> PinResult: ...

    def unregister(self, address: int) -> PinResult: ...


class NullPinner:
    """Pins nothing; every call reports ``SKIPPED`` with ``reason``."""

    def __init__(self, reason: str = "CUDA unavailable") -> None:
        self.reason = reason

    def register(self, address: int, nbytes: int) -> PinResult:
        return PinResult(PinStatus.SKIPPED, address, nbytes, self.reason)

    def unregister(self, address: int) -> PinResult:
        return PinResult(PinStatus.SKIPPED, address, 0, self.reason)


class CudaPinner:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's CUDA runtime bindings."""

    def register(self, address: int, nbytes: int) -> PinResult:
        cudart = _cudart()
        if cudart is None:
            return PinResult(PinStatus.SKIPPED, address, nbytes, "CUDA unavailable")
        code = int(cudart.cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE))
        if code != 0:
            return PinResult(PinStatus.FAILED, address, nbytes, _describe(cudart, "cudaHostRegister", code))
        return PinResult(PinStatus.REGISTERED, address, nbytes)

    def unregister(self, address: int) -> PinResult:
        cudart = _cudart()
        if cudart is None:
            return PinResult(PinStatus.SKIPPED, address, 0, "CUDA unavailable")
        code = int(cudart.cudaHostUnregister(address))
        if code != 0:
            return PinResult(PinStatus.FAILED, address, 0, _describe(cudart, "cudaHostUnregister", code))
        return PinResult(PinStatus.UNREGISTERED, address, 0)


def default_pinner() -> Pinner:
    """``CudaPinner`` where torch sees a CUDA device, else a ``NullPinner`` saying why not."""
    return CudaPinner() if _cudart() is not None else NullPinner("CUDA unavailable")


def _cudart() -> Any:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    try:
        return torch.cuda.cudart()
    except (RuntimeError, AssertionError):
        return None


def _describe(cudart: Any, call: str, code: int) -> str:
    try:
        text = cudart.cudaGetErrorString(cudart.cudaError(code))
    except (AttributeError, TypeError, ValueError, RuntimeError):
        text = "unknown error"
    return f"{call} returned cudaError {code} ({text})"

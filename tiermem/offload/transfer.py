"""State transfer: the daemon's fp32 state in and out, piece by piece through the staging window.

The staging window is bounded (``jobs.window_size`` or the client's
``window_nbytes``), so a tensor larger than it moves in several pieces, each
one STATE_READ / STATE_WRITE round trip.  ``state_dict`` and
``load_state_dict`` build ``torch.optim.AdamW``'s format on top of this.
"""

from __future__ import annotations

import torch

from tiermem.client import Client
from tiermem.errors import InvalidState
from tiermem.protocol import MemRef

__all__ = ["StateTransfer"]


class StateTransfer:
    def __init__(self, client: Client) -> None:
        self.client = client

    def _stage(self) -> tuple[MemRef, torch.Tensor]:
        info = self.client.info
        if info is None:
            raise InvalidState("not attached")
        length = self.client.window.numel() // 4 * 4
        if length == 0:
            raise InvalidState("the staging window is empty")
        return MemRef(info.window_id, 0, length), self.client.window[:length].view(torch.float32)

    def push(self, tid: int, key: str, values: torch.Tensor, *, step: int, accumulate: bool = False) -> None:
        """Write fp32 state ``key`` of tensor ``tid`` (``step`` sets its count when ``key`` is a moment).

        ``values`` may be of any float dtype and on any device: each piece is converted as it is copied
        into the window, so no full-size host copy is made."""
        ref, buf = self._stage()
        flat = values.detach().reshape(-1)
        per = buf.numel()
        if flat.numel() == 0:
            self.client.write_state(tid, key, 0, MemRef(ref.window, ref.offset, 0), step, accumulate=accumulate)
        for start in range(0, flat.numel(), per):
            piece = flat[start : start + per]
            buf[: piece.numel()].copy_(piece)
            nbytes = piece.numel() * 4
            self.client.write_state(
                tid, key, start * 4, MemRef(ref.window, ref.offset, nbytes), step, accumulate=accumulate
            )

    def pull(self, tid: int, key: str, numel: int) -> tuple[torch.Tensor, int]:
        """Read fp32 state ``key`` of tensor ``tid``; returns (values, the tensor's step count)."""
        ref, buf = self._stage()
        out = torch.empty(numel, dtype=torch.float32)
        per = buf.numel()
        step = self.step_of(tid) if numel == 0 else 0
        for start in range(0, numel, per):
            n = min(per, numel - start)
            chunk = self.client.read_state(tid, key, start * 4, MemRef(ref.window, ref.offset, n * 4))
            out[start : start + n].copy_(buf[:n])
            step = chunk.step
        return out, step

    def pull_into(self, tid: int, key: str, dest: torch.Tensor) -> int:
        """Read fp32 state ``key`` of tensor ``tid`` into ``dest`` (any float dtype, any device: converted
        piece by piece on the copy out of the window); returns the tensor's step count."""
        ref, buf = self._stage()
        flat = dest.view(-1)
        numel = flat.numel()
        per = buf.numel()
        step = self.step_of(tid) if numel == 0 else 0
        for start in range(0, numel, per):
            n = min(per, numel - start)
            chunk = self.client.read_state(tid, key, start * 4, MemRef(ref.window, ref.offset, n * 4))
            flat[start : start + n].copy_(buf[:n])
            step = chunk.step
        return step

    def step_of(self, tid: int) -> int:
        """The tensor's Adam step count (a zero-length read)."""
        ref, _ = self._stage()
        return self.client.read_state(tid, "exp_avg", 0, MemRef(ref.window, ref.offset, 0)).step

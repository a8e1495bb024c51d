"""State transfer: the daemon's fp32 state in and out, piece by piece through the staging window.

The staging window is bounded (``jobs.window_size`` or the client's
``window_nbytes``), so a tensor larger than it moves in several pieces, each
one STATE_READ / STATE_WRITE round trip.  ``state_dict`` and
``load_state_dict`` build ``torch.optim.AdamW``'s format on top of this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tiermem.client import Client
from tiermem.errors import InvalidArgument, InvalidState
from tiermem.offload.args import check_hyper
from tiermem.protocol import MemRef

__all__ = ["StateTransfer", "plan_load"]


def plan_load(
    state_dict: Any, param_groups: Sequence[dict[str, Any]], numels: Sequence[int]
) -> list[tuple[int, dict[str, Any], int]]:
    """Check a ``torch.optim.AdamW``-format state dict against this optimizer's groups and tensor sizes, before
    anything is changed; returns ``(tensor id, state entry, step)`` per param that has state in it."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(groups, list) or len(groups) != len(param_groups):
        raise InvalidArgument(
            f"state dict has {len(groups) if isinstance(groups, list) else 'no'} param groups, "
            f"this optimizer has {len(param_groups)}"
        )
    mapping: dict[Any, int] = {}
    tid = 0
    for mine, saved in zip(param_groups, groups, strict=True):
        if len(mine["params"]) != len(saved["params"]):
            raise InvalidArgument(
                f"a saved param group has {len(saved['params'])} params, the matching group here has "
                f"{len(mine['params'])}"
            )
        for key in saved["params"]:
            mapping[key] = tid
            tid += 1
    loads: list[tuple[int, dict[str, Any], int]] = []
    for key, entry in state_dict.get("state", {}).items():
        if key not in mapping:
            raise InvalidArgument(f"state for param {key!r}, which no param group lists")
        t = mapping[key]
        for name in ("exp_avg", "exp_avg_sq"):
            value = entry.get(name)
            if not isinstance(value, torch.Tensor) or value.numel() != numels[t]:
                raise InvalidArgument(
                    f"state {name} of param {key!r} has "
                    f"{value.numel() if isinstance(value, torch.Tensor) else 'no'} elements, not {numels[t]}"
                )
        loads.append((t, entry, int(float(entry["step"]))))
    for mine, saved in zip(param_groups, groups, strict=True):
        saved_adamw = saved.get("adamw", saved.get("decoupled_weight_decay", mine.get("adamw", True)))
        check_hyper(
            saved.get("lr", mine["lr"]),
            tuple(saved.get("betas", mine["betas"])),
            saved.get("eps", mine["eps"]),
            saved.get("weight_decay", mine["weight_decay"]),
            adamw=bool(saved_adamw),
        )
    return loads


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

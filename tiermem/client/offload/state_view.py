"""``opt.state`` for ``OffloadAdam``: torch's per-param state mapping, read from the daemon on access.

``opt.state[p]`` is a read-only mapping with torch's keys (``step`` as a
float tensor, ``exp_avg``, ``exp_avg_sq``, plus ``master`` for low-precision
params); each value is fetched when it is read.  Iterating ``opt.state``
yields the params that have stepped, as torch's ``defaultdict`` holds only
those.  Writes are refused: state goes in through ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from tiermem.core.errors import InvalidState

if TYPE_CHECKING:
    from tiermem.client.offload.optimizer import OffloadAdam

__all__ = ["ParamState", "StateView"]


class ParamState(Mapping[str, Any]):
    def __init__(self, opt: OffloadAdam, index: int) -> None:
        self._opt = opt
        self._index = index

    def _keys(self) -> tuple[str, ...]:
        p = self._opt.tensors[self._index]
        return ("step", "exp_avg", "exp_avg_sq") + (("master",) if p.dtype != torch.float32 else ())

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys():
            raise KeyError(key)
        return self._opt._read_state(self._index, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __setitem__(self, key: str, value: Any) -> None:
        raise InvalidState("OffloadAdam's state lives in tiermemd and is read-only here; use load_state_dict()")


class StateView(Mapping[torch.Tensor, ParamState]):
    def __init__(self, opt: OffloadAdam) -> None:
        self._opt = opt

    def __getitem__(self, param: torch.Tensor) -> ParamState:
        index = self._opt._index_of(param)
        if index is None:
            raise KeyError(param)
        return ParamState(self._opt, index)

    def __contains__(self, param: object) -> bool:
        index = self._opt._index_of(param) if isinstance(param, torch.Tensor) else None
        return index is not None and self._opt._step_of(index) > 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        for index, p in enumerate(self._opt.tensors):
            if self._opt._step_of(index) > 0:
                yield p

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __setitem__(self, key: Any, value: Any) -> None:
        raise InvalidState("OffloadAdam's state lives in tiermemd and is read-only here; use load_state_dict()")

"""``opt.state`` for ``OffloadAdam``: torch's per-param state mapping, over the state the daemon holds.

``opt.state[p]`` is a mutable mapping with torch's keys (``step`` as a float
tensor, ``exp_avg``, ``exp_avg_sq``, plus ``master`` for low-precision
params).  Reading a value fetches it from the daemon: it is a copy, so moving
it (``.to(device)``) or keeping it changes nothing.  Assigning writes through:

- ``opt.state[p][key] = value`` writes that key (a moment, ``master``, or the
  ``step`` count); assigning back the very tensor a read returned, unchanged
  (``v[k] = v[k].to("cpu")``, as PyTorch Lightning does for every state when
  it moves an optimizer), sends nothing;
- ``opt.state[p] = {"step": ..., "exp_avg": ..., "exp_avg_sq": ...}`` writes
  each key given.

A read tensor changed in place is not written back until it is assigned.
Iterating ``opt.state`` yields the params that have stepped, as torch's
``defaultdict`` holds only those.  A frozen param (``requires_grad=False``,
not registered) has no state here: reading its keys raises ``KeyError`` and
writing is refused (``load_state_dict`` registers it when a checkpoint holds
state for it).  ``del opt.state[p]`` is refused: state is reset through
``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import torch

from tiermem.core.errors import InvalidArgument, InvalidState

if TYPE_CHECKING:
    from tiermem.client.offload.optimizer import OffloadAdam

__all__ = ["ParamState", "StateView"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


class ParamState(MutableMapping[str, Any]):
    """One param's state: reads fetch from the daemon, writes go to it (see the module docstring)."""

    def __init__(self, opt: OffloadAdam, param: torch.Tensor) -> None:
        self._opt = opt
        self._param = param
        self._given: dict[str, tuple[torch.Tensor, int]] = {}
        """The tensors reads returned, with their versions: assigning one back unchanged is a no-op."""

    def _tid(self) -> int | None:
        return self._opt._index_of(self._param)

    def _keys(self) -> tuple[str, ...]:
        if self._tid() is None:
            return ()
        return ("step", *_MOMENTS) + (("master",) if self._param.dtype != torch.float32 else ())

    def __getitem__(self, key: str) -> Any:
        tid = self._tid()
        if tid is None or key not in self._keys():
            raise KeyError(key)
        value = self._opt._read_state(tid, key)
        self._given[key] = (value, value._version)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __setitem__(self, key: str, value: Any) -> None:
        given = self._given.get(key)
        if given is not None and given[0]._version == given[1] and _same(value, given[0]):
            return  # the values the daemon holds, handed back (Lightning moving the state to a device)
        self._opt._write_state(self._writable(), {key: value})

    def __delitem__(self, key: str) -> None:
        raise InvalidState(
            f"OffloadAdam cannot delete state key {key!r}: the daemon holds every key of a param's state; "
            "assign new values, or load a state dict without this param's state to start it afresh"
        )

    def _writable(self) -> int:
        tid = self._tid()
        if tid is None:
            raise InvalidState(
                f"this param (shape {tuple(self._param.shape)}) is frozen (requires_grad=False) and holds no state "
                "in OffloadAdam; its state starts when it gets a grad, or load a state dict that holds it"
            )
        return tid


def _same(value: Any, read: torch.Tensor) -> bool:
    """Whether ``value`` is a read's tensor or a copy of it (e.g. moved to another device)."""
    if value is read:
        return True
    if not isinstance(value, torch.Tensor) or value.shape != read.shape or value.dtype != read.dtype:
        return False
    return bool(torch.equal(value.detach().to("cpu"), read))


class StateView(MutableMapping[torch.Tensor, ParamState]):
    """``opt.state``: the params of the groups to their ``ParamState`` (see the module docstring)."""

    def __init__(self, opt: OffloadAdam) -> None:
        self._opt = opt

    def __getitem__(self, param: torch.Tensor) -> ParamState:
        if not isinstance(param, torch.Tensor) or not self._opt._in_groups(param):
            raise KeyError(param)
        return ParamState(self._opt, param)

    def __contains__(self, param: object) -> bool:
        index = self._opt._index_of(param) if isinstance(param, torch.Tensor) else None
        return index is not None and self._opt._step_of(index) > 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        counts = self._opt.step_counts()
        return iter([p for index, p in enumerate(self._opt.tensors) if counts[index] > 0])

    def __len__(self) -> int:
        return sum(1 for count in self._opt.step_counts() if count > 0)

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        if not hasattr(value, "items"):
            raise InvalidArgument(
                f"opt.state[p] takes a dict of AdamW state (step, exp_avg, exp_avg_sq), got {value!r}"
            )
        state = self[param]
        if isinstance(value, ParamState) and value._param is param:
            return  # its own state, assigned back
        self._opt._write_state(state._writable(), dict(value.items()))

    def __delitem__(self, param: torch.Tensor) -> None:
        raise InvalidState(
            "OffloadAdam cannot delete a param's state from opt.state; load a state dict without it "
            "(load_state_dict) to start that param afresh"
        )

"""What leaves an ``OffloadAdam``: its state dicts, reads of one tensor's state (``opt.state[p]``), and the
refusal to be copied; a part of ``OffloadAdam`` (a mixin over its records, transfer and step).

``state_dict()`` is ``torch.optim.AdamW``'s format (plus ``master`` for
low-precision params), read from the daemon in one pipelined transfer;
``load_state_dict()`` takes that format from ``OffloadAdam``, ``Adam`` or
``AdamW``, checks all of it before anything changes, resets the params it has
no state for (as torch does) and never writes the model's params, so the
order of ``model.load_state_dict`` and ``opt.load_state_dict`` does not
matter.  The optimizer holds a connection and its state lives in the daemon,
so ``copy.deepcopy`` and ``pickle`` raise, naming ``state_dict()``; ``copy.copy`` shares the
optimizer's one handle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tiermem.client.offload.transfer import (
    PushItem,
    StateTransfer,
    adopt_saved_groups,
    hooked_load,
    hooked_state_dict,
    packed_groups,
    plan_load,
)
from tiermem.core.errors import InvalidArgument, InvalidState
from tiermem.core.uncopyable import Uncopyable

if TYPE_CHECKING:
    from tiermem.client.link import Client
    from tiermem.client.offload.feeds import Feed
    from tiermem.client.offload.policy import StepPolicy
    from tiermem.client.offload.reentry import Calls

__all__ = ["OptimizerState"]

_COPY_ERROR = (
    "OffloadAdam holds a connection to tiermemd and its state lives there; it cannot be copied or pickled. "
    "Save opt.state_dict() (torch.save works on it) and load it into a new OffloadAdam"
)


class OptimizerState(Uncopyable):
    """``OffloadAdam``'s state dicts, state reads and copy guards; see the module docstring."""

    if TYPE_CHECKING:
        tensors: list[torch.nn.Parameter]
        frozen: list[torch.nn.Parameter]
        _index: dict[int, int]
        _open: Any
        policy: StepPolicy
        _steps_sent: int
        _step_lag: int
        feed: Feed
        param_groups: list[dict[str, Any]]
        state_keys: tuple[str, ...]
        transfer: StateTransfer

        @property
        def client(self) -> Client: ...
        _calls: Calls

        def _flush(self) -> None: ...
        def _settle(self) -> None: ...
        def _abort_open(self) -> None: ...
        def _new_step(self) -> None: ...
        def _reregister(
            self, window: int, *, fallback: int | None, carry_state: bool, include: set[int] | None = None
        ) -> bool: ...

    # ----------------------------------------------------------------- state

    def _require_open(self) -> None:
        """``InvalidState`` naming a closed optimizer, before a state access reaches its emptied window."""
        self.client  # noqa: B018  (the property raises for a closed optimizer)

    def _index_of(self, param: torch.Tensor) -> int | None:
        return self._index.get(id(param))

    def _step_of(self, index: int) -> int:
        with self._calls.enter("state[p]", reads=True):
            self._require_open()
            self._settle()
            return self.transfer.step_of(index)

    def _read_state(self, index: int, key: str) -> Any:
        with self._calls.enter("state[p]", reads=True):
            self._require_open()
            self._flush()
            p = self.tensors[index]
            if key == "step":
                return torch.tensor(float(self.transfer.step_of(index)))
            values, _ = self.transfer.pull(index, key, p.numel())
            return values.view(p.shape)

    def _in_groups(self, param: torch.Tensor) -> bool:
        return self._index_of(param) is not None or any(p is param for p in self.frozen)

    def _write_state(self, index: int, values: dict[str, Any]) -> None:
        """Write AdamW-format state keys of registered tensor ``index`` (``opt.state[p][key] = value``); a
        ``step`` alone sets the count (the moments written back with it)."""
        with self._calls.enter("state[p] = ...", reads=False):
            self._write_entry(index, values)

    def _write_entry(self, index: int, values: dict[str, Any]) -> None:
        self._require_open()
        self._flush()
        if self._open is not None:
            raise InvalidState("opt.state cannot be written during an overlapped backward; write it after step()")
        p = self.tensors[index]
        allowed = ("exp_avg", "exp_avg_sq") + (("master",) if p.dtype != torch.float32 else ())
        writes: dict[str, torch.Tensor] = {}
        for key, value in values.items():
            if key == "step":
                continue
            if key not in allowed:
                raise InvalidArgument(
                    f"OffloadAdam's state of a {p.dtype} param has keys step, {', '.join(allowed)}; got {key!r}"
                )
            if not isinstance(value, torch.Tensor) or value.numel() != p.numel():
                raise InvalidArgument(
                    f"state {key} of a param of shape {tuple(p.shape)} must be a tensor of {p.numel()} elements, "
                    f"got {tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
                )
            writes[key] = value.detach().to("cpu", torch.float32).reshape(-1)
        now = self.transfer.step_of(index)
        step = now if values.get("step") is None else int(float(values["step"]))
        if step != now and not {"exp_avg", "exp_avg_sq"} & writes.keys():
            writes["exp_avg"] = self.transfer.pull(index, "exp_avg", p.numel())[0]  # carries the new count
        self.transfer.push_many([(index, key, value, step, False) for key, value in writes.items()])

    def step_counts(self) -> list[int]:
        """Each tensor's Adam step count (0: no state, as in torch): zero-length reads, a request per
        ``MAX_SPANS`` tensors."""
        self._require_open()
        return self.transfer.pull_many_into([(i, "exp_avg", torch.empty(0)) for i in range(len(self.tensors))])

    def _flat_params(self) -> list[torch.nn.Parameter]:
        """Every param of the groups, in torch's state-dict order (frozen ones included)."""
        return [p for g in self.param_groups for p in g["params"]]

    def _state_entries(self) -> dict[int, dict[str, Any]]:
        """The state of each registered tensor that has stepped, by tensor id, in AdamW's format."""
        self._require_open()
        self._flush()
        # a param that never stepped has no state in torch: the step counts first (zero-length reads), then one
        # pipelined transfer of the state of those that have some, so no memory is taken for the others.  With
        # the overlapped update, a bucket's update may land between the two (the staged exchange announces
        # buckets from its own thread): every tensor is read then.
        counts = [1] * len(self.tensors) if self.policy.overlap_now else self.step_counts()
        keys = ("exp_avg", "exp_avg_sq", "master")
        reads: list[tuple[int, str, torch.Tensor]] = []
        for index, p in enumerate(self.tensors):
            if counts[index] == 0:
                continue
            for key in keys if p.dtype != torch.float32 else keys[:2]:
                reads.append((index, key, torch.empty(p.shape, dtype=torch.float32)))
        steps = self.transfer.pull_many_into(reads)
        state: dict[int, dict[str, Any]] = {}
        for (index, key, values), step in zip(reads, steps, strict=True):
            if step == 0:
                continue
            entry = state.setdefault(index, {"step": torch.tensor(float(step))})
            entry[key] = values
        attempt = self._open  # read after the state: any bucket updated in the state was announced before it
        if attempt is not None:
            self._params_of_open_step(state, attempt.step)
        return state

    def _params_of_open_step(self, state: dict[int, dict[str, Any]], open_step: int) -> None:
        """A read during an overlapped backward (a signal handler's checkpoint, a hook's): the buckets the
        daemon has updated so far are at the step being taken, each tensor's ``step`` says which, and their
        params come into the model now (the staged exchange's; the shared one's are updated in place), so
        the model saved beside this state is of the same step, tensor by tensor.  Those params are final
        for this backward (the overlap contract), and ``step()`` brings in the same values again."""
        ahead = [index for index, entry in state.items() if int(entry["step"]) == open_step]
        if ahead:
            self.feed.receive(ahead)

    def _state_by_param(self) -> dict[torch.nn.Parameter, dict[str, Any]]:
        return {self.tensors[t]: entry for t, entry in self._state_entries().items()}

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s format (plus ``master`` for low-precision params): the state keyed by each
        param's position in the groups, frozen params included, as torch numbers them; torch.optim's
        state-dict hooks run around it."""
        return hooked_state_dict(self, self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        with self._calls.enter("state_dict()", reads=True):
            by_param = self._state_by_param()
            state = {i: by_param[p] for i, p in enumerate(self._flat_params()) if p in by_param}
            return {"state": state, "param_groups": packed_groups(self.param_groups)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by ``OffloadAdam`` or ``torch.optim.Adam``/``AdamW``.

        Everything is checked before anything changes.  Params that have no state in it start afresh
        (step 0), as in torch; the model's params are not touched.  A frozen param with state in it joins
        the registration first (it holds state now, as it would in torch).  torch.optim's load hooks run
        around it."""
        hooked_load(self, state_dict, self._load_guarded)

    def _load_guarded(self, state_dict: dict[str, Any]) -> None:
        with self._calls.enter("load_state_dict()", reads=False):
            self._load_state_dict(state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        flat = self._flat_params()
        loads = plan_load(state_dict, self.param_groups, [p.numel() for p in flat])
        groups: list[dict[str, Any]] = state_dict["param_groups"]  # checked by plan_load
        # checked: now change things
        self._flush()
        self._abort_open()
        # steps counts as torch's state["step"] does: from the loaded step.  The daemon's STEP sequence goes on
        # from it when it is ahead (a resume, so a reattach finds the trainer's step), else it stays ahead
        loaded = max((step for _, _, step in loads), default=0)
        if loaded >= self._steps_sent:
            self._steps_sent, self._step_lag = loaded, 0
        else:
            self._step_lag = self._steps_sent - loaded
        self._new_step()
        adopt_saved_groups(self.param_groups, groups)
        holders = {id(flat[t]) for t, _, _ in loads}
        if any(id(p) in holders for p in self.frozen):
            self._reregister(self.client.window.numel(), fallback=None, carry_state=False, include=holders)
        self.client.reset_state()
        self.feed.send_params()  # the model is the truth
        self._load_entries({self._index[id(flat[t])]: entry for t, entry, _ in loads})

    def _load_entries(self, entries: dict[int, dict[str, Any]]) -> None:
        """Write AdamW-format state entries (with their ``step``) into the registered tensors of these ids."""
        keep_master = "master" in self.state_keys
        writes: list[PushItem] = []
        for t, entry in entries.items():
            step = int(float(entry["step"]))
            writes.append((t, "exp_avg", entry["exp_avg"], step, False))
            writes.append((t, "exp_avg_sq", entry["exp_avg_sq"], step, False))
            if keep_master and "master" in entry and self.tensors[t].dtype != torch.float32:
                writes.append((t, "master", entry["master"], step, False))
        self.transfer.push_many(writes)

    # ----------------------------------------------------------------- copying

    def __copy__(self) -> Any:
        """A shallow copy shares the one handle (``tiermem.client.offload.handle``), as a torch optimizer's
        shallow copy shares its state: closing or dropping it closes nothing the original uses."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def _not_copyable(self) -> TypeError:
        return TypeError(_COPY_ERROR)

    def __getstate__(self) -> Any:
        raise self._not_copyable()

"""Param paging's state dicts and meta-device initialization: a part of ``ParamPager`` (a mixin over its
records, residency and I/O thread).

``model.state_dict()`` gathers each paged param (a CPU copy: from the device
when it is there, else read from the daemon's master); ``load_state_dict()``
materializes one submodule's params in its pre-hook, lets torch check and copy
into them, and in its post-hook takes the loaded ones into their masters (a
master element that rounds to the loaded value is kept) and releases
them.  A model made on the meta device gets its values one
submodule at a time (``reset_parameters()``, then ``init``), each written
straight into the daemon, so the whole model is never in the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tiermem.client.offload.pagedparam import PagedParam, PagerRecords, Residency
from tiermem.core.errors import InvalidArgument, InvalidState

__all__ = ["PagedState"]


class PagedState(PagerRecords):
    units: dict[nn.Module, list[PagedParam]]
    _loading: dict[int, list[PagedParam]]

    if TYPE_CHECKING:

        def drain(self) -> None: ...
        def _submit(self, what: str, fn: Callable[..., Any], *args: Any) -> Future[Any]: ...
        def _materialize(self, group: list[PagedParam], *, event: str) -> None: ...
        def _settle(self, e: PagedParam) -> None: ...
        def _release(self, e: PagedParam) -> None: ...
        def _check_untouched(self, entries: Iterable[PagedParam]) -> None: ...
        def _buffer_for(self, e: PagedParam) -> torch.Tensor: ...

    def _push_master(self, group: list[PagedParam], *, adopt: bool = False) -> None:
        """Write the device values of ``group`` as their masters in the daemon (``adopt``: loaded values, taken
        where they differ from the master at the param's precision, ``ParamCopies.adopt_master``)."""
        write = self.copies.adopt_master if adopt else self.copies.write_master
        futures = []
        for e in group:
            if e.data is None:  # pragma: no cover - callers materialize first
                raise InvalidState(f"{e.describe()} is not on the device")
            futures.append(self._submit(f"master {e.name}", write, self.transfer, e.index, e.data))
        for future in futures:
            future.result()

    def _lease_quietly(self, group: list[PagedParam]) -> None:
        """Materialize and lease ``group`` outside forward (not a use of the trace)."""
        self._materialize(group, event="fetch")
        for e in group:
            e.leases += 1

    def _unlease_quietly(self, group: list[PagedParam]) -> None:
        for e in group:
            e.leases -= 1
            self._settle(e)

    def gather(self, e: PagedParam) -> torch.Tensor:
        """A CPU copy of ``e``'s current value (from the device when it is there, else from the daemon)."""
        self.drain()
        if e.data is not None and e.residency is Residency.RESIDENT:
            return e.data.detach().to("cpu", copy=True)
        self._check_untouched([e])
        out = torch.empty(e.shape, dtype=e.dtype)
        # read here, not on the I/O thread (``drain`` waited for what was queued there, or, from a signal handler
        # holding the connection, left what changes no master): a handler's gather may have interrupted this
        # thread inside the executor's ``submit``, under a lock that a second ``submit`` waits for for good
        self.copies.read_master(self.transfer, e.index, out)
        return out

    def _saving_state(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """Before ``module``'s params go into a state dict (as ``p.detach()``): ``_gather_state`` puts their
        values in after, so a save in the middle of a forward (a signal handler's) leases none of them to the
        running module (``CatchParams``), whose budget they would not fit."""
        self._saving.add(id(module))

    def _gather_state(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        self._saving.discard(id(module))
        for name, p in module._parameters.items():
            e = self._by_param.get(id(p)) if p is not None else None
            if p is not None and e is not None and prefix + name in state_dict:
                kept = self.kept(p) if self.kept is not None else None
                state_dict[prefix + name] = kept if kept is not None else self.gather(e)

    def _load_pre(self, module: nn.Module, state_dict: Any, prefix: str, local_metadata: Any, *rest: Any) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            raise InvalidArgument(
                "load_state_dict(assign=True) would replace paged params with the loaded tensors; "
                "load with assign=False (the values are written to tiermemd)"
            )
        own = self.units.get(module, [])
        loaded = [self._by_param[id(p)] for name, p in module._parameters.items() if prefix + name in state_dict]
        self.drain()
        self._lease_quietly(own)
        self._loading[id(module)] = list({id(e): e for e in loaded}.values())

    def _load_post(self, module: nn.Module, incompatible_keys: Any) -> None:
        loaded = self._loading.pop(id(module), None)
        if loaded is None:
            return
        own = self.units.get(module, [])
        self._push_master(loaded, adopt=True)
        self._unlease_quietly(own)

    def _initialize(self, init: Callable[[nn.Module], None] | None) -> None:
        """Give params made on the meta device their values, one submodule at a time, straight into the daemon."""
        done: set[int] = set()
        for module, own in self.units.items():
            fresh = [e for e in own if e.index not in done]
            if not fresh:
                continue
            reset = getattr(module, "reset_parameters", None)
            if init is None and not callable(reset):
                raise InvalidArgument(
                    f"{fresh[0].describe()} was made on the meta device and its module {type(module).__name__} "
                    "has no reset_parameters(); give offload_params an init function that sets its values"
                )
            old = [e for e in own if e.index in done]
            self._materialize(old, event="fetch")
            for e in fresh:
                data = self._buffer_for(e)
                e.move(Residency.FETCHING)
                e.move(Residency.RESIDENT)
                self._present[e.index] = e
                self.nbytes += e.nbytes
                with torch.no_grad():
                    e.param.data = data
            self.peak_nbytes = max(self.peak_nbytes, self.nbytes)
            with torch.no_grad():
                if callable(reset):
                    reset()
                if init is not None:
                    init(module)
            self._push_master(own)
            done.update(e.index for e in fresh)
            for e in own:
                self._release(e)

"""Param paging (ZeRO-3 / ZeRO-Infinity): a model's params live in tiermemd and visit the device a submodule at a time.

API::

    opt = tiermem.OffloadAdam(model.parameters(), lr=3e-4, offload="nvme", exchange="staged")
    pager = tiermem.offload_params(model, opt, device_budget="4GiB", prefetch=2)
    for x, y in data:
        model(x, y).backward(); opt.step(); opt.zero_grad()

Why a function of (model, optimizer) and not an ``OffloadAdam`` option: an
optimizer sees params, never modules, and paging needs the module tree (hooks
on the submodules that own params, ``state_dict`` keys); the optimizer stays
``torch.optim``'s API, and the pager becomes its grad feed.  The tier is the
optimizer's ``offload``: the params are the daemon's state of the staged
exchange (a fetch reads the ``param`` key, a load writes ``master``), so they
live where the rest of the rank's state lives, the pool or NVMe; on NVMe in
their own dtype and apart from the moments and grads, so a fetch reads only
the param's bytes (``tiermemd.state``).  A submodule's params are fetched in
one transfer, and its grads in one once all of them have landed (they share
the staging window's slots).

What the model holds: each param's data is a placeholder (one NaN element
expanded to the param's shape, so shapes and ``numel`` stay true and a stray
read gives NaN, a stray write an error); ``materialized`` bytes are the
params' real data on the device, kept at most ``device_budget`` (checked on
every fetch; ``peak_nbytes`` is the measured peak).  Grads go to the daemon's
``grad`` key as they land (``p.grad`` is None after backward, as with
``release_grads=True``); grads waiting for the I/O thread are bounded by the
same budget, separately (``peak_grad_nbytes``).

When params are on the device:

- forward: a pre-hook on each submodule owning params leases them (a fetch
  through the staging window, or one already prefetched), a post-hook
  releases them; params used outside the submodule that owns them (a tied
  output projection, a root module's own params, ``F.linear(x,
  self.wte.weight)``) are caught by a ``TorchFunctionMode`` active during
  forward and leased to the innermost running module;
- saved tensors: autograd would keep the params (views of them) alive until
  backward, so a ``saved_tensors_hooks`` pair packs a saved param view as a
  reference and unpacks it by fetching the param again.  Backward therefore
  re-fetches exactly the params its nodes need, when they run, a
  submodule's saved params in one fetch (a first layer, whose input needs
  no grad, is not fetched again: as in the seed's pipeline, layer m's
  backward needs layer m+1's weights), and holds each until its grad has
  landed or the backward pass ends;
- ``torch.utils.checkpoint``: the recomputation runs the forward hooks
  again, inside backward, so its params are fetched then and held until
  their grads land (the checkpoint keeps its recomputed tensors, views of
  them, meanwhile): the budget must hold one checkpointed segment's params;
- prefetch: the first step records the order of uses (``FetchTrace``); later
  steps fetch the next ``prefetch`` uses ahead on the I/O thread while the
  trainer computes, and keep a released param that is about to be used
  again, within the budget.

Every transfer runs on the pager's one I/O thread, in the order the
trainer's thread submitted them; the trainer's thread only waits.  That
order is fixed by the model, never by timing: a fetch is submitted when a use
needs it or a recorded use ahead is prefetched, a submodule's grads when the
last of them lands (``GradUnits``), those a backward pass left incomplete at
its end, in module order; so ZeRO-3's collectives (which run inside these
transfers) come in the same order on every rank.  ``step()`` and every other
optimizer call first wait for the I/O thread (``drain``), so the connection
is never used by two threads at once.
All materialized params are dropped at ``step()`` (the update changes them);
nothing is cached across steps.

``model.state_dict()`` gathers each paged param from the daemon (a CPU copy,
torch's keys); ``model.load_state_dict()`` materializes one submodule's
params, lets torch copy into them, and writes the loaded ones back as their
master.  A model made on the ``meta`` device is initialized one submodule at
a time (``reset_parameters()``, then ``init(module)``) straight into the
daemon, so no full copy of the model exists in the trainer at any time.

Not supported: in-place edits of params outside ``load_state_dict`` (they
are dropped when the param is released), the overlapped and delayed
updates, a ``GradScaler``.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tiermem.client.offload.copies import GradItem, ParamCopies, copies_for
from tiermem.client.offload.feeds import hook_grads, remove_hooks
from tiermem.client.offload.pagedparam import BufferCache, GradUnits, PagedParam, Residency, SavedParam
from tiermem.client.offload.pagestate import PagedState
from tiermem.client.offload.trace import FetchTrace
from tiermem.client.offload.transfer import staged_dtype
from tiermem.core.errors import DTypeError, InvalidArgument, InvalidState
from tiermem.core.modes import Exchange, StepMode
from tiermem.core.units import MiB, format_size, parse_size

if TYPE_CHECKING:
    from tiermem.client.offload.optimizer import OffloadAdam

__all__ = ["PagedParam", "ParamPager", "Probe", "Residency", "offload_params"]

log = logging.getLogger(__name__)

AUTO_WINDOW_MAX = 64 * MiB
"""The largest staging window ``offload_params`` grows an optimizer's to by itself: the 2B-param demo GPT's
paged step met its disk bound with it (0.98x, 1,017 requests a step; its largest submodule, 105 MiB staged as
fp32, takes a few).  A window is memory the daemon keeps locked, so the growth stays bounded."""
LOG_EVENTS = 100_000
"""Events kept in ``ParamPager.events`` (the oldest are dropped)."""


class Probe(Protocol):
    """A declared point where a caller watches the pager's schedule, or slows it down (the schedule-fuzzing
    tests inject random delays through one), called at each ``point``:

    - ``fetch``: the trainer's thread is about to submit a fetch (``what``: the params' names);
    - ``grad``: a grad landed in its hook (``what``: the param's name);
    - ``io``: the I/O thread is about to run a transfer (``what``: ``fetch`` or ``push``, and the params);
    - ``collective``: a collective is about to be issued (``tiermem.distributed``: its kind and submodule)."""

    def at(self, point: str, what: str) -> None: ...


def _probed(probe: Probe, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """I/O thread: ``fn(*args)`` after the probe's ``io`` point."""
    probe.at("io", what)
    return fn(*args)


class _CatchParams(TorchFunctionMode):
    """During forward: a paged param used by a torch function while absent is leased to the running module."""

    def __init__(self, pager: ParamPager) -> None:
        super().__init__()
        self.pager = pager

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        pager = self.pager
        wanted = [e for e in map(pager._absent_entry, _flat(args, kwargs)) if e is not None]
        if wanted:
            pager._use(_dedup(wanted), lease=True)
        return func(*args, **kwargs)


def _flat(args: Any, kwargs: dict[str, Any]) -> Iterable[Any]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, list | tuple):
            yield from a
        else:
            yield a


def _dedup(entries: Iterable[PagedParam]) -> list[PagedParam]:
    return list({id(e): e for e in entries}.values())


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() >= 0)


@dataclass
class _Frame:
    """A running forward of one hooked module: what it leased."""

    module: nn.Module
    leased: list[PagedParam] = field(default_factory=list)
    contexts: list[Any] = field(default_factory=list)


def _placeholder(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What the model holds of an absent param: one NaN element expanded to its shape."""
    return torch.full((), float("nan"), dtype=p.dtype, device=device).expand(p.shape)


def _check_optimizer(model: nn.Module, optimizer: OffloadAdam) -> None:
    """``offload_params``' refusals of a model or an optimizer it cannot page."""
    from tiermem.client.offload.optimizer import OffloadAdam

    if not isinstance(model, nn.Module):
        raise InvalidArgument(f"offload_params pages an nn.Module's params, got {type(model).__name__}")
    if not isinstance(optimizer, OffloadAdam):
        raise InvalidArgument(f"offload_params needs the model's OffloadAdam, got {type(optimizer).__name__}")
    if optimizer.paged:
        raise InvalidState("this optimizer's params are already paged (offload_params was called on it)")
    if optimizer.exchange is not Exchange.STAGED:
        raise InvalidArgument(
            "offload_params needs an OffloadAdam made with exchange='staged' (the daemon keeps each param as "
            f"its master state key); this one uses exchange={optimizer.exchange.value!r}"
        )
    if optimizer.policy.mode is not StepMode.SYNC:
        raise InvalidArgument(
            f"offload_params needs the synchronous step; this OffloadAdam uses {optimizer.policy.mode.value} "
            "(overlap_update and delayed_update need the params resident)"
        )


def _check_budget(device_budget: int | str, prefetch: int) -> int:
    """``device_budget`` in bytes, checked with ``prefetch``."""
    try:
        budget = parse_size(device_budget)
    except ValueError as exc:
        raise InvalidArgument(f"device_budget: {exc}") from None
    if budget <= 0:
        raise InvalidArgument(f"device_budget must be > 0, got {device_budget!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise InvalidArgument(f"prefetch must be an int >= 0 (uses fetched ahead), got {prefetch!r}")
    return budget


def _paged_tensors(
    model: nn.Module, optimizer: OffloadAdam, params: list[nn.Parameter] | None
) -> tuple[list[nn.Parameter], dict[int, str]]:
    """The params to page (tensor i: the optimizer's tensor i), and the model's names of its params by id:
    every param of the model, each in the optimizer."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = list(optimizer.tensors) if params is None else list(params)
    if len(tensors) != len(optimizer.tensors):
        raise InvalidArgument(f"{len(tensors)} params for an optimizer of {len(optimizer.tensors)} tensors")
    by_id = {id(p) for p in tensors}
    for p_id, name in names.items():
        if p_id not in by_id:
            raise InvalidArgument(f"param {name!r} of the model is not in the optimizer; give it every param")
    for i, p in enumerate(tensors):
        if id(p) not in names:
            raise InvalidArgument(f"optimizer param {i} (shape {tuple(p.shape)}) is not in the model")
    return tensors, names


class ParamPager(PagedState):
    """Pages a model's params through tiermemd; also ``OffloadAdam``'s grad feed.  See the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: OffloadAdam,
        *,
        device_budget: int | str,
        prefetch: int = 2,
        init: Callable[[nn.Module], None] | None = None,
        params: list[nn.Parameter] | None = None,
        copies: ParamCopies | None = None,
        probe: Probe | None = None,
    ) -> None:
        """``params`` and ``copies`` are for a pager whose optimizer's tensors are not the model's params
        (``tiermem.distributed.ShardedPagedAdam``: tensor i is this rank's shard of ``params[i]``, and
        ``copies`` gathers and reduce-scatters); by default tensor i is the optimizer's param i.  ``probe``:
        told of each fetch, grad and transfer (``Probe``)."""
        _check_optimizer(model, optimizer)
        budget = _check_budget(device_budget, prefetch)
        tensors, names = _paged_tensors(model, optimizer, params)
        devices = {p.device for p in tensors if p.device.type != "meta"}
        if len(devices) > 1:
            raise InvalidArgument(f"paged params must share one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.budget = budget
        self.prefetch = prefetch
        self.probe = probe
        self.model = model
        self.optimizer = optimizer
        self.transfer = optimizer.transfer
        self.copies: ParamCopies = copies_for(self.device) if copies is None else copies
        fresh = [p for p in tensors if p.is_meta]
        device = self.device
        self.entries = [
            PagedParam(i, p, names[id(p)], p.shape, p.dtype, _placeholder(p, device)) for i, p in enumerate(tensors)
        ]
        self._by_param = {id(e.param): e for e in self.entries}
        self.units = self._units(model)
        self._fit_largest_unit()
        # the feed interface OffloadAdam uses
        self.accumulated = False
        self.changed_after_landing = False
        self.buffer = 0
        self.trace = FetchTrace()
        self.events: collections.deque[tuple[str, str]] = collections.deque(maxlen=LOG_EVENTS)
        """``(event, param name)``: fetch (needed now, absent), prefetch, release, grad."""
        self.nbytes = 0
        """Bytes of params on the device or being fetched into it."""
        self.peak_nbytes = 0
        self.grad_nbytes = 0
        self.peak_grad_nbytes = 0
        self.counters = collections.Counter[str]()
        self._requests_at_reset = self.transfer.requests
        self._crossed_at_reset = self.transfer.crossed.snapshot()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="tiermem-pager")
        self._pushes: collections.deque[tuple[Future[None], int]] = collections.deque()
        self._grad_units: GradUnits[GradItem] = GradUnits(self.units.values())
        """Grads landed and not yet pushed: a submodule's go in one transfer, once all of them are in."""
        self._present: dict[int, PagedParam] = {}
        self._by_storage: dict[int, PagedParam] = {}
        self._upcoming: set[int] = set()
        self._frames: list[_Frame] = []
        self._tasks: set[int] = set()
        self._loading: dict[int, list[PagedParam]] = {}
        self._buffers = BufferCache()
        self._hooks: list[Any] = []
        self._mode = _CatchParams(self)
        # the optimizer's own feed sends the edits made since registration and steps aside (before any data
        # is dropped); from here on this pager is its feed
        optimizer.use_feed(self, send_edits=not fresh)
        for e in self.entries:
            self._drop_data(e)
        if fresh:
            self._initialize(init)
        self._install_hooks(model)

    # ----------------------------------------------------------------- structure

    def _units(self, model: nn.Module) -> dict[nn.Module, list[PagedParam]]:
        """The submodules that own paged params (their own, not their children's), in module order."""
        units: dict[nn.Module, list[PagedParam]] = {}
        for module in model.modules():
            own = [self._by_param[id(p)] for p in module._parameters.values() if p is not None]
            if own:
                units[module] = _dedup(own)
        return units

    def _fit_largest_unit(self) -> None:
        """Refuse a budget smaller than the largest submodule's params; grow the window for them."""
        largest = max(self.units.items(), key=lambda kv: sum(e.nbytes for e in kv[1]), default=None)
        if largest is None:
            return
        module, own = largest
        if sum(e.nbytes for e in own) > self.budget:
            raise InvalidArgument(
                f"device_budget {format_size(self.budget)} is smaller than the params of one submodule "
                f"({type(module).__name__} with {', '.join(e.name for e in own)}: "
                f"{format_size(sum(e.nbytes for e in own))}); raise it or split that module"
            )
        self._fit_window(module, sum(e.shape.numel() * staged_dtype(e.dtype).itemsize for e in own))
        self.transfer = self.optimizer.transfer  # a grown window came with a new registration

    def _install_hooks(self, model: nn.Module) -> None:
        hooked = dict(self.units)
        hooked.setdefault(model, [])
        for module, own in hooked.items():
            self._hooks.append(module.register_forward_pre_hook(functools.partial(self._enter, own)))
            self._hooks.append(module.register_forward_hook(functools.partial(self._exit, own), always_call=True))
            if own:
                self._hooks.append(module.register_state_dict_post_hook(functools.partial(self._gather_state)))
                self._hooks.append(module.register_load_state_dict_pre_hook(functools.partial(self._load_pre)))
                self._hooks.append(module.register_load_state_dict_post_hook(functools.partial(self._load_post)))
        self._hooks += hook_grads((e.param for e in self.entries), self._grad_ready)

    def unhook(self) -> None:
        """Remove every hook (``OffloadAdam.close``); the model keeps its placeholders."""
        remove_hooks(self._hooks)
        self._io.shutdown(wait=True)

    def hook(self) -> None:
        """The hooks are installed when the pager is made."""

    # ----------------------------------------------------------------- forward hooks

    def _enter(self, own: list[PagedParam], module: nn.Module, args: Any) -> None:
        frame = _Frame(module)
        if not self._frames:
            self._mode.__enter__()
            frame.contexts.append(self._mode)
            if torch.is_grad_enabled() and not _in_backward():
                saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                saved.__enter__()
                frame.contexts.append(saved)
        self._frames.append(frame)
        if own:
            self._use(own, lease=True)

    def _exit(self, own: list[PagedParam], module: nn.Module, args: Any, output: Any) -> None:
        if not self._frames or self._frames[-1].module is not module:
            return  # a pre-hook that raised before its frame was pushed
        frame = self._frames.pop()
        for e in frame.leased:
            self._unlease(e)
        for ctx in reversed(frame.contexts):
            ctx.__exit__(None, None, None)

    # ----------------------------------------------------------------- saved tensors

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._by_storage or type(t) not in (torch.Tensor, nn.Parameter):
            return t
        e = self._by_storage.get(t.untyped_storage().data_ptr())
        if e is None:
            return t
        e.saved = True
        return SavedParam(e, t.size(), t.stride(), int(t.storage_offset()))

    def _unpack(self, saved: Any) -> Any:
        """A saved param is used again: in backward, with the other params of its submodule saved for it, in
        one fetch (one all-gather at ZeRO-3), held until their grads land."""
        if not isinstance(saved, SavedParam):
            return saved
        e = saved.entry
        if _in_backward():
            self._use([x for x in self._grad_units.owner(e) if x is e or x.saved], lease=False, hold=True)
        else:
            self._use([e], lease=False)
        if e.data is None:  # pragma: no cover - _use makes it resident
            raise InvalidState(f"{e.describe()} is not on the device after its fetch")
        return e.data.as_strided(saved.size, saved.stride, saved.offset)

    # ----------------------------------------------------------------- uses, leases, holds

    def _absent_entry(self, value: Any) -> PagedParam | None:
        if not isinstance(value, nn.Parameter):
            return None
        e = self._by_param.get(id(value))
        if e is None or e.residency is Residency.RESIDENT:
            return None
        return e

    def _use(self, group: list[PagedParam], *, lease: bool, hold: bool = False) -> None:
        """A use of ``group``: on the device when this returns; leased to the running module or held by
        the running backward; then the next recorded uses are prefetched."""
        self.trace.use(tuple(e.index for e in group))
        self._materialize(group, event="fetch")
        if lease:
            frame = self._frames[-1]
            for e in group:
                e.leases += 1
                frame.leased.append(e)
        if hold:
            task = self._watch_backward()
            for e in group:
                e.hold_task = task
        self._look_ahead()

    def _unlease(self, e: PagedParam) -> None:
        e.leases -= 1
        if e.leases > 0:
            return
        if _in_backward() and torch.is_grad_enabled() and e.param.requires_grad:
            # a recomputation (checkpoint) inside backward: its saved tensors keep the param until its grad lands
            e.hold_task = self._watch_backward()
            return
        self._settle(e)

    def _settle(self, e: PagedParam) -> None:
        """Nobody needs ``e`` now: keep it for an upcoming use, else drop it."""
        if e.idle and e.index not in self._upcoming:
            self._release(e)

    def _watch_backward(self) -> int:
        """The running backward pass (its graph task), which calls ``_backward_done`` when it ends."""
        task = int(torch._C._current_graph_task_id())
        if task not in self._tasks:
            self._tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._backward_done, task))
        return task

    def _backward_done(self, task: int) -> None:
        """A backward pass ended: the grads of submodules it left incomplete go (in module order), and the
        params it held are settled."""
        self._tasks.discard(task)
        self._push_rest()
        for e in list(self._present.values()):
            if e.hold_task == task:
                e.hold_task = -1
                self._settle(e)

    def _look_ahead(self) -> None:
        upcoming = self.trace.upcoming(self.prefetch)
        self._upcoming = {i for g in upcoming for i in g}
        for e in list(self._present.values()):
            self._settle(e)
        for g in upcoming:  # each use whole or not at all: one fetch (one collective) per use
            wanted = [self.entries[i] for i in dict.fromkeys(g) if self.entries[i].residency is Residency.ABSENT]
            if sum(e.nbytes for e in wanted) > self.budget - self.nbytes:
                return
            self._start_fetches(wanted, event="prefetch")

    def _fit_window(self, module: nn.Module, staged_nbytes: int) -> None:
        """Grow the optimizer's staging window to two slots of the largest submodule's params as staged
        (``staged_nbytes``: 2 bytes an element in bf16/fp16, 4 in fp32), so that a submodule's fetch or grad
        push is about one request; say so where it cannot grow.

        A transfer costs a request per window slot filled, and each request about a millisecond here: with
        the default 2 MiB window a 2B-param step sent 23,055 requests and waited 31 s of its 60 for fetches;
        with 64 MiB, 1,017 requests and 13 s (``benchmarks/README.md``, bench_scale).  Where the user left
        its size to the daemon, the window grows (a new registration before the first step:
        ``OffloadAdam.grow_window``), to at most ``AUTO_WINDOW_MAX`` and at most half of the daemon's free
        window budget (``_window_share``); where it stays smaller than that cap (a size the user chose, a
        budget too small, or a size the daemon refuses), a warning names the size to pass."""
        optimizer = self.optimizer
        window = optimizer.client.window.numel()
        want = -(-2 * staged_nbytes // MiB) * MiB
        cap = min(want, AUTO_WINDOW_MAX)
        if window >= cap:
            return
        goal = min(cap, self._window_share(window))
        if window < goal and optimizer.grow_window(goal):
            log.info(
                "staging window grown from %s to %s for the largest submodule's params (%s, %s as staged)",
                format_size(window),
                format_size(goal),
                type(module).__name__,
                format_size(staged_nbytes),
            )
            window = goal
        if window >= cap:
            return
        if window >= goal:
            log.warning(
                "the staging window is %s, not %s: a paged job takes at most half of the daemon's free window "
                "budget (raise jobs.window_budget, or pass OffloadAdam(..., window_nbytes=%d))",
                format_size(window),
                format_size(cap),
                cap,
            )
            return
        log.warning(
            "the staging window (%s) is smaller than two slots of the largest submodule's params as staged "
            "(%s, %s): each of its fetches and grad pushes takes several requests; pass "
            "OffloadAdam(..., window_nbytes=%d) (%s; or raise the daemon's jobs.window_size) for about one "
            "request per submodule",
            format_size(window),
            type(module).__name__,
            format_size(staged_nbytes),
            want,
            format_size(want),
        )

    def _window_share(self, window: int) -> int:
        """The largest window this job may grow to: half of the daemon's free window budget, counting the
        window it holds now, in whole MiB, so that paged jobs never take the whole budget from jobs that
        attach later (each takes half of what is left)."""
        reply = self.optimizer.client.stats()
        budget = {b.resource: b for b in reply.node.budgets}.get("window")
        if budget is None:
            return window
        free = max(0, budget.capacity_nbytes - budget.held_nbytes) + window
        return max(window, free // 2 // MiB * MiB)

    # ----------------------------------------------------------------- residency

    def _submit(self, what: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """``fn(*args)`` on the I/O thread, after every transfer submitted before it."""
        if self.probe is None:
            return self._io.submit(fn, *args)
        return self._io.submit(_probed, self.probe, what, fn, *args)

    def _materialize(self, group: list[PagedParam], *, event: str) -> None:
        need = [e for e in group if e.residency is Residency.ABSENT]
        self._make_room(need, keep=group)
        self._start_fetches(need, event=event)
        for e in group:
            if e.residency is Residency.FETCHING:
                self._finish_fetch(e)

    def _make_room(self, need: list[PagedParam], keep: list[PagedParam]) -> None:
        nbytes = sum(e.nbytes for e in need)
        if self.nbytes + nbytes <= self.budget:
            return
        kept = {id(e) for e in keep}
        idle = [e for e in self._present.values() if e.idle and id(e) not in kept]
        idle.sort(key=lambda e: e.index in self._upcoming)  # the ones no upcoming use needs go first
        for e in idle:
            self._release(e)
            if self.nbytes + nbytes <= self.budget:
                return
        held = [e for e in self._present.values() if not e.idle]
        raise InvalidState(
            f"device_budget {format_size(self.budget)} cannot hold {', '.join(e.name for e in need)} "
            f"({format_size(nbytes)}) as well: "
            f"{format_size(self.nbytes)} are in use by {len(held)} params "
            f"({', '.join(e.name for e in held[:6])}{', ...' if len(held) > 6 else ''}); raise device_budget"
        )

    def _start_fetches(self, entries: list[PagedParam], *, event: str) -> None:
        """Fetch ``entries`` (a submodule's params) in one transfer: they share the window's slots."""
        if not entries:
            return
        items = [(e.index, self._buffer_for(e)) for e in entries]
        names = ", ".join(e.name for e in entries) if self.probe is not None else ""
        if self.probe is not None:
            self.probe.at("fetch", names)
        future = self._submit(f"fetch {names}", self.copies.fetch_many, self.transfer, items)
        for e in entries:
            e.fetch = future
            e.move(Residency.FETCHING)
            self._present[e.index] = e
            self.nbytes += e.nbytes
            self.peak_nbytes = max(self.peak_nbytes, self.nbytes)
            self.counters[f"{event}es"] += 1
            self.counters["fetched_nbytes"] += e.nbytes
            self.events.append((event, e.name))

    def _finish_fetch(self, e: PagedParam) -> None:
        future, e.fetch = e.fetch, None
        if future is None or e.data is None:  # pragma: no cover - FETCHING always has both
            raise InvalidState(f"{e.describe()} is fetching without a fetch")
        started = time.perf_counter()
        token = future.result()
        self.counters["fetch_wait_us"] += int((time.perf_counter() - started) * 1e6)
        self.copies.ready(token)
        e.move(Residency.RESIDENT)
        with torch.no_grad():
            e.param.data = e.data
        if e.data.numel():
            self._by_storage[e.data.untyped_storage().data_ptr()] = e

    def _buffer_for(self, e: PagedParam) -> torch.Tensor:
        """A device tensor for ``e`` (a reused buffer when one fits); the caller made room in the budget."""
        numel = e.shape.numel()
        buf = self._buffers.take(numel, e.dtype)
        if buf is None:
            while self.nbytes + self._buffers.nbytes + e.nbytes > self.budget and self._buffers.drop_oldest():
                pass
            buf = self.copies.empty(torch.Size([numel]), e.dtype)
            self.counters["buffers_allocated"] += 1
        e.buffer = buf
        e.data = buf.view(e.shape)
        return e.data

    def _release(self, e: PagedParam) -> None:
        if e.residency is Residency.FETCHING:
            self._finish_fetch(e)
        if e.data is not None and e.data.numel():
            self._by_storage.pop(e.data.untyped_storage().data_ptr(), None)
        self._drop_data(e)
        e.move(Residency.ABSENT)
        del self._present[e.index]
        self.nbytes -= e.nbytes
        self.events.append(("release", e.name))

    def _drop_data(self, e: PagedParam) -> None:
        e.data = None
        buf, e.buffer = e.buffer, None
        if e.param.is_meta:
            torch.utils.swap_tensors(e.param, nn.Parameter(e.placeholder, requires_grad=e.param.requires_grad))
        else:
            with torch.no_grad():
                e.param.data = e.placeholder
        if buf is not None:
            self._buffers.give(buf)

    def _release_all(self) -> None:
        for e in list(self._present.values()):
            if e.leases:
                raise InvalidState(f"{e.describe()} is in use by a running forward; call step() after backward")
            e.hold_task = -1
            self._release(e)
        self._upcoming.clear()

    # ----------------------------------------------------------------- grads

    def _grad_ready(self, param: torch.Tensor) -> None:
        e = self._by_param.get(id(param))
        grad = param.grad
        if e is None or grad is None:
            return
        param.grad = None
        self._land(e, grad)
        if e.hold_task >= 0:
            e.hold_task = -1
            self._settle(e)

    def _land(self, e: PagedParam, grad: torch.Tensor) -> None:
        if grad.is_sparse or grad.layout is not torch.strided:
            raise InvalidArgument(
                f"{e.describe()} got a sparse gradient; OffloadAdam, like torch.optim.AdamW, takes dense gradients"
            )
        if grad.dtype != e.dtype:
            raise DTypeError(f"{e.describe()} got a {grad.dtype} gradient; params and grads must share a dtype")
        if grad.shape != e.shape:
            raise InvalidArgument(f"{e.describe()} got a gradient of shape {tuple(grad.shape)}")
        accumulate = e.landed
        self.accumulated = self.accumulated or accumulate
        e.landed = True
        nbytes = grad.numel() * grad.element_size()
        self._reap(wait_over=self.budget - nbytes)
        if self.probe is not None:
            self.probe.at("grad", e.name)
        token = self.copies.grad_token(grad)
        self.grad_nbytes += nbytes
        self.peak_grad_nbytes = max(self.peak_grad_nbytes, self.grad_nbytes)
        self.counters["pushed_nbytes"] += nbytes
        self.events.append(("grad", e.name))
        for items in self._grad_units.land(e, (e.index, grad, accumulate, token)):
            self._push(items)
        if _in_backward():
            self._watch_backward()  # its end pushes what it left incomplete

    def _push(self, items: list[GradItem]) -> None:
        """One submodule's grads to the daemon, in one transfer (after every transfer submitted before)."""
        nbytes = sum(grad.numel() * grad.element_size() for _, grad, _, _ in items)
        names = ", ".join(self.entries[tid].name for tid, _, _, _ in items) if self.probe is not None else ""
        what = f"push {names}"
        self._pushes.append((self._submit(what, self.copies.push_many, self.transfer, items), nbytes))

    def _push_rest(self) -> None:
        for items in self._grad_units.rest():
            self._push(items)

    def _reap(self, *, wait_over: int | None) -> None:
        """Forget finished grad pushes; wait for the oldest while more than ``wait_over`` bytes wait (None:
        wait for all).  A failed push is raised here."""
        while self._pushes:
            future, nbytes = self._pushes[0]
            if not future.done():
                if wait_over is not None and self.grad_nbytes <= wait_over:
                    return
                started = time.perf_counter()
                future.result()
                self.counters["push_wait_us"] += int((time.perf_counter() - started) * 1e6)
            self._pushes.popleft()
            self.grad_nbytes -= nbytes
            future.result()

    # ----------------------------------------------------------------- the feed interface

    def drain(self) -> None:
        """Wait for every transfer of the I/O thread (before anything else uses the connection)."""
        self._reap(wait_over=None)
        for e in list(self._present.values()):
            if e.residency is Residency.FETCHING:
                self._finish_fetch(e)

    def check(self) -> list[int]:
        """At ``step()``: land grads set by hand, wait for every push, drop the params; the ids with a grad."""
        for e in self.entries:
            grad = e.param.grad
            if grad is not None:
                e.param.grad = None
                self._land(e, grad.detach())
        self._push_rest()
        self.drain()
        self._release_all()
        return [e.index for e in self.entries if e.landed]

    def reset(self) -> None:
        """A new step: nothing has landed; the trace is recorded once, then followed."""
        self.drain()
        self._release_all()
        for e in self.entries:
            e.landed = False
            e.saved = False
        self.accumulated = False
        self.trace.end_step()

    def zero(self, *, set_to_none: bool) -> None:
        """``zero_grad``: the grads landed in this step are dropped (``p.grad`` is None either way: the grads
        live in the daemon, whose next landing overwrites them)."""
        for e in self.entries:
            e.landed = False
            e.param.grad = None
        for items in self._grad_units.rest():  # grads not pushed yet are dropped with the others
            self.grad_nbytes -= sum(grad.numel() * grad.element_size() for _, grad, _, _ in items)
        self.accumulated = False

    # the rest of the Feed protocol (tiermem.client.offload.feeds)
    @property
    def releases_grads(self) -> bool:
        return True  # the grads go to the daemon as backward makes them; p.grad is None after it

    def retire(self, *, send_edits: bool) -> None:
        self.unhook()

    def send(self, ids: Sequence[int]) -> None:
        pass  # ``check`` pushed every grad; the params are the daemon's

    def receive(self, ids: Sequence[int]) -> None:
        pass  # nothing stays resident: the next forward fetches the updated params

    def send_params(self) -> None:
        pass  # the params live in the daemon; the model holds placeholders

    def new_step(self, buffer: int, *, early: bool) -> None:
        self.reset()
        self.buffer = buffer

    # ----------------------------------------------------------------- figures

    def stats(self) -> dict[str, float]:
        """Peak and current device bytes, bytes fetched and pushed, fetch counts, time spent waiting, and
        ``requests``: the state reads and writes sent to the daemon through the optimizer's transfer (one per
        staging-window slot filled; the pager's fetches and pushes, and any other use of that transfer), and
        what that transfer's copies moved through the window (``crossed_nbytes.<direction>.<key>`` and
        ``crossed_numel.<direction>.<key>``: ``to_device.param`` the params fetched, ``to_host.grad`` the grads
        pushed; 2 bytes an element for a bf16 model)."""
        out = {k: float(v) for k, v in self.counters.items()}
        out.update(
            requests=float(self.transfer.requests - self._requests_at_reset),
            device_budget=float(self.budget),
            nbytes=float(self.nbytes),
            peak_nbytes=float(self.peak_nbytes),
            peak_grad_nbytes=float(self.peak_grad_nbytes),
            trace_uses=float(len(self.trace.groups)),
            trace_missed=float(self.trace.missed),
        )
        crossed = self.transfer.crossed.since(self._crossed_at_reset)
        out.update({f"crossed_nbytes.{name}": float(n) for name, n in crossed.nbytes.items()})
        out.update({f"crossed_numel.{name}": float(n) for name, n in crossed.numel.items()})
        return out

    def reset_stats(self) -> None:
        self.counters.clear()
        self._requests_at_reset = self.transfer.requests
        self._crossed_at_reset = self.transfer.crossed.snapshot()
        self.peak_nbytes = self.nbytes
        self.peak_grad_nbytes = self.grad_nbytes
        self.events.clear()


def offload_params(
    model: nn.Module,
    optimizer: OffloadAdam,
    *,
    device_budget: int | str,
    prefetch: int = 2,
    init: Callable[[nn.Module], None] | None = None,
) -> ParamPager:
    """Page ``model``'s params through tiermemd (the tier of ``optimizer``, an ``OffloadAdam`` over every param
    of the model made with ``exchange="staged"``); see the module docstring.

    ``device_budget``: most bytes of params materialized at once (a size: "4GiB"), at least the params of
    the largest submodule.  ``prefetch``: uses fetched ahead of compute (0: none).  ``init``: for a model
    made on the meta device, called on each submodule owning params, after its ``reset_parameters()``.

    Before the first step, an optimizer whose staging window was left to the daemon is registered again
    with a window of two slots of the largest submodule's params as staged (2 bytes an element in bf16/fp16,
    4 in fp32; at most ``AUTO_WINDOW_MAX``), so that a submodule's fetch is about one request; see
    ``ParamPager._fit_window``.  Frozen params, which
    an ``OffloadAdam`` leaves unregistered, are registered first: the daemon holds every paged param."""
    optimizer.register_frozen()
    return ParamPager(model, optimizer, device_budget=device_budget, prefetch=prefetch, init=init)

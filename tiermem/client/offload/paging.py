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
  landed or the backward pass ends.  A frozen param (LoRA's base) gets no
  grad to end a hold, so it is not held: released once its node has its
  view, its buffer stays with the node (``BufferCache.give`` drops a viewed
  buffer rather than reuse it), so a backward through frozen layers keeps
  one node's frozen weights at a time (``PageUses._unpack``); a param
  frozen when the pager was made and trained later gets its grad hook at
  the next forward.  A trained param's grad lands once per backward, so in one loss
  over two forwards of the model (``(model(a) + model(b)).backward()``) a
  param is used by the second forward's nodes long before the first's: a
  hold whose node is done is given up when a fetch needs the room
  (``holds_given_up`` in the figures), and the param is fetched again for
  its next node; a buffer that a running node still views is dropped,
  never reused (``BufferCache.give``);
- ``torch.utils.checkpoint``: the recomputation runs the forward hooks
  again, inside backward, so its params are fetched then and held until
  their grads land (the checkpoint keeps its recomputed tensors, views of
  them, meanwhile): the budget must hold one checkpointed segment's params.
  A forward that starts inside a checkpointed function (submodules called
  without their parent) leaves saving to the checkpoint
  (``pagehooks.in_checkpoint_region``);
- ``torch.compile``: the hooks (and ``CatchParams``'s function) are marked
  for dynamo not to trace: they swap params' data and talk to the daemon, so a
  graph traced through them was built around placeholders.  They run as
  Python, between the compiled pieces of each submodule;
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
daemon, so no full copy of the model exists in the trainer at any time; its
buffers must have values already (a meta buffer is refused, naming it).

Not supported: edits of params outside ``load_state_dict``.  One made in a
forward is dropped when the param is released; one made to a paged-out
param (an ``nn.init`` function, ``p.data = t``, ``model.half()``) is refused
at its next use, a fetch or a state dict read, naming the param, and its
placeholder is put back (``PageIO._check_untouched``: its version counter
and data pointer, 0.2 us a param fetched).  The overlapped and delayed
updates and a ``GradScaler`` are not supported either.  ``copy.deepcopy(model)``
and ``torch.save(model)`` are refused (``pagehooks.ModelHook``: the copy would
hold placeholders), and the message says to copy ``model.state_dict()``.

Parts: ``ParamPager`` here (set-up, the window's size, the feed interface,
figures) is composed of ``pageuses.PageUses`` (the schedule of uses: hooks,
saved tensors, leases, holds, prefetch), ``pageio.PageIO`` (fetches, releases
and grad pushes on the I/O thread) and ``pagestate.PagedState`` (state dicts,
meta-device initialization); ``pageargs`` checks what ``offload_params``
takes, ``pagehooks`` holds the ``Probe`` point and the torch hooks' helpers,
``pagedparam`` the record of one paged param.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tiermem.client.offload.copies import GradItem, ParamCopies, copies_for
from tiermem.client.offload.feeds import hook_grads, remove_hooks
from tiermem.client.offload.pageargs import check_budget, check_buffers, check_optimizer, paged_tensors, placeholder
from tiermem.client.offload.pagedparam import BufferCache, GradUnits, PagedParam, Residency
from tiermem.client.offload.pagehooks import CatchParams, Frame, ModelHook, Probe, dedup
from tiermem.client.offload.pageio import PageIO
from tiermem.client.offload.pagestate import PagedState
from tiermem.client.offload.pageuses import PageUses
from tiermem.client.offload.trace import FetchTrace
from tiermem.client.offload.transfer import staged_dtype
from tiermem.core.errors import InvalidArgument
from tiermem.core.units import MiB, format_size

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


def _device_of(tensors: list[nn.Parameter], copies: ParamCopies | None) -> torch.device:
    """The one device of the paged params; for a model made on the meta device, where the copies materialize
    it (the host by default)."""
    devices = {p.device for p in tensors if p.device.type != "meta"}
    if len(devices) > 1:
        raise InvalidArgument(f"paged params must share one device, got {sorted(map(str, devices))}")
    return devices.pop() if devices else getattr(copies, "device", torch.device("cpu"))


class ParamPager(PageUses, PageIO, PagedState):
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
        owner: str = "offload_params",
    ) -> None:
        """``params`` and ``copies`` are for a pager whose optimizer's tensors are not the model's params
        (``tiermem.distributed.ShardedPagedAdam``: tensor i is this rank's shard of ``params[i]``, and
        ``copies`` gathers and reduce-scatters); by default tensor i is the optimizer's param i.  ``probe``:
        told of each fetch, grad and transfer (``Probe``).  ``owner``: what pages the model, as a refused
        copy of it says (``ModelHook``)."""
        check_optimizer(model, optimizer)
        budget = check_budget(device_budget, prefetch)
        tensors, names = paged_tensors(model, optimizer, params)
        self.device = _device_of(tensors, copies)
        self.budget = budget
        self.prefetch = prefetch
        self.probe = probe
        self.owner, self.sharded = owner, copies is not None  # sharded: ranks gather each param (``copies``)
        self.model = model
        self.optimizer = optimizer
        self.calls = optimizer._calls
        """The optimizer's calls (``reentry.Calls``): ``CatchParams`` reads it at every torch function."""
        self.transfer = optimizer.transfer
        self.copies: ParamCopies = copies_for(self.device) if copies is None else copies
        fresh = [p for p in tensors if p.is_meta]
        device = self.device
        self.entries = [
            PagedParam(i, p, names[id(p)], p.shape, p.dtype, placeholder(p, device)) for i, p in enumerate(tensors)
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
        self._saving: set[int] = set()
        self._finishing = 0
        """Calls under way that finish fetches (``_materialize``, ``drain``): a signal handler's ``drain`` in
        one of them leaves the fetches to it (``tiermem.client.offload.pageio``)."""
        self._by_storage: dict[int, PagedParam] = {}
        self._upcoming: set[int] = set()
        self._frames: list[Frame] = []
        self._tasks: set[int] = set()
        self._loading: dict[int, list[PagedParam]] = {}
        self._buffers = BufferCache()
        self._hooks: list[Any] = []
        self._mode = CatchParams(self)
        # the optimizer's own feed sends the edits made since registration and steps aside (before any data
        # is dropped); from here on this pager is its feed
        optimizer.use_feed(self, send_edits=not fresh)
        for e in self.entries:
            self._drop_data(e)
        if fresh:
            self._first_values(len(fresh), init)
        self._install_hooks(model)

    def _first_values(self, fresh: int, init: Callable[[nn.Module], None] | None) -> None:
        """Params made on the meta device (``fresh`` of them): an init for a new job; on a reattach the daemon
        holds their values (the trained ones), which a use fetches."""
        if self.optimizer.state_from == "new":
            self._initialize(init)
            return
        log.info(
            "%d param(s) made on the meta device take their values from tiermemd's state (%s), not from an init",
            fresh,
            self.optimizer.state_from,
        )

    # ----------------------------------------------------------------- structure

    def _units(self, model: nn.Module) -> dict[nn.Module, list[PagedParam]]:
        """The submodules that own paged params (their own, not their children's), in module order."""
        units: dict[nn.Module, list[PagedParam]] = {}
        for module in model.modules():
            own = [self._by_param[id(p)] for p in module._parameters.values() if p is not None]
            if own:
                units[module] = dedup(own)
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
            enter, leave = (
                ModelHook(functools.partial(fn, own), f"paged by {self.owner}", ranks=self.sharded)
                for fn in (self._enter, self._exit)
            )
            self._hooks.append(module.register_forward_pre_hook(enter))
            self._hooks.append(module.register_forward_hook(leave, always_call=True))
            if own:
                self._hooks.append(module.register_state_dict_pre_hook(functools.partial(self._saving_state)))
                self._hooks.append(module.register_state_dict_post_hook(functools.partial(self._gather_state)))
                self._hooks.append(module.register_load_state_dict_pre_hook(functools.partial(self._load_pre)))
                self._hooks.append(module.register_load_state_dict_post_hook(functools.partial(self._load_post)))
        self._hooks.append(_ForwardGuard(model, self._interrupted))
        self._on_grad = torch.compiler.disable(self._grad_ready)
        self._hooks += hook_grads((e.param for e in self.entries), self._on_grad)
        self._unhooked = [e for e in self.entries if not e.param.requires_grad]

    def unhook(self) -> None:
        """Remove every hook (``OffloadAdam.close``); the model keeps its placeholders."""
        remove_hooks(self._hooks)
        self._io.shutdown(wait=True)

    def hook(self) -> None:
        """The hooks are installed when the pager is made."""

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

    # ----------------------------------------------------------------- the feed interface

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


class _ForwardGuard:
    """The model's ``forward`` wrapped so that a ``BaseException`` that is not an ``Exception`` escaping it calls
    ``on_interrupt`` (see ``PageUses._interrupted``); removed like a hook (``remove()``), giving back the
    ``forward`` the model had, its class's or one set on it (accelerate's hooks set one)."""

    def __init__(self, model: nn.Module, on_interrupt: Callable[[], None]) -> None:
        self.model = model
        self.before = model.__dict__.get("forward")
        inner = model.forward

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            try:
                return inner(*args, **kwargs)
            except BaseException as exc:
                if not isinstance(exc, Exception):
                    on_interrupt()
                raise

        self.forward = forward
        model.forward = forward

    def remove(self) -> None:
        if self.model.__dict__.get("forward") is not self.forward:
            return  # wrapped again since: leave the newer wrapper's
        if self.before is None:
            del self.model.forward
        else:
            self.model.forward = self.before


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
    check_buffers(model, "offload_params")
    return ParamPager(model, optimizer, device_budget=device_budget, prefetch=prefetch, init=init)

"""``OffloadAdam``: a ``torch.optim.Optimizer`` whose Adam state lives in tiermemd, and whose step the daemon owns.

A thin facade over named parts:

- the link (``tiermem.client.link.Client``): attach, register, the staging window
  and the shared storage;
- the grad feed (``feed``): one record per tensor; the model's params and
  grads live in the daemon's shared storage, so the daemon updates the model
  in place and sees every in-place edit;
- the step policy (``policy``, pure): delayed or not, overlap or not, and
  the overlap contract;
- state transfer (``transfer``): ``state_dict`` / ``load_state_dict`` in
  ``torch.optim.AdamW``'s format, through the bounded staging window.

Semantics are ``torch.optim.AdamW``'s (``adamw=False``: ``torch.optim.Adam``'s):
the same defaults, argument checks and messages (``args``); params and grads
edited in place between steps are honoured; ``load_state_dict`` never touches
the model's params, so it may come before or after ``model.load_state_dict``;
params without state in a loaded checkpoint start afresh.

Step rules: ``tiermem.core.step_rules``, decided where the facts are.  A
``GradScaler`` overflow (its own check) skips the step: the STEP goes to the
daemon with ``skip`` and only the rank's skip count moves.  ``max_grad_norm``:
the daemon takes the grad statistics and clips (``clip_grad_norm_``; a
non-finite norm is applied as torch applies it).  A sharding strategy that has
the global statistics passes its ``StepDecision`` to ``step(decision=...)``.
The daemon owns the counts: ``steps`` (applied) and ``skipped_steps`` mirror
its replies, survive a reattach, and are what ``/metrics`` counts.  The last
step's global norm (when one was computed) is ``last_grad_norm``;
``last_found_inf`` says whether it found an inf/nan grad (the scaler or the
daemon), ``last_skipped`` whether it was skipped.

Interrupts: an interrupt while the daemon works on a step (Ctrl-C's
``KeyboardInterrupt``, or what a signal handler raises: ``SystemExit`` from
``sys.exit()``, a preemption error) leaves that step to finish there, and
``step()`` waits for its outcome before the interrupt reaches the trainer:
each step is applied fully or not at all, and a handler that saves on Ctrl-C
(or an ``except`` that reads ``steps`` to know which batch to redo) finds the
params and ``steps`` of one step.  A second Ctrl-C during that wait ends it; the next call then reads the
outcome (an interrupt there too leaves it to the call after), so the
optimizer stays usable however often it is interrupted.  An update that
fails part-way makes the daemon refuse the rank (``StepFailed``) until a
checkpoint is loaded.

Ranks of one job (``tiermem.distributed``) agree on a token before any of them attaches and pass
``create_job=True``: whichever attaches first creates the job with that token.

Restarts: a reattach (``token=``) is told the step the daemon's state is at;
with ``expected_step=N`` (the step the trainer has reached, e.g. from its own
checkpoint) a state older than N raises ``StaleStateError`` naming both
steps, unless ``rollback=True`` accepts it (``steps`` then says where
training resumes; ``state_from`` where the state came from).

Params are on the CPU (the shared exchange) or a GPU (the staged exchange, and
``exchange="staged"`` on the CPU), in one dtype (float32, float16 or
bfloat16).  The staging window is registered with CUDA when the params are on a GPU
(``pin_window=True``: also for host tensors whose copies go to a GPU, as a
sharding strategy's shards do).  ``add_param_group`` after construction registers the rank again
with every tensor (``_register_again``: the state goes through one
``state_dict``/``load_state_dict`` round trip).

Compressed state (``state_dtype``): ``"fp32"`` (the default) is exact AdamW;
``"bf16"`` keeps both moments in bfloat16 (8 bytes of state a param with the
fp32 master, against 12) and ``"int8"`` in block-wise 8-bit codes with one
fp32 scale a block of 256 (6.03 bytes a param), the scheme of 8-bit Adam
(``tiermem.core.lowbit`` says which and why).  The master stays fp32.  The
daemon's pool and swap hold the compressed bytes, so each step moves fewer;
``state_dict`` still exports AdamW's fp32 moments (dequantized) and
``load_state_dict`` quantizes them, so checkpoints load into
``torch.optim.AdamW`` and back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from tiermem.client.link import Client, connect
from tiermem.client.offload.args import (
    check_group_switches,
    check_group_values,
    check_hyper,
    check_torch_flags,
    closure_loss,
    optimizer_defaults,
    torch_switch_name,
)
from tiermem.client.offload.checkpoint import OptimizerState
from tiermem.client.offload.eager import eager_under_compile
from tiermem.client.offload.feeds import Feed
from tiermem.client.offload.handle import InHandle, OffloadHandle, weak_method
from tiermem.client.offload.options import OffloadOptions
from tiermem.client.offload.policy import StepPolicy, plan_buckets
from tiermem.client.offload.resume import check_resume
from tiermem.client.offload.shared import SharedFeed, TensorEntry
from tiermem.client.offload.staged import StagedEntry, StagedFeed
from tiermem.client.offload.state_view import StateView
from tiermem.client.offload.stats import OptimizerStats
from tiermem.client.offload.transfer import StateTransfer
from tiermem.core import dtypes
from tiermem.core.errors import (
    AdmissionError,
    DTypeError,
    GradsAfterRelease,
    InvalidArgument,
    InvalidState,
    ProtocolError,
    TiermemError,
)
from tiermem.core.grad_mode import without_grad
from tiermem.core.modes import Exchange, StepMode
from tiermem.core.param_groups import check_params_once
from tiermem.core.protocol import ParamGroup, RankReport, Step, StepDone, TensorSpec
from tiermem.core.protocol.records import MAX_GROUPS
from tiermem.core.step_rules import GradStats, StepDecision
from tiermem.core.units import format_size

__all__ = ["OffloadAdam"]

log = logging.getLogger(__name__)


@dataclass
class _SentStep:
    """A STEP whose reply was interrupted: its outcome is read before anything else."""

    step: int
    attempt: int
    ids: list[int]
    delayed: bool
    request_id: int
    """The connection's last request id when the interrupt came (-1: not noted yet)."""
    before_id: int
    skip: bool = False
    failure: TiermemError | None = None
    """The daemon's error for it, read while settling after the interrupt: raised by the next call."""
    settled: bool = False
    """A signal handler's call took its outcome in while ``step()`` waited for it (``Calls``)."""


@dataclass
class _OpenAttempt:
    """An overlapped step: buckets already handed to the daemon during backward."""

    step: int
    attempt: int
    groups: tuple[ParamGroup, ...]
    applied: set[int] = field(default_factory=set)


class OffloadAdam(OptimizerState, torch.optim.Optimizer):
    """Adam/AdamW with its state in tiermemd; see the module docstring."""

    _step_supports_amp_scaling = True
    _h: OffloadHandle

    # what changes after construction lives in the one handle (``tiermem.client.offload.handle``)
    _client = InHandle()
    _own_client = InHandle()
    _registered = InHandle()
    _closed = InHandle()
    _token = InHandle()
    _expected_step = InHandle()
    tensors = InHandle()
    _index = InHandle()
    frozen = InHandle()
    feed = InHandle()
    shared_feed = InHandle()
    _own_feed = InHandle()
    transfer = InHandle()
    exchange = InHandle()
    placement_used = InHandle()
    state_keys = InHandle()
    state_from = InHandle()
    _pinned = InHandle()
    _steps_sent = InHandle()
    _step_lag = InHandle()
    _skipped = InHandle()
    _attempts = InHandle()
    _sent = InHandle()
    _open = InHandle()
    _inflight = InHandle()
    _receiving = InHandle()
    _calls = InHandle()
    last_grad_norm = InHandle()
    """The global norm of the last step's (unscaled) grads; None when that step computed none (no clipping,
    or a skipped step)."""
    last_found_inf = InHandle()
    """Whether the last step found an inf/nan grad (the scaler's check, or the daemon's when it clipped)."""
    last_skipped = InHandle()
    """Whether the last step was skipped (a ``GradScaler`` overflow): nothing changed but the skip count."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        adamw: bool = True,
        client: Client | None = None,
        options: OffloadOptions | None = None,
        **offload_options: Any,
    ) -> None:
        """torch's arguments as ``torch.optim.AdamW`` takes them; tiermem's in ``options``
        (``tiermem.client.offload.options.OffloadOptions``), or as its field names given as keywords
        (``offload="nvme"``, ``state_dtype="int8"``, ...); ``client``: a connection to use (else the node's
        daemon, or a private one)."""
        hyper = check_hyper(lr, betas, eps, weight_decay, adamw=adamw)
        check_torch_flags(amsgrad=amsgrad, capturable=capturable, differentiable=differentiable)
        unknown = sorted(set(offload_options) - OffloadOptions.names())
        if unknown:
            raise TypeError(f"OffloadAdam got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
        opts = self.options = OffloadOptions.merge(options, offload_options)
        defaults = optimizer_defaults(hyper, foreach=foreach, maximize=maximize, fused=fused, adamw=adamw)
        self.__dict__["_h"] = OffloadHandle(
            token=opts.token, expected_step=opts.expected_step, own_client=client is None
        )
        super().__init__(params, defaults)
        self.state_dtype = opts.state_dtype
        self.placement = opts.offload
        self._exchange_asked = opts.exchange
        self.policy = StepPolicy(opts.mode, opts.warmup_steps)
        self.max_grad_norm = opts.max_grad_norm
        self.release_grads = opts.release_grads
        self.bucket_nbytes = opts.bucket_nbytes
        self.job_id = opts.job_id or _fresh_job_id()
        self._job_id_given = opts.job_id is not None
        self.rank = 0 if opts.rank is None else opts.rank
        self.world_size = 1 if opts.world_size is None else opts.world_size
        self._create_job = opts.create_job
        self.rollback = opts.rollback
        self._pin_asked = opts.pin_window
        self.window_asked = opts.window_nbytes
        """The ``window_nbytes`` given (None: the daemon's default, which ``offload_params`` may grow)."""
        self._register(client, opts.window_nbytes)
        self.state = StateView(self)  # type: ignore[assignment]

    # ----------------------------------------------------------------- construction

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group`` (progressive unfreezing, a new head): the group's params start with no
        state, the others keep theirs.  After construction the rank registers again with every tensor: its
        state comes back to the trainer in AdamW's format and is loaded into the new registration (a cost
        of one ``state_dict`` and one ``load_state_dict``, once per new group).  Not with params paged by
        ``offload_params`` or under a sharded optimizer, which own the registration."""
        if getattr(self, "_h", None) is not None and self._closed:
            raise InvalidState("this OffloadAdam is closed: it takes no new param group; make a new one")
        registered = getattr(self, "_registered", False)
        with self._calls.enter("add_param_group()", reads=False) if registered else contextlib.nullcontext():
            self._add_param_group(param_group, registered)

    def _add_param_group(self, param_group: dict[str, Any], registered: bool) -> None:
        if registered:
            self._check_regroupable()
        check_params_once(param_group, "OffloadAdam")
        if len(self.param_groups) >= MAX_GROUPS:
            raise InvalidArgument(
                f"OffloadAdam takes at most {MAX_GROUPS} param groups (the daemon's limit; each step sends every "
                "group's hyper-parameters), and this would be one more: put the params that share lr, betas, eps "
                "and weight_decay in one group"
            )
        torch_switch_name(param_group)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_hyper(
                group["lr"], group["betas"], group["eps"], group["weight_decay"], adamw=group["decoupled_weight_decay"]
            )
            check_group_switches(group, lambda: f"param_groups[{len(self.param_groups) - 1}]")
            for p in group["params"]:
                if not isinstance(p, torch.Tensor) or p.dtype not in (d.torch for d in dtypes.DTYPES):
                    raise DTypeError(f"OffloadAdam takes float32/float16/bfloat16 params, got {getattr(p, 'dtype', p)}")
            if registered:
                self._register_again()
        except BaseException:
            self.param_groups.pop()  # torch leaves a refused group out too
            raise

    def _check_regroupable(self) -> None:
        why = self._not_reregistrable()
        if why is not None:
            raise InvalidState(f"add_param_group {why}")

    def _not_reregistrable(self) -> str | None:
        """Why this optimizer cannot register its tensors again in a fresh rank of its own, or None."""
        if not self._own_feed:
            return "after offload_params: page the model with every param group given"
        if self._create_job or self.world_size > 1:
            return "on a rank of a sharded optimizer: give the sharded optimizer every param group"
        return None

    def _register_again(self) -> None:
        """Register every tensor (the old ones and the new group's) in a fresh rank; the old tensors' state
        comes along, the new ones start afresh.  The step count goes on from where it was."""
        new = self.param_groups[-1]["params"]
        kinds = {p.dtype for p in self.tensors} | {p.dtype for p in new}
        if len(kinds) != 1:
            raise DTypeError(
                f"OffloadAdam needs one working dtype for all params, got {sorted(str(d) for d in kinds)}; "
                "use one OffloadAdam per dtype"
            )
        window = self.client.window.numel()
        self._reregister(window, fallback=None, carry_state=True)

    def grow_window(self, nbytes: int) -> bool:
        """Re-register with a staging window of ``nbytes`` (``offload_params`` asks, before the first step, when
        the window would split a submodule's transfers); True when the window is that size now.

        Only an optimizer whose window the user left to the daemon, that has not stepped, and whose job is its
        own (not a rank of a sharded optimizer) grows; where the daemon refuses the size (its
        ``jobs.window_budget``), the old window comes back and the refusal is logged."""
        if nbytes <= self.client.window.numel():
            return True
        if self.window_asked is not None or self._steps_sent or self._not_reregistrable() is not None:
            return False
        if any(self.step_counts()):  # state loaded from a state dict: a fresh rank would start without it
            return False
        return self._reregister(nbytes, fallback=self.client.window.numel(), carry_state=False)

    def _reregister(
        self, window: int, *, fallback: int | None, carry_state: bool, include: set[int] | None = None
    ) -> bool:
        """Register every tensor again in a fresh rank with a ``window``-byte staging window (a private daemon
        is started again, sized for it), from the params as they are now, then drop the old registration;
        with ``carry_state`` the Adam state and step counts come along (read whole first: a state dict's
        worth of memory), else there must be none.  Where the attach is refused and ``fallback`` is given,
        registers with a window of ``fallback`` bytes instead and returns False.

        New before old: the new rank is made beside the old one (a new private daemon, or a new job on the
        same daemon), so a refusal leaves the optimizer exactly as it was, state included.  On a caller's
        connection, which holds one job at a time, the new job takes a second connection to the same daemon,
        which the optimizer owns from then on (the caller's stays theirs, detached).  Only where the job's
        name was given (two jobs of one name cannot live side by side) or no second connection opens does
        the old rank go first.
        ``include``: ids of frozen params to register too (they are to hold state)."""
        self._flush()
        if self._open is not None:
            self._abort_open()
        saved = self._state_by_param() if carry_state else {}
        steps, skipped = self._steps_sent, self._skipped
        keep = set(self._index) | (include or set())  # these hold state: they stay registered
        self._choose_exchange(self._split_frozen(keep)[0])  # refused before anything changes, on any connection
        second = None if self._own_client or self._job_id_given else self._second_connection()
        old = _Registration.take(self._h)
        same_daemon = second is not None or old.client.daemon is None
        beside = second is not None or (self._own_client and (old.client.daemon is not None or not self._job_id_given))
        old.feed.retire(send_edits=False)  # the new registration takes every param as it is now
        if not beside:
            old.drop()
        job_id = self.job_id
        if beside and same_daemon:
            self.job_id = _fresh_job_id()  # the old job stays attached on that daemon until the new one is
        if second is not None:
            self._own_client = True  # the new rank's connection is this optimizer's own; the caller keeps theirs
        target = second if second is not None else (None if self._own_client else old.client)
        grown = True
        try:
            try:
                self._register(target, window, keep=keep)
            except AdmissionError as exc:
                if fallback is None:
                    raise
                log.warning(
                    "a %s staging window was refused (%s); keeping %s", format_size(window), exc, format_size(fallback)
                )
                if second is not None:  # the refused registration closed it
                    target = second = self._second_connection(old.client)
                    if target is None:
                        raise
                self._register(target, fallback, keep=keep)
                grown = False
        except BaseException:
            if beside:
                self.job_id = job_id
                old.restore(self._h)
            raise
        if beside:
            old.drop()
        self._steps_sent, self._skipped = steps, skipped
        if saved:
            self._load_entries({self._index[id(p)]: entry for p, entry in saved.items() if id(p) in self._index})
        return grown

    def _second_connection(self, client: Client | None = None) -> Client | None:
        """A connection of this optimizer's own to the daemon of the caller's connection, or None (logged)."""
        path = (client or self.client).socket_path
        try:
            return connect(path, embed=False)
        except TiermemError as exc:
            log.warning("no second connection to %s (%s): the old rank is detached before the new one", path, exc)
            return None

    def _split_frozen(self, keep: set[int]) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        """The params to register and the frozen ones: a param that wants no grad (``requires_grad=False``) and
        has no state here costs nothing, as in torch, until it gets a grad (then the rank registers again).
        Only where a fresh registration is possible later (not under ``offload_params`` or a sharded
        optimizer, which register every tensor they are given); and never all of them.  ``keep``: ids of
        params registered whatever their ``requires_grad`` (they hold state)."""
        every = [p for g in self.param_groups for p in g["params"]]
        if self._not_reregistrable() is not None:
            return every, []
        registered = [p for p in every if p.requires_grad or id(p) in keep]
        if not registered:
            return every, []
        ids = {id(p) for p in registered}
        return registered, [p for p in every if id(p) not in ids]

    def register_frozen(self) -> None:
        """Register the frozen params too (``offload_params`` pages every param of the model, so the daemon
        holds them all); their state starts afresh when they first get a grad."""
        if self.frozen:
            self._reregister(
                self.client.window.numel(), fallback=None, carry_state=True, include={id(p) for p in self.frozen}
            )

    def _unfreeze(self) -> None:
        """Frozen params that got a grad since the last step join the registration (their state starts
        afresh, the others' comes along)."""
        if any(p.grad is not None for p in self.frozen):
            self._reregister(self.client.window.numel(), fallback=None, carry_state=True)

    def _register(self, client: Client | None, window_nbytes: int | None, *, keep: set[int] | None = None) -> None:
        params, frozen = self._split_frozen(keep or set())
        self.tensors = params
        self.frozen = frozen
        self._index = {id(p): i for i, p in enumerate(params)}
        dtype, exchange = self._choose_exchange(params)
        self.exchange = exchange
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        specs = [
            TensorSpec(str(i), tuple(p.shape), dtype.name, self.placement, group_of[id(p)])
            for i, p in enumerate(params)
        ]
        if client is None:
            sized = self.options.replace(exchange=exchange, window_nbytes=window_nbytes)  # as registered now
            plan = sized.pool_plan([p.numel() for p in params], dtype=dtype.name)
            client = connect(pool_size=plan.nbytes, settings={"pool.arena_size": plan.arena_size})
        attached = False
        try:
            info = client.attach(
                self.job_id,
                rank=self.rank,
                world_size=self.world_size,
                window_nbytes=window_nbytes or 0,
                token=self._token,
                create=self._create_job,
            )
            self._token = info.token
            attached = True
            try:
                check_resume(info, expected_step=self._expected_step, rollback=self.rollback)
            except TiermemError:
                attached = False
                client.detach(keep_state=True)  # the state waits, unchanged, for a client that accepts it
                raise
            self.state_from = info.state_from
            reply = client.register(
                specs,
                [self._wire_group(g) for g in self.param_groups],
                grad_buffers=self.policy.grad_buffers,
                exchange=exchange,
                grads_in_state=exchange is Exchange.SHARED and self.release_grads,
                state_dtype=self.state_dtype,
            )
            self.state_keys = reply.state_keys
            self.placement_used = reply.placement
            self.transfer = StateTransfer(client)
            on_gpu = any(p.is_cuda for p in params) if self._pin_asked is None else self._pin_asked
            self._pinned = self._pin_window(client) if on_gpu else False
            if exchange is Exchange.STAGED:
                self._bind_staged(params, dtype, reattached=info.reattached)
            else:
                self._bind_shared(client, params, reply.slots, dtype, reattached=info.reattached)
            if info.reattached:
                report = _rank_report(client)
                self._steps_sent, self._skipped, self._step_lag = report.last_step, report.skipped_steps, 0
                self.feed.buffer = self._next_buffer()
        except BaseException:
            if self._own_client:
                client.close()
            elif attached:
                # the caller's connection: leave the job as a reattach finds it (its state waits for the
                # token), so the connection can attach again, with corrected arguments
                try:
                    client.detach(keep_state=True)
                except TiermemError as exc:
                    log.warning("could not detach from job %r after a failed registration: %s", self.job_id, exc)
            raise
        self._h.adopt(client, own=self._own_client)
        self._registered = True

    def _choose_exchange(self, params: list[torch.nn.Parameter]) -> tuple[dtypes.WorkingDType, Exchange]:
        """The params' one dtype and the exchange they take (checked: CPU params for the shared one, values
        to update, a step mode the grads allow)."""
        if not params:
            raise InvalidArgument("OffloadAdam got an empty parameter list")
        kinds = {p.dtype for p in params}
        if len(kinds) != 1:
            raise DTypeError(
                f"OffloadAdam needs one working dtype for all params, got {sorted(str(d) for d in kinds)}; "
                "use one OffloadAdam per dtype"
            )
        dtype = dtypes.by_torch(kinds.pop())
        on_cpu = all(p.device.type == "cpu" for p in params)
        exchange = self._exchange_asked
        if exchange is Exchange.AUTO:
            exchange = Exchange.SHARED if on_cpu else Exchange.STAGED
        if exchange is Exchange.SHARED and not on_cpu:
            raise InvalidArgument(
                "exchange='shared' needs every param on the CPU (their storage becomes memory shared with tiermemd); "
                f"got params on {sorted({str(p.device) for p in params})}"
            )
        meta = [i for i, p in enumerate(params) if p.is_meta]
        if meta and self._exchange_asked is not Exchange.STAGED:  # auto would pick staged: ask for it
            raise InvalidArgument(
                f"{len(meta)} of {len(params)} params (first: param {meta[0]}, shape {tuple(params[meta[0]].shape)}) "
                "are on the meta device and have no values for OffloadAdam to update; build the model on the CPU "
                "or a GPU, or page it from the meta device: OffloadAdam(..., exchange='staged') then "
                "tiermem.offload_params(model, opt, init=...)"
            )
        if self.release_grads and self.policy.mode is StepMode.DELAYED:
            raise InvalidArgument(
                "release_grads=True cannot be combined with delayed_update=True: the delayed update reads the "
                "released grads while the next step's land"
            )
        return dtype, exchange

    def _bind_staged(self, params: list[torch.nn.Parameter], dtype: dtypes.WorkingDType, *, reattached: bool) -> None:
        """The staged exchange's feed: params and grads through the window; the daemon's values to the params
        on a reattach, else the params' to the daemon."""
        buckets = plan_buckets([p.numel() * dtype.itemsize for p in params], self.bucket_nbytes)
        staged = [StagedEntry(i, p, p.dtype, p.device, p.shape, buckets.bucket_of[i]) for i, p in enumerate(params)]
        feed = StagedFeed(
            staged,
            self.transfer,
            buckets,
            release_grads=self.release_grads,
            on_bucket=weak_method(self._on_bucket) if self.policy.mode is StepMode.OVERLAP else None,
        )
        feed.early = self._grads_early()
        feed.hook()
        self.feed = feed
        if reattached:  # a param made on the meta device has nowhere to put them: the pager fetches it on use
            feed.pull_params(range(len(staged)))
        else:  # params made on the meta device get their values later (tiermem.offload_params)
            feed.push_params(only_edited=False)

    def _bind_shared(
        self, client: Client, params: list[torch.nn.Parameter], slots: Any, dtype: Any, *, reattached: bool
    ) -> None:
        buckets = plan_buckets([p.numel() * dtype.itemsize for p in params], self.bucket_nbytes)

        def view(offset: int, length: int, p: torch.Tensor) -> torch.Tensor:
            # a torch storage of its own per param and per grad: checkpoint writers see distinct tensors
            return client.storage_tensor(offset, length).view(dtype.torch).view(p.shape)

        entries = [
            TensorEntry(
                i,
                p,
                view(slot.param.offset, slot.param.length, p),
                tuple(view(g.offset, g.length, p) for g in slot.grads),
                buckets.bucket_of[i],
            )
            for i, (p, slot) in enumerate(zip(params, slots, strict=True))
        ]
        for e in entries:
            SharedFeed.bind(e.param, e.view, adopt=reattached)
        base = client.storage.data_ptr()

        def remap(address: int, like: torch.Tensor) -> torch.Tensor:
            return view(address - base, like.numel() * like.element_size(), like)

        transfer = self.transfer

        def push(tid: int, grad: torch.Tensor, accumulate: bool) -> None:
            transfer.push(tid, "grad", grad, step=0, accumulate=accumulate)

        feed = self.shared_feed = SharedFeed(
            entries,
            buckets,
            release_grads=self.release_grads,
            on_bucket=weak_method(self._on_bucket),
            push=push if self.release_grads else None,
            remap=remap,
        )
        feed.buffer = self._next_buffer()
        feed.hook()
        self.feed = feed

    @property
    def paged(self) -> bool:
        """Whether a feed other than the exchange's own serves the grads (``offload_params``' pager)."""
        return not self._own_feed

    def use_feed(self, feed: Feed, *, send_edits: bool = True) -> None:
        """The declared plug-in point for a feed of another kind (``offload_params``' pager, a sharding
        strategy's): the current feed sends the params edited since the last step (``send_edits``) and steps
        aside; ``feed`` serves every later step.  Only between steps, and once."""
        self._settle()
        if not self._own_feed:
            raise InvalidState("this OffloadAdam already takes its grads from another feed (offload_params)")
        if self._open is not None or self._inflight:
            raise InvalidState("a feed can be given only between steps (an overlapped or delayed step is open)")
        self.feed.retire(send_edits=send_edits)
        self.feed = feed
        self._own_feed = False

    @staticmethod
    def _pin_window(client: Client) -> bool:
        """Register the staging window with CUDA (copies between it and a GPU are then DMA)."""
        from tiermem.engine.pool.pinning import default_pinner

        result = default_pinner().register(client.window.data_ptr(), client.window.numel())
        if not result.registered:
            log.warning("the staging window could not be registered with CUDA (%s); copies will be staged", result)
        return result.registered

    def _wire_group(self, group: dict[str, Any]) -> ParamGroup:
        check_group_values(group, self.param_groups)  # a string written into a group fails here, named
        return ParamGroup(
            lr=float(group["lr"]),
            betas=(float(group["betas"][0]), float(group["betas"][1])),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            adamw=bool(group.get("decoupled_weight_decay", True)),
            maximize=bool(group.get("maximize", False)),
        )

    def _groups(self) -> tuple[ParamGroup, ...]:
        return tuple(self._wire_group(g) for g in self.param_groups)

    def _next_buffer(self) -> int:
        return (self._steps_sent + 1) % 2 if self.policy.mode is StepMode.DELAYED else 0

    # ----------------------------------------------------------------- properties

    @property
    def client(self) -> Client:
        if self._client is None:
            raise InvalidState("this OffloadAdam is closed")
        return self._client

    @property
    def token(self) -> str | None:
        """The job token (give it to ``OffloadAdam(token=...)`` to reattach after a crash)."""
        return self._token

    @property
    def steps(self) -> int:
        """Steps applied so far, as torch's ``state["step"]`` counts them (skipped steps are ``skipped_steps``):
        the daemon's count, from the loaded step after ``load_state_dict``.  After an interrupt that ended
        ``step()``'s wait for its outcome, that outcome is read first: an ``except`` that picks the batch to
        train next by ``steps`` never trains one twice."""
        if self._sent is not None:
            with self._calls.enter("steps", reads=True):
                self._settle(defer_failure=True)
        return self._steps_sent - self._step_lag

    @property
    def update_in_flight(self) -> bool:
        """Whether a delayed update runs in the daemon whose params the model does not have yet (``flush``)."""
        return bool(self._inflight)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (``GradScaler`` overflows; the daemon's count)."""
        return self._skipped

    # ----------------------------------------------------------------- the step

    @eager_under_compile
    @without_grad
    def step(self, closure: Callable[[], float] | None = None, *, decision: StepDecision | None = None) -> float | None:
        """One step.  ``decision``: taken by a sharding strategy over the global grad statistics (its skip,
        inverse scale and clip coefficient replace the scaler's hand-over and ``max_grad_norm``)."""
        loss = closure_loss(closure)
        with self._calls.enter("step()", reads=False):
            return self._step(loss, decision)

    def _step(self, loss: float | None, decision: StepDecision | None) -> float | None:
        self._settle()
        if self.frozen:
            self._unfreeze()
        grad_scale, found_inf = self._scaler_inputs()
        if decision is not None:  # the strategy took the scaler's hand-over into its decision
            grad_scale, found_inf = False, decision.skip
        scaled = grad_scale is not False
        # only the overlap mode refuses grads changed after they landed (its early updates saw them before)
        changed = self.policy.mode is StepMode.OVERLAP and self.feed.changed_after_landing
        try:
            ids = self.feed.check()
        except GradsAfterRelease:
            self._abort_open()
            self._new_step()
            raise
        open_attempt = self._open
        try:
            self.policy.check_step(
                scaled=scaled,
                accumulated=self.feed.accumulated,
                changed=changed,
                applied_early=len(open_attempt.applied) if open_attempt else 0,
            )
        except InvalidState:
            self._abort_open()
            self._new_step()
            raise
        if self.feed.releases_grads and scaled:
            self._abort_open()
            self._new_step()
            raise InvalidState(
                "torch.amp.GradScaler checks the grads for inf/nan itself, and grads released to tiermemd "
                "(release_grads=True, or params paged by offload_params) are not there to check; train without a "
                "GradScaler (bf16 needs none) or with release_grads=False"
            )
        if found_inf is not None and float(found_inf) > 0:
            self._abort_open()  # GradScaler found an overflow: skip, as torch's fused Adam does
            self._send(Step(step=self._steps_sent + 1, attempt=next(self._attempts), skip=True), [], delayed=False)
            return loss
        step_no = self._steps_sent + 1
        delayed = self.policy.delayed(step_no)
        if self._inflight and not (delayed and self.shared_feed is not None and set(self._inflight) <= set(ids)):
            self._install()  # else the delayed STEP installs them first, in the daemon, with no round trip
        if not ids and open_attempt is None:
            self._new_step()
            return loss
        self.feed.send(ids)
        if decision is not None:
            loss_scale = 1.0 / decision.inv_scale
        else:
            loss_scale = 1.0 if grad_scale is None or grad_scale is False else float(grad_scale)
        attempt = open_attempt.attempt if open_attempt else next(self._attempts)
        groups = open_attempt.groups if open_attempt else self._groups()
        msg = Step(
            step=step_no,
            attempt=attempt,
            groups=groups,
            loss_scale=loss_scale,
            max_grad_norm=self.max_grad_norm if decision is None else None,
            clip_coef=None if decision is None or decision.grad_norm is None else decision.clip_coef,
            tensor_ids=self._wire_ids(ids),
            delayed=delayed,
            grad_buffer=self.feed.buffer,
        )
        self._send(msg, ids, delayed)
        if decision is not None and decision.grad_norm is not None:
            self.last_grad_norm = decision.grad_norm  # the strategy's global norm (the daemon took none)
            self.last_found_inf = decision.nonfinite
        return loss

    def set_max_grad_norm(self, max_grad_norm: float | None) -> None:
        """Clip the global grad norm to ``max_grad_norm`` from the next step on (None: no clipping), as the
        constructor's argument does: the daemon takes the norm of the step's grads, accumulated ones too.  HF
        Trainer's callback hands Trainer's ``max_grad_norm`` this way to an optimizer whose grads bypass
        ``p.grad`` (``offload_params``, ``release_grads``), where Trainer's own clip finds none."""
        with self._calls.enter("set_max_grad_norm()", reads=False):
            options = self.options.replace(max_grad_norm=max_grad_norm)
            self.policy.mode = options.mode  # refuses what the constructor refuses: overlap_update cannot clip
            self.options, self.max_grad_norm = options, max_grad_norm

    def held_grad_stats(self) -> GradStats:
        """The daemon's statistics of the grads this step has put there so far (GRAD_NORM; changes nothing): a
        sharded optimizer's part of the global norm where the step added several backward passes' grads in the
        daemon, whose sum only the daemon holds."""
        ids = self.feed.check()  # grads set by hand land, every push is done (``step()`` asks again: the same)
        if not ids:
            return GradStats(0.0, False)
        reply = self.client.grad_norm(self._wire_ids(ids), grad_buffer=self.feed.buffer)
        return GradStats(reply.sq_norm, reply.nonfinite)

    def _wire_ids(self, ids: list[int]) -> tuple[int, ...]:
        """``ids`` as a STEP or GRAD_NORM names them: none for every registered tensor (the usual step), which
        the daemon need not read and check one by one."""
        return () if len(ids) == len(self.tensors) else tuple(ids)

    def _send(self, msg: Step, ids: list[int], delayed: bool) -> None:
        conn = self.client.conn
        # recorded before it is sent and forgotten once its outcome is in: an interrupt landing anywhere between
        # (a second one in the handler below included) leaves the step to be settled, never sent again
        sent = self._sent = _SentStep(msg.step, msg.attempt, ids, delayed, -1, conn.last_request_id, msg.skip)
        try:
            done = self.client.step(msg)
            if sent.settled:
                return  # a signal handler's state_dict() took the outcome in while this waited for it
            self._finish(done, ids, delayed)
            self._sent = None
        except TiermemError:
            self._sent = None
            self._open = None
            self._new_step()
            raise
        except BaseException:  # an interrupt: Ctrl-C, or what a signal handler raised (SystemExit, a preemption)
            sent.request_id = conn.last_request_id
            self._settle_interrupted()
            raise

    def _scaler_inputs(self) -> tuple[Any, Any]:
        """What ``GradScaler.step`` handed over as attributes: the scale (False: no scaler; None: ``unscale_``
        came first) and the found-inf flag (None: none)."""
        return getattr(self, "grad_scale", False), getattr(self, "found_inf", None)

    def _finish(self, done: StepDone, ids: list[int], delayed: bool) -> None:
        self._steps_sent = done.step
        self._skipped = done.skipped_steps
        self.last_grad_norm = done.grad_norm
        self.last_skipped = done.skipped
        self.last_found_inf = done.nonfinite or done.skipped
        if done.skipped:
            pass  # nothing changed in the daemon: the model keeps its params
        elif delayed:
            self._inflight = ids
        else:
            self._receive(ids, fetch=False)
        self._open = None
        self._new_step()

    def _new_step(self) -> None:
        self.feed.new_step(self._next_buffer(), early=self._grads_early())

    def _grads_early(self) -> bool:
        """Whether staged grads go to the daemon as they land in the coming backward."""
        return self.release_grads or self.policy.overlap_now

    def _on_bucket(self, bucket: int, members: list[int]) -> bool:
        """A bucket's grads are final: with the overlap mode verified, the daemon updates it now (True)."""
        if not self.policy.overlap_now:
            return False
        if self._open is None:
            self._settle()
            self._open = _OpenAttempt(self._steps_sent + 1, next(self._attempts), self._groups())
        attempt = self._open
        self.client.bucket_ready(attempt.step, attempt.attempt, bucket, members, attempt.groups, self.feed.buffer)
        attempt.applied.update(members)
        return True

    def _abort_open(self) -> None:
        attempt, self._open = self._open, None
        if attempt is not None:
            reply = self.client.abort(attempt.step, attempt.attempt)
            self._steps_sent = max(self._steps_sent, reply.last_step)

    def _settle(self, *, defer_failure: bool = False) -> None:
        """Read the outcome of an interrupted STEP (and wait for the param pager's transfers) before anything
        else goes to the daemon.  The record of that STEP goes only once its outcome is taken in, so an
        interrupt in here leaves it to the next call."""
        if self._calls.reentered:
            self._settle_reentered()
            return
        sent = self._sent
        if sent is not None and sent.request_id < 0:  # an interrupt came before _send's handler could note it
            sent.request_id = self.client.conn.last_request_id  # nothing was sent since the STEP
        feed: Feed | None = getattr(self, "feed", None)
        if feed is not None:
            feed.drain()
        if sent is None:
            return
        if sent.failure is None:
            conn = self.client.conn
            late = conn.take_late(sent.request_id) if sent.request_id != sent.before_id else None
            if isinstance(late, StepDone):
                self._finish(late, sent.ids, sent.delayed)
                self._sent = None
                return
            if isinstance(late, TiermemError):
                sent.failure = late
        if sent.failure is not None:
            if defer_failure:
                return
            self._sent = None
            self._open = None
            self._new_step()
            raise sent.failure
        # the reply was read before the interrupt landed, or the request never left: ask the daemon
        report = _rank_report(self.client)
        last = report.last_step
        if sent.skip:
            self._skipped = report.skipped_steps  # counted there or not: nothing else changed
            self._new_step()
        elif last >= sent.step:
            self._steps_sent = last
            if sent.delayed:
                self._inflight = sent.ids
            else:
                self.feed.receive(sent.ids)  # the applied step's params, which the interrupt kept out
            self._open = None
            self._new_step()
        elif self._open is not None and self._open.attempt == sent.attempt:
            self._abort_open()
            self._new_step()
        self._sent = None

    def _settle_reentered(self) -> None:
        """``_settle`` for a signal handler's read (``Calls``) that interrupted this thread's call: take in the
        outcome of a STEP whose reply the interrupted ``step()`` is waiting for (so the state read is the
        step's, whole), and leave anything else to that call, which goes on once the handler returns.  The
        reply stays for the waiting frame, which then sees ``settled``.  Where the interrupted call was copying
        new params into the model, the copy is made whole here (the interrupted one goes on with the same
        values), so the model read beside the state is of the same step."""
        if self._receiving is not None:
            ids, fetch = self._receiving
            if fetch:
                self.client.fetch_params(ids)
            self.feed.receive(ids)
            return
        sent = self._sent
        if sent is None or sent.settled or sent.failure is not None:
            return
        conn = self.client.conn
        request_id = sent.request_id if sent.request_id >= 0 else conn.last_request_id
        if request_id == sent.before_id:
            return  # not sent yet: the state is the last step's
        reply = conn.reply_awaited(request_id)
        if isinstance(reply, StepDone):
            self._finish(reply, sent.ids, sent.delayed)
            sent.settled = True
            self._sent = None
        elif reply is None and not sent.skip and _rank_report(self.client).last_step >= sent.step:
            # the interrupted step() has the reply in hand and is about to take the params in: the same values
            self._receive(sent.ids, fetch=sent.delayed)

    def _settle_interrupted(self) -> None:
        """After an interrupt in ``step()`` (see the module docstring): wait for that step's outcome before the
        interrupt reaches the trainer, so that its handler finds the params and ``steps`` whole (the daemon no
        longer writes them).  A second Ctrl-C ends the wait; an error of the step's is raised by the next call;
        either way the next call settles what is left."""
        step = self._sent.step
        try:
            self._settle(defer_failure=True)
        except KeyboardInterrupt:
            log.warning("interrupted again while waiting for step %d's outcome; the next call reads it", step)
        except Exception as exc:  # a failure, or a second interrupt: the first is what the trainer gets
            log.warning("the wait for step %d's outcome ended (%r); the next call reads it", step, exc)

    def zero_grad(self, set_to_none: bool = True) -> None:
        with self._calls.enter("zero_grad()", reads=False):
            self._settle()
            if self._open is not None:
                self._abort_open()  # a backward whose step() never came (interrupted): close its attempt
                self._new_step()
            self.feed.zero(set_to_none=set_to_none)

    def _install(self) -> None:
        ids, self._inflight = self._inflight, []
        self._receive(ids, fetch=True)

    def _receive(self, ids: list[int], *, fetch: bool) -> None:
        """The new params of ``ids`` into the model (``fetch``: the daemon writes them out first, a delayed
        update's); noted while it runs, for a signal handler's read that interrupts it."""
        self._receiving = (ids, fetch)
        try:
            if fetch:
                self.client.fetch_params(ids)
            self.feed.receive(ids)
        finally:
            self._receiving = None

    def flush(self) -> None:
        """Wait for a delayed update and install its params in the model."""
        with self._calls.enter("flush()", reads=True):
            self._flush()

    def _flush(self) -> None:
        self._settle()
        if self._inflight and self._sent is None:  # (a STEP in flight: the step() it interrupted installs them)
            self._install()

    def close(self, *, keep_state: bool = False) -> None:
        """Detach from the daemon (the job's state is freed unless ``keep_state``) and close the connection.

        The model keeps its params: they stay in the shared memory they were moved into, now private."""
        with self._calls.enter("close()", reads=False):
            self._close(keep_state)

    def _close(self, keep_state: bool) -> None:
        if getattr(self, "feed", None) is not None:
            self.feed.unhook()
        client = self._client
        if client is None:
            return
        try:
            if self._registered:
                self._flush()
                if getattr(self, "_pinned", False):
                    from tiermem.engine.pool.pinning import default_pinner

                    default_pinner().unregister(client.window.data_ptr())  # before the window is unmapped
                    self._pinned = False
                client.detach(keep_state=keep_state)
        except Exception as exc:  # closing must not mask the caller's own error
            log.warning("detaching from tiermemd failed: %s", exc)
        finally:
            self._closed = True
            self._h.release()
            client.close()

    def stats(self) -> OptimizerStats:
        """The daemon's figures for this rank and the node, plus the client's: skipped steps, DPU staleness,
        last norm, the bytes that crossed the staging window."""
        reply = self.client.stats()
        if reply.rank is None:
            raise ProtocolError("the daemon sent no figures for this optimizer's rank (the connection is not attached)")
        return OptimizerStats(
            rank=reply.rank,
            node=reply.node,
            steps=self.steps,
            client_skipped_steps=self._skipped,
            staleness_steps=1 if self._inflight else 0,
            last_grad_norm=self.last_grad_norm,
            frozen_params=len(self.frozen),
            frozen_numel=sum(p.numel() for p in self.frozen),
            crossed_nbytes=dict(self.transfer.crossed.nbytes),
            crossed_numel=dict(self.transfer.crossed.numel),
        )


def _fresh_job_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass
class _Registration:
    """A registration taken out of the handle while a new one is made: put back if that fails, else
    dropped (detached and, when it is the optimizer's own, its connection closed)."""

    fields: dict[str, Any]

    _NAMES = (
        "client", "own_client", "registered", "token", "expected_step", "tensors", "index", "frozen", "feed",
        "shared_feed", "own_feed", "transfer", "exchange", "placement_used", "state_keys", "state_from", "pinned",
    )  # fmt: skip

    @classmethod
    def take(cls, handle: OffloadHandle) -> _Registration:
        taken = cls({name: getattr(handle, name) for name in cls._NAMES})
        handle.release()
        handle.own_feed = True
        handle.token = None  # a new job: its own token
        handle.expected_step = None
        handle.pinned = False
        return taken

    @property
    def client(self) -> Client:
        client: Client = self.fields["client"]
        return client

    @property
    def feed(self) -> Feed:
        feed: Feed = self.fields["feed"]
        return feed

    def restore(self, handle: OffloadHandle) -> None:
        for name, value in self.fields.items():
            setattr(handle, name, value)
        handle.adopt(self.client, own=self.fields["own_client"])
        self.feed.hook()

    def drop(self) -> None:
        client = self.client
        if self.fields["pinned"]:
            from tiermem.engine.pool.pinning import default_pinner

            default_pinner().unregister(client.window.data_ptr())  # before the window is unmapped
            self.fields["pinned"] = False
        client.detach(keep_state=False)
        if self.fields["own_client"]:
            client.close()  # a private daemon sized for the old registration: the next is sized for this one


def _rank_report(client: Client) -> RankReport:
    """The daemon's figures of the rank ``client`` is attached to."""
    report = client.stats().rank
    if report is None:
        raise ProtocolError("the daemon sent no figures for this connection's rank (the connection is not attached)")
    return report

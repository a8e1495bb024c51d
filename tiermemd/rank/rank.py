"""One rank's optimizer inside the daemon: it owns the step.

A ``RankOptimizer`` owns, for one rank of one job:

- the staging window (a bounded shared segment made at ATTACH, sized by
  configuration, never by the model): state transfer (``state_dict``,
  ``load_state_dict``) goes through it piece by piece;
- the shared storage (made at REGISTER): the trainer's params and grads live
  in it (``tiermem.core.layout``: a param region, one grad region per grad buffer),
  so the daemon reads grads and updates params with no copy, and sees the
  trainer's in-place edits;
- the fp32 Adam state (``StateChunks``: pool or NVMe) with its keys: the
  moments always, the master unless the rank's fp32 params are their own
  master (fp32 params, state in the pool, no delayed update);
- one ``TensorRecord`` per tensor, the rank's phase (``records``), the open
  overlapped attempt, and the update runner.

A step (``STEP``) is validated completely before anything changes; then the
gradient statistics are taken if the step clips, and ``tiermem.core.step_rules``
decides: a skip (the trainer's, from ``GradScaler``) leaves params, state and
the step count untouched and counts the skip; else the planner's pieces run
with the decided grad scale.  An
update that raises leaves the rank FAILED (``StepFailed`` for every later
request until every tensor's state is reset and reloaded), and the job file of
a FAILED rank says so: nothing is recorded as applied that was not.

The overlapped update (``BUCKET_READY``) applies buckets as they land, under
an ``Attempt``; ``STEP`` of the same attempt completes it and ``ABORT`` closes
it, keeping what was applied (with its per-tensor step counts, as torch leaves
a param without a grad un-stepped).  A delayed step's update runs on the
rank's pipeline thread; its params are installed into the storage by the next
``FETCH_PARAMS`` (the trainer reads the old ones meanwhile), and the next
request of any kind waits for it first.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from tiermem.core import dtypes
from tiermem.core.errors import InvalidArgument, InvalidState, StepFailed, TiermemError
from tiermem.core.layout import Layout, plan_layout
from tiermem.core.layout import TensorSpec as LayoutSpec
from tiermem.core.modes import Exchange, Placement
from tiermem.core.protocol import (
    Abort,
    Aborted,
    BucketReady,
    GradNorm,
    GradNormReply,
    MemRef,
    ParamGroup,
    Step,
    StepDone,
    TensorSlot,
    TensorSpec,
)
from tiermem.core.statekeys import StateFormat, element_align, state_keys_for
from tiermem.core.step_rules import GradStats, combine_grad_stats, decide
from tiermem.engine.pool import Arena
from tiermemd import health
from tiermemd.persist import RankRecord
from tiermemd.rank.planner import Piece, check_ids, plan_pieces
from tiermemd.rank.records import Attempt, PhaseRecord, RankPhase, TensorRecord
from tiermemd.rank.runner import AdamKernel, UpdateRunner, UpdateTarget
from tiermemd.rank.stateio import StateIO
from tiermemd.rank.stats import RankStats
from tiermemd.scheduler import CpuScheduler
from tiermemd.state import StateChunks, StateStats, chunk_ranges

__all__ = ["RankOptimizer", "Registration", "state_keys_for"]

MakeState = Callable[[int, StateFormat], StateChunks]
"""Makes a rank's state: (elements, its format: keys, working dtype, state dtype)."""
MakeStorage = Callable[[int], tuple[Arena, int]]


@dataclass(frozen=True)
class Registration:
    slots: tuple[TensorSlot, ...]
    """Empty for the staged exchange (no storage)."""
    placement: Placement
    state_keys: tuple[str, ...]
    storage: Arena | None


class RankOptimizer(StateIO):
    def __init__(
        self,
        *,
        job_id: str,
        rank: int,
        window: Arena,
        window_id: int,
        kernel: AdamKernel,
        scheduler: CpuScheduler,
    ) -> None:
        self.job_id = job_id
        self.rank = rank
        self.window = window
        self.window_id = window_id
        self.kernel = kernel
        self.scheduler = scheduler
        self.tenant = f"{job_id}/{rank}"
        self._window_bytes = torch.frombuffer(window.view(0, window.nbytes), dtype=torch.uint8)
        self.restored: RankRecord | None = None
        """Set when the rank comes from a previous daemon's job file and waits for its REGISTER."""
        self.phase = PhaseRecord()
        self.records: list[TensorRecord] = []
        self.specs: tuple[TensorSpec, ...] = ()
        self.groups: tuple[ParamGroup, ...] = ()
        self.layout: Layout | None = None
        self.state: StateChunks | None = None
        self.placement: Placement | None = None
        """Where the state is (``CPU`` or ``NVME``); None before REGISTER."""
        self.exchange = Exchange.SHARED
        self.storage: Arena | None = None
        self.storage_id = 0
        self._storage_bytes = torch.empty(0, dtype=torch.uint8)
        self._regions: dict[int, torch.Tensor] = {}
        """``_region``'s tensors by offset (made once: each took tens of microseconds of every STEP)."""
        self.last_step = 0
        self.skipped_steps = 0
        self.overlapped_tensors = 0
        self.runner = UpdateRunner(kernel, scheduler, self.tenant)
        self._attempt: Attempt | None = None
        self._delayed: Future[None] | None = None
        self._delayed_step = 0
        self._uninstalled: set[int] = set()
        """Tensors whose storage params do not hold their master yet (a delayed update, a restore)."""
        self.timings: dict[str, float] = {"stats_s": 0.0, "wait_s": 0.0}

    # ----------------------------------------------------------------- registration

    def register(
        self,
        specs: Sequence[TensorSpec],
        groups: Sequence[ParamGroup],
        grad_buffers: int,
        placement: Placement,
        make_state: MakeState,
        make_storage: MakeStorage,
        exchange: Exchange = Exchange.SHARED,
        grads_in_state: bool = False,
        state_dtype: str = "fp32",
    ) -> Registration:
        """Plan the storage of ``specs``, create it and their state.

        Registering the same tensors again (a reattached client) returns the same plan and storage.  A
        rank restored from a previous daemon's job file must be registered with the tensors it had; its
        state is reopened and its params are installed from the master into the new storage.
        """
        grads_in_state = grads_in_state or exchange is Exchange.STAGED  # staged: always (``grads_in_state``)
        if self.layout is not None:
            self._settle()
            differs = _differences(
                (tuple(self.specs), tuple(specs)),
                ("grad buffers", len(self.layout.grad_offsets), grad_buffers),
                ("exchange", self.exchange.value, exchange.value),
                ("grads kept in the state", self.grads_in_state, grads_in_state),
                ("state_dtype", self.state.format.state_dtype, state_dtype),  # type: ignore[union-attr]
            )
            if differs:
                raise InvalidState(
                    f"rank {self.rank} of job {self.job_id!r} is already registered otherwise: {differs}; a "
                    "reattach registers what the job has (the same model and OffloadAdam settings)"
                )
            self.groups = tuple(groups)
            return self._registration()
        restored = self.restored
        if restored is not None:
            differs = _differences(
                (tuple(restored.specs), tuple(specs)),
                ("grad buffers", restored.grad_buffers, grad_buffers),
                ("exchange", restored.exchange.value, exchange.value),
                ("grads kept in the state", restored.grads_in_state, grads_in_state),
                ("state_dtype", restored.state_dtype, state_dtype),
            )
            if differs:
                raise InvalidState(
                    f"rank {self.rank} of job {self.job_id!r} was restored otherwise: {differs}; register exactly "
                    "what it had to continue (the same model and OffloadAdam settings)"
                )
            placement = restored.placement
        if not groups:
            raise InvalidArgument("register at least one param group")
        for spec in specs:
            if spec.group >= len(groups):
                raise InvalidArgument(f"tensor {spec.name!r} names group {spec.group}, but {len(groups)} were given")
        # int8 moments are quantized in blocks of the flat space: each tensor starts one, so a block never
        # holds two tensors' elements (which an update of one of them would re-quantize)
        layout = plan_layout(
            [LayoutSpec(s.name, tuple(s.shape), s.dtype, s.group) for s in specs],
            bucket_nbytes=1 << 62,
            grad_buffers=grad_buffers,
            element_align=element_align(state_dtype),
        )
        keys = state_keys_for(layout.dtype, placement, grad_buffers, exchange, grads_in_state)
        fmt = StateFormat(keys, layout.dtype, state_dtype)
        storage, storage_id = make_storage(layout.nbytes) if exchange is Exchange.SHARED else (None, 0)
        try:
            state = make_state(layout.numel, fmt)
            if state_dtype != "fp32":
                self.runner.kernel.prepare(state_dtype)
        except BaseException:
            if storage is not None:
                storage.close()
            raise
        self.storage, self.storage_id, self.state, self.layout = storage, storage_id, state, layout
        self._regions = {}
        if storage is not None:
            self._storage_bytes = torch.frombuffer(storage.view(0, storage.nbytes), dtype=torch.uint8)
        self.placement = placement
        self.exchange = exchange
        self.specs = tuple(specs)
        self.groups = tuple(groups)
        self.records = [TensorRecord(slot.index, spec, slot) for slot, spec in zip(layout.slots, specs, strict=True)]
        if restored is not None:
            for rec, step in zip(self.records, restored.steps, strict=True):
                rec.step = step
            self.last_step = restored.last_step
            self.skipped_steps = restored.skipped_steps
            self.restored = None
            self.phase.move(RankPhase.IDLE)
            if restored.failed_step:
                self.phase.fail(restored.failed_step, "recorded as failed by the previous daemon")
            else:
                self._install(range(len(self.records)), force=True)
        else:
            self.phase.move(RankPhase.IDLE)
        return self._registration()

    def _registration(self) -> Registration:
        layout, storage, placement = self.layout, self.storage, self.placement
        if layout is None or self.state is None or placement is None:  # pragma: no cover - callers check
            raise InvalidState("not registered")
        if storage is None:
            return Registration((), placement, self.state.keys, None)
        slots = tuple(
            TensorSlot(
                slot.index,
                MemRef(self.storage_id, layout.param_offset + slot.slot_offset, slot.nbytes),
                tuple(MemRef(self.storage_id, g + slot.slot_offset, slot.nbytes) for g in layout.grad_offsets),
            )
            for slot in layout.slots
        )
        return Registration(slots, placement, self.state.keys, storage)

    def _parts(self) -> tuple[Layout, StateChunks]:
        if self.layout is None or self.state is None:
            raise InvalidState(f"rank {self.rank} of job {self.job_id!r} has not registered tensors yet")
        return self.layout, self.state

    def _region(self, offset: int) -> torch.Tensor:
        layout = self.layout
        if layout is None:  # pragma: no cover - callers check
            raise InvalidState("not registered")
        region = self._regions.get(offset)
        if region is None:
            dtype = dtypes.by_name(layout.dtype).torch
            region = self._regions[offset] = self._storage_bytes[offset : offset + layout.region_nbytes].view(dtype)
        return region

    @property
    def master_in_params(self) -> bool:
        return self.state is not None and "master" not in self.state.keys

    @property
    def grads_in_state(self) -> bool:
        """The grads are in the ``grad`` state key (staged, or released by the client as they land)."""
        return self.state is not None and "grad" in self.state.keys

    @property
    def staged(self) -> bool:
        """The params live on the trainer's device, not in the storage: grads and params are staged
        through the window (the ``grad`` and ``master`` keys)."""
        return self.storage is None

    # ----------------------------------------------------------------- waiting and failing

    def _settle(self) -> None:
        """Before any request: wait for a delayed update (its failure fails the rank) and refuse when FAILED."""
        if self._delayed is not None:
            future, self._delayed = self._delayed, None
            started = time.perf_counter()
            try:
                health.wait(future)  # the pipeline thread's own beacon says whether the update moves
            except BaseException as exc:
                self.phase.fail(self._delayed_step, _reason(exc))
            else:
                self.phase.move(RankPhase.IDLE)
            finally:
                self.timings["wait_s"] += time.perf_counter() - started
        self.phase.check_usable()

    def _wait_queued(self) -> None:
        """Before state is read or written: wait for the updates an open overlapped attempt queued on the
        pipeline thread (their step counts are advanced already), so a read sees each tensor's update whole
        and a write does not race one.  The attempt stays open; a failed update is the attempt's to report
        when it closes (its future raises again there)."""
        attempt = self._attempt
        if attempt is None:
            return
        for future in attempt.futures:
            with contextlib.suppress(BaseException):
                health.wait(future)

    def _close_attempt(self, attempt: Attempt) -> None:
        """Wait for an attempt's updates; the ones that ran count, a failure fails the rank."""
        self._attempt = None
        error: BaseException | None = None
        for future in attempt.futures:
            try:
                health.wait(future)
            except BaseException as exc:
                error = error or exc
        if attempt.applied:
            self.last_step = max(self.last_step, attempt.step)
        if error is not None:
            self.phase.fail(attempt.step, _reason(error))
        else:
            self.phase.move(RankPhase.IDLE)

    def _target(self, grad_buffer: int, *, write_params: bool) -> UpdateTarget:
        layout, _ = self._parts()
        if self.staged:
            return UpdateTarget(grads=None, params=None, master_in_params=False, write_params=False)
        return UpdateTarget(
            grads=None if self.grads_in_state else self._region(layout.grad_offsets[grad_buffer]),
            params=self._region(layout.param_offset),
            master_in_params=self.master_in_params,
            write_params=write_params,
        )

    def _check_buffer(self, grad_buffer: int) -> None:
        layout, _ = self._parts()
        if grad_buffer >= len(layout.grad_offsets):
            raise InvalidArgument(
                f"grad_buffer {grad_buffer} does not exist (the layout has {len(layout.grad_offsets)})"
            )

    @staticmethod
    def _check_loss_scale(loss_scale: float) -> None:
        if not (loss_scale > 0 and math.isfinite(loss_scale)):
            raise InvalidArgument(f"loss_scale must be a positive finite number, got {loss_scale}")

    def _step_grads(self, grad_buffer: int) -> torch.Tensor | None:
        """Where a step's grads are: grad buffer ``grad_buffer`` of the storage, or None where they are staged in
        the state's ``grad`` key."""
        layout, _ = self._parts()
        return None if self.grads_in_state else self._region(layout.grad_offsets[grad_buffer])

    def _check_groups(self, groups: Sequence[ParamGroup]) -> None:
        if groups and len(groups) != len(self.groups):
            raise InvalidArgument(f"the message carries {len(groups)} param groups, {len(self.groups)} are registered")

    def _chunk_ranges(self, ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """The ``(chunk, lo, hi)`` ranges of the tensors ``ids``."""
        _, state = self._parts()
        return [
            r for tid in ids for r in chunk_ranges(self.records[tid].start, self.records[tid].stop, state.chunk_numel)
        ]

    def _advance(self, ids: Sequence[int], groups: Sequence[ParamGroup]) -> list[Piece]:
        """The pieces of an update of ``ids``; from here on they count as stepped."""
        _, state = self._parts()
        pieces = plan_pieces(self.records, ids, groups, state.chunk_numel, align=state.format.block)
        for tid in ids:
            self.records[tid].step += 1
        return pieces

    # ----------------------------------------------------------------- the step

    def bucket_ready(self, msg: BucketReady) -> None:
        """The overlapped update: apply a bucket now, on the rank's pipeline thread."""
        if self.phase.phase is not RankPhase.OVERLAPPING:
            self._settle()
        else:
            self.phase.check_usable()
        self._check_buffer(msg.grad_buffer)
        self._check_groups(msg.groups)
        ids = check_ids(msg.tensor_ids, len(self.records))
        attempt = self._attempt
        if attempt is None:
            if msg.step <= self.last_step:
                raise InvalidArgument(f"bucket for step {msg.step}, but step {self.last_step} was already applied")
            attempt = Attempt(msg.step, msg.attempt, msg.grad_buffer, tuple(msg.groups))
        elif (attempt.step, attempt.attempt) != (msg.step, msg.attempt):
            raise InvalidState(
                f"a bucket of step {msg.step} attempt {msg.attempt} while attempt {attempt.attempt} of step "
                f"{attempt.step} is open; ABORT it first"
            )
        if tuple(msg.groups) != attempt.groups or msg.grad_buffer != attempt.grad_buffer:
            raise InvalidArgument(f"buckets of step {msg.step} carry different hyper-parameters or grad buffers")
        again = sorted(set(ids) & attempt.applied)
        if again:
            raise InvalidState(
                f"tensor {again[0]} was already updated in step {msg.step}; an overlapped update needs each "
                "gradient exactly once per step (no accumulation over several backward passes)"
            )
        self._install(ids)
        if self._attempt is None:
            self._attempt = attempt
            self.phase.move(RankPhase.OVERLAPPING)
        _, state = self._parts()
        pieces = self._advance(ids, attempt.groups)
        attempt.applied.update(ids)
        self.overlapped_tensors += len(ids)
        target = self._target(msg.grad_buffer, write_params=True)
        attempt.futures.append(self.runner.run(state, pieces, target, 1.0, wait=False))

    def abort(self, msg: Abort | None = None) -> Aborted:
        """Close the open attempt (``msg`` None: the client is gone, whatever it was)."""
        attempt = self._attempt
        applied = 0
        if attempt is not None and (msg is None or (attempt.step, attempt.attempt) == (msg.step, msg.attempt)):
            applied = len(attempt.applied)
            self._close_attempt(attempt)
        step, number = (msg.step, msg.attempt) if msg is not None else (0, 0)
        return Aborted(step=step, attempt=number, last_step=self.last_step, tensors_applied=applied)

    def step(self, msg: Step) -> StepDone:
        attempt = self._attempt
        if attempt is None:
            self._settle()
        else:
            self.phase.check_usable()
            if (attempt.step, attempt.attempt) != (msg.step, msg.attempt):
                raise InvalidState(
                    f"STEP for step {msg.step} attempt {msg.attempt} while attempt {attempt.attempt} of step "
                    f"{attempt.step} is open; ABORT it first"
                )
        layout, state = self._parts()
        # validate everything before anything changes
        if attempt is None and msg.step <= self.last_step:
            raise InvalidArgument(f"step {msg.step} was already applied (last step {self.last_step})")
        self._check_buffer(msg.grad_buffer)
        self._check_groups(msg.groups)
        self._check_loss_scale(msg.loss_scale)
        if msg.max_grad_norm is not None and msg.clip_coef is not None:
            raise InvalidArgument(
                "a STEP gives max_grad_norm (the daemon clips by the rank's norm) or clip_coef (the trainer's, "
                "from the global norm), not both"
            )
        if msg.delayed and not self.staged and (self.master_in_params or len(layout.grad_offsets) < 2):
            raise InvalidArgument(
                "a delayed STEP needs a rank registered for the delayed update (two grad buffers, and a master "
                "apart from the params the trainer reads meanwhile); register with grad_buffers=2"
            )
        ids = check_ids(msg.tensor_ids, len(self.records))
        groups = tuple(msg.groups) or self.groups
        if attempt is not None:
            self._close_attempt(attempt)  # the overlapped updates of this step are done (or the rank failed)
            self.phase.check_usable()
            rules = msg.loss_scale != 1.0 or msg.max_grad_norm is not None or msg.clip_coef is not None
            if rules or msg.skip or groups != attempt.groups:
                raise InvalidState(
                    f"step {msg.step} asks for loss scaling, clipping or other hyper-parameters, but "
                    f"{len(attempt.applied)} tensor(s) were already updated as their buckets landed; they keep "
                    "that update (the step counts as applied for them only)"
                )
            ids = [tid for tid in ids if tid not in attempt.applied]
        t0 = time.perf_counter()
        grads = self._step_grads(msg.grad_buffer)
        inv_scale = 1.0 / msg.loss_scale
        stats = None
        if msg.max_grad_norm is not None and not msg.skip:
            stats = self._grad_stats(grads, ids, inv_scale)
        decision = decide(stats, inv_scale=inv_scale, max_grad_norm=msg.max_grad_norm, scaler_found_inf=msg.skip)
        self.groups = groups  # the statistics were taken: from here on the step is applied or skipped
        t1 = time.perf_counter()
        self.timings["stats_s"] += t1 - t0
        if decision.skip:
            self.skipped_steps += 1
        done = functools.partial(
            StepDone,
            attempt=msg.attempt,
            nonfinite=decision.nonfinite,
            skipped_steps=self.skipped_steps,
            grad_norm=decision.grad_norm,
        )
        if decision.skip:
            return done(step=self.last_step, skipped=True)
        grad_scale = decision.grad_scale if msg.clip_coef is None else inv_scale * msg.clip_coef
        if msg.delayed:
            fresh = self._uninstalled.intersection(ids)  # installed just now from the master: no edit to adopt
            self._install(ids)
            edited = [tid for tid in ids if tid not in fresh]
            if edited and not self.master_in_params and not self.staged:
                params = self._region(layout.param_offset)
                self.runner.adopt(state, self._chunk_ranges(edited), params)
            pieces = self._advance(ids, groups)
            self.last_step = msg.step
            self._delayed = self.runner.run(
                state,
                pieces,
                self._target(msg.grad_buffer, write_params=False),
                grad_scale,
                consume=self.grads_in_state,
                wait=False,
            )
            self._delayed_step = msg.step
            self._uninstalled.update(ids)
            self.phase.move(RankPhase.DELAYED)
            return done(step=msg.step, params_ready=False)
        self._install(ids)
        pieces = self._advance(ids, groups)
        self.last_step = msg.step
        try:
            target = self._target(msg.grad_buffer, write_params=True)
            self.runner.run(state, pieces, target, grad_scale, consume=self.grads_in_state)
        except BaseException as exc:
            self.phase.fail(msg.step, _reason(exc))
            raise StepFailed(msg.step, _reason(exc)) from exc
        t2 = time.perf_counter()
        return done(step=msg.step, timings=(("stats", t1 - t0), ("update", t2 - t1)))

    def grad_norm(self, msg: GradNorm) -> GradNormReply:
        """GRAD_NORM: the statistics a STEP with ``max_grad_norm`` takes of the same grads, with nothing changed
        (the trainer decides on every rank's, then sends the STEP with its ``clip_coef``)."""
        if self._attempt is not None:
            raise InvalidState(
                f"GRAD_NORM while attempt {self._attempt.attempt} of step {self._attempt.step} is open: tensors of "
                "it were updated as their buckets landed, so no norm of this step's grads exists; ABORT it first"
            )
        self._settle()
        self.phase.check_usable()
        self._check_buffer(msg.grad_buffer)
        self._check_loss_scale(msg.loss_scale)
        ids = check_ids(msg.tensor_ids, len(self.records))
        started = time.perf_counter()
        grads = self._step_grads(msg.grad_buffer)
        stats = self._grad_stats(grads, ids, 1.0 / msg.loss_scale)
        self.timings["stats_s"] += time.perf_counter() - started
        return GradNormReply(sq_norm=stats.sq_norm, nonfinite=stats.found_inf)

    def _grad_stats(self, grads: torch.Tensor | None, ids: Sequence[int], inv_scale: float) -> GradStats:
        """The statistics of the unscaled grads of ``ids`` (in the storage, or staged in the ``grad`` key).

        Taken over the same pieces (each tensor cut at the state's chunk boundaries) and summed in the same
        order whichever exchange holds the grads, so both exchanges get the same norm to the last bit."""
        futures = []
        _, state = self._parts()
        for tid in ids:
            rec = self.records[tid]
            for chunk, a, b in chunk_ranges(rec.start, rec.stop, state.chunk_numel):
                if grads is not None:
                    task = functools.partial(self.kernel.grad_stats, grads[a:b], inv_scale)
                else:
                    task = functools.partial(self._staged_stats, chunk, a, b, inv_scale)
                futures.append(self.scheduler.run_here(self.tenant, task))
        return combine_grad_stats(health.wait(future) for future in futures)

    def _staged_stats(self, chunk: int, a: int, b: int, inv_scale: float) -> tuple[float, bool]:
        _, state = self._parts()
        c0 = chunk * state.chunk_numel
        tensors = state.acquire(chunk, ("grad",), advance=False)
        try:
            if tensors.grad is None:
                raise InvalidState("the rank keeps no staged grads")
            return self.kernel.grad_stats(tensors.grad[a - c0 : b - c0], inv_scale)
        finally:
            state.release(chunk, ("grad",), dirty=False)

    # ----------------------------------------------------------------- params and state

    def _install(self, ids: Sequence[int] | range, *, force: bool = False) -> None:
        """Cast the master of tensors whose storage does not hold it yet into the storage."""
        layout, state = self._parts()
        todo = list(ids) if force else [tid for tid in ids if tid in self._uninstalled]
        if not todo or self.master_in_params or self.staged:
            self._uninstalled.difference_update(todo)
            return
        params = self._region(layout.param_offset)
        self.runner.install(state, self._chunk_ranges(todo), params)
        self._uninstalled.difference_update(todo)

    def write_params(self, ids: Sequence[int]) -> None:
        """FETCH_PARAMS: wait for a delayed update and install its params (``ids`` empty: all) into the storage."""
        self._settle()
        self._install(check_ids(ids, len(self.records)))

    # ----------------------------------------------------------------- lifecycle

    def quiesce(self) -> None:
        """Wait for a delayed update (its failure fails the rank), so the state is that of the last step."""
        self._settle()

    def close_pipeline(self) -> None:
        """Stop taking work: close an open attempt, finish a delayed update, stop the pipeline thread."""
        if self._attempt is not None:
            self._close_attempt(self._attempt)
        if self._delayed is not None:
            with contextlib.suppress(TiermemError):
                self._settle()  # a failure is recorded in the phase
        self.runner.close()

    def close(self, *, keep_swap: bool = False) -> None:
        """Release everything; the state is zeroed and freed (its swap files kept when ``keep_swap``)."""
        self.close_pipeline()
        if self.state is not None:
            self.state.close(remove=not (keep_swap and hasattr(self.state, "persist")))
            self.state = None
        self._window_bytes = torch.empty(0, dtype=torch.uint8)
        self._storage_bytes = torch.empty(0, dtype=torch.uint8)
        self._regions = {}  # they hold the storage's mapping
        if self.storage is not None:
            self.storage.close()
            self.storage = None

    def export(self, placement: Placement) -> RankRecord:
        """What a restarted daemon needs to reopen this rank (its state itself is in the swap store)."""
        return RankRecord(
            rank=self.rank,
            placement=placement,
            specs=self.specs,
            groups=self.groups,
            grad_buffers=len(self.layout.grad_offsets) if self.layout else 1,
            steps=tuple(rec.step for rec in self.records),
            last_step=self.last_step,
            failed_step=self.phase.failed_step if self.phase.phase is RankPhase.FAILED else 0,
            skipped_steps=self.skipped_steps,
            exchange=self.exchange,
            grads_in_state=self.grads_in_state,
            state_dtype=self.state.format.state_dtype if self.state is not None else "fp32",
        )

    def stats(self) -> RankStats:
        state = self.state
        return RankStats(
            job_id=self.job_id,
            rank=self.rank,
            placement=self.placement,
            state_dtype=state.format.state_dtype if state is not None else "",
            last_step=self.last_step,
            skipped_steps=self.skipped_steps,
            failed=self.phase.phase is RankPhase.FAILED,
            overlapped_tensors=self.overlapped_tensors,
            tensors=len(self.records),
            numel=self.layout.numel if self.layout else 0,
            window_nbytes=self.window.nbytes,
            storage_nbytes=self.storage.nbytes if self.storage is not None else 0,
            state_keys=len(state.keys) if state is not None else 0,
            adopted_elements=self.runner.adopted,
            kernel_path=self.runner.kernel_path,
            updates=self.runner.updates,
            updated_elements=self.runner.updated_elements,
            update_s=self.runner.update_s,
            update_seconds=self.runner.update_seconds.snapshot(),
            grad_stats_s=self.timings["stats_s"],
            wait_s=self.timings["wait_s"],
            staleness_steps=1 if self._delayed is not None and not self._delayed.done() else 0,
            state=state.stats() if state is not None else StateStats(cpu_nbytes=0),
        )


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _differences(specs: tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]], *facts: tuple[str, Any, Any]) -> str:
    """What a registration asks that differs from the rank's (empty: nothing): the first differing tensor, or
    the count, and each differing fact as "name held, not asked"."""
    held, asked = specs
    out = []
    if len(held) != len(asked):
        out.append(f"{len(held)} tensors, not {len(asked)}")
    else:
        for i, (a, b) in enumerate(zip(held, asked, strict=True)):
            if a != b:
                out.append(
                    f"tensor {i} is {a.name!r} {list(a.shape)} {a.dtype} (group {a.group}, {a.placement.value}), "
                    f"not {b.name!r} {list(b.shape)} {b.dtype} (group {b.group}, {b.placement.value})"
                )
                break
    out += [f"{name} {h}, not {a}" for name, h, a in facts if h != a]
    return "; ".join(out)

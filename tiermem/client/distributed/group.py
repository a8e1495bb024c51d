"""``RankGroup``: the sharding strategies' one view of their process group, and the global half of a step.

Each sharded optimizer (``ShardedOffloadAdam``, ``LayerShardedAdam``,
``ShardedPagedAdam``) is the one facade, ``ShardedOptimizer`` (``sharded``:
the start, the step, the counters, ``close()``), with its strategy, over an
``OffloadAdam`` per rank (its daemon link and its update).  What every
strategy needs of the group lives here once:

- who this rank is (``rank``, ``world_size``, the group), refused without
  ``torch.distributed``;
- ``collective``: every collective through one guard, so a rank that died or
  timed out surfaces as ``RankLost`` naming the phase, this rank and its step
  (``steps``: steps this optimizer completed, applied or skipped), never as a
  low-level error or a hang (the collectives have the group's timeout);
- ``schedule`` (ZeRO-3, ``start_schedule``): the collectives of the steps, on
  a group of their own with a short timeout (``schedule.Collectives``); the
  step's norm all-reduce is one of them;
- the start: rank 0's initial values broadcast (``broadcast_from_first``), the
  job id and token agreed (``agree_identity``), the node's daemon found or
  started (``node_client``), an action that must succeed on every rank or
  fail on every rank (``all_or_none``);
- the two-phase step's first phase, ``decide``: each rank's statistics of the
  grads it holds (sum of squares, whether they accumulated over several
  backward passes) are all-reduced and ``step_rules.decide`` turns the global
  ones, with the scaler's verdict, into the one ``StepDecision`` every rank
  applies (the second phase: the rank's STEP with that skip, inverse scale and
  clip coefficient).  One rank is the same exchange at world size 1: the
  all-reduce of one rank returns its own figures.

``ShardGrads`` is the statistics a ZeRO-3 rank keeps of the reduced grads it
sent to its daemon as they landed (the grads are not in the trainer at
``step()``), and the check ``ShardedGradScaler`` asks it for.  They stay on
the grads' device: a step reads them back once, with the all-reduced norm
(``RankGroup.read_back``, the one seam through which a step's grad statistics reach
the host; a test counts its calls).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tiermem.client.distributed.identity import agree_identity
from tiermem.client.distributed.node import node_client
from tiermem.client.distributed.scaler import shard_scaler_inputs
from tiermem.client.distributed.schedule import Collectives, Probe
from tiermem.client.link import Client
from tiermem.client.offload.optimizer import OffloadAdam
from tiermem.client.offload.options import OffloadOptions
from tiermem.core.errors import InvalidArgument, InvalidState, RankLost
from tiermem.core.step_rules import GradStats, StepDecision, decide
from tiermem.core.uncopyable import Uncopyable

__all__ = ["NotCopyable", "RankGroup", "ShardGrads", "check_max_grad_norm"]


def check_max_grad_norm(max_grad_norm: float | None) -> None:
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise InvalidArgument(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")


class NotCopyable(Uncopyable):
    """A sharded optimizer holds a connection to tiermemd and a place in a process group: ``copy.deepcopy``
    and ``pickle`` are refused, naming what to save instead."""

    def _not_copyable(self) -> TypeError:
        return TypeError(
            f"{type(self).__name__} holds a connection to tiermemd; save its state instead: full_state_dict() "
            "(torch.optim.AdamW's format, any world size) or state_dict()"
        )


def collective_device(process_group: Any) -> torch.device:
    """The device a collective of ``process_group`` takes tensors on: the current GPU where the group's only
    backend is NCCL (which has no host tensors), else the host (gloo, or torch's default pair of a CPU and a
    CUDA backend)."""
    if str(dist.get_backend(process_group)).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RankGroup:
    """See the module docstring.  ``who`` names the optimizer in errors; ``alone_hint`` says what to use
    without ``torch.distributed``."""

    def __init__(self, process_group: Any, who: str, *, alone_hint: str = "") -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidState(
                f"{who} needs torch.distributed initialised (torchrun, then torch.distributed.init_process_group)"
                + alone_hint
            )
        self.who = who
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.device = collective_device(process_group)
        """Where this group's collectives take their tensors (``collective_device``)."""
        self.steps = 0
        """Steps completed, applied or skipped (the step a ``RankLost`` names is the next one)."""
        self.job_id = ""
        self.token = ""
        self.schedule: Collectives | None = None
        """The steps' collectives (ZeRO-3: ``start_schedule``)."""

    @staticmethod
    def read_back(t: torch.Tensor) -> list[float]:
        """``t``'s values on the host: how a sharded step reads its all-reduced grad statistics back (on a
        device, the step's one wait for its reduced grads)."""
        return [float(v) for v in t.reshape(-1).tolist()]

    def start_schedule(self, timeout_s: float, probe: Probe | None = None) -> Collectives:
        """The group of the steps' collectives, each bounded by ``timeout_s`` (a collective over the group:
        every rank calls it once its arguments are checked)."""
        self.schedule = Collectives(self.group, self.rank, lambda: self.steps, timeout_s=timeout_s, probe=probe)
        return self.schedule

    def close(self) -> None:
        if self.schedule is not None:
            self.schedule.close()

    def global_rank(self, rank: int) -> int:
        """The default group's rank of the group's ``rank`` (what torch's ``src``/``dst`` take)."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def collective(self, during: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn`` over the group; a failure (a rank gone, a timeout) is ``RankLost(during, rank, steps)``."""
        kwargs.setdefault("group", self.group)
        return self.guard(during, fn, *args, **kwargs)

    def guard(self, during: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` (a collective, or a ``Work``'s ``wait``) with the same guard."""
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, dist.DistError) as exc:
            raise RankLost(during, self.rank, self.steps, exc) from exc

    # ----------------------------------------------------------------- the start

    def broadcast_from_first(self, tensors: Iterable[torch.Tensor]) -> None:
        """One truth to start from: rank 0's values, in place on every rank."""
        for t in tensors:
            self.collective("broadcast of the initial params", dist.broadcast, t, src=self.global_rank(0))

    def agree_identity(self, job_id: str | None, token: str | None) -> tuple[str, str]:
        """Rank 0's job id and token (given, or derived), the same on every rank (``identity``); the job the
        ranks' inner optimizers attach to."""
        self.job_id, self.token = agree_identity(self.collective, self.group, self.rank, job_id, token)
        return self.job_id, self.token

    def node_client(self, numels: Sequence[int], options: OffloadOptions, *, dtype: str) -> Client:
        """This rank's client of its node's daemon, for the inner optimizer ``options`` describe, of tensors of
        ``numels`` elements of ``dtype`` (``node``, which sizes a private daemon for every rank of the node)."""
        return node_client(self.collective, self.rank, self.world_size, numels, options, dtype=dtype)

    def inner_optimizer(self, params: list[Any], client: Client | None, options: OffloadOptions) -> OffloadAdam:
        """This rank's ``OffloadAdam`` with ``options`` (the record its node's daemon was sized by), in the
        agreed job (``agree_identity``), as rank ``rank`` of ``world_size``; whichever rank attaches first
        creates the job with the agreed token."""
        job = options.replace(
            job_id=self.job_id, token=self.token, create_job=True, rank=self.rank, world_size=self.world_size
        )
        return OffloadAdam(params, client=client, options=job)

    def all_or_none(self, what: str, action: Callable[[], None]) -> None:
        """Run ``action`` on every rank; if it fails on any, every rank raises (none hangs in a collective)."""
        error: BaseException | None = None
        try:
            action()
        except Exception as exc:
            error = exc
        outcomes: list[Any] = [None] * self.world_size
        self.collective(what, dist.all_gather_object, outcomes, None if error is None else f"{error}")
        if error is not None:
            raise error
        bad = [(r, e) for r, e in enumerate(outcomes) if e is not None]
        if bad:
            raise InvalidState(f"the {what} failed on rank {bad[0][0]}: {bad[0][1]}")

    # ----------------------------------------------------------------- the step's global facts

    def decide(
        self,
        sumsq: float | torch.Tensor | None,
        *,
        inv_scale: float = 1.0,
        max_grad_norm: float | None,
        scaler_found_inf: bool = False,
        skip_nonfinite: bool = False,
    ) -> StepDecision:
        """The step every rank applies, from this rank's sum of squares of its (scaled) grads (None: no norm is
        needed) and the scaler's verdict (already global)."""
        stats = None
        if sumsq is not None:
            total = torch.as_tensor(sumsq, dtype=torch.float64).reshape(1).to(self.device)  # a device's stays there
            if self.schedule is not None:
                self.schedule.run("all-reduce", "the grad norm", dist.all_reduce, total)
            else:
                self.collective("norm's all-reduce", dist.all_reduce, total)
            (global_sumsq,) = self.read_back(total)
            stats = GradStats.of(global_sumsq * inv_scale * inv_scale, False)
        return decide(
            stats,
            inv_scale=inv_scale,
            max_grad_norm=max_grad_norm,
            scaler_found_inf=scaler_found_inf,
            skip_nonfinite=skip_nonfinite,
        )


class ShardGrads:
    """What a ZeRO-3 rank knows of the reduced grads it sent to its daemon this step: their sum of squares
    (per key, a submodule's grads: one sent again without accumulating replaces its figure), whether one was
    non-finite, whether one was added to a grad already there (accumulation), and what ``ShardedGradScaler``
    asked.

    The figures cost a pass over each reduced grad (in fp64) and a wait for it, so they are taken only when
    something asks for them (``watching``): clipping (``clipping``), or a ``ShardedGradScaler``, which asks
    at every step; whether one does is known once the first step is decided (not refused), and the steps until
    then take them either way.  A scaler that first asks at a later step is refused (``check``)."""

    def __init__(self, *, clipping: bool = False) -> None:
        self.clipping = clipping
        self.scaled: bool | None = None
        """Whether a ``ShardedGradScaler`` checks this optimizer's grads (None: not known before the first step
        ends)."""
        self.sumsq: dict[Hashable, torch.Tensor] = {}
        """Per key, the sum of squares of its reduced grads, a 0-d fp64 tensor on the grads' device."""
        self._seen: list[torch.Tensor] = []
        """Every reduced grad's sum of squares this step (accumulated ones too: the overflow check)."""
        self.accumulated = False
        self.unchecked = False
        """A reduced grad of this step went to the daemon without its figures."""
        self.unscaled_by = 1.0
        """The inverse scale ``ShardedGradScaler.unscale_`` gave (applied by the daemon at ``step()``)."""
        self.scale_checked = False

    @property
    def watching(self) -> bool:
        """Whether ``add`` takes the figures of the grads."""
        return self.clipping or self.scaled is not False

    def set_clipping(self, clipping: bool, name: str) -> None:
        """Take the figures for clipping, or not, from this step on: refused once a grad of this step went to
        the daemon (``name``: the optimizer's), whose figures would be missing or half of the step's."""
        if clipping != self.clipping and (self._seen or self.unchecked):
            raise InvalidState(
                f"set_max_grad_norm() on {name} after some of this step's grads were reduced: the global norm "
                "needs all of them; call it before the step's first backward (or after step())"
            )
        self.clipping = clipping

    def add(self, key: Hashable, grad: torch.Tensor, *, accumulate: bool = False) -> None:
        """A reduced grad went to the daemon (``accumulate``: added to the one there; its square is then no
        figure of one pass, and only marks the step as accumulated)."""
        if accumulate:
            self.accumulated = True
        if not self.watching:
            self.unchecked = True
            return
        sq = torch.linalg.vector_norm(grad, dtype=torch.float64).square()  # on the grad's device: no wait
        self._seen.append(sq)
        if not accumulate:
            self.sumsq[key] = sq

    def _overflowed(self) -> torch.Tensor | None:
        """Whether a reduced grad of this step held an inf/nan, as a 0-d tensor where the grads are (None: no
        grad was seen)."""
        if not self._seen:
            return None
        return torch.stack(self._seen).isfinite().all().logical_not()

    @property
    def nonfinite(self) -> bool:
        """Whether a reduced grad of this step held an inf/nan (a read: a device's grads are waited for)."""
        flag = self._overflowed()
        return flag is not None and bool(flag)

    @property
    def total(self) -> torch.Tensor:
        """The sum of squares of this step's reduced grads (a 0-d fp64 tensor on their device)."""
        if not self.sumsq:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack(list(self.sumsq.values())).sum()

    def check(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> torch.Tensor:
        """``ShardedGradScaler``'s question: whether this rank's reduced grads overflowed (it all-reduces the
        flag); the inverse scale is applied by the daemon at ``step()``."""
        if self.unchecked:
            raise InvalidState(
                "a ShardedGradScaler asked whether this step's reduced grads overflowed, but they went to the "
                "daemons unchecked: without max_grad_norm a ZeRO-3 optimizer checks them only if a scaler asked "
                "at its first step; use the scaler from the first step"
            )
        self.unscaled_by = float(inv_scale)
        self.scale_checked = True
        flag = self._overflowed()
        if flag is not None:  # on the flags' device, without reading it here
            found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device, found_inf.dtype)))
        return found_inf

    def decide(
        self,
        group: RankGroup,
        optimizer: Any,
        max_grad_norm: float | None,
        held: Callable[[], float],
        *,
        accumulated: bool = False,
    ) -> StepDecision:
        """The step every rank applies: the scaler's hand-over on ``optimizer`` (``shard_scaler_inputs``) and,
        with ``max_grad_norm``, the global norm of the shards (``RankGroup.decide``).  Where the step added
        several backward passes' grads in the daemon (``accumulated``, or an ``add`` with ``accumulate``), the
        figures here are each pass's: ``held`` gives this rank's sum of squares of their sum, as the daemon
        holds it (GRAD_NORM)."""
        inv_scale, skip = shard_scaler_inputs(optimizer, checked=self.scale_checked, unscaled_by=self.unscaled_by)
        total = None if max_grad_norm is None or skip else self.total
        if total is not None and (self.accumulated or accumulated):
            total = torch.tensor(held(), dtype=torch.float64)
        decision = group.decide(total, inv_scale=inv_scale, max_grad_norm=max_grad_norm, scaler_found_inf=skip)
        if self.scaled is None:  # the first step goes on: from now on the figures are taken if a scaler asked
            self.scaled = self.scale_checked
        return decision

    def new_step(self) -> None:
        self.sumsq.clear()
        self._seen.clear()
        self.accumulated = False
        self.unchecked = False
        self.scale_checked = False

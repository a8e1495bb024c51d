"""``Collectives``: where a sharded rank issues the collectives of its steps, each named and bounded in time.

``torch.distributed`` matches collectives by the order each rank issues
them: two ranks that issue an all-gather and a reduce-scatter in different
orders wait for each other forever.  A rank's order is fixed by who submits
them, never by timing:

- ``ShardedOffloadAdam`` (ZeRO-2): one reduce-scatter a bucket, from the
  last bucket to the first (during backward with ``overlap_comm``, a bucket
  only after the ones behind it), the statistics' all-reduce, then one
  all-gather a bucket, first to last, on the trainer's thread;

- ``ShardedPagedAdam``: the trainer's thread submits every fetch and grad
  push to the pager's one I/O thread, at points fixed by the module order
  and the autograd order (a submodule's fetch when its forward or backward
  needs it, or a recorded use ahead; a submodule's grads once all of them
  have landed, the incomplete ones at the end of the backward pass, in
  module order); the I/O thread runs them one at a time, in that order;
- ``LayerShardedAdam``: the forward and backward hooks issue them on the
  trainer's thread, in the same two orders.

This object issues them, one at a time, on a process group of its own over
the same ranks, made with ``timeout_s`` (``GroupPool``): a collective that waits longer (a
rank gone, stuck, or issuing another collective) fails there, and becomes
``RankLost`` naming the collective, the submodule, its number in the step
and the step, on every rank that waits.  ``counts`` holds the collectives of
the running step by kind (``last_counts``: those of the last step).  The
start of a job (the initial broadcast, the identity, the node's daemon) and
the checkpoints keep the caller's group and its timeout: a private daemon
starting, or a rank reading its state from NVMe, may take longer.

``Probe``: the declared point where a caller watches the schedule, or slows
it down (the schedule-fuzzing tests inject delays through it), called by the
pager (``fetch``, ``grad`` on the trainer's thread, ``io`` on its I/O
thread) and here (``collective``, before each one is issued).
"""

from __future__ import annotations

import collections
import datetime
import math
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from tiermem.client.offload.paging import Probe
from tiermem.core.errors import InvalidArgument, RankLost

__all__ = [
    "ALL_GATHER",
    "DEFAULT_TIMEOUT_S",
    "GROUPS",
    "REDUCE_SCATTER",
    "Collectives",
    "GroupPool",
    "Probe",
    "check_timeout",
]

# torch 2.13 renamed the tensor collectives (the old names warn); older releases have only the old ones
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

DEFAULT_TIMEOUT_S = 30.0
"""How long a ZeRO-3 collective waits for the other ranks before it is ``RankLost``: longer than a step's
difference between ranks on one node (each rank's update of its equal shard), well under gloo's and NCCL's
default of 30 and 10 minutes."""


def check_timeout(timeout_s: float) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < math.inf:
        raise InvalidArgument(f"collective_timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    return float(timeout_s)


class GroupPool:
    """Process groups with a timeout, over given ranks, kept for the next schedule when one closes.

    A group is made by ``torch.distributed.new_group`` (by every rank of the world where it spans the
    world; by its own ranks alone otherwise) and never destroyed: torch names a group by a count of the
    live ones, so a new group made after one was destroyed can take the dead one's name and meet its keys
    in the store.  A schedule that closes gives its group back, and the next schedule over the same ranks
    takes it (every rank makes and closes its optimizers in the same order, so every rank takes the same
    group); one that failed (``RankLost``) is dropped.  Two schedules alive at once get two groups, so
    their collectives never interleave."""

    def __init__(self) -> None:
        self.free: dict[tuple[tuple[int, ...], str, float], list[Any]] = {}
        self.world: Any = None

    def take(self, process_group: Any, timeout_s: float) -> tuple[Any, tuple[tuple[int, ...], str, float]]:
        """A group over ``process_group``'s ranks and backend with ``timeout_s``, and its key for ``give``."""
        world = dist.group.WORLD
        if world is not self.world:  # torch.distributed was made again: the groups kept are gone
            self.free.clear()
            self.world = world
        ranks = tuple(dist.get_process_group_ranks(process_group if process_group is not None else world))
        key = (ranks, str(dist.get_backend(process_group)), timeout_s)
        kept = self.free.get(key)
        if kept:
            return kept.pop(), key
        group = dist.new_group(
            list(ranks),
            timeout=datetime.timedelta(seconds=timeout_s),
            backend=key[1],
            use_local_synchronization=len(ranks) < dist.get_world_size(),  # a subgroup: only its ranks call
        )
        return group, key

    def give(self, group: Any, key: tuple[tuple[int, ...], str, float]) -> None:
        if dist.is_initialized() and dist.group.WORLD is self.world:
            self.free.setdefault(key, []).append(group)


GROUPS = GroupPool()
"""This process's groups for schedules."""


class Collectives:
    """See the module docstring.  ``process_group``: the ranks (None: every rank); ``rank`` this rank in it;
    ``steps()``: the steps completed (the step a ``RankLost`` names is the next one)."""

    def __init__(
        self,
        process_group: Any,
        rank: int,
        steps: Callable[[], int],
        *,
        timeout_s: float,
        probe: Probe | None = None,
    ) -> None:
        self.timeout_s = check_timeout(timeout_s)
        self.rank = rank
        self.steps = steps
        self.probe = probe
        self.group, self._key = GROUPS.take(process_group, self.timeout_s)
        self.failed = False
        """A collective failed: the group is not given back."""
        self.counts: collections.Counter[str] = collections.Counter()
        """This step's collectives by kind (``all-gather``, ``reduce-scatter``, ...)."""
        self.last_counts: collections.Counter[str] = collections.Counter()
        """The last step's."""

    def run(self, kind: str, unit: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, group=..., **kwargs)``, the step's next collective (``kind``, for the submodule ``unit``);
        an ``async_op`` one returns its work, which ``wait`` takes."""
        if self.probe is not None:
            self.probe.at("collective", f"{kind} of {unit}")
        self.counts[kind] += 1
        number = sum(self.counts.values())
        kwargs.setdefault("group", self.group)
        return self._guard(kind, unit, number, fn, *args, **kwargs)

    def wait(self, kind: str, unit: str, work: Any) -> None:
        """Wait for the work of an ``async_op`` collective (``run``'s), within the same limit."""
        self._guard(kind, unit, None, work.wait)

    def _guard(
        self, kind: str, unit: str, number: int | None, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, dist.DistError) as exc:
            self.failed = True
            which = "awaited" if number is None else f"the step's collective {number}"
            during = f"{kind} of {unit} ({which}, limit {self.timeout_s:g} s)"
            raise RankLost(during, self.rank, self.steps(), exc) from exc

    def end_step(self) -> None:
        self.last_counts = self.counts
        self.counts = collections.Counter()

    def close(self) -> None:
        """Give the group back for the next schedule (once; not one where a collective failed)."""
        group, self.group = self.group, None
        if group is not None and not self.failed:
            GROUPS.give(group, self._key)

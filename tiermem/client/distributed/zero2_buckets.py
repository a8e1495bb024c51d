"""ZeRO-2's buckets on one rank: one record per bucket and per piece, and the collectives over them.

``BucketRounds`` owns what a ZeRO-2 rank keeps of its layout
(``tiermem.core.shard_plan``) between and during steps:

- ``RankPiece``: a piece this rank keeps (elements ``[lo, hi)`` of a param):
  its host param (a tensor of the inner optimizer), its entry in the daemon's
  shared storage (the shared exchange; None otherwise) and this step's mean
  grad (``grad``, set by ``reduce_scatter``);
- ``RankBucket``: a bucket: this rank's pieces in it, where its slices are
  the daemon's storage itself (``param_slice``, ``grad_slice``: the
  collectives read and write the daemon's memory, no copy through the
  transfer buffer), how many grads complete it during backward (``wanted``,
  ``left``), its own buffers and its reduce in flight (``overlap_comm``);
- the rounds: ``reduce_scatter`` at ``step()`` or, with ``overlap_comm``, each
  bucket as soon as its grads are complete during backward (``grad_landed``),
  from the last bucket to the first on every rank so all ranks issue the
  collectives in one order, checked again at ``step()``; ``all_gather``
  after an update.

Every collective goes through the optimizer's schedule (``Collectives``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tiermem.client.distributed.schedule import ALL_GATHER, REDUCE_SCATTER, Collectives
from tiermem.client.offload.optimizer import OffloadAdam
from tiermem.client.offload.shared import TensorEntry
from tiermem.core import dtypes
from tiermem.core.shard_plan import Bucket, Piece, ShardLayout

__all__ = ["BucketRounds", "RankBucket", "RankPiece"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RankPiece:
    """A piece of a param this rank keeps (see the module docstring)."""

    plan: Piece
    param: torch.nn.Parameter
    """Its host tensor, a param of the inner optimizer."""
    entry: TensorEntry | None = None
    grad: torch.Tensor | None = None
    """This step's mean grad of the piece, once reduced."""


@dataclass(eq=False)
class _Reduce:
    """A bucket's reduce-scatter: its collective while in flight, where the slice lands, and the grads it read
    with their versions (``BucketRounds._changed``)."""

    work: Any
    out: torch.Tensor
    seen: list[tuple[torch.Tensor | None, int]]


@dataclass(eq=False)
class RankBucket:
    """A bucket as this rank sees it (see the module docstring)."""

    index: int
    plan: Bucket
    pieces: list[RankPiece] = field(default_factory=list)
    """This rank's pieces in it, in their order in the rank's slice."""
    param_slice: torch.Tensor | None = None
    grad_slice: torch.Tensor | None = None
    wanted: int = 0
    """Params whose grads complete the bucket during backward."""
    left: int = 0
    """Of those, the ones not landed yet this round."""
    own: tuple[torch.Tensor, torch.Tensor] | None = None
    """Its own flat-grad and slice buffers (``overlap_comm``), kept for the next steps."""
    reduce: _Reduce | None = None
    """Its reduce this round, once issued."""

    @property
    def name(self) -> str:
        return f"bucket {self.index}"


class BucketRounds:
    """See the module docstring.  Made at the start over the model's params (after rank 0's values were
    broadcast: the pieces copy them); ``attach`` binds it to the inner optimizer once attached."""

    def __init__(
        self,
        layout: ShardLayout,
        rank: int,
        params: Sequence[torch.nn.Parameter],
        *,
        dtype: dtypes.WorkingDType,
        device: torch.device,
        schedule: Collectives,
    ) -> None:
        self.layout = layout
        self.world_size = layout.world_size
        self.dtype = dtype
        self.device = device
        self.schedule = schedule
        flat = [p.detach().reshape(-1) for p in params]
        self.pieces = [
            RankPiece(pc, torch.nn.Parameter(flat[pc.param][pc.lo : pc.hi].to("cpu", copy=True)))
            for pc in layout.pieces(rank)
        ]
        self.buckets = [RankBucket(b, plan) for b, plan in enumerate(layout.buckets)]
        for piece in self.pieces:
            self.buckets[piece.plan.bucket].pieces.append(piece)
        self._bucket_of = [self.buckets[0]] * len(params)
        for bucket in self.buckets:
            for index in bucket.plan.params:
                self._bucket_of[index] = bucket
            bucket.wanted = sum(params[i].requires_grad for i in bucket.plan.params)
        largest = layout.largest_bucket()
        self._flat = torch.empty(largest, dtype=dtype.torch, device=device)
        self._slice = torch.empty(-(-largest // self.world_size), dtype=dtype.torch, device=device)
        self.holding = False
        """Inside ``no_sync()``: landed grads reduce nothing."""
        self._told_accumulation = False
        self.new_round()

    def attach(self, inner: OffloadAdam | None) -> None:
        """The pieces' entries in the inner optimizer's shared storage, and where a bucket's slices can be that
        storage itself: its pieces fill the slice (no padding) side by side there (the storage packs tensors
        densely in registration order, ``tiermem.core.layout``).  Not for device params (the collectives run
        on the device) nor with two grad buffers (the delayed update alternates them)."""
        feed = inner.shared_feed if inner is not None else None
        if inner is None or feed is None:
            return
        for piece, entry in zip(self.pieces, feed.entries, strict=True):
            piece.entry = entry
        if self.device.type != "cpu" or not feed.entries or len(feed.entries[0].grad_views) != 1:
            return
        base = inner.client.storage
        for bucket in self.buckets:
            members = [(p.plan, p.entry) for p in bucket.pieces if p.entry is not None]  # every piece has one
            numel = bucket.plan.slice_numel
            if not members or sum(plan.numel for plan, _ in members) != numel:
                continue
            first = members[0][1]
            runs = [_run_from(base, first.view, numel), _run_from(base, first.grad_views[0], numel)]
            if all(
                view.data_ptr() == run.data_ptr() + plan.at * run.element_size()
                for plan, entry in members
                for view, run in zip((entry.view, entry.grad_views[0]), runs, strict=True)
            ):
                bucket.param_slice, bucket.grad_slice = runs

    # ----------------------------------------------------------------- the rounds

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside reduce nothing (DDP's ``no_sync``): accumulate micro-batches in it and run
        the last backward of the step outside.  Needed only for speed, with ``overlap_comm``: without it an
        accumulated bucket is reduced again at ``step()``, correct but twice."""
        before, self.holding = self.holding, True
        try:
            yield
        finally:
            self.holding = before

    def new_round(self, params: Sequence[torch.nn.Parameter] | None = None) -> None:
        """A new step: no param has landed, no bucket is reduced or in flight.  ``params`` (after a step): the
        next backward's buckets are whole once the params that had a grad this step have one (an unused
        layer's params would otherwise hold back every bucket before it until ``step()``)."""
        self._landed: set[int] = set()
        for bucket in self.buckets:
            if params is not None:
                bucket.wanted = sum(params[i].grad is not None for i in bucket.plan.params)
            bucket.left = bucket.wanted
            bucket.reduce = None
        self._next = len(self.buckets) - 1
        """The next bucket to reduce: the last first (backward makes the last params' grads first), so every
        rank issues the collectives in one order, whichever of them ran during backward."""
        self._accumulated = False

    def grad_landed(self, index: int, params: Callable[[], Sequence[torch.nn.Parameter]]) -> None:
        """``overlap_comm``: param ``index``'s grad is complete for this backward; reduce every bucket that is
        whole (``params()``, the optimizer's params, is asked only then: most grads complete no bucket)."""
        if self.holding:
            return
        if index in self._landed:
            self._accumulated = True  # a second backward: step() sees the changed grad and reduces it again
            return
        self._landed.add(index)
        self._bucket_of[index].left -= 1
        if self._next < 0 or self.buckets[self._next].left > 0:
            return  # most grads: their bucket, or one after it, is not whole yet
        current = params()
        while self._next >= 0 and self.buckets[self._next].left <= 0:
            bucket = self.buckets[self._next]
            bucket.reduce = self._launch(current, bucket, async_op=True, own=True)
            self._next -= 1

    def reduce_scatter(
        self, params: Sequence[torch.nn.Parameter], stats: torch.Tensor | None, *, grad_buffer: int, overlap: bool
    ) -> None:
        """Every piece's mean grad (``RankPiece.grad``), bucket by bucket; adds the slices' sums of squares to
        ``stats[0]``.  ``grad_buffer``: the daemon's grad buffer of this step (the delayed update alternates
        two).  With ``overlap`` the buckets reduced during backward are waited for, and those whose grads
        changed since (on any rank: one all-reduce of the flags, so every rank issues the same collectives)
        are reduced again."""
        for piece in self.pieces:
            piece.grad = self._grad_of(piece, grad_buffer)
        if not overlap:
            while self._next >= 0:  # bucket by bucket through the shared buffers
                bucket = self.buckets[self._next]
                self._finish(self._launch(params, bucket, async_op=False, own=False), bucket, stats)
                self._next -= 1
            return
        issued: list[tuple[RankBucket, _Reduce]] = []  # every bucket, the last first
        for bucket in self.buckets[::-1]:
            reduce = bucket.reduce
            if reduce is None:  # what backward did not reduce (a param without a grad on this rank)
                reduce = bucket.reduce = self._launch(params, bucket, async_op=True, own=True)
            issued.append((bucket, reduce))
        self._next = -1
        for bucket, reduce in issued:
            self._wait(bucket, reduce)
        flags = torch.tensor([float(self._changed(params, b, r)) for b, r in issued], device=self.device)
        self.schedule.run("all-reduce", "the overlapped reduces' check", dist.all_reduce, flags, op=dist.ReduceOp.MAX)
        again = [k for k in range(len(issued)) if float(flags[k]) > 0]
        if again and self._accumulated and not self._told_accumulation:
            self._told_accumulation = True
            log.warning(
                "grads were accumulated over several backward passes with overlap_comm=True: %d bucket(s) were "
                "reduced once per pass and again at step(); run all but the last micro-batch's backward inside "
                "optimizer.no_sync() to reduce each once",
                len(again),
            )
        for k in again:
            bucket = issued[k][0]
            issued[k] = (bucket, self._launch(params, bucket, async_op=False, own=True))
        for bucket, reduce in issued:
            self._finish(reduce, bucket, stats)

    def drop_grads(self) -> None:
        """The step is over: the pieces let go of its reduced grads."""
        for piece in self.pieces:
            piece.grad = None

    def all_gather(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Every bucket's slices, this rank's from its pieces, into every rank's params."""
        for bucket in self.buckets:
            plan = bucket.plan
            mine = bucket.param_slice
            if mine is None:
                mine = self._slice[: plan.slice_numel]
                mine.zero_()
                for piece in bucket.pieces:
                    mine[piece.plan.at : piece.plan.at + piece.plan.numel].copy_(piece.param.detach())
            if self.world_size == 1:
                flat = mine  # the slice is the whole bucket
            else:
                flat = self._flat[: self.layout.padded_numel(plan)]
                self.schedule.run("all-gather", bucket.name, ALL_GATHER, flat, mine)
            for index, offset in zip(plan.params, plan.offsets, strict=True):
                p = params[index]
                p.data.copy_(flat[offset : offset + p.numel()].view(p.shape))

    def pull_params(self, params: Sequence[torch.nn.Parameter]) -> None:
        """The model's params (edited in place since the last step) into the pieces."""
        for piece in self.pieces:
            plan = piece.plan
            piece.param.data.copy_(params[plan.param].detach().reshape(-1)[plan.lo : plan.hi])

    # ----------------------------------------------------------------- one bucket

    def _grad_of(self, piece: RankPiece, grad_buffer: int) -> torch.Tensor:
        """Where the piece's mean grad goes this step."""
        if piece.entry is not None:
            if self.buckets[piece.plan.bucket].grad_slice is not None:
                return piece.entry.grad_views[0]  # the reduce-scatter writes it in place
            # this step's grad buffer of the daemon's storage, never the one a delayed update still reads
            # (the piece's .grad is left pointing at the last step's buffer by the inner optimizer)
            return piece.entry.grad_views[grad_buffer]
        if piece.param.grad is None:
            piece.param.grad = torch.empty_like(piece.param)
        return piece.param.grad

    def _buffers(self, bucket: RankBucket, *, own: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's flat grads and reduced slice: the shared transfer buffers, or (``own``: its collective
        runs while others are issued) buffers of its own, kept for the next steps."""
        padded = self.layout.padded_numel(bucket.plan)
        if not own:
            return self._flat[:padded], self._slice[: bucket.plan.slice_numel]
        if bucket.own is None:
            bucket.own = (
                torch.empty(padded, dtype=self.dtype.torch, device=self.device),
                torch.empty(bucket.plan.slice_numel, dtype=self.dtype.torch, device=self.device),
            )
        return bucket.own

    def _launch(
        self, params: Sequence[torch.nn.Parameter], bucket: RankBucket, *, async_op: bool, own: bool
    ) -> _Reduce:
        """Copy the bucket's grads (zeros for a param without one) and issue its reduce-scatter, into the shared
        transfer buffers (``own`` False: the caller consumes the result before the next launch) or the bucket's
        own."""
        plan = bucket.plan
        direct = bucket.grad_slice
        alone = self.world_size == 1
        flat, out = self._buffers(bucket, own=own)
        if alone and direct is not None:
            flat = direct  # one rank: its slice is the whole bucket, and the grads go straight to the daemon
        seen: list[tuple[torch.Tensor | None, int]] = []
        for index, offset in zip(plan.params, plan.offsets, strict=True):
            grad = params[index].grad
            dst = flat[offset : offset + params[index].numel()]
            if grad is None:
                dst.zero_()
            else:
                dst.copy_(grad.reshape(-1))
            seen.append((grad, -1 if grad is None else grad._version))
        flat[plan.numel :].zero_()
        if alone:
            return _Reduce(None, flat[: plan.slice_numel], seen)
        if direct is not None:
            out = direct  # the mean grads land in the daemon's grad buffer
        work = self.schedule.run("reduce-scatter", bucket.name, REDUCE_SCATTER, out, flat, async_op=async_op)
        return _Reduce(work if async_op else None, out, seen)

    @staticmethod
    def _changed(params: Sequence[torch.nn.Parameter], bucket: RankBucket, reduce: _Reduce) -> bool:
        """A grad of the bucket was replaced or changed in place after ``reduce`` was issued (a further
        backward, ``GradScaler.unscale_``, an edit; edits through ``.data`` are not seen)."""
        for index, (grad, version) in zip(bucket.plan.params, reduce.seen, strict=True):
            now = params[index].grad
            if now is not grad or (now is not None and now._version != version):
                return True
        return False

    def _finish(self, reduce: _Reduce, bucket: RankBucket, stats: torch.Tensor | None) -> None:
        """The bucket's reduce landed: the mean (DDP's), the slice's sum of squares into ``stats[0]``, and the
        pieces' grads (copied out of the transfer buffer unless it was the daemon's grad buffer itself)."""
        out = reduce.out
        if self.world_size > 1:
            out.div_(self.world_size)
        if stats is not None:
            stats[0] += out.double().square().sum()
        if bucket.grad_slice is None:
            for piece in bucket.pieces:
                if piece.grad is not None:  # always, once reduce_scatter began
                    piece.grad.copy_(out[piece.plan.at : piece.plan.at + piece.plan.numel])

    def _wait(self, bucket: RankBucket, reduce: _Reduce) -> None:
        if reduce.work is not None:
            self.schedule.wait("reduce-scatter", bucket.name, reduce.work)
            reduce.work = None


def _run_from(base: torch.Tensor, first: torch.Tensor, numel: int) -> torch.Tensor:
    """``numel`` elements of the shared storage ``base`` (uint8) from where ``first`` starts: a flat view across
    the tensors laid out after it (each of which has a torch storage of its own over the same mapping)."""
    offset = first.data_ptr() - base.data_ptr()
    return base[offset : offset + numel * first.element_size()].view(first.dtype)

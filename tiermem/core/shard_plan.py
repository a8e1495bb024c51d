"""How a model's params are cut into per-rank shards (ZeRO-2).  Pure: numbers in, plan out.

The params, in the optimizer's order, are packed into buckets: runs of
consecutive params of one param group, up to ``bucket_numel`` elements (a
bigger param is a bucket of its own).  A bucket is the unit of one collective:
its flat grads are reduce-scattered and its flat params all-gathered in one
call each.  Its ``numel`` elements are padded to ``slice_numel * world_size``
and rank ``r`` owns the slice ``[r * slice_numel, (r + 1) * slice_numel)``;
padding is never anyone's param, only zeros in the transfer buffers.

A rank's shard is then a list of pieces: the parts of params that fall into
its slices (``param``'s flat elements ``[lo, hi)``, at offset ``at`` of the
slice of ``bucket``).  The daemon keeps one tensor per piece, so a param whose
grad is None on every rank skips its step as ``torch.optim`` skips it, and a
piece's state maps back to its param's elements for a full checkpoint.

Why slices of buckets and not one contiguous range of the whole model per
rank: a collective then needs only a bucket-sized buffer, never a
model-sized one, and each rank's share of each bucket is even (within one
element per bucket), so the ranks' updates take the same time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiermem.core.errors import InvalidArgument

__all__ = ["Bucket", "Piece", "ShardLayout", "plan_shards"]


@dataclass(frozen=True, slots=True)
class Bucket:
    group: int
    params: tuple[int, ...]
    """Param indices (the optimizer's flat order), consecutive."""
    offsets: tuple[int, ...]
    """Where each param starts in the bucket's flat elements."""
    numel: int
    slice_numel: int
    """Elements per rank: ``ceil(numel / world_size)``."""


@dataclass(frozen=True, slots=True)
class Piece:
    param: int
    bucket: int
    lo: int
    hi: int
    """The param's flat elements ``[lo, hi)``."""
    at: int
    """Where they sit in this rank's slice of the bucket."""

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class ShardLayout:
    world_size: int
    numels: tuple[int, ...]
    buckets: tuple[Bucket, ...]

    def padded_numel(self, bucket: Bucket) -> int:
        return bucket.slice_numel * self.world_size

    def pieces(self, rank: int) -> list[Piece]:
        """Rank ``rank``'s pieces, by bucket and then by position in its slice."""
        if not 0 <= rank < self.world_size:
            raise InvalidArgument(f"rank {rank} is not in [0, {self.world_size})")
        out = []
        for b, bucket in enumerate(self.buckets):
            lo_slice = rank * bucket.slice_numel
            hi_slice = min(lo_slice + bucket.slice_numel, bucket.numel)
            for param, start in zip(bucket.params, bucket.offsets, strict=True):
                stop = start + self.numels[param]
                lo, hi = max(start, lo_slice), min(stop, hi_slice)
                if lo < hi:
                    out.append(Piece(param, b, lo - start, hi - start, lo - lo_slice))
        return out

    def fingerprint(self) -> tuple[int, tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """What a sharded checkpoint must match to be loaded: world size, param sizes, bucket members."""
        return self.world_size, self.numels, tuple(b.params for b in self.buckets)

    def largest_bucket(self) -> int:
        return max((self.padded_numel(b) for b in self.buckets), default=0)


def plan_shards(numels: Sequence[int], groups: Sequence[int], world_size: int, bucket_numel: int) -> ShardLayout:
    """Buckets of consecutive params of one group, up to ``bucket_numel`` elements each."""
    if world_size < 1:
        raise InvalidArgument(f"world_size must be >= 1, got {world_size}")
    if bucket_numel < 1:
        raise InvalidArgument(f"bucket size must be >= 1 element, got {bucket_numel}")
    if len(numels) != len(groups):
        raise InvalidArgument(f"{len(numels)} param sizes but {len(groups)} group indices")
    buckets: list[Bucket] = []
    members: list[int] = []
    offsets: list[int] = []
    filled = 0

    def close() -> None:
        nonlocal members, offsets, filled
        if members:
            slice_numel = -(-filled // world_size)
            buckets.append(Bucket(groups[members[0]], tuple(members), tuple(offsets), filled, slice_numel))
        members, offsets, filled = [], [], 0

    for i, n in enumerate(numels):
        if n < 0:
            raise InvalidArgument(f"param {i} has {n} elements")
        if members and (groups[i] != groups[members[0]] or filled + n > bucket_numel):
            close()
        members.append(i)
        offsets.append(filled)
        filled += n
    close()
    return ShardLayout(world_size, tuple(numels), tuple(buckets))

"""The private daemon's pool size: the blocks it will hold, packed as the allocator places them."""

from __future__ import annotations

import pytest

from tiermem.core.errors import InvalidArgument
from tiermem.core.modes import Exchange, Placement, StepMode
from tiermem.core.pool_plan import packed_pool_nbytes, private_pool_plan
from tiermem.core.units import MiB
from tiermem.engine.pool import BufferPool


def test_blocks_that_tile_need_no_slack() -> None:
    assert packed_pool_nbytes([8 * MiB] * 8, 32 * MiB) == 64 * MiB


def test_blocks_that_do_not_tile_an_arena_pay_for_its_unused_end() -> None:
    # 48 MiB blocks in 64 MiB arenas: one per arena, whatever the total
    assert packed_pool_nbytes([48 * MiB] * 3, 64 * MiB) >= 2 * 64 * MiB + 48 * MiB


def test_a_block_larger_than_an_arena_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="does not fit an arena"):
        packed_pool_nbytes([65 * MiB], 64 * MiB)


@pytest.mark.parametrize("sizes", [[3 * MiB, 48 * MiB, 48 * MiB, 20 * MiB], [5 * MiB] * 13, [1, 4097, 48 * MiB]])
def test_the_real_allocator_places_every_block_in_the_computed_pool(sizes: list[int]) -> None:
    arena = 64 * MiB
    total = packed_pool_nbytes(sizes, arena)
    with BufferPool.create(total, arena_size=arena, mlock=False, name="sizing-test") as pool:
        blocks = [pool.alloc(n, owner="t") for n in sizes]
        assert all(b is not None for b in blocks)


def test_the_private_pool_stays_within_two_percent_of_what_a_large_model_needs() -> None:
    numel = 300_000_000
    for release in (False, True):
        need = numel * (12 if release else 8) + 2 * MiB
        got = private_pool_plan(
            numel,
            dtype="float32",
            placement=Placement.CPU,
            mode=StepMode.SYNC,
            exchange=Exchange.SHARED,
            release_grads=release,
            window_nbytes=None,
        ).nbytes
        assert need <= got <= need * 1.02

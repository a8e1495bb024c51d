"""The NVMe placement's layout: each chunk's params, fp32 state and grads are separate tier records.

Against a real pool and a real swap store (libaio, O_DIRECT), with a cache of
two of twelve chunks, so every pass pages: a param fetch reads the params'
bytes in their working dtype and nothing else; an update reads the state and
the grads once and writes the state and the params once, the params without
reading them and the consumed grads without writing them back.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tiermem.core import dtypes
from tiermem.core.statekeys import StateFormat
from tiermem.core.units import align_up
from tiermem.engine.pool import BufferPool
from tiermem.engine.swap.store import SwapStore
from tiermem.engine.tiers.sizing import plan_cache
from tiermemd.nvme import NvmeStateChunks, chunk_nbytes
from tiermemd.state import PAGED_KEYS, STAGED_KEYS

CHUNK_NUMEL = 16384  # a whole number of pages for every part
NCHUNKS = 12


class IoLog:
    """What the store reads and writes, by key (wrapping the real store's methods: the I/O still happens)."""

    def __init__(self, store: SwapStore) -> None:
        self.reads: list[tuple[str, int]] = []
        self.writes: list[tuple[str, int]] = []
        read, write = store.read, store.write

        def logged_read(key: str, memory: Any) -> Any:
            self.reads.append((key, memory[1]))
            return read(key, memory)

        def logged_write(key: str, memory: Any) -> Any:
            self.writes.append((key, memory[1]))
            return write(key, memory)

        store.read, store.write = logged_read, logged_write  # type: ignore[method-assign]

    def take(self) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        out = (self.reads, self.writes)
        self.reads, self.writes = [], []
        return out


@pytest.mark.parametrize(
    ("keys", "dtype"), [(PAGED_KEYS, torch.bfloat16), (STAGED_KEYS, torch.float32)], ids=["bf16", "fp32"]
)
def test_fetches_read_the_params_only_and_an_update_moves_each_state_byte_once(
    pool_and_store: tuple[BufferPool, SwapStore], keys: tuple[str, ...], dtype: torch.dtype
) -> None:
    pool, store = pool_and_store
    per_chunk = chunk_nbytes(CHUNK_NUMEL, StateFormat(keys, dtypes.by_torch(dtype).name))
    plan = plan_cache(None, chunk_nbytes=per_chunk, nchunks=NCHUNKS, memory_nbytes=4 * per_chunk)
    state = NvmeStateChunks(pool, store, NCHUNKS * CHUNK_NUMEL, CHUNK_NUMEL, plan.cache_nbytes, keys, param_dtype=dtype)
    io = IoLog(store)
    params = CHUNK_NUMEL * dtype.itemsize  # a chunk's params in their working dtype
    fetched = ("param",) if "param" in keys else ("master",)
    written: list[str] = []
    try:
        for step in range(4):
            for c in range(NCHUNKS):  # forward: fetches
                t = state.acquire(c, fetched, advance=False)
                got = t.param if t.param is not None else t.master
                assert got is not None and torch.equal(got, torch.full_like(got, float(step)))
                state.release(c, fetched, dirty=False)
            reads, _ = io.take()
            assert all(key.endswith(".param") and n == params for key, n in reads), reads  # the params only
            assert len({key for key, _ in reads}) == len(reads)  # each at most once
            assert step == 0 or reads  # the cache did not hold them all
            for c in reversed(range(NCHUNKS)):  # backward: a grad lands in each chunk
                t = state.acquire(c, ("grad",), advance=False)
                assert t.grad is not None and not t.grad.any()  # consumed by the last update: zeros
                t.grad.fill_(1.0)
                state.release(c, ("grad",), dirty=True)
            reads, _ = io.take()
            assert reads == []  # a grad's first landing reads nothing
            for c in range(NCHUNKS):  # the update: master += grad; the params cast from it
                t = state.acquire(c, overwrite=("param",))
                assert t.master is not None and t.grad is not None and t.exp_avg is not None
                t.master.add_(t.grad)
                t.exp_avg.add_(1.0)
                if t.param is not None:
                    t.param.copy_(t.master)
                state.release(c, dirty=True, consumed=True)
            reads, writes = io.take()
            read_keys = [key for key, _ in reads]
            assert len(read_keys) == len(set(read_keys))  # every part read at most once
            if "param" in keys:
                assert not any(key.endswith(".param") for key in read_keys)  # written whole, never read
            if step:  # the state did not fit: most of it was read (the cache holds at most six state parts)
                assert sum(key.endswith(".state") for key in read_keys) >= NCHUNKS - 6
            if step:  # (step 0 fetches never-written params: zero blocks, written once when evicted)
                written += [key for key, _ in writes]
        # each of the four updates dirties a chunk's state and params once: each is written at most once for
        # it (the last one's tail may still be in the cache); consumed grads are dropped, never written back
        assert max(written.count(key) for key in written) <= 4, sorted(
            {k: written.count(k) for k in written}.items(), key=lambda kv: -kv[1]
        )[:4]
        assert state.tiers.stats().discards == 4 * NCHUNKS
    finally:
        state.close()


def test_a_grad_part_pushed_in_pieces_stays_in_memory_until_it_is_whole(
    pool_and_store: tuple[BufferPool, SwapStore],
) -> None:
    """Backward pushes a chunk's grads in pieces (a window's worth per request) with param fetches between
    them: the part that is not whole yet is kept resident (``release(filled=)``), so it is never written out
    and read back between two pieces; once whole it may go out, and the update reads it once."""
    pool, store = pool_and_store
    keys, dtype = STAGED_KEYS, torch.float32
    per_chunk = chunk_nbytes(CHUNK_NUMEL, StateFormat(keys, dtypes.by_torch(dtype).name))
    plan = plan_cache(None, chunk_nbytes=per_chunk, nchunks=NCHUNKS, memory_nbytes=4 * per_chunk)
    state = NvmeStateChunks(pool, store, NCHUNKS * CHUNK_NUMEL, CHUNK_NUMEL, plan.cache_nbytes, keys, param_dtype=dtype)
    io = IoLog(store)
    half = CHUNK_NUMEL // 2
    try:
        for step in range(3):
            for c in reversed(range(NCHUNKS)):  # backward
                for piece in range(2):
                    t = state.acquire(c, ("grad",), advance=False)
                    assert t.grad is not None
                    t.grad[piece * half : (piece + 1) * half].fill_(1.0)
                    state.release(c, ("grad",), dirty=True, filled=half)
                    for other in range(max(c - 4, 0), c):  # the prefetch of the next submodules' params comes
                        state.acquire(other, ("master",), advance=False)  # in between: more than the cache
                        state.release(other, ("master",), dirty=False)
            reads, _ = io.take()
            assert not [key for key, _ in reads if key.endswith(".grad")], f"step {step}: grads read back"
            for c in range(NCHUNKS):  # the update consumes every grad
                t = state.acquire(c)
                assert t.grad is not None and torch.equal(t.grad, torch.ones_like(t.grad)), (step, c)
                state.release(c, dirty=True, consumed=True)
            reads, _ = io.take()
            grads = [key for key, _ in reads if key.endswith(".grad")]
            assert len(grads) == len(set(grads))  # each read back at most once
    finally:
        state.close()


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_the_state_part_moves_the_compressed_bytes(
    pool_and_store: tuple[BufferPool, SwapStore], state_dtype: str
) -> None:
    """A paged bf16 rank: each page-in and page-out of a chunk's ``state`` part (master and moments) moves
    that part's bytes in its state dtype: 12, 8 and 6.03 bytes an element, in whole pages; what is written
    reads back (the int8 codes and their scales both)."""
    pool, store = pool_and_store
    fmt = StateFormat(PAGED_KEYS, "bfloat16", state_dtype)
    per_chunk = chunk_nbytes(CHUNK_NUMEL, fmt)
    plan = plan_cache(None, chunk_nbytes=per_chunk, nchunks=NCHUNKS, memory_nbytes=4 * per_chunk)
    state = NvmeStateChunks(
        pool,
        store,
        NCHUNKS * CHUNK_NUMEL,
        CHUNK_NUMEL,
        plan.cache_nbytes,
        PAGED_KEYS,
        param_dtype=torch.bfloat16,
        state_dtype=state_dtype,
    )
    io = IoLog(store)
    expected = align_up(fmt.part_nbytes("state", CHUNK_NUMEL))
    try:
        for step in range(3):
            for c in range(NCHUNKS):
                t = state.acquire(c, overwrite=("param",))
                moments = t.moments(state_dtype, c * CHUNK_NUMEL)
                if step:
                    m, v = moments.dequantize()
                    assert torch.equal(m, torch.full_like(m, float(step))), (step, c)
                    assert torch.equal(v, torch.full_like(v, float(2 * step))), (step, c)
                moments.store(
                    torch.full((CHUNK_NUMEL,), step + 1.0), torch.full((CHUNK_NUMEL,), 2 * step + 2.0), step=1
                )
                state.release(c, dirty=True, consumed=True)
        reads, writes = io.take()
        moved = [n for key, n in reads + writes if key.endswith(".state")]
        assert moved and all(n == expected for n in moved), (set(moved), expected)
        bound = {"fp32": 12.0, "bf16": 8.0, "int8": 6.2}[state_dtype]
        assert expected <= align_up(int(bound * CHUNK_NUMEL))
    finally:
        state.close()

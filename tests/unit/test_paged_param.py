"""Param paging's records: residency moves, and the buffer cache that reuses released device buffers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tiermem.client.offload.pagedparam import BufferCache, PagedParam, Residency
from tiermem.core.errors import InvalidState


def entry() -> PagedParam:
    p = nn.Parameter(torch.zeros(3, 4))
    return PagedParam(0, p, "w", p.shape, p.dtype, torch.full((), float("nan")).expand(p.shape))


def test_residency_moves_only_forward_through_a_fetch() -> None:
    e = entry()
    assert e.nbytes == 48 and not e.idle
    with pytest.raises(InvalidState, match="cannot go from absent to resident"):
        e.move(Residency.RESIDENT)
    e.move(Residency.FETCHING)
    assert e.idle  # on its way to the device, needed by nobody yet
    with pytest.raises(InvalidState, match="cannot go from fetching to absent"):
        e.move(Residency.ABSENT)
    e.move(Residency.RESIDENT)
    e.leases = 1
    assert not e.idle
    e.leases, e.hold_task = 0, 3
    assert not e.idle
    e.move(Residency.ABSENT)


def test_a_released_buffer_is_reused_for_the_same_size_and_dtype_only() -> None:
    cache = BufferCache()
    buf = torch.empty(12)
    ptr = buf.data_ptr()
    cache.give(buf)
    del buf
    assert cache.nbytes == 48
    assert cache.take(12, torch.float16) is None
    assert cache.take(6, torch.float32) is None
    again = cache.take(12, torch.float32)
    assert again is not None and again.data_ptr() == ptr and cache.nbytes == 0


def test_a_buffer_still_viewed_elsewhere_is_not_reused() -> None:
    cache = BufferCache()
    buf = torch.empty(12)
    view = buf[4:]  # e.g. a checkpoint's recomputed tensor
    cache.give(buf)
    assert cache.nbytes == 0 and cache.take(12, torch.float32) is None
    assert view.numel() == 8


def test_dropping_frees_the_oldest_first() -> None:
    cache = BufferCache()
    first, second = torch.empty(4), torch.empty(8)
    cache.give(first)
    cache.give(second)
    del first, second
    assert cache.drop_oldest() and cache.nbytes == 32
    assert cache.take(4, torch.float32) is None and cache.take(8, torch.float32) is not None
    assert not cache.drop_oldest()

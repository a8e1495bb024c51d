"""Param paging's records: residency moves, and the buffer cache that reuses released device buffers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tiermem.client.offload.pagedparam import BufferCache, GradUnits, PagedParam, Residency
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


def entries(*names: str, frozen: tuple[str, ...] = ()) -> dict[str, PagedParam]:
    out = {}
    for i, name in enumerate(names):
        p = nn.Parameter(torch.zeros(2), requires_grad=name not in frozen)
        out[name] = PagedParam(i, p, name, p.shape, p.dtype, torch.full((), float("nan")).expand(p.shape))
    return out


def test_a_submodules_grads_go_together_in_its_params_order_whatever_order_they_land_in() -> None:
    e = entries("a.w", "a.b", "b.w")
    units: GradUnits[str] = GradUnits([[e["a.w"], e["a.b"]], [e["b.w"]]])
    assert units.land(e["a.b"], "grad a.b") == []
    assert units.land(e["b.w"], "grad b.w") == [["grad b.w"]]
    assert units.land(e["a.w"], "grad a.w") == [["grad a.w", "grad a.b"]]
    assert units.rest() == [] and not units.pending


def test_params_without_grads_leave_their_submodule_to_the_end_in_module_order() -> None:
    e = entries("a.w", "a.b", "b.w", "b.b", "c.w", frozen=("c.w",))
    units: GradUnits[str] = GradUnits([[e["a.w"], e["a.b"]], [e["b.w"], e["b.b"]], [e["c.w"]]])
    assert units.land(e["b.b"], "b.b") == []  # b.w is unused in this pass
    assert units.land(e["a.w"], "a.w") == []  # a.b too
    assert units.rest() == [["a.w"], ["b.b"]]  # module order, not landing order
    assert units.rest() == []


def test_a_param_owned_twice_goes_with_its_first_submodule_and_a_second_landing_pushes_the_first() -> None:
    e = entries("wte", "head.b")
    units: GradUnits[str] = GradUnits([[e["wte"]], [e["wte"], e["head.b"]]])  # a tied weight
    assert units.units == [[e["wte"]], [e["head.b"]]]
    assert units.land(e["wte"], "1") == [["1"]]
    e2 = entries("x", "y")
    pair: GradUnits[str] = GradUnits([[e2["x"], e2["y"]]])
    assert pair.land(e2["x"], "x1") == []
    assert pair.land(e2["x"], "x2") == [["x1"]]  # landed again before its submodule went
    assert pair.land(e2["y"], "y") == [["x2", "y"]]

"""The records of param paging: one ``PagedParam`` per param, its ``Residency``, reused device buffers, and
which grads are pushed together (``GradUnits``).

Pure bookkeeping (no transfers): a ``PagedParam`` moves between residencies
only through ``move``, which refuses illegal transitions::

    ABSENT --fetch starts--> FETCHING --fetch done--> RESIDENT --released--> ABSENT

``BufferCache`` keeps released device buffers for the next fetch of the same
size and dtype (ZeRO-R's constant, reused buffers).  ``GradUnits`` groups the
landed grads by submodule: one push per submodule, in an order the model fixes.
``PagerRecords`` declares the tables over these records that the parts of
``ParamPager`` share.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch import nn

from tiermem.core.errors import InvalidState
from tiermem.core.units import format_size

if TYPE_CHECKING:
    from tiermem.client.offload.copies import ParamCopies
    from tiermem.client.offload.transfer import StateTransfer

__all__ = ["BufferCache", "GradUnits", "PagedParam", "PagerRecords", "Residency", "SavedParam", "placeholder_edit"]

T = TypeVar("T")


class Residency(enum.Enum):
    ABSENT = "absent"
    """Only the placeholder is in the model; the data is in the daemon."""
    FETCHING = "fetching"
    """A fetch into the device is on the I/O thread."""
    RESIDENT = "resident"
    """The param's data is on the device and in the model."""


_MOVES = {
    Residency.ABSENT: frozenset({Residency.FETCHING}),
    Residency.FETCHING: frozenset({Residency.RESIDENT}),
    Residency.RESIDENT: frozenset({Residency.ABSENT}),
}


@dataclass(eq=False)
class PagedParam:
    """One paged param: where its data is, who needs it, and its grad in this step."""

    index: int
    """The optimizer's tensor id (its state record in the daemon)."""
    param: nn.Parameter
    name: str
    shape: torch.Size
    dtype: torch.dtype
    placeholder: torch.Tensor
    residency: Residency = Residency.ABSENT
    version: int = 0
    """The param's version counter when it was last given its placeholder: a write into the placeholder (an
    in-place edit while paged out) moves it on."""
    data: torch.Tensor | None = None
    """The param's values on the device: a view of ``buffer``."""
    buffer: torch.Tensor | None = None
    fetch: Future[Any] | None = None
    leases: int = 0
    """Running forwards that use it (nested or repeated modules count once each)."""
    hold_task: int = -1
    """The autograd graph task that needs it until its grad lands (-1: none)."""
    hold_saved: bool = False
    """The hold is a backward node's use of a saved view (``PageUses._unpack``), which ends with the node: it
    may be given up for room (a recomputation's hold may not: the checkpoint keeps its tensors)."""
    landed: bool = False
    """Its grad reached the daemon in this step."""
    saved: bool = False
    """Autograd saved it for backward in this step (backward fetches it again)."""

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    @property
    def idle(self) -> bool:
        """On the device but needed by nobody now (may be kept for an upcoming use, or dropped)."""
        return self.residency is not Residency.ABSENT and self.leases == 0 and self.hold_task < 0

    def move(self, to: Residency) -> None:
        if to not in _MOVES[self.residency]:
            raise InvalidState(f"param {self.name!r} cannot go from {self.residency.value} to {to.value}")
        self.residency = to

    def describe(self) -> str:
        return f"param {self.name!r} ({tuple(self.shape)}, {self.dtype}, {format_size(self.nbytes)})"

    def touched(self) -> bool:
        """The param was written or given other data while it held its placeholder (two reads: a fetch asks)."""
        return self.param._version != self.version or self.param.data_ptr() != self.placeholder.data_ptr()

    def holds_a_copy(self) -> bool:
        """The param holds a copy of its placeholder, not an edit: new data of its shape, dtype and device, all
        NaN as the placeholder is.  ``model.to(device)`` copies every param whose device is named otherwise
        (``torch.device("cpu:0")`` for a CPU tensor, as HF Trainer and accelerate name it at several ranks),
        which changes no value."""
        p = self.param
        return (
            p.data_ptr() != self.placeholder.data_ptr()
            and (p.shape, p.dtype, p.device) == (self.shape, self.dtype, self.placeholder.device)
            and bool(torch.isnan(p).all())
        )

    def change_while_absent(self) -> str | None:
        """What was done to the param while it held its placeholder, as an error says it; None: nothing."""
        p = self.param
        same = p.data_ptr() == self.placeholder.data_ptr() and p.shape == self.shape
        return placeholder_edit(p, self.dtype, self.placeholder.device, self.version, same_data=same)


def placeholder_edit(
    p: torch.Tensor, dtype: torch.dtype, device: torch.device, version: int, *, same_data: bool
) -> str | None:
    """What was done to a param that holds a placeholder (the pager's, or ZeRO-3 by layer's empty one) since it
    got it with ``dtype``, on ``device``, at version counter ``version``, as an error says it; None: nothing.
    ``same_data``: it still holds that placeholder (each owner knows its own)."""
    if p.dtype != dtype or p.device != device:
        return f"converted to {p.dtype} on {p.device} (model.half(), model.to())"
    if not same_data:
        return "given new data (p.data = t)"
    if p._version != version:
        return "written in place (nn.init, p.mul_(), p.zero_(), copy_)"
    return None


@dataclass(frozen=True)
class SavedParam:
    """A saved tensor that was a view of a materialized param: fetched again when backward unpacks it."""

    entry: PagedParam
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class PagerRecords:
    """The state the parts of ``ParamPager`` (``PageUses``, ``PageIO``, ``PagedState``) share, declared once;
    ``ParamPager.__init__`` sets it."""

    entries: list[PagedParam]
    """One per paged tensor, in the optimizer's order (``PagedParam.index``)."""
    on_forward: Callable[[nn.Module], None] | None = None
    """Called with the module about to run as a forward enters the paged model (``under_ddp.DdpOff``)."""
    kept: Callable[[nn.Parameter], torch.Tensor | None] | None = None
    """A param's value gathered for a save before (``ShardedPagedAdam.consolidate_model_state``): a state dict
    takes it instead of reading the param (a collective when sharded)."""
    transfer: StateTransfer
    copies: ParamCopies
    budget: int
    """Bytes of params the device may hold (``device_budget``)."""
    nbytes: int
    """Bytes of params on the device or being fetched into it."""
    peak_nbytes: int
    _by_param: dict[int, PagedParam]
    """By ``id`` of the model's param."""
    _by_storage: dict[int, PagedParam]
    """The resident ones, by their device data's storage pointer (a tensor torch hands back finds its param)."""
    _present: dict[int, PagedParam]
    """The ones fetching or resident, by index."""
    _upcoming: set[int]
    """Indices of the params the next uses need (``prefetch`` of them ahead): a release keeps them."""
    _saving: set[int]
    """Modules whose state dict is being saved (``PagedState._saving_state``)."""


class BufferCache:
    """Released param buffers kept for the next fetch of the same size and dtype (ZeRO-R's reused buffers).

    Freeing and allocating a layer's params at every use leaves the C allocator holding the memory (glibc
    raises its mmap threshold to the sizes it sees freed, then keeps them in its heap), so the process
    would grow towards the model's size; reusing buffers keeps it at the budget.  A buffer someone else
    still views (a checkpoint's recomputed tensors) is not reused, only dropped."""

    def __init__(self) -> None:
        self.free: collections.OrderedDict[int, tuple[tuple[int, torch.dtype], torch.Tensor]] = (
            collections.OrderedDict()
        )
        self.nbytes = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        for key, (kind, buf) in self.free.items():
            if kind == (numel, dtype):
                del self.free[key]
                self.nbytes -= buf.numel() * buf.element_size()
                return buf
        return None

    def give(self, buf: torch.Tensor) -> None:
        if torch._C._storage_Use_Count(buf.untyped_storage()._cdata) > 2:  # this buffer and the call's own
            return  # viewed elsewhere: not ours to reuse
        self.free[id(buf)] = ((buf.numel(), buf.dtype), buf)
        self.nbytes += buf.numel() * buf.element_size()

    def drop_oldest(self) -> bool:
        if not self.free:
            return False
        _, (_, buf) = self.free.popitem(last=False)
        self.nbytes -= buf.numel() * buf.element_size()
        return True

    def clear(self) -> None:
        self.free.clear()
        self.nbytes = 0


class GradUnits(Generic[T]):
    """Which grads go to the daemon together, so that a push (and at ZeRO-3 its reduce-scatter) depends on
    the model and the autograd order alone, never on when the I/O thread is free.

    Each param belongs to the first submodule (in module order) that owns it.  ``land`` keeps a landed
    grad's item with its submodule's and returns the submodule's items, in the order of its params, once
    every param of it that takes a grad has landed; ``rest`` returns the submodules still incomplete
    (params unused in this backward pass, grads set by hand), in module order.  Landing a param twice
    before its submodule went (accumulation over two passes) first returns what it had."""

    def __init__(self, units: Iterable[Sequence[PagedParam]]) -> None:
        self.units: list[list[PagedParam]] = []
        self.unit_of: dict[int, int] = {}
        for own in units:
            mine = [e for e in own if e.index not in self.unit_of]
            if mine:
                self.unit_of.update((e.index, len(self.units)) for e in mine)
                self.units.append(mine)
        self.pending: dict[int, dict[int, T]] = {}

    def land(self, e: PagedParam, item: T) -> list[list[T]]:
        """The pushes ready now that ``e``'s grad (``item``) landed: none, its submodule's, or two."""
        unit = self.unit_of[e.index]
        ready = [self._take(unit)] if e.index in self.pending.get(unit, {}) else []
        got = self.pending.setdefault(unit, {})
        got[e.index] = item
        if all(x.index in got for x in self.units[unit] if x.param.requires_grad):
            ready.append(self._take(unit))
        return ready

    def owner(self, e: PagedParam) -> list[PagedParam]:
        """The params of the submodule ``e`` belongs to."""
        return self.units[self.unit_of[e.index]]

    def rest(self) -> list[list[T]]:
        """Every incomplete submodule's items, in module order."""
        return [self._take(unit) for unit in sorted(self.pending)]

    def _take(self, unit: int) -> list[T]:
        got = self.pending.pop(unit)
        return [got[e.index] for e in self.units[unit] if e.index in got]

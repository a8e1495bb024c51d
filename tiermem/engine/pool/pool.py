"""BufferPool: the daemon's constant host memory, sliced into blocks (ZeRO-R).

Owns a list of ``Arena``s (made once, at start) and one ``Allocator`` per
arena; a block lives inside one arena and never spans two.  Binds the pure
allocator to memory: compaction plans are executed with ``memmove`` inside
the block's arena.

Thread safety: one re-entrant lock guards every call.  The ``evict`` callback
(``evict(nbytes_needed) -> bool``) runs with that lock held, on the calling
thread, and may call ``free()``; it returns True when it freed something.

Validity of views: ``view(block)``, ``tensor(...)`` and ``address(block)``
point at where the block is *now*.  The next compaction (which any ``alloc``
may trigger) can move an unpinned block, after which old views see other
bytes.  Hold a pin (``pin``/``unpin`` or ``with pool.pinned(block) as mv:``)
for as long as a view, tensor or raw address is in use: pinned blocks never move.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING

import psutil

from tiermem.core.closing import Closing
from tiermem.core.config import PoolConfig
from tiermem.core.errors import BoundsError, InvalidArgument, InvalidState, PoolExhausted
from tiermem.core.pool_plan import arena_sizes
from tiermem.core.units import PAGE_SIZE, GiB
from tiermem.engine.pool.allocator import Allocator, Block, EvictFn, PoolFigures, PoolStats, allocate
from tiermem.engine.pool.arena import Arena, MlockRefusal, memlock_warning
from tiermem.engine.pool.compaction import Move
from tiermem.engine.pool.pinning import Pinner, PinResult

if TYPE_CHECKING:
    import torch

__all__ = ["BufferPool", "arena_sizes", "auto_pool_size"]

log = logging.getLogger(__name__)


def auto_pool_size(alignment: int = PAGE_SIZE) -> int:
    """Half of the memory available now, rounded down to ``alignment`` (``pool.size = 0``)."""
    half = int(psutil.virtual_memory().available) // 2
    return half - half % alignment


class BufferPool(PoolFigures, Closing):
    """Thread-safe block allocation over one or more arenas, with pins, compaction and eviction."""

    def __init__(
        self,
        arenas: Sequence[Arena],
        *,
        alignment: int = PAGE_SIZE,
        evict: EvictFn | None = None,
        pinner: Pinner | None = None,
    ) -> None:
        """Serve blocks from ``arenas`` (the pool owns and closes them).

        With a ``pinner``, each arena is registered with it (CUDA) now and
        unregistered at ``close()``; ``pin_results`` says what happened.
        """
        if not arenas:
            raise InvalidArgument("a pool needs at least one arena")
        self._lock = threading.RLock()
        self._arenas = list(arenas)
        self._allocators = [
            Allocator(a.nbytes, alignment=alignment, mover=self._mover(a), index=i) for i, a in enumerate(self._arenas)
        ]
        self._evict = evict
        self._pinner = pinner
        self._pin_results: list[PinResult] = []
        if pinner is not None:
            self._pin_results = [pinner.register(a.address, a.nbytes) for a in self._arenas]
        self._closed = False

    @classmethod
    def create(
        cls,
        nbytes: int,
        *,
        arena_size: int = GiB,
        alignment: int = PAGE_SIZE,
        mlock: bool = True,
        name: str = "tiermem",
        evict: EvictFn | None = None,
        pinner: Pinner | None = None,
    ) -> BufferPool:
        """A pool of ``nbytes`` in arenas of at most ``arena_size``; one warning if mlock is refused."""
        arenas: list[Arena] = []
        try:
            for i, size in enumerate(arena_sizes(nbytes, arena_size, alignment)):
                arenas.append(Arena.create(size, name=f"{name}.{i}", mlock=mlock, warn=False))
        except BaseException:
            for arena in arenas:
                arena.close()
            raise
        refused = [a.mlock_refusal for a in arenas if a.mlock_refusal is not None]
        if refused:
            log.warning(memlock_warning(refused, sum(a.nbytes for a in arenas)))
        return cls(arenas, alignment=alignment, evict=evict, pinner=pinner)

    @classmethod
    def from_config(
        cls, config: PoolConfig, *, evict: EvictFn | None = None, pinner: Pinner | None = None, name: str = "tiermem"
    ) -> BufferPool:
        """The pool ``config`` describes; ``size = 0`` takes half of the available memory."""
        size = config.size or auto_pool_size(config.alignment)
        return cls.create(
            size,
            arena_size=config.arena_size,
            alignment=config.alignment,
            mlock=config.mlock,
            name=name,
            evict=evict,
            pinner=pinner,
        )

    # ------------------------------------------------------------------ blocks

    def try_alloc(self, nbytes: int, *, owner: str = "", evict: bool = True) -> Block | None:
        """A block of at least ``nbytes`` (best fit, then compaction, then eviction unless ``evict`` is
        False: memory borrowed above a guarantee must not push anyone out), or None."""
        with self._lock:
            self._require_open()
            return allocate(self._allocators, nbytes, owner, self._evict if evict else None)

    def alloc(self, nbytes: int, *, owner: str = "") -> Block:
        """Like ``try_alloc`` but raises ``PoolExhausted(requested, free, largest_free)``."""
        with self._lock:
            block = self.try_alloc(nbytes, owner=owner)
            if block is None:
                stats = self.stats()
                raise PoolExhausted(nbytes, stats.free, stats.largest_free)
            return block

    def free(self, block: Block) -> None:
        with self._lock:
            self._allocator(block).free(block)

    def pin(self, block: Block) -> None:
        """Keep ``block`` in place (no compaction moves it) until the matching ``unpin``."""
        with self._lock:
            self._allocator(block).pin(block)

    def unpin(self, block: Block) -> None:
        with self._lock:
            self._allocator(block).unpin(block)

    @contextmanager
    def pinned(self, block: Block) -> Iterator[memoryview]:
        """Pin ``block`` and yield a view of it that stays valid until the ``with`` ends."""
        with self._lock:
            self.pin(block)
            try:
                view = self.view(block)
            except BaseException:
                self.unpin(block)
                raise
        try:
            yield view
        finally:
            self.unpin(block)
            with suppress(BufferError):  # something still exports from it; the mapping outlives it anyway
                view.release()

    def view(self, block: Block) -> memoryview:
        """A writable view of the block's ``nbytes`` (aligned) bytes; see the module note on validity."""
        with self._lock:
            self._allocator(block).check_live(block)
            return self._arenas[block.arena].view(block.offset, block.nbytes)

    def address(self, block: Block) -> int:
        """Address of the block's first byte (page aligned); valid while pinned."""
        with self._lock:
            self._allocator(block).check_live(block)
            return self._arenas[block.arena].address + block.offset

    def tensor(self, block: Block, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A torch tensor of ``dtype`` and ``shape`` over the block's first bytes (shares its memory)."""
        import torch

        numel = 1
        for dim in shape:
            numel *= int(dim)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel * itemsize > block.nbytes:
            raise BoundsError(
                f"tensor {tuple(shape)} of {dtype} needs {numel * itemsize} bytes; the block holds {block.nbytes}"
            )
        if numel == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        return torch.frombuffer(self.view(block), dtype=dtype, count=numel).view(tuple(shape))

    def compact(self) -> int:
        """Pack every arena's unpinned blocks toward its start; returns bytes moved."""
        with self._lock:
            self._require_open()
            return sum(a.compact() for a in self._allocators)

    # ------------------------------------------------------------------ facts

    @property
    def arenas(self) -> list[Arena]:
        return list(self._arenas)

    @property
    def pin_results(self) -> list[PinResult]:
        """What the pinner did to each arena at construction (empty without a pinner)."""
        return list(self._pin_results)

    @property
    def locked(self) -> bool:
        """True when every arena is mlocked."""
        return all(a.locked for a in self._arenas)

    @property
    def mlock_refusals(self) -> list[MlockRefusal]:
        return [a.mlock_refusal for a in self._arenas if a.mlock_refusal is not None]

    @property
    def alignment(self) -> int:
        return self._allocators[0].alignment

    def stats(self) -> PoolStats:
        """Counters over all arenas, taken under the lock (one consistent snapshot)."""
        with self._lock:
            combined = PoolStats.combine([a.stats() for a in self._allocators])
        return dataclasses.replace(combined, locked=sum(a.nbytes for a in self._arenas if a.locked))

    @property
    def capacity(self) -> int:
        return self.stats().capacity

    @property
    def allocators(self) -> list[Allocator]:
        """The per-arena allocators (read their layout; do not allocate through them)."""
        return list(self._allocators)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Unregister from the pinner and close the arenas; blocks become unusable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._pinner is not None:
                for result, arena in zip(self._pin_results, self._arenas, strict=True):
                    if result.registered:
                        self._pinner.unregister(arena.address)
            for arena in self._arenas:
                arena.close()

    def _require_open(self) -> None:
        if self._closed:
            raise InvalidState("buffer pool is closed")

    def _allocator(self, block: Block) -> Allocator:
        self._require_open()
        if not 0 <= block.arena < len(self._allocators):
            raise InvalidState(f"block names arena {block.arena}; this pool has {len(self._allocators)}")
        return self._allocators[block.arena]

    @staticmethod
    def _mover(arena: Arena) -> Callable[[Sequence[Move]], None]:
        base = arena.address

        def move(moves: Sequence[Move]) -> None:
            for m in moves:
                ctypes.memmove(base + m.dst, base + m.src, m.nbytes)

        return move

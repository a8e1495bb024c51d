"""``LibaioEngine``: O_DIRECT transfers through Linux AIO (the ``libaio`` package).

Owns one kernel AIO context of ``queue_depth`` slots, an array of iocbs (one
per slot, allocated once), an eventfd the kernel signals on every completion,
and a FIFO of blocks waiting for a free slot.  ``set_queue_depth`` lowers (or
raises again, up to the context's size) how many of the slots are used, so a
depth measured after start-up applies without a new context.

Flow: ``submit`` splits each request into ``block_size`` blocks, queues them and
fills free slots with one ``io_submit`` of many iocbs.  Completions are reaped
when the eventfd becomes readable, either by the engine's own reaper thread
(default) or, with ``reaper_thread=False``, by whoever watches ``fileno()``
(``loop.add_reader(engine.fileno(), engine.reap)`` in an asyncio daemon: reaping
never blocks).  Each reaped slot is refilled from the queue at once, so up to
``queue_depth`` blocks stay in flight.

Invariants: a slot is either free or holds exactly one submitted block; the
block's ``Transfer`` (and through it the memory) is referenced until its event
is reaped; every event is checked (negative = errno, short = error).  Files
used with this engine must be opened with O_DIRECT; requests are aligned to
4 KiB (``InvalidArgument`` otherwise).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future

from libaio import libaio as _aio
from libaio.eventfd import EFD_CLOEXEC, EFD_NONBLOCK, eventfd

from tiermem.core.errors import InvalidArgument, InvalidState
from tiermem.engine.swap.engine import IOOp, IORequest, Transfer, check_direct

__all__ = ["LibaioEngine"]

_OPCODE = {IOOp.READ: _aio.IO_CMD_PREAD, IOOp.WRITE: _aio.IO_CMD_PWRITE}

# (transfer, file offset, address, nbytes)
_Block = tuple[Transfer, int, int, int]


class LibaioEngine:
    """Linux AIO with O_DIRECT; see the module docstring."""

    name = "libaio"
    direct = True

    def __init__(self, *, block_size: int, queue_depth: int, reaper_thread: bool = True) -> None:
        if block_size <= 0 or block_size % 4096:
            raise InvalidArgument(f"block_size must be a positive multiple of 4096, got {block_size}")
        if queue_depth <= 0:
            raise InvalidArgument(f"queue_depth must be > 0, got {queue_depth}")
        self._block_size = block_size
        self._depth = queue_depth
        self._active = queue_depth  # slots in use at most (set_queue_depth)
        self._ctx = _aio.io_context_t()
        _aio.io_setup(queue_depth, ctypes.byref(self._ctx))
        self._efd = eventfd(0, EFD_CLOEXEC | (0 if reaper_thread else EFD_NONBLOCK))
        self._iocbs = (_aio.iocb * queue_depth)()
        self._ptrs = [ctypes.pointer(self._iocbs[i]) for i in range(queue_depth)]
        self._events = (_aio.io_event * queue_depth)()
        self._no_wait = _aio.timespec(0, 0)
        self._slots: list[_Block | None] = [None] * queue_depth
        self._free: list[int] = list(range(queue_depth - 1, -1, -1))
        self._queue: deque[_Block] = deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._reaper: threading.Thread | None = None
        if reaper_thread:
            self._reaper = threading.Thread(target=self._reap_forever, name="tiermem-aio-reaper", daemon=True)
            self._reaper.start()

    # ------------------------------------------------------------------ interface

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def queue_depth(self) -> int:
        """Blocks kept in flight at most (``set_queue_depth``)."""
        return self._active

    @property
    def capacity(self) -> int:
        """Slots of the kernel context: the deepest ``set_queue_depth`` may ask for."""
        return self._depth

    def set_queue_depth(self, depth: int) -> None:
        """Keep at most ``depth`` blocks in flight from now on (1 <= depth <= ``capacity``)."""
        if not 1 <= depth <= self._depth:
            raise InvalidArgument(f"queue depth must be 1..{self._depth} (the AIO context's size), got {depth}")
        with self._lock:
            self._active = depth
            failed = self._fill_slots()
        _report(failed)

    def fileno(self) -> int:
        """The eventfd that becomes readable when completions are waiting (see ``reap``)."""
        return int(self._efd)

    @property
    def submitted(self) -> int:
        """Blocks in the kernel now (at most ``queue_depth``)."""
        with self._lock:
            return self._depth - len(self._free)

    @property
    def in_flight(self) -> int:
        """Blocks submitted to the kernel or queued for a slot."""
        with self._lock:
            return self._depth - len(self._free) + len(self._queue)

    def submit(self, requests: Sequence[IORequest]) -> list[Future[int]]:
        for request in requests:
            check_direct(request)
        transfers = [Transfer(r, -(-r.nbytes // self._block_size)) for r in requests]
        with self._lock:
            if self._closed:
                raise InvalidState("the libaio engine is closed")
            for t in transfers:
                for offset, address, nbytes in t.blocks(self._block_size):
                    self._queue.append((t, offset, address, nbytes))
            failed = self._fill_slots()
        _report(failed)
        return [t.future for t in transfers]

    def reap(self) -> int:
        """Handle every completion waiting now and refill the slots (for ``reaper_thread=False``; never blocks)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._efd, 8)
        return self._harvest()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._queue or len(self._free) < self._depth:
                if self._reaper is None:
                    self._lock.release()
                    try:
                        self._wait_and_reap()
                    finally:
                        self._lock.acquire()
                else:
                    self._idle.wait()
        os.eventfd_write(self._efd, 1)
        if self._reaper is not None:
            self._reaper.join()
        _aio.io_destroy(self._ctx)
        os.close(self._efd)

    # ------------------------------------------------------------------ internals

    def _fill_slots(self) -> list[tuple[_Block, int]]:
        """Submit queued blocks into free slots (lock held).  Returns blocks the kernel refused, with errno."""
        failed: list[tuple[_Block, int]] = []
        while self._queue and self._free:
            usable = min(len(self._free), self._active - (self._depth - len(self._free)))
            if usable <= 0:
                break
            slots = [self._free.pop() for _ in range(min(len(self._queue), usable))]
            for slot in slots:
                block = self._queue.popleft()
                self._prepare(slot, block)
            array = (_aio.iocb_p * len(slots))(*[self._ptrs[s] for s in slots])
            try:
                done = _aio.io_submit(self._ctx, len(slots), array)
            except OSError as exc:
                code = exc.errno or errno.EIO
                others_in_flight = self._depth - len(self._free) - len(slots) > 0
                if code == errno.EAGAIN and others_in_flight:
                    self._requeue(slots)  # the kernel is full: retry when something completes
                    break
                # the first iocb was refused: fail that block, retry the others
                refused = self._release(slots[0])
                failed.append((refused, code))
                self._requeue(slots[1:])
                continue
            self._requeue(slots[done:])
        return failed

    def _prepare(self, slot: int, block: _Block) -> None:
        transfer, offset, address, nbytes = block
        cb = self._iocbs[slot]
        cb.data = slot + 1
        cb.aio_lio_opcode = _OPCODE[transfer.request.op]
        cb.aio_fildes = transfer.request.fd
        cb.u.c.buf = address
        cb.u.c.nbytes = nbytes
        cb.u.c.offset = offset
        cb.u.c.flags = _aio.IOCB_FLAG_RESFD
        cb.u.c.resfd = self._efd
        self._slots[slot] = block

    def _release(self, slot: int) -> _Block:
        block = self._slots[slot]
        if block is None:  # pragma: no cover - a slot in use always holds a block
            raise InvalidState(f"aio slot {slot} released twice")
        self._slots[slot] = None
        self._free.append(slot)
        return block

    def _requeue(self, slots: list[int]) -> None:
        for slot in reversed(slots):
            self._queue.appendleft(self._release(slot))

    def _harvest(self) -> int:
        total = 0
        while True:
            with self._lock:
                got = _aio.io_getevents(self._ctx, 0, self._depth, self._events, ctypes.byref(self._no_wait))
                finished: list[tuple[_Block, int]] = []
                for i in range(got):
                    event = self._events[i]
                    finished.append((self._release(int(event.data) - 1), int(event.res)))
                failed = self._fill_slots()
                if not self._queue and len(self._free) == self._depth:
                    self._idle.notify_all()
            for (transfer, offset, _address, nbytes), res in finished:
                transfer.block_done(offset, nbytes, res)
            _report(failed)
            total += got
            if got == 0:
                return int(total)

    def _wait_and_reap(self) -> None:
        select.select([self._efd], [], [])
        self.reap()

    def _reap_forever(self) -> None:
        while True:
            os.read(self._efd, 8)
            self._harvest()
            with self._lock:
                if self._closed and not self._queue and len(self._free) == self._depth:
                    return


def _report(failed: list[tuple[_Block, int]]) -> None:
    for (transfer, offset, _address, nbytes), code in failed:
        transfer.block_done(offset, nbytes, -code)

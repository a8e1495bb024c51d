"""``TierManager``: one job's tensors across the CPU tier (pool blocks) and the NVMe tier (a swap store).

Owns one ``TensorRecord`` per registered tensor (``records``), the job's CPU
budget, the access order (given to ``prefetch`` or recorded on the first pass)
and a pager thread.  The pool and the store are shared and owned by the caller.

How it works:
- ``acquire(key)`` returns a tensor over the tensor's pool block, pinned until
  the matching ``release``; when the tensor is not resident it asks the pager
  for it and waits (the time is counted in ``TierStats.wait_s``).
- The pager thread does every page-in and page-out.  It serves acquires first,
  then the next ``depth`` tensors of the access order (prefetch).  When a
  page-in would exceed the budget it first pages out victims chosen by
  ``policy.choose_victims`` (furthest next use; never a tensor in use, being
  paged, or needed before the one being fetched).  Clean victims are dropped
  without I/O.
- ``evict(nbytes_needed)`` is the pool's eviction callback: it runs on the
  allocating thread with the pool's lock held and pages idle tensors out
  synchronously.
- Elastic budget: the budget (``cpu_budget_nbytes``) is the guaranteed floor;
  with ``ceiling_nbytes`` above it the manager also borrows free pool memory
  up to the ceiling.  Page-ins beyond the floor allocate without eviction
  (borrowing never takes memory from anyone); when one finds no room the
  manager works within what it holds until its next pass.  The node's owner
  of the pool (``shares.PoolShares``) takes borrowed memory back when another
  allocation needs it (``node_candidates``, ``give_back``), never below the floor.

Locking rule (deadlock freedom): the manager's lock is never held while calling
the pool or the store, and I/O completions (which arrive on the engine's and
the store's threads) only queue work for the pager and notify; the pager, not
the completion thread, then calls the pool.  The pool may call ``evict`` with
its lock held; ``evict`` takes the manager's lock only for short bookkeeping.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from tiermem.core.errors import InvalidArgument, InvalidState, PoolExhausted, TiermemError, UnknownKey
from tiermem.core.units import align_up
from tiermem.engine.swap.store import SwapStore
from tiermem.engine.tiers.policy import AccessOrder, Candidate, NodeCandidate, choose_victims
from tiermem.engine.tiers.records import TensorRecord, TensorState, TierStats
from tiermem.engine.tiers.sizing import CachePlan

__all__ = ["TierManager"]

log = logging.getLogger(__name__)
T = TensorState


class TierManager:
    """See the module docstring.  ``pool`` is a ``tiermem.engine.pool.BufferPool``."""

    def __init__(
        self,
        pool: Any,
        store: SwapStore,
        cpu_budget_nbytes: int,
        *,
        ceiling_nbytes: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if cpu_budget_nbytes <= 0:
            raise InvalidArgument(f"cpu_budget_nbytes must be > 0, got {cpu_budget_nbytes}")
        ceiling = cpu_budget_nbytes if ceiling_nbytes is None else ceiling_nbytes
        if ceiling < cpu_budget_nbytes:
            raise InvalidArgument(
                f"ceiling_nbytes ({ceiling}) must be at least cpu_budget_nbytes ({cpu_budget_nbytes})"
            )
        self._pool = pool
        self._store = store
        self._budget = cpu_budget_nbytes
        self._ceiling = ceiling
        self._limit = ceiling  # what the pager plans to: the ceiling, or what it held when borrowing failed
        self._use_s = 0.0  # moving average of the seconds between two acquires (0: not measured yet)
        self._hold_s = 0.0  # moving average of the seconds a tensor stays acquired
        self._sizing: CachePlan | None = None
        self._last_acquire_t: float | None = None
        self._clock = clock
        self._records: dict[str, TensorRecord] = {}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._cpu = 0  # bytes of blocks held or being allocated for page-ins
        self._outgoing = 0  # bytes of page-outs in flight
        self._tick = 0
        self._order: AccessOrder | None = None
        self._trace: list[str] = []
        self._traced: set[str] = set()
        self._position = -1
        self._depth = 0
        self._wrap = True
        self._demand: dict[str, None] = {}  # keys acquire is waiting for, oldest first
        self._completions: deque[Callable[[], None]] = deque()
        self._kicked = False
        self._closed = False
        self._crashed: BaseException | None = None
        """Why the pager thread ended with an error (then every wait for it fails at once, naming it)."""
        self._counts: dict[str, Any] = dict.fromkeys(
            (
                "acquires",
                "hits",
                "page_ins",
                "page_outs",
                "bytes_in",
                "bytes_out",
                "evictions",
                "io_errors",
                "given_back",
                "grow_refused",
                "discards",
            ),
            0,
        )
        self._counts["wait_s"] = 0.0
        self._pager = threading.Thread(target=self._run, name="tiermem-pager", daemon=True)
        self._pager.start()

    # ------------------------------------------------------------------ registration

    def register(self, key: str, dtype: Any, shape: Sequence[int]) -> TensorRecord:
        """Track a tensor.  If the store already holds ``key`` (a reopened job) it starts on NVMe, else EMPTY."""
        import torch

        shape = tuple(int(d) for d in shape)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes <= 0:
            raise InvalidArgument(f"tensor {key!r} of shape {shape} holds no bytes")
        record = TensorRecord(key, dtype, shape, nbytes, align_up(nbytes))
        if key in self._store:
            if self._store.nbytes(key) != record.padded_nbytes:
                raise InvalidArgument(
                    f"tensor {key!r}: the swap store holds {self._store.nbytes(key)} bytes, "
                    f"the tensor needs {record.padded_nbytes}"
                )
            record.state, record.on_nvme = T.NVME, True
        with self._lock:
            if key in self._records:
                raise InvalidState(f"tensor {key!r} is already registered")
            self._records[key] = record
        return record

    def unregister(self, key: str) -> None:
        """Forget a tensor that is not in use or being paged; frees its block and its swap copy."""
        with self._lock:
            record = self._get(key)
            if record.state not in (T.EMPTY, T.NVME, T.CPU):
                raise InvalidState(f"tensor {key!r} is {record.state.value}; release it first")
            del self._records[key]
            self._demand.pop(key, None)
            block, record.block = record.block, None
            if block is not None:
                self._cpu -= record.padded_nbytes
        if block is not None:
            self._pool.free(block)
        if record.on_nvme:
            self._store.delete(key)

    # ------------------------------------------------------------------ use

    def acquire(self, key: str, *, overwrite: bool = False, advance: bool = True) -> Any:
        """The tensor ``key`` resident and pinned (a torch tensor over its pool block) until ``release``.

        ``overwrite``: the caller writes the whole tensor before it or anyone else reads any of it, so a
        tensor that is not resident is given a zeroed block without being read from NVMe (unless another
        acquire waiting for it needs its contents); it is then dirty.  ``advance``: this use is a step of
        the access order (the prefetch moves on past it); False for a use outside the order's pass (a
        param fetched for forward between two updates), which must not make the pager read ahead of it."""
        start = self._clock()
        with self._cond:
            record = self._get(key)
            self._note_use(record, advance=advance)
            waited = False
            if record.state in (T.NVME, T.EMPTY):
                record.skip_read = overwrite and (record.skip_read or record.waiters == 0)
            record.waiters += 1
            try:
                while True:
                    if record.error is not None:
                        error, record.error = record.error, None
                        raise error
                    if record.state in (T.CPU, T.IN_USE):
                        break
                    if self._closed:
                        raise InvalidState("the tier manager is closed")
                    self._check_pager()
                    if record.state in (T.NVME, T.EMPTY):
                        self._demand.setdefault(key, None)
                    self._kick_locked()
                    waited = True
                    self._cond.wait()
            finally:
                record.waiters -= 1
            if record.state is T.CPU:
                record.move(T.IN_USE)
                record.acquired_at = self._clock()
            record.users += 1
            block = record.block
            self._counts["acquires"] += 1
            self._counts["hits"] += 0 if waited else 1
            self._counts["wait_s"] += self._clock() - start if waited else 0.0
            self._nudge_locked()  # the position moved: prefetch what comes next
        self._pool.pin(block)
        return self._pool.tensor(block, record.dtype, record.shape)

    def want(self, keys: Sequence[str]) -> None:
        """Start paging ``keys`` in now, ahead of the acquires that follow (each waits for its own page-in,
        and the disk serves them together instead of one after the other)."""
        with self._cond:
            for key in keys:
                if self._get(key).state in (T.NVME, T.EMPTY):
                    self._demand.setdefault(key, None)
            self._kick_locked()

    def release(self, key: str, *, dirty: bool = True, discard: bool = False, keep: bool = False) -> None:
        """End one ``acquire``; ``dirty`` says the tensor was modified (its NVMe copy is now stale).

        ``discard``: its contents are no longer needed (grads an update consumed): once no one else uses
        it, its block is freed and its swap copy dropped without a write, and its next acquire sees zeros
        (EMPTY) without a read.  ``keep``: it will be acquired again soon (a grad part that more pushes will
        fill): it stays resident while anything else can make room, instead of going out and coming back
        in between two pieces; the next release without ``keep`` makes it an ordinary tensor again."""
        with self._lock:
            record = self._get(key)
            if record.state is not T.IN_USE:
                raise InvalidState(f"tensor {key!r} is {record.state.value}, not in use; release without acquire")
            block = record.block
        self._pool.unpin(block)
        stored = False
        with self._cond:
            record.users -= 1
            record.dirty = record.dirty or dirty
            record.kept = keep and not discard
            record.write_failed = record.write_failed and not dirty
            if record.users == 0:
                held = self._clock() - record.acquired_at
                self._hold_s = held if self._hold_s == 0.0 else 0.8 * self._hold_s + 0.2 * held
                if discard and not record.waiters:
                    record.move(T.EMPTY)
                    record.block, record.dirty, record.write_failed = None, False, False
                    stored, record.on_nvme = record.on_nvme, False
                    self._cpu -= record.padded_nbytes
                    self._counts["discards"] += 1
                else:
                    block = None
                    record.move(T.CPU)
                self._nudge_locked()  # a victim for a waiting page-in, perhaps
            else:
                block = None
        if block is not None:
            self._pool.free(block)
        if stored:
            self._store.delete(key)

    def prefetch(self, order: Sequence[str] | None, depth: int, *, wrap: bool = True) -> None:
        """Keep the next ``depth`` tensors of ``order`` (None: the order recorded on the first pass) in flight.

        ``wrap=False``: the prefetch stops at the end of a pass and starts again with the next pass's first
        use, for passes with other uses between them (an update's, with a model's fetches between two),
        which tensors read ahead would only sit through, taking the room of those uses."""
        if depth < 0:
            raise InvalidArgument(f"prefetch depth must be >= 0, got {depth}")
        with self._cond:
            if order is not None:
                self._order = AccessOrder(list(order))
                self._position = -1
            self._depth = depth
            self._wrap = wrap
            self._kick_locked()

    def set_plan(self, plan: CachePlan, *, tensors_per_chunk: int = 1) -> None:
        """Adopt a sizing decision: its prefetch depth from now on; the plan is reported in ``stats``.

        The plan counts chunks; ``tensors_per_chunk`` is how many of this manager's tensors one chunk is
        (its parts), so the prefetch keeps ``prefetch_depth`` whole chunks in flight."""
        if tensors_per_chunk < 1:
            raise InvalidArgument(f"tensors_per_chunk must be >= 1, got {tensors_per_chunk}")
        with self._cond:
            self._sizing = plan
            self._depth = plan.prefetch_depth * tensors_per_chunk
            self._kick_locked()

    def flush(self) -> None:
        """Write every modified resident tensor to NVMe (keeping it resident), then commit the swap store.

        Every write is submitted before the first is waited for, so the disk's queue stays full across
        tensors and each checksum runs while earlier writes are on the disk.
        """
        with self._lock:
            todo = [r for r in self._records.values() if r.state is T.CPU and (r.dirty or not r.on_nvme)]
            for r in todo:
                r.move(T.PAGING_OUT)
        errors: list[BaseException] = []
        for r, error in self._write_all(todo):
            self._pool.unpin(r.block)
            with self._cond:
                if error is None:
                    r.dirty, r.on_nvme = False, True
                else:
                    errors.append(error)
                r.move(T.CPU)
                self._kick_locked()
        if errors:
            raise errors[0]
        self._store.commit()

    # ------------------------------------------------------------------ pool eviction callback

    def evict(self, nbytes_needed: int) -> bool:
        """The pool's callback: page idle tensors out now until ``nbytes_needed`` are freed; True if any was."""
        with self._lock:
            victims = self._victims(nbytes_needed, protect=set(), sooner_than=None, last_resort=True)
        return self.page_out([v.key for v in victims])

    def page_out(self, keys: Sequence[str]) -> bool:
        """Page the idle ones of ``keys`` out now (writing the dirty ones) and free their blocks; True if any was.

        Synchronous: the caller (the pool's eviction callback, with the pool's lock held) waits for the
        writes; they are all submitted before the first is waited for.  Keys that are in use, being paged
        or no longer resident are skipped.
        """
        with self._lock:
            records = []
            for key in keys:
                r = self._records.get(key)
                if r is None or r.state is not T.CPU or r.waiters or r.write_failed or r.error is not None:
                    continue
                r.move(T.PAGING_OUT)
                self._outgoing += r.padded_nbytes
                records.append(r)
        clean = [r for r in records if not r.dirty and r.on_nvme]
        results = [(r, None) for r in clean] + self._write_all([r for r in records if r not in clean])
        freed = False
        for r, error in results:
            if r not in clean:
                self._pool.unpin(r.block)
            freed = self._finish_page_out(r, error) or freed
        return freed

    def node_candidates(self, tenant: str) -> tuple[int, list[NodeCandidate]]:
        """For the node's pool owner: bytes held above the floor, and the idle tensors it could take back.

        The estimate of a tensor's next use is its distance in the access order times the measured
        seconds between two acquires (without an order: the uses since its last use, least recent
        first); tensors an acquire waits for are never offered.
        """
        with self._lock:
            spare = self._cpu - self._outgoing - self._budget
            if spare <= 0:
                return 0, []
            per_use = self._use_s or 1e-3
            out = []
            for r in self._records.values():
                if r.state is not T.CPU or r.waiters or r.write_failed or r.error is not None:
                    continue
                if self._order is not None:
                    uses = self._order.distance(r.key, self._position)
                else:
                    uses = self._tick - r.last_use
                out.append(NodeCandidate(tenant, r.key, r.padded_nbytes, uses * per_use, r.on_nvme and not r.dirty))
            return spare, out

    def give_back(self, keys: Sequence[str]) -> bool:
        """Page ``keys`` out for another allocation of the node (see ``page_out``); no borrowing until the
        next pass.  True if anything was freed."""
        freed = self.page_out(keys)
        with self._cond:
            self._limit = max(self._budget, self._cpu)
            self._counts["given_back"] += len(keys) if freed else 0
        return freed

    def _write_all(self, records: Sequence[TensorRecord]) -> list[tuple[TensorRecord, BaseException | None]]:
        """Write each record's block (pinned here; the caller unpins), all submitted first; each with its error."""
        futures: list[tuple[TensorRecord, Future[int] | BaseException]] = []
        for r in records:
            self._pool.pin(r.block)
            try:
                futures.append((r, self._write(r)))
            except TiermemError as exc:
                futures.append((r, exc))
        out: list[tuple[TensorRecord, BaseException | None]] = []
        for r, f in futures:
            if isinstance(f, BaseException):
                out.append((r, f))
                continue
            try:
                f.result()
            except TiermemError as exc:
                out.append((r, exc))
            else:
                out.append((r, None))
        return out

    # ------------------------------------------------------------------ facts

    def resident(self) -> bool:
        """Whether every tensor is in the pool now (an acquire of any of them would not wait for a page-in)."""
        with self._lock:
            return all(r.state in (T.CPU, T.IN_USE) for r in self._records.values())

    def record(self, key: str) -> TensorRecord:
        with self._lock:
            return self._get(key)

    def stats(self) -> TierStats:
        with self._lock:
            c = self._counts
            return TierStats(
                tensors=len(self._records),
                cpu_nbytes=self._cpu,
                cpu_budget_nbytes=self._budget,
                ceiling_nbytes=self._ceiling,
                limit_nbytes=max(self._budget, self._limit),
                given_back=c["given_back"],
                grow_refused=c["grow_refused"],
                discards=c["discards"],
                prefetch_depth=self._depth,
                use_s=self._use_s,
                hold_s=self._hold_s,
                plan=self._sizing,
                acquires=c["acquires"],
                hits=c["hits"],
                page_ins=c["page_ins"],
                page_outs=c["page_outs"],
                bytes_in=c["bytes_in"],
                bytes_out=c["bytes_out"],
                evictions=c["evictions"],
                wait_s=c["wait_s"],
                io_errors=c["io_errors"],
            )

    def close(self) -> None:
        """Stop the pager after in-flight transfers finish and free every block (``flush`` first to keep data)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._pager.join()
        with self._lock:
            blocks = [r.block for r in self._records.values() if r.block is not None]
            for r in self._records.values():
                r.block = None
            self._cpu = 0
        for block in blocks:
            while block.pins:
                self._pool.unpin(block)
            self._pool.free(block)

    # ------------------------------------------------------------------ internals (lock held)

    def _get(self, key: str) -> TensorRecord:
        record = self._records.get(key)
        if record is None:
            raise UnknownKey(key, "tier manager")
        return record

    def _note_use(self, record: TensorRecord, *, advance: bool = True) -> None:
        self._tick += 1
        record.last_use = self._tick
        now = self._clock()
        if self._last_acquire_t is not None:
            gap = now - self._last_acquire_t
            self._use_s = gap if self._use_s == 0.0 else 0.8 * self._use_s + 0.2 * gap
        self._last_acquire_t = now
        if not advance:
            return
        previous = self._position
        if self._order is None:
            if record.key in self._traced:  # a second pass began: the first one is the order
                self._order = AccessOrder(self._trace)
                self._trace, self._traced = [], set()
            else:
                self._trace.append(record.key)
                self._traced.add(record.key)
        if self._order is not None and record.key in self._order:
            self._position = self._order.position_after(record.key, self._position) or 0
            if self._position <= previous:  # a new pass: try borrowing up to the ceiling again
                self._limit = self._ceiling

    def _kick_locked(self) -> None:
        self._kicked = True
        self._cond.notify_all()

    def _nudge_locked(self) -> None:
        """``_kick_locked`` after a use, when the pager has something to page in (``_wanted``; it plans
        nothing else: page-outs only make room for those).  With every tensor of the window resident, as
        on a state that fits its cache, each acquire and release would otherwise wake the pager for
        nothing: a thread switch, and the GIL, per chunk part, taken from the update and the trainer."""
        if self._wanted():
            self._kick_locked()

    def _victims(
        self, nbytes: int, protect: set[str], sooner_than: float | None, *, last_resort: bool = False
    ) -> list[Candidate]:
        """Tensors to page out for ``nbytes``; kept ones (``release(keep=True)``) only as a ``last_resort`` (an
        acquire waits) where the others do not make the room, never for a prefetch."""
        movable = [
            r
            for r in self._records.values()
            if r.state is T.CPU and r.key not in protect and r.error is None and not r.write_failed and not r.waiters
        ]

        def among(records: list[TensorRecord]) -> list[Candidate]:
            candidates = [Candidate(r.key, r.padded_nbytes, r.last_use, r.on_nvme and not r.dirty) for r in records]
            return choose_victims(candidates, nbytes, self._order, self._position, sooner_than=sooner_than)

        victims = among([r for r in movable if not r.kept])
        if last_resort and sum(v.nbytes for v in victims) < nbytes:
            victims = among(movable)
        return victims

    def _wanted(self) -> list[str]:
        """Keys to page in, most urgent first: those acquire waits for, then the prefetch window.

        While an acquire waits, nothing is prefetched: a prefetch would refill the room the waiting
        page-in is making (each evicting the other's pages, forever, when victims are clean and free).
        """
        wanted = [k for k in self._demand if self._records[k].state in (T.NVME, T.EMPTY)]
        if wanted:
            return wanted
        if self._order is not None and self._depth:
            for key in self._order.window(self._position, self._depth, wrap=self._wrap):
                r = self._records.get(key)
                if r is not None and r.state in (T.NVME, T.EMPTY) and r.error is None and key not in wanted:
                    wanted.append(key)
        return wanted

    def _plan(self) -> tuple[str, list[TensorRecord]] | None:
        """The pager's next action: ("in", [record]) within the floor, ("borrow", [record]) above it, or
        ("out", victims); None when there is nothing to do now."""
        limit = max(self._budget, self._limit)
        for key in self._wanted():
            record = self._records[key]
            need = record.padded_nbytes
            if self._cpu + need <= limit:
                record.move(T.PAGING_IN)
                self._cpu += need
                self._demand.pop(key, None)
                return ("in" if self._cpu <= self._budget else "borrow"), [record]
            if self._cpu - self._outgoing + need <= limit:
                return None  # page-outs in flight will make the room
            demand = key in self._demand
            protect = set(self._demand)
            distance = None
            if not demand and self._order is not None:  # prefetch: keep what is needed sooner than this key
                protect |= set(self._order.window(self._position, self._depth, wrap=self._wrap))
                distance = self._order.distance(key, self._position)
            deficit = self._cpu - self._outgoing + need - limit
            victims = self._victims(deficit, protect=protect, sooner_than=distance, last_resort=demand)
            if sum(v.nbytes for v in victims) >= deficit or (victims and demand):
                records = [self._records[v.key] for v in victims]
                for r in records:
                    r.move(T.PAGING_OUT)
                    self._outgoing += r.padded_nbytes
                return "out", records
            incoming = any(r.state is T.PAGING_IN for r in self._records.values())
            if demand and not victims and self._outgoing == 0 and not incoming:
                record.error = PoolExhausted(need, max(self._budget - self._cpu, 0), 0, what="tier CPU budget")
                self._demand.pop(key, None)
                self._cond.notify_all()
                continue
            return None
        return None

    # ------------------------------------------------------------------ pager thread

    def _check_pager(self) -> None:
        """Raise if the pager thread died (under the lock): nothing would ever page for a waiter."""
        if self._crashed is not None:
            raise InvalidState(
                f"the tier manager's pager thread failed ({type(self._crashed).__name__}: {self._crashed}); "
                "state on NVMe can no longer be paged in (see the daemon's log for the traceback)"
            ) from self._crashed

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug: every waiter must hear of it, not wait forever
            log.exception("the tier manager's pager thread failed")
            with self._cond:
                self._crashed = exc
                self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._kicked and not self._completions and not self._closed:
                    self._cond.wait()
                busy = any(r.state in (T.PAGING_IN, T.PAGING_OUT) for r in self._records.values())
                if self._closed and not self._completions and not busy:
                    return
                self._kicked = False
                completions = list(self._completions)
                self._completions.clear()
            for finish in completions:
                finish()
            while True:
                with self._cond:
                    step = None if self._closed else self._plan()
                if step is None:
                    break
                kind, records = step
                for r in records:
                    if kind != "out":
                        self._page_in(r, borrow=kind == "borrow")
                    else:
                        self._page_out(r)
            if self._closed:
                with self._cond:
                    if not self._completions:
                        self._cond.wait(0.05)

    def _complete(self, fn: Callable[[], None]) -> Callable[[Future[int]], None]:
        def done(_future: Future[int]) -> None:
            with self._cond:
                self._completions.append(fn)
                self._cond.notify_all()

        return done

    def _page_in(self, record: TensorRecord, *, borrow: bool = False) -> None:
        try:
            if borrow:
                block = self._pool.try_alloc(record.padded_nbytes, owner=f"tier:{record.key}", evict=False)
                if block is None:
                    self._borrow_refused(record)
                    return
            else:
                block = self._pool.alloc(record.padded_nbytes, owner=f"tier:{record.key}")
        except TiermemError as exc:
            self._finish_page_in(record, None, exc)
            return
        self._pool.pin(block)
        if not record.on_nvme or record.skip_read:  # nothing stored, or its waiter overwrites it whole
            ctypes.memset(self._pool.address(block), 0, record.padded_nbytes)
            self._finish_page_in(record, block, None)
            return
        try:
            future = self._store.read(record.key, (self._pool.address(block), record.padded_nbytes))
        except TiermemError as exc:
            self._finish_page_in(record, block, exc)
            return
        future.add_done_callback(self._complete(lambda: self._finish_page_in(record, block, future.exception())))

    def _borrow_refused(self, record: TensorRecord) -> None:
        """The pool had no free room above the floor: work within what is held until the next pass."""
        with self._cond:
            self._cpu -= record.padded_nbytes
            record.move(T.NVME if record.on_nvme else T.EMPTY)
            if record.waiters:
                self._demand.setdefault(record.key, None)
            self._limit = max(self._budget, self._cpu)
            self._counts["grow_refused"] += 1
            self._kick_locked()

    def _finish_page_in(self, record: TensorRecord, block: Any, error: BaseException | None) -> None:
        if block is not None:
            self._pool.unpin(block)
            if error is not None:
                self._pool.free(block)
        with self._cond:
            read = record.on_nvme and not record.skip_read
            record.skip_read = False
            if error is None:
                record.block = block
                record.move(T.CPU)
                record.dirty = not read  # a block that was not read differs from the stored copy, if any
                self._counts["page_ins"] += 1
                self._counts["bytes_in"] += record.padded_nbytes if read else 0
            else:
                self._cpu -= record.padded_nbytes
                record.move(T.NVME if record.on_nvme else T.EMPTY)
                record.error = error
                self._counts["io_errors"] += 1
            self._cond.notify_all()

    def _page_out(self, record: TensorRecord) -> None:
        if not record.dirty and record.on_nvme:
            self._finish_page_out(record, None)
            return
        self._pool.pin(record.block)
        try:
            future = self._write(record)
        except TiermemError as exc:
            self._pool.unpin(record.block)
            self._finish_page_out(record, exc)
            return

        def finish() -> None:
            self._pool.unpin(record.block)
            self._finish_page_out(record, future.exception())

        future.add_done_callback(self._complete(finish))

    def _write(self, record: TensorRecord) -> Future[int]:
        return self._store.write(record.key, (self._pool.address(record.block), record.padded_nbytes))

    def _finish_page_out(self, record: TensorRecord, error: BaseException | None) -> bool:
        """Free the block after a successful page-out (no manager lock held on entry).  True if freed."""
        wrote = record.dirty or not record.on_nvme
        if error is None:
            self._pool.free(record.block)
        with self._cond:
            self._outgoing -= record.padded_nbytes
            if error is None:
                record.block = None
                record.on_nvme, record.dirty = True, False
                record.move(T.NVME)
                self._cpu -= record.padded_nbytes
                self._counts["evictions"] += 1
                self._counts["page_outs"] += 1 if wrote else 0
                self._counts["bytes_out"] += record.padded_nbytes if wrote else 0
            else:
                record.move(T.CPU)  # the data is still in memory; the failed copy is not used
                record.write_failed = True
                self._counts["io_errors"] += 1
                log.warning("page-out of %r failed, keeping it in memory: %s", record.key, error)
            self._kick_locked()
        return error is None

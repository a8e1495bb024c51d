"""The update runner: edits adopted into the master, pieces applied on the CPU scheduler, failures contained.

Real parts: a ``BufferPool`` over memfds, ``CpuStateChunks`` in it, the ``CpuScheduler`` thread and the
daemon's Adam kernel (eager).  The fake kernels here record what they were handed or raise on one piece.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tiermem.core.errors import InvalidState
from tiermem.core.layout import TensorSpec as LayoutSpec
from tiermem.core.layout import plan_layout
from tiermem.core.protocol import ParamGroup, TensorSpec
from tiermem.core.units import MiB
from tiermem.engine.optim import AdamEngine
from tiermem.engine.pool import BufferPool
from tiermemd.kernel import EngineKernel
from tiermemd.rank.planner import Piece, plan_pieces
from tiermemd.rank.records import TensorRecord
from tiermemd.rank.runner import AdamSlices, UpdateRunner, UpdateTarget, adopt_edits
from tiermemd.scheduler import CpuScheduler
from tiermemd.state import ALL_KEYS, UPDATE_KEYS, ChunkTensors, CpuStateChunks

TENANT = "job/0"
LOW = (torch.float16, torch.bfloat16)
GROUPS = (
    ParamGroup(lr=1e-2, weight_decay=0.1),
    ParamGroup(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0),
)
SHAPES = [(3, 4), (5,), (2, 3), (7,)]
GROUP_OF = [0, 0, 1, 1]
CHUNK_NUMEL = 8  # 30 elements in 4 chunks: most tensors straddle a boundary


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def pool() -> Iterator[BufferPool]:
    with BufferPool.create(1 * MiB, arena_size=1 * MiB, mlock=False, name="runner-test") as pool:
        yield pool


@pytest.fixture
def scheduler() -> Iterator[CpuScheduler]:
    sched = CpuScheduler(name="runner-test")
    yield sched
    sched.close()


def pins(pool: BufferPool) -> int:
    return sum(block.pins for allocator in pool.allocators for block in allocator.live_blocks())


def make_records(dtype: str) -> list[TensorRecord]:
    specs = [TensorSpec(f"t{i}", s, dtype, group=g) for i, (s, g) in enumerate(zip(SHAPES, GROUP_OF, strict=True))]
    layout = plan_layout([LayoutSpec(s.name, s.shape, s.dtype, s.group) for s in specs], bucket_nbytes=1 << 62)
    return [TensorRecord(slot.index, spec, slot) for slot, spec in zip(layout.slots, specs, strict=True)]


NUMEL = sum(torch.Size(s).numel() for s in SHAPES)


def advance(records: list[TensorRecord], ids: list[int]) -> list[Piece]:
    """What the rank does before running an update: plan it, then count it."""
    pieces = plan_pieces(records, ids, GROUPS, CHUNK_NUMEL)
    for tid in ids:
        records[tid].step += 1
    return pieces


def target(dtype: torch.dtype, *, master_in_params: bool = False, write_params: bool = True) -> UpdateTarget:
    gen = torch.Generator().manual_seed(0)
    return UpdateTarget(
        grads=torch.randn(NUMEL, generator=gen).to(dtype),
        params=torch.randn(NUMEL, generator=gen).to(dtype),
        master_in_params=master_in_params,
        write_params=write_params,
    )


def read_key(state: CpuStateChunks, key: str) -> torch.Tensor:
    parts = []
    for chunk in range(state.nchunks):
        tensors = state.acquire(chunk)
        try:
            parts.append(getattr(tensors, key).clone())
        finally:
            state.release(chunk, dirty=False)
    return torch.cat(parts)


class CountingState:
    """A ``StateChunks`` over a real one that counts what is held, with an optional ``max_acquired``."""

    def __init__(self, inner: CpuStateChunks, max_acquired: int | None = None) -> None:
        self.inner = inner
        self.numel, self.chunk_numel, self.keys = inner.numel, inner.chunk_numel, inner.keys
        self.format = inner.format
        if max_acquired is not None:
            self.max_acquired = max_acquired
        self._lock = threading.Lock()
        self.held = 0
        self.most_held = 0
        self.acquires = 0

    @property
    def nchunks(self) -> int:
        return self.inner.nchunks

    def acquire(
        self, chunk: int, keys: Iterable[str] = UPDATE_KEYS, *, advance: bool = True, overwrite: Iterable[str] = ()
    ) -> ChunkTensors:
        tensors = self.inner.acquire(chunk, keys, advance=advance, overwrite=overwrite)
        with self._lock:
            self.held += 1
            self.acquires += 1
            self.most_held = max(self.most_held, self.held)
        return tensors

    def release(self, chunk: int, keys: Iterable[str] = UPDATE_KEYS, *, dirty: bool, consumed: bool = False) -> None:
        self.inner.release(chunk, keys, dirty=dirty, consumed=consumed)
        with self._lock:
            self.held -= 1

    def close(self, *, remove: bool = True) -> None:
        self.inner.close(remove=remove)


def counting_state(pool: BufferPool, max_acquired: int | None = None) -> CountingState:
    return CountingState(CpuStateChunks(pool, NUMEL, CHUNK_NUMEL, owner=TENANT), max_acquired)


def assert_released(state: CountingState, pool: BufferPool) -> None:
    """Every chunk ``state`` handed out came back and no block of ``pool`` is pinned; then ``state`` is closed."""
    assert state.held == 0
    assert pins(pool) == 0
    state.close()


@dataclass
class Call:
    lo: int
    hi: int
    group: ParamGroup
    step: int
    grad_scale: float
    master: torch.Tensor
    """What the master held when the kernel was called."""
    master_ptr: int
    out_ptr: int | None


class RecordingKernel:
    """Records each call; adds 1 to exp_avg and 2 to exp_avg_sq so the touched state can be read back.

    ``fail_lo``: the piece starting there raises ``error``; ``delay_s``: how long every other piece takes."""

    def __init__(self, grads: torch.Tensor, *, fail_lo: int | None = None, delay_s: float = 0.0) -> None:
        self.grads = grads
        self.fail_lo = fail_lo
        self.delay_s = delay_s
        self.error = RuntimeError("kernel failed on purpose")
        self.calls: list[Call] = []
        self.finished: list[int] = []

    def grad_stats(self, grad: torch.Tensor, inv_scale: float) -> tuple[float, bool]:
        g = grad.float() * inv_scale
        return float(g.square().sum()), not bool(torch.isfinite(g).all())

    def update(self, ops: AdamSlices, *, group: ParamGroup, step: int, grad_scale: float) -> None:
        master, moments, grad, out = ops
        exp_avg, exp_avg_sq = moments.exp_avg, moments.exp_avg_sq
        lo = (grad.data_ptr() - self.grads.data_ptr()) // self.grads.element_size()
        out_ptr = None if out is None else out.data_ptr()
        self.calls.append(
            Call(lo, lo + grad.numel(), group, step, grad_scale, master.clone(), master.data_ptr(), out_ptr)
        )
        if lo == self.fail_lo:
            raise self.error
        time.sleep(self.delay_s)
        exp_avg.add_(1.0)
        exp_avg_sq.add_(2.0)
        self.finished.append(lo)


# ----------------------------------------------------------------- adopt_edits


@st.composite
def edited(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, set[int]]:
    """An fp32 master, params that are the master cast down with some elements changed, and which."""
    dtype = draw(st.sampled_from([torch.float32, *LOW]))
    limit = 6e4 if dtype is torch.float16 else 2.0**100
    finite = st.floats(-limit, limit, allow_nan=False, width=32)
    values = draw(st.lists(finite, min_size=1, max_size=40))
    master = torch.tensor(values, dtype=torch.float32)
    params = master.to(dtype, copy=True)
    changed: set[int] = set()
    for index in draw(st.sets(st.integers(0, len(values) - 1))):
        new = torch.tensor([draw(st.one_of(finite, st.just(float("nan")), st.just(float("inf"))))]).to(dtype)
        if not bool(new == params[index]):
            params[index] = new[0]
            changed.add(index)
    return master, params, changed


@given(edited())
def test_adopt_edits_takes_exactly_the_changed_params(case: tuple[torch.Tensor, torch.Tensor, set[int]]) -> None:
    master, params, changed = case
    before = master.clone()
    assert adopt_edits(master, params) == len(changed)
    for i in range(len(master)):
        if i in changed:
            torch.testing.assert_close(master[i], params[i].float(), equal_nan=True, rtol=0, atol=0)
        else:  # kept bit for bit, even where the param holds it only rounded
            assert master[i].view(torch.int32) == before[i].view(torch.int32)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_adopt_edits_keeps_an_fp32_master_that_rounds_to_the_untouched_param(dtype: torch.dtype) -> None:
    master = torch.tensor([1.0 + 2**-12, -3.0 - 2**-11, 0.1], dtype=torch.float32)
    params = master.to(dtype, copy=True)
    assert not torch.equal(params.float(), master)  # the params really are rounded
    before = master.clone()
    assert adopt_edits(master, params) == 0
    assert torch.equal(master.view(torch.int32), before.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
def test_adopt_edits_widens_the_edited_param(dtype: torch.dtype) -> None:
    master = torch.tensor([1.0 + 2**-12, 2.0, 3.0], dtype=torch.float32)
    params = master.to(dtype, copy=True)
    params[1] = 0.5  # e.g. p.data.clamp_(max=0.5)
    assert adopt_edits(master, params) == 1
    assert master.tolist() == [1.0 + 2**-12, 0.5, 3.0]


@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
def test_adopt_edits_adopts_nan_and_inf_params(dtype: torch.dtype) -> None:
    master = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float32)
    params = master.to(dtype, copy=True)
    params[0] = float("nan")
    params[2] = float("-inf")
    assert adopt_edits(master, params) == 2
    assert master[0].isnan()
    assert master[1].item() == 2.0
    assert master[2].item() == float("-inf")


def test_adopt_edits_writes_into_the_master_view_it_is_given() -> None:
    base = torch.arange(10, dtype=torch.float32)
    params = base[2:6].to(torch.bfloat16)
    params[1] = 100.0
    assert adopt_edits(base[2:6], params) == 1
    assert base.tolist() == [0, 1, 2, 100, 4, 5, 6, 7, 8, 9]


# ----------------------------------------------------------------- UpdateRunner.run


@pytest.mark.parametrize(
    ("dtype", "master_in_params"),
    [(torch.float32, True), (torch.float32, False), (torch.bfloat16, False), (torch.float16, False)],
    ids=["fp32-params-are-master", "fp32-with-master", "bf16", "fp16"],
)
def test_run_matches_torch_adamw(
    pool: BufferPool, scheduler: CpuScheduler, dtype: torch.dtype, master_in_params: bool
) -> None:
    """Three steps (tensor 2 has no grad in the second), grads scaled by 4 and unscaled by the runner."""
    keys = ("exp_avg", "exp_avg_sq") if master_in_params else ALL_KEYS
    state = CpuStateChunks(pool, NUMEL, CHUNK_NUMEL, owner=TENANT, keys=keys)
    records = make_records(str(dtype).removeprefix("torch."))
    tgt = target(dtype, master_in_params=master_in_params)
    ref = [torch.nn.Parameter(tgt.params[r.start : r.stop].float().view(r.spec.shape).clone()) for r in records]
    opt = torch.optim.AdamW(
        [
            {
                "params": [p for p, g in zip(ref, GROUP_OF, strict=True) if g == i],
                "lr": grp.lr,
                "betas": grp.betas,
                "eps": grp.eps,
                "weight_decay": grp.weight_decay,
            }
            for i, grp in enumerate(GROUPS)
        ],
        foreach=False,
    )
    engine = AdamEngine(threads=1, compile=False, warmup=())
    runner = UpdateRunner(EngineKernel(engine), scheduler, TENANT)
    gen = torch.Generator().manual_seed(1)
    try:
        for ids in ([0, 1, 2, 3], [0, 1, 3], [0, 1, 2, 3]):
            grads = torch.randn(NUMEL, generator=gen).to(dtype)
            tgt.grads.copy_(grads * 4)
            for tid, (p, rec) in enumerate(zip(ref, records, strict=True)):
                p.grad = grads[rec.start : rec.stop].float().view(p.shape) if tid in ids else None
            runner.run(state, advance(records, ids), tgt, grad_scale=0.25)
            opt.step()
    finally:
        engine.close()
    got = tgt.params.float() if master_in_params else read_key(state, "master")
    torch.testing.assert_close(got, torch.cat([p.detach().view(-1) for p in ref]))
    assert torch.equal(tgt.params, got.to(dtype))
    assert pins(pool) == 0
    state.close()


def test_run_hands_each_piece_its_slices_group_step_and_scale(pool: BufferPool, scheduler: CpuScheduler) -> None:
    state = CpuStateChunks(pool, NUMEL, CHUNK_NUMEL, owner=TENANT)
    records = make_records("bfloat16")
    records[1].step = 4
    tgt = target(torch.bfloat16)
    kernel = RecordingKernel(tgt.grads)
    pieces = advance(records, [1, 2, 3])
    UpdateRunner(kernel, scheduler, TENANT).run(state, pieces, tgt, grad_scale=0.125)
    calls = sorted(kernel.calls, key=lambda c: c.lo)
    assert [(c.lo, c.hi, c.group, c.step) for c in calls] == [(p.lo, p.hi, p.group, p.step) for p in pieces]
    assert {c.grad_scale for c in calls} == {0.125}
    itemsize = tgt.params.element_size()
    assert [c.out_ptr for c in calls] == [tgt.params.data_ptr() + c.lo * itemsize for c in calls]
    # the state sections of each piece were the ones handed over: tensor 0 untouched, the rest once
    touched = torch.zeros(NUMEL)
    touched[records[1].start :] = 1.0
    assert torch.equal(read_key(state, "exp_avg"), touched)
    assert torch.equal(read_key(state, "exp_avg_sq"), 2 * touched)
    assert pins(pool) == 0
    state.close()


def test_run_adopts_the_params_into_the_master_before_the_update(pool: BufferPool, scheduler: CpuScheduler) -> None:
    state = CpuStateChunks(pool, NUMEL, CHUNK_NUMEL, owner=TENANT)  # a fresh master: all zeros
    records = make_records("bfloat16")
    tgt = target(torch.bfloat16)
    kernel = RecordingKernel(tgt.grads)
    runner = UpdateRunner(kernel, scheduler, TENANT)
    runner.run(state, advance(records, [0, 1, 2, 3]), tgt, grad_scale=1.0)
    for call in kernel.calls:
        assert torch.equal(call.master, tgt.params[call.lo : call.hi].float())
    assert runner.adopted == int((tgt.params != 0).sum())
    state.close()


def test_run_of_fp32_params_kept_with_a_master_updates_the_params_and_writes_the_master(
    pool: BufferPool, scheduler: CpuScheduler
) -> None:
    """The NVMe placement keeps a master beside fp32 params: the update reads the params (an edit is its
    input, with no compare pass) and writes the result to the master in the same call."""
    state = CpuStateChunks(pool, NUMEL, CHUNK_NUMEL, owner=TENANT)  # a master that differs from the params
    records = make_records("float32")
    tgt = target(torch.float32)
    kernel = RecordingKernel(tgt.grads)
    runner = UpdateRunner(kernel, scheduler, TENANT)
    runner.run(state, advance(records, [0, 1, 2, 3]), tgt, grad_scale=1.0)
    assert kernel.calls
    itemsize = tgt.params.element_size()
    for call in kernel.calls:
        assert call.master_ptr == tgt.params.data_ptr() + call.lo * itemsize
        assert call.out_ptr is not None and call.out_ptr != call.master_ptr
    assert runner.adopted == 0
    state.close()


def test_run_of_a_delayed_step_neither_adopts_nor_writes_params(pool: BufferPool, scheduler: CpuScheduler) -> None:
    state = CpuStateChunks(pool, NUMEL, CHUNK_NUMEL, owner=TENANT)
    records = make_records("bfloat16")
    tgt = target(torch.bfloat16, write_params=False)
    kernel = RecordingKernel(tgt.grads)
    runner = UpdateRunner(kernel, scheduler, TENANT)
    runner.run(state, advance(records, [0, 1, 2, 3]), tgt, grad_scale=1.0)
    assert kernel.calls
    assert all(c.out_ptr is None and not c.master.any() for c in kernel.calls)
    assert runner.adopted == 0
    state.close()


def test_run_updates_fp32_params_in_place_when_they_are_the_master(pool: BufferPool, scheduler: CpuScheduler) -> None:
    state = CpuStateChunks(pool, NUMEL, CHUNK_NUMEL, owner=TENANT, keys=("exp_avg", "exp_avg_sq"))
    records = make_records("float32")
    tgt = target(torch.float32, master_in_params=True)
    kernel = RecordingKernel(tgt.grads)
    UpdateRunner(kernel, scheduler, TENANT).run(state, advance(records, [0, 1, 2, 3]), tgt, grad_scale=1.0)
    assert [c.master_ptr for c in kernel.calls] == [tgt.params.data_ptr() + c.lo * 4 for c in kernel.calls]
    assert all(c.out_ptr is None for c in kernel.calls)
    state.close()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_failed_piece_is_raised_after_every_other_piece_ended(
    pool: BufferPool, scheduler: CpuScheduler, where: str
) -> None:
    state = counting_state(pool)
    records = make_records("bfloat16")
    tgt = target(torch.bfloat16)
    pieces = advance(records, [0, 1, 2, 3])
    failing = pieces[{"first": 0, "middle": len(pieces) // 2, "last": -1}[where]]
    kernel = RecordingKernel(tgt.grads, fail_lo=failing.lo, delay_s=0.005)
    with pytest.raises(RuntimeError) as info:
        UpdateRunner(kernel, scheduler, TENANT).run(state, pieces, tgt, grad_scale=1.0)
    assert info.value is kernel.error
    assert sorted(kernel.finished) == sorted(p.lo for p in pieces if p is not failing)
    assert state.acquires == len(pieces)
    assert_released(state, pool)


def test_run_holds_at_most_max_acquired_chunks(pool: BufferPool, scheduler: CpuScheduler) -> None:
    state = counting_state(pool, max_acquired=2)
    records = make_records("bfloat16")
    tgt = target(torch.bfloat16)
    pieces = advance(records, [0, 1, 2, 3])
    assert len(pieces) > 2
    kernel = RecordingKernel(tgt.grads, delay_s=0.002)
    UpdateRunner(kernel, scheduler, TENANT).run(state, pieces, tgt, grad_scale=1.0)
    assert sorted(kernel.finished) == sorted(p.lo for p in pieces)
    assert state.most_held == 2
    assert_released(state, pool)


def test_a_failure_inside_the_window_stops_new_pieces_and_releases_the_rest(
    pool: BufferPool, scheduler: CpuScheduler
) -> None:
    state = counting_state(pool, max_acquired=2)
    records = make_records("bfloat16")
    tgt = target(torch.bfloat16)
    pieces = advance(records, [0, 1, 2, 3])
    kernel = RecordingKernel(tgt.grads, fail_lo=pieces[0].lo, delay_s=0.002)
    with pytest.raises(RuntimeError) as info:
        UpdateRunner(kernel, scheduler, TENANT).run(state, pieces, tgt, grad_scale=1.0)
    assert info.value is kernel.error
    assert len(kernel.calls) == len(kernel.finished) + 1  # nothing still running
    assert len(kernel.calls) < len(pieces)
    assert_released(state, pool)


def test_cancelled_pieces_release_their_chunks(pool: BufferPool, scheduler: CpuScheduler) -> None:
    state = counting_state(pool)
    records = make_records("bfloat16")
    tgt = target(torch.bfloat16)
    pieces = advance(records, [0, 1, 2, 3])
    kernel = RecordingKernel(tgt.grads)
    started, gate = threading.Event(), threading.Event()

    def hold_the_executor() -> None:
        started.set()
        gate.wait(10)

    blocker = scheduler.submit("another-job/0", hold_the_executor)
    started.wait(10)
    assert started.is_set()
    runner = UpdateRunner(kernel, scheduler, TENANT)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            runner.run(state, pieces, tgt, grad_scale=1.0)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 10
    while scheduler.queued < len(pieces) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert scheduler.cancel(TENANT) == len(pieces)
    gate.set()
    worker.join(10)
    blocker.result(10)
    assert outcome  # run returned
    assert kernel.calls == []
    assert_released(state, pool)


def test_run_on_a_closed_scheduler_releases_what_it_acquired(pool: BufferPool, scheduler: CpuScheduler) -> None:
    state = counting_state(pool)
    records = make_records("bfloat16")
    tgt = target(torch.bfloat16)
    scheduler.close()
    with pytest.raises(InvalidState):
        UpdateRunner(RecordingKernel(tgt.grads), scheduler, TENANT).run(
            state, advance(records, [0]), tgt, grad_scale=1.0
        )
    assert_released(state, pool)


def test_a_queued_run_reraises_a_failed_piece_from_its_future(pool: BufferPool, scheduler: CpuScheduler) -> None:
    state = CpuStateChunks(pool, NUMEL, CHUNK_NUMEL, owner=TENANT)
    records = make_records("bfloat16")
    tgt = target(torch.bfloat16)
    pieces = advance(records, [0, 1, 2, 3])
    kernel = RecordingKernel(tgt.grads, fail_lo=pieces[1].lo)
    runner = UpdateRunner(kernel, scheduler, TENANT)
    try:
        future = runner.run(state, pieces, tgt, grad_scale=1.0, wait=False)
        error = future.exception(10)
        assert error is kernel.error
        assert len(kernel.finished) == len(pieces) - 1
    finally:
        runner.close()
    assert pins(pool) == 0
    state.close()

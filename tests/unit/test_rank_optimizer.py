"""The daemon's step owner, ``RankOptimizer``, built in process and driven directly; numerics against AdamW.

Real parts: a ``BufferPool`` over memfds with ``CpuStateChunks`` in it (the cpu tier), the staging window and
shared storage arenas, the ``CpuScheduler`` thread and the daemon's Adam kernel (``EngineKernel``, eager).
No daemon, no socket: the test is the trainer, writing grads into the storage views a REGISTER_OK names.
The one fake, ``FailingKernel``, raises on its Nth update.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from tiermem.core.errors import InvalidArgument, InvalidState, StepFailed
from tiermem.core.modes import Placement
from tiermem.core.protocol import Abort, BucketReady, ParamGroup, Step, StepDone, TensorSpec
from tiermem.core.units import PAGE_SIZE, MiB
from tiermem.engine.optim import AdamEngine
from tiermem.engine.pool import Arena, BufferPool
from tiermemd.kernel import EngineKernel
from tiermemd.rank import AdamKernel, RankOptimizer
from tiermemd.scheduler import CpuScheduler
from tiermemd.state import CpuStateChunks

SHAPES = [(3, 4), (5,), (2, 3), (7,)]
GROUP_OF = [0, 0, 1, 1]
GROUPS = (
    ParamGroup(lr=1e-2, weight_decay=0.1),
    ParamGroup(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01),
)
CHUNK_NUMEL = 8  # 30 elements: 5 update pieces, most tensors straddle a chunk boundary


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def kernel() -> Iterator[EngineKernel]:
    engine = AdamEngine(threads=1, compile=False, warmup=())
    yield EngineKernel(engine)
    engine.close()


class FailingKernel:
    """The real kernel, except that its ``fail_on``-th update (1-based) raises."""

    def __init__(self, inner: AdamKernel, fail_on: int) -> None:
        self.inner, self.fail_on, self.updates = inner, fail_on, 0

    def grad_stats(self, grad: torch.Tensor, inv_scale: float) -> tuple[float, bool]:
        return self.inner.grad_stats(grad, inv_scale)

    def update(self, *args: object, **kwargs: object) -> None:
        self.updates += 1
        if self.updates == self.fail_on:
            raise RuntimeError("kernel failed on purpose")
        self.inner.update(*args, **kwargs)  # type: ignore[arg-type]


@dataclass
class Trainer:
    """The trainer's side of one rank: its params and grads are views of the rank's shared storage."""

    rank: RankOptimizer
    params: list[torch.Tensor]
    grads: list[list[torch.Tensor]]
    """``grads[buffer][tensor]``."""
    ref: list[torch.nn.Parameter]
    """The same params under ``opt``, torch's AdamW."""
    opt: torch.optim.AdamW

    def feed(self, seed: int, *, ids: tuple[int, ...] = (0, 1, 2, 3), scale: float = 1.0, buffer: int = 0) -> None:
        """Grads for ``ids`` (the others have none this step): ``scale`` times them into the storage."""
        gen = torch.Generator().manual_seed(seed)
        for i, p in enumerate(self.ref):
            g = torch.randn(p.shape, generator=gen)
            self.grads[buffer][i].copy_(g * scale)
            p.grad = g if i in ids else None

    def step(self, step: int, **fields: object) -> StepDone:
        """STEP to the rank, and AdamW's step on the reference."""
        done = self.rank.step(Step(step=step, **fields))  # type: ignore[arg-type]
        self.opt.step()
        return done

    def key(self, name: str) -> torch.Tensor:
        """State key ``name`` of the whole rank, flat, copied."""
        state = self.rank.state
        assert state is not None
        parts = []
        for chunk in range(state.nchunks):
            parts.append(getattr(state.acquire(chunk), name).clone())
            state.release(chunk, dirty=False)
        return torch.cat(parts)

    def assert_matches_reference(self) -> None:
        """Params and both moments as AdamW has them (the moments also catch a wrong grad scale, which
        Adam's update direction hardly shows)."""
        moments = {name: self.key(name) for name in ("exp_avg", "exp_avg_sq")}
        for mine, ref, rec in zip(self.params, self.ref, self.rank.records, strict=True):
            torch.testing.assert_close(mine, ref.detach())
            for name, flat in moments.items():
                want = self.opt.state[ref].get(name, torch.zeros_like(ref)).flatten()
                torch.testing.assert_close(flat[rec.start : rec.stop], want)

    def snapshot(self) -> list[torch.Tensor]:
        """The params and every state key the rank keeps, copied."""
        assert self.rank.state is not None
        return [p.clone() for p in self.params] + [self.key(name) for name in self.rank.state.keys]

    def assert_unchanged_since(self, before: list[torch.Tensor]) -> None:
        for now, then in zip(self.snapshot(), before, strict=True):
            assert torch.equal(now, then)

    @property
    def steps(self) -> tuple[int, ...]:
        """Each tensor's Adam step count, as the rank's job file records it."""
        return self.rank.export(self.rank.placement).steps


def open_rank(pool: BufferPool, scheduler: CpuScheduler, kernel: AdamKernel, *, grad_buffers: int = 1) -> Trainer:
    window = Arena.create(PAGE_SIZE, name="rank-test-window", mlock=False)
    rank = RankOptimizer(job_id="job", rank=0, window=window, window_id=1, kernel=kernel, scheduler=scheduler)
    specs = [
        TensorSpec(f"t{i}", s, "float32", Placement.CPU, g)
        for i, (s, g) in enumerate(zip(SHAPES, GROUP_OF, strict=True))
    ]
    reg = rank.register(
        specs,
        GROUPS,
        grad_buffers,
        Placement.CPU,
        lambda numel, fmt: CpuStateChunks(
            pool, numel, CHUNK_NUMEL, owner="job/0", keys=fmt.keys, state_dtype=fmt.state_dtype
        ),
        lambda nbytes: (Arena.create(nbytes, name="rank-test-storage", mlock=False, reserve=False), 2),
    )
    assert reg.storage is not None

    def view(offset: int, nbytes: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.frombuffer(reg.storage.view(offset, nbytes), dtype=torch.float32).view(shape)  # type: ignore[union-attr]

    params = [view(s.param.offset, s.param.length, shape) for s, shape in zip(reg.slots, SHAPES, strict=True)]
    grads = [
        [view(s.grads[b].offset, s.grads[b].length, shape) for s, shape in zip(reg.slots, SHAPES, strict=True)]
        for b in range(grad_buffers)
    ]
    gen = torch.Generator().manual_seed(1234)
    for p in params:
        p.copy_(torch.randn(p.shape, generator=gen))
    return Trainer(rank, params, grads, *reference(params))


def reference(params: list[torch.Tensor]) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    """Copies of ``params`` under a fresh AdamW with the registered groups."""
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    groups = [
        {"params": [p for p, g in zip(ref, GROUP_OF, strict=True) if g == i], "lr": grp.lr, "betas": grp.betas}
        | {"eps": grp.eps, "weight_decay": grp.weight_decay}
        for i, grp in enumerate(GROUPS)
    ]
    return ref, torch.optim.AdamW(groups)


@pytest.fixture
def open_trainer(kernel: EngineKernel) -> Iterator[Callable[..., Trainer]]:
    """Opens ranks (``kernel`` and ``grad_buffers`` may be given) over one pool and scheduler; closes all."""
    opened: list[Trainer] = []
    pool = BufferPool.create(1 * MiB, arena_size=1 * MiB, mlock=False, name="rank-test")
    scheduler = CpuScheduler(name="rank-test")

    def make(*, kernel: AdamKernel = kernel, grad_buffers: int = 1) -> Trainer:
        opened.append(open_rank(pool, scheduler, kernel, grad_buffers=grad_buffers))
        return opened[-1]

    yield make
    for t in opened:
        t.rank.close()
        t.rank.window.close()
    scheduler.close()
    pool.close()


@pytest.fixture
def trainer(open_trainer: Callable[..., Trainer]) -> Trainer:
    return open_trainer()


def test_a_reattach_that_registers_otherwise_is_told_what_differs(trainer: Trainer) -> None:
    rank = trainer.rank
    specs = list(rank.specs)

    def register(specs: list[TensorSpec], **kw: object) -> None:
        rank.register(specs, GROUPS, 1, Placement.CPU, None, None, **kw)  # type: ignore[arg-type]

    register(specs)  # the same registration: the same plan (a reattach)
    with pytest.raises(InvalidState, match=r"registered otherwise: state_dtype fp32, not bf16; a reattach"):
        register(specs, state_dtype="bf16")
    bigger = [*specs[:-1], TensorSpec(specs[-1].name, (99,), "float32", Placement.CPU, specs[-1].group)]
    last = specs[-1]
    said = f"tensor {len(specs) - 1} is '{last.name}' {list(last.shape)} float32 (group {last.group}, cpu), not "
    with pytest.raises(InvalidState, match=re.escape(said + f"'{last.name}' [99]")):
        register(bigger)
    with pytest.raises(InvalidState, match=rf"{len(specs)} tensors, not {len(specs) - 1}"):
        register(specs[:-1])


def test_step_applies_adamw_to_the_params_in_storage(trainer: Trainer) -> None:
    assert trainer.rank.state is not None and trainer.rank.state.keys == ("exp_avg", "exp_avg_sq")
    for step in (1, 2, 3):
        trainer.feed(seed=step)
        done = trainer.step(step, attempt=step)
        assert (done.step, done.attempt, done.skipped, done.grad_norm) == (step, step, False, None)
        assert trainer.rank.last_step == step
    trainer.assert_matches_reference()
    assert trainer.steps == (3, 3, 3, 3)


def test_max_grad_norm_clips_by_the_norm_clip_grad_norm_takes(trainer: Trainer) -> None:
    for step in (1, 2):
        trainer.feed(seed=step)
        done = trainer.rank.step(Step(step=step, max_grad_norm=1.0))
        total = torch.nn.utils.clip_grad_norm_(trainer.ref, 1.0)
        trainer.opt.step()
        assert float(total) > 1.0  # the clip did something
        assert done.grad_norm == pytest.approx(float(total), rel=1e-6)
        assert not done.nonfinite
    trainer.assert_matches_reference()


def test_loss_scale_and_clip_coef_scale_the_grads_once(trainer: Trainer) -> None:
    trainer.feed(seed=1, scale=1024.0)  # what backward of a scaled loss leaves
    done = trainer.rank.step(Step(step=1, loss_scale=1024.0, clip_coef=0.25))
    for p in trainer.ref:
        p.grad.mul_(0.25)  # type: ignore[union-attr]
    trainer.opt.step()
    assert done.grad_norm is None  # the trainer decided the coefficient: the daemon took no norm
    trainer.assert_matches_reference()


def test_skip_changes_only_the_skip_count(trainer: Trainer) -> None:
    trainer.feed(seed=1)
    trainer.step(1)
    trainer.feed(seed=2)
    before = trainer.snapshot()
    done = trainer.rank.step(Step(step=2, attempt=5, skip=True, max_grad_norm=1.0))
    assert (done.step, done.attempt, done.skipped, done.nonfinite, done.skipped_steps) == (1, 5, True, True, 1)
    trainer.assert_unchanged_since(before)
    assert trainer.rank.last_step == 1 and trainer.steps == (1, 1, 1, 1)
    assert trainer.rank.stats().skipped_steps == 1
    # the retry of step 2 is Adam's second step (bias correction of t=2), not its third
    done = trainer.step(2)
    assert (done.step, done.skipped, done.skipped_steps) == (2, False, 1)
    trainer.assert_matches_reference()


@pytest.mark.parametrize(
    ("msg", "match"),
    [
        (Step(step=2, max_grad_norm=1.0, clip_coef=0.5), "not both"),
        (Step(step=2, loss_scale=0.0), "loss_scale"),
        (Step(step=2, tensor_ids=(0, 4)), "tensor id 4"),
        (Step(step=2, grad_buffer=1), "grad_buffer 1"),
        (Step(step=2, groups=GROUPS[:1]), "1 param groups, 2 are registered"),
        (Step(step=1), "already applied"),
        (Step(step=0), "already applied"),
    ],
)
def test_invalid_step_is_refused_before_anything_changes(trainer: Trainer, msg: Step, match: str) -> None:
    trainer.feed(seed=1)
    trainer.step(1)
    trainer.feed(seed=2)
    before = trainer.snapshot()
    with pytest.raises(InvalidArgument, match=match):
        trainer.rank.step(msg)
    trainer.assert_unchanged_since(before)
    assert trainer.rank.last_step == 1 and trainer.steps == (1, 1, 1, 1)
    trainer.step(2)  # still usable
    trainer.assert_matches_reference()


def test_overlapped_buckets_and_their_step_update_each_tensor_once(trainer: Trainer) -> None:
    trainer.feed(seed=1)
    trainer.rank.bucket_ready(BucketReady(step=1, attempt=7, bucket=0, tensor_ids=(2, 3), groups=GROUPS))
    trainer.rank.bucket_ready(BucketReady(step=1, attempt=7, bucket=1, tensor_ids=(0,), groups=GROUPS))
    with pytest.raises(InvalidState, match="already updated"):
        trainer.rank.bucket_ready(BucketReady(step=1, attempt=7, bucket=2, tensor_ids=(0,), groups=GROUPS))
    done = trainer.step(1, attempt=7)
    assert (done.step, done.skipped) == (1, False)
    assert trainer.rank.last_step == 1 and trainer.steps == (1, 1, 1, 1)
    assert trainer.rank.stats().overlapped_tensors == 3
    trainer.assert_matches_reference()


def test_abort_keeps_applied_buckets_with_their_own_step_counts(trainer: Trainer) -> None:
    trainer.feed(seed=1)
    trainer.step(1)
    trainer.feed(seed=2, ids=(0, 1))  # as torch sees it: tensors 2 and 3 had no grad in step 2
    trainer.rank.bucket_ready(BucketReady(step=2, attempt=1, bucket=0, tensor_ids=(0, 1), groups=GROUPS))
    other = trainer.rank.abort(Abort(step=2, attempt=9))  # not the open attempt: nothing closes
    assert other.tensors_applied == 0
    aborted = trainer.rank.abort(Abort(step=2, attempt=1))
    trainer.opt.step()
    assert (aborted.tensors_applied, aborted.last_step) == (2, 2)
    assert trainer.steps == (2, 2, 1, 1)
    trainer.feed(seed=3)
    trainer.step(3)
    assert trainer.steps == (3, 3, 2, 2)
    trainer.assert_matches_reference()


def test_loss_scaled_step_of_an_overlapped_attempt_is_refused_and_keeps_the_buckets(trainer: Trainer) -> None:
    trainer.feed(seed=1, ids=(1,))
    trainer.rank.bucket_ready(BucketReady(step=1, attempt=1, bucket=0, tensor_ids=(1,), groups=GROUPS))
    with pytest.raises(InvalidState, match="already updated as their buckets landed"):
        trainer.rank.step(Step(step=1, attempt=1, loss_scale=2.0))
    trainer.opt.step()  # as torch sees it: only tensor 1 had a grad
    assert trainer.rank.last_step == 1 and trainer.steps == (0, 1, 0, 0)
    trainer.assert_matches_reference()


def test_failed_update_fails_the_rank_until_every_tensor_is_reset(
    open_trainer: Callable[..., Trainer], kernel: EngineKernel
) -> None:
    t = open_trainer(kernel=FailingKernel(kernel, fail_on=2))  # the second of five pieces raises
    t.feed(seed=1)
    with pytest.raises(StepFailed, match="kernel failed on purpose"):
        t.rank.step(Step(step=1))
    assert t.rank.stats().failed and t.rank.export(t.rank.placement).failed_step == 1
    with pytest.raises(StepFailed, match="step 1"):
        t.rank.step(Step(step=2))
    with pytest.raises(StepFailed):
        t.rank.bucket_ready(BucketReady(step=2, attempt=0, bucket=0, tensor_ids=(0,), groups=GROUPS))
    t.rank.reset_state([0, 1, 2])
    with pytest.raises(StepFailed):
        t.rank.step(Step(step=2))
    t.rank.reset_state([])
    assert not t.rank.stats().failed and t.steps == (0, 0, 0, 0)
    t.ref, t.opt = reference(t.params)  # the params are what they are (partly stepped); Adam starts afresh
    t.feed(seed=2)
    t.step(2)
    assert t.steps == (1, 1, 1, 1)
    t.assert_matches_reference()


def test_delayed_step_writes_the_params_only_when_they_are_fetched(open_trainer: Callable[..., Trainer]) -> None:
    t = open_trainer(grad_buffers=2)  # the delayed update alternates two grad buffers and keeps a master
    assert t.rank.state is not None and "master" in t.rank.state.keys
    for step in (1, 2):
        t.feed(seed=step, buffer=step % 2)
        before = [p.clone() for p in t.params]
        done = t.step(step, delayed=True, grad_buffer=step % 2)
        assert (done.step, done.params_ready) == (step, False)
        t.rank.quiesce()  # the update has run, into the master only
        for now, then in zip(t.params, before, strict=True):
            assert torch.equal(now, then)
        t.rank.write_params([])
        t.assert_matches_reference()


def test_delayed_step_on_a_rank_without_a_master_is_refused(trainer: Trainer) -> None:
    """A rank registered for the synchronous update (fp32 params are their own master, one grad buffer)
    would have the background update write the params the trainer is reading: refused, nothing changed."""
    trainer.feed(seed=1)
    before = [p.clone() for p in trainer.params]
    with pytest.raises(InvalidArgument, match="grad_buffers=2"):
        trainer.step(1, delayed=True)
    assert trainer.rank.last_step == 0
    for now, then in zip(trainer.params, before, strict=True):
        assert torch.equal(now, then)

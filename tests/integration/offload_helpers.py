"""Shared pieces of the ``OffloadAdam`` integration tests: a private daemon, models, data, training loops.

``OffloadDaemon`` starts one real private tiermemd (``tiermem.client.link.connect``)
for a test module and hands out ``OffloadAdam`` optimizers, each on its own
connection to that daemon (one connection attaches to one job), closing them
all at teardown.  The daemon runs its Adam eagerly (``adam.compile = false``,
compiling costs tens of seconds per daemon here) on one thread, and the tests
run torch on one thread: on a shared 2-core machine, oversubscribed OpenMP
threads make every step an order of magnitude slower.

Reference optimizers: ``cpu_adam`` builds ``tiermem.engine.optim.CPUAdam`` with the
daemon's engine settings (eager, one thread), the same arithmetic the daemon
runs, so long trajectories can be compared exactly; ``torch.optim.AdamW`` is the
external reference (see each test for the tolerance and why).

Models: ``tiny_gpt`` (``tiermem.client.demo.model.GPT``, about 21k parameters, about
10 chunks of 2048 elements), ``mlp`` (fixed data, where torch and the engine
stay within ``assert_close``'s default tolerances over 100 steps).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tiermem.client.connection import Connection
from tiermem.client.demo.model import GPT, CharCorpus, GPTConfig
from tiermem.client.link import Client, EmbeddedDaemon, connect
from tiermem.client.offload import OffloadAdam
from tiermem.engine.optim import CPUAdam

TINY_GPT = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)
BATCH = 4
CHUNK_NUMEL = 2048
"""Daemon chunk size in the tests: the tiny GPT's state is ~10 chunks, more than the NVMe tier's 6-chunk cache."""
DAEMON_SETTINGS: dict[str, Any] = {
    "adam.compile": False,
    "adam.threads": 1,
    "adam.chunk_numel": CHUNK_NUMEL,
    "swap.fsync": False,
    # the NVMe tier's sizes fixed (no probe of the disk) and no borrowing: every step pages chunks out and in
    "swap.queue_depth": 32,
    "swap.cache_chunks": 6,
    "swap.prefetch_depth": 2,
    "swap.borrow": False,
}

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


# ----------------------------------------------------------------------------- daemon


class OffloadDaemon:
    """One private tiermemd (a real child process, as ``connect()`` starts it).

    ``make(params, **kw)`` gives an ``OffloadAdam`` on a fresh connection to it."""

    def __init__(self, owner: Client) -> None:
        self.owner = owner
        self.socket_path = owner.socket_path
        self._made: list[OffloadAdam] = []

    def client(self) -> Client:
        return connect(self.socket_path)

    def make(self, params: Any, **kwargs: Any) -> OffloadAdam:
        opt = OffloadAdam(params, client=self.client(), **kwargs)
        self._made.append(opt)
        return opt

    def close_all(self) -> None:
        for opt in self._made:
            opt.close()
        self._made.clear()


@contextlib.contextmanager
def offload_daemon(settings: dict[str, Any] | None = None, pool_size: int = 128 << 20) -> Iterator[OffloadDaemon]:
    """A private daemon for a module (its torch and OpenMP on one thread)."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        # what connect() starts when no daemon answers; started directly so a node daemon is never picked up
        embedded = EmbeddedDaemon(pool_size=pool_size, settings={**DAEMON_SETTINGS, **(settings or {})})
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    try:
        owner = Client(Connection.open(embedded.socket), socket_path=embedded.socket, daemon=embedded)
    except BaseException:
        embedded.stop()
        raise
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    daemon = OffloadDaemon(owner)
    try:
        yield daemon
    finally:
        daemon.close_all()
        owner.close()
        torch.set_num_threads(threads)


def cpu_adam(params: Any, **kwargs: Any) -> CPUAdam:
    """``CPUAdam`` with the test daemon's engine settings (eager, one thread)."""
    return CPUAdam(params, compile=False, threads=1, **kwargs)


# ----------------------------------------------------------------------------- models and data


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY_GPT)


def mlp(seed: int = 0, width: int = 64) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 8))


def replicas(model: nn.Module, n: int) -> list[nn.Module]:
    """``n`` independent copies of ``model`` with identical values."""
    return [copy.deepcopy(model) for _ in range(n)]


@functools.cache
def corpus() -> CharCorpus:
    return CharCorpus(nbytes=1 << 16, seed=0)


def gpt_batches(steps: int, seed: int = 1, batch: int = BATCH) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [corpus().batch(batch, TINY_GPT.block_size, g) for _ in range(steps)]


def mlp_batches(steps: int, seed: int = 1, *, fixed: bool = True) -> list[Batch]:
    """Regression data; ``fixed``: the same batch every step."""
    g = torch.Generator().manual_seed(seed)
    if fixed:
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
        return [(x, y)] * steps
    return [(torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)) for _ in range(steps)]


def gpt_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return model(x, y)  # type: ignore[no-any-return]


def mlp_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    out = model(x.to(next(model.parameters()).dtype))
    return F.mse_loss(out.float(), y)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: Sequence[Batch],
    loss_fn: LossFn,
    *,
    after_backward: Callable[[int], None] | None = None,
    after_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Plain loop: forward, backward, [after_backward], step, zero_grad, [after_step]; returns the losses."""
    losses = []
    for i, batch in enumerate(batches):
        loss = loss_fn(model, batch)
        loss.backward()
        if after_backward is not None:
            after_backward(i)
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(i)
        losses.append(float(loss.detach()))
    return losses


def assert_params_close(a: nn.Module, b: nn.Module, **tolerance: Any) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"param {name}: {m}", **tolerance)


def assert_params_equal(a: nn.Module, b: nn.Module) -> None:
    assert_params_close(a, b, rtol=0, atol=0)


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.float() - q.float()).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def assert_state_close(saved: dict[str, Any], reference: dict[str, Any], **tolerance: Any) -> None:
    """Two ``torch.optim.AdamW``-format state dicts hold the same step, exp_avg and exp_avg_sq."""
    assert sorted(saved["state"]) == sorted(reference["state"])
    for key, ref in reference["state"].items():
        mine = saved["state"][key]
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                mine[name].float(), ref[name].float(), msg=lambda m, k=key, n=name: f"state {k} {n}: {m}", **tolerance
            )

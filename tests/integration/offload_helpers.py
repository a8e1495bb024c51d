"""Shared pieces of the ``OffloadAdam`` integration tests: a private daemon, training loops, comparisons.

``OffloadDaemon`` starts one real private tiermemd (``tiermem.client.link.connect``)
for a test module and hands out ``OffloadAdam`` optimizers, each on its own
connection to that daemon (one connection attaches to one job), closing them
all at teardown; conftest's ``offload`` fixture is one for the module.  The
daemon runs its Adam eagerly (``adam.compile = false``, compiling costs tens of
seconds per daemon here) on one thread, and the tests run torch on one thread:
on a shared 2-core machine, oversubscribed OpenMP threads make every step an
order of magnitude slower.

Reference optimizers: ``cpu_adam`` builds ``tiermem.engine.optim.CPUAdam`` with the
daemon's engine settings (eager, one thread), the same arithmetic the daemon
runs, so long trajectories can be compared exactly; ``torch.optim.AdamW`` is the
external reference (see each test for the tolerance and why), and
``offload_and_adamw`` makes the usual pair of them.

The models and their data are in ``small_models``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from small_models import Batch, LossFn, mlp, mlp_batches, mlp_loss, replicas
from torch import nn

from tiermem.client.connection import Connection
from tiermem.client.link import Client, EmbeddedDaemon, connect
from tiermem.client.offload import OffloadAdam
from tiermem.engine.optim import CPUAdam

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


def offload_and_adamw(
    offload: OffloadDaemon, base: nn.Module, tier: str, *, offload_only: dict[str, Any] | None = None, **hyper: Any
) -> tuple[nn.Module, OffloadAdam, nn.Module, torch.optim.AdamW]:
    """Two copies of ``base``: one trained by ``OffloadAdam`` on ``tier`` (with ``hyper`` and ``offload_only``),
    one by ``torch.optim.AdamW`` (with ``hyper``)."""
    m_off, m_ref = replicas(base, 2)
    opt = offload.make(m_off.parameters(), offload=tier, **hyper, **(offload_only or {}))
    return m_off, opt, m_ref, torch.optim.AdamW(m_ref.parameters(), **hyper)


# ----------------------------------------------------------------------------- training and comparing


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


def assert_trains_like(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ref_model: nn.Module,
    ref: torch.optim.Optimizer,
    batches: Sequence[Batch],
    loss_fn: LossFn,
) -> None:
    """``train`` each model with its optimizer on ``batches``: the params and the Adam state agree (default
    fp32 tolerances)."""
    train(model, opt, batches, loss_fn)
    train(ref_model, ref, batches, loss_fn)
    assert_params_close(model, ref_model)
    assert_state_close(opt.state_dict(), ref.state_dict())


def scaled_step(opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> bool:
    """``opt.step()``, through ``scaler`` (step, then update) when there is one; True when the scaler skipped
    the step (it lowered its scale: an inf or nan grad)."""
    if scaler is None:
        opt.step()
        return False
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale() < before


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


def record_state_dict_hooks(opt: torch.optim.Optimizer, calls: list[str]) -> None:
    """torch.optim's four state-dict hooks on ``opt``, each appending its name to ``calls``: the save's post
    hook adds a key, the load's pre hook takes it out again (as a library that saves its own state beside the
    optimizer's does)."""

    def saved(o: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        calls.append("save post")
        return {**state_dict, "extra": {"ema_decay": 0.999}}

    def loading(o: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        calls.append(f"load pre {state_dict.get('extra')}")
        return {k: v for k, v in state_dict.items() if k != "extra"}

    opt.register_state_dict_pre_hook(lambda o: calls.append("save pre"))
    opt.register_state_dict_post_hook(saved)
    opt.register_load_state_dict_pre_hook(loading)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))


def assert_bf16_trains_like_cpu_adam(make: Callable[[Any], torch.optim.Optimizer], **hyper: Any) -> None:
    """A bf16 MLP trained 5 steps by ``make(params)`` equals ``CPUAdam``'s training with ``hyper`` bitwise (the
    daemon's own arithmetic, fp32 master)."""
    base = mlp()
    m_off, m_eng = (m.to(torch.bfloat16) for m in replicas(base, 2))
    opt = make(m_off.parameters())
    eng = cpu_adam(m_eng.parameters(), **hyper)
    batches = mlp_batches(5, fixed=False)
    train(m_off, opt, batches, mlp_loss)
    train(m_eng, eng, batches, mlp_loss)
    assert_params_equal(m_off, m_eng)

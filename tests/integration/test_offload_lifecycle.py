"""``OffloadAdam`` as frameworks hold it: copies and wrappers that own nothing, ``opt.state`` written
through, a refused regrouping that changes nothing, and frozen params that cost nothing.

Each optimizer here owns its connection (a private daemon, as a user's script gets one), since that is the
connection copies and finalizers could close.
"""

from __future__ import annotations

import copy
import gc
import os
from typing import Any

import pytest
import torch
from offload_helpers import assert_params_close, assert_params_equal, train
from small_models import Batch, mlp, mlp_batches, mlp_loss, replicas
from torch import nn

from tiermem import OffloadAdam
from tiermem.core.errors import InvalidArgument, InvalidState

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

HYPER = {"lr": 1e-2, "weight_decay": 0.1}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_state_equal(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Two state dicts hold the same tensors, bit for bit, for every param ``before`` has state for."""
    for i, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, after["state"][i][key]), (i, key)


def _offload_and_adamw(
    base: nn.Module, **offload_only: Any
) -> tuple[nn.Module, OffloadAdam, nn.Module, torch.optim.AdamW]:
    """Two copies of ``base``: one trained by an ``OffloadAdam`` (with ``HYPER`` and ``offload_only``, e.g. a
    caller's client), one by ``torch.optim.AdamW`` (with ``HYPER``)."""
    m_off, m_ref = replicas(base, 2)
    opt = OffloadAdam(m_off.parameters(), **HYPER, **offload_only)
    return m_off, opt, m_ref, torch.optim.AdamW(m_ref.parameters(), **HYPER)


def _finish_like_adamw(
    m_off: nn.Module, opt: OffloadAdam, m_ref: nn.Module, ref: torch.optim.Optimizer, batches: list[Batch], done: int
) -> None:
    """``opt`` trains on from batch ``done``, the reference over every batch, and the params end alike."""
    train(m_off, opt, batches[done:], mlp_loss)
    train(m_ref, ref, batches, mlp_loss)
    assert_params_close(m_off, m_ref)


def _wrap_like_lightning(opt: torch.optim.Optimizer) -> object:
    """What ``LightningOptimizer`` makes: an instance of a dynamic subclass of the optimizer's class that
    forwards attribute reads to the real optimizer."""

    class Wrapper:
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self._optimizer = inner
            self.__class__ = type("Wrapped" + type(inner).__name__, (Wrapper, type(inner)), {})

        def __getattr__(self, item: str) -> object:
            return getattr(self._optimizer, item)

    return Wrapper(opt)


def test_a_dropped_wrapper_or_copy_closes_nothing_the_optimizer_uses() -> None:
    m_off, opt, m_ref, ref = _offload_and_adamw(mlp())
    batches = mlp_batches(6, fixed=False)
    train(m_off, opt, batches[:2], mlp_loss)
    wrapper = _wrap_like_lightning(opt)
    assert isinstance(wrapper, OffloadAdam)
    assert wrapper.steps == 2  # type: ignore[attr-defined]
    shallow = copy.copy(opt)
    assert shallow.steps == 2
    del wrapper, shallow
    gc.collect()
    train(m_off, opt, batches[2:], mlp_loss)  # the private daemon still serves the optimizer
    train(m_ref, ref, batches, mlp_loss)
    assert opt.steps == 6
    assert_params_close(m_off, m_ref)
    opt.close()


def test_a_copy_sees_the_steps_the_original_takes() -> None:
    model = mlp()
    opt = OffloadAdam(model.parameters(), **HYPER)
    shallow = copy.copy(opt)
    train(model, opt, mlp_batches(3), mlp_loss)
    assert shallow.steps == opt.steps == 3
    assert shallow.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    opt.close()
    with pytest.raises(InvalidState, match="closed"):
        shallow.stats()


def test_a_closed_optimizer_says_so_for_its_state_and_a_new_group() -> None:
    """After ``close()``: reading ``opt.state``, ``state_dict()`` and a new param group raise ``InvalidState``
    naming the closed optimizer (they said "the staging window is empty", or took the group silently)."""
    model = mlp()
    opt = OffloadAdam(model.parameters(), **HYPER)
    train(model, opt, mlp_batches(1), mlp_loss)
    opt.close()
    p = next(model.parameters())
    for access in (lambda: p in opt.state, lambda: opt.state[p]["exp_avg"], lambda: len(opt.state), opt.state_dict):
        with pytest.raises(InvalidState, match="this OffloadAdam is closed"):
            access()
    with pytest.raises(InvalidState, match="closed: it takes no new param group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert len(opt.param_groups) == 1
    opt.close()  # twice is once


def test_the_last_owner_gone_stops_the_private_daemon() -> None:
    model = mlp()
    opt = OffloadAdam(model.parameters(), **HYPER)
    train(model, opt, mlp_batches(1), mlp_loss)
    daemon = opt.client.daemon
    assert daemon is not None
    pid = daemon.process.pid
    assert _alive(pid)
    del opt, model
    gc.collect()
    daemon.process.wait(timeout=30)
    assert not _alive(pid)


def test_state_assigned_back_as_lightning_moves_it_changes_nothing() -> None:
    m_off, opt, m_ref, ref = _offload_and_adamw(mlp())
    batches = mlp_batches(6, fixed=False)
    train(m_off, opt, batches[:3], mlp_loss)
    before = opt.state_dict()
    # lightning_fabric.utilities.optimizer._optimizer_to_device, written out
    for _, state in opt.state.items():
        for key, value in state.items():
            if key != "step":
                state[key] = value.to("cpu")
    after = opt.state_dict()
    assert_state_equal(before, after)
    _finish_like_adamw(m_off, opt, m_ref, ref, batches, done=3)
    opt.close()


def test_state_writes_go_through_to_the_daemon() -> None:
    m_off, opt, m_ref, ref = _offload_and_adamw(mlp())
    batches = mlp_batches(4, fixed=False)
    train(m_off, opt, batches[:2], mlp_loss)
    train(m_ref, ref, batches[:2], mlp_loss)
    p_off, p_ref = next(m_off.parameters()), next(m_ref.parameters())
    halved = ref.state[p_ref]["exp_avg"].mul_(0.5)
    opt.state[p_off]["exp_avg"] = halved.clone()
    assert torch.equal(opt.state[p_off]["exp_avg"], halved)
    # a whole entry, as a user moving state writes it, the step count included
    q_off, q_ref = list(m_off.parameters())[1], list(m_ref.parameters())[1]
    ref.state[q_ref]["exp_avg_sq"].mul_(2.0)
    opt.state[q_off] = {key: value.clone() for key, value in ref.state[q_ref].items()}
    assert float(opt.state[q_off]["step"]) == 2.0
    train(m_off, opt, batches[2:], mlp_loss)
    train(m_ref, ref, batches[2:], mlp_loss)
    assert_params_close(m_off, m_ref)
    with pytest.raises(InvalidArgument, match="'momentum_buffer'"):
        opt.state[p_off]["momentum_buffer"] = halved
    with pytest.raises(InvalidArgument, match="elements"):
        opt.state[p_off]["exp_avg"] = torch.zeros(3)
    opt.close()


def test_a_second_optimizer_on_a_connection_in_use_is_told_to_use_another() -> None:
    from tiermem.client.link import connect

    client = connect()
    first = OffloadAdam(mlp().parameters(), offload="cpu", client=client)
    try:
        with pytest.raises(InvalidState, match=r"already attached .* one job a connection; attach on another one"):
            OffloadAdam(mlp().parameters(), offload="cpu", client=client)
        second = OffloadAdam(mlp().parameters(), offload="cpu")  # its own connection
        second.close()
    finally:
        first.close()


def test_a_state_dict_of_another_optimizer_is_refused_naming_what_it_lacks() -> None:
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, sgd, mlp_batches(1), mlp_loss)
    opt = OffloadAdam(model.parameters(), offload="cpu")
    try:
        with pytest.raises(InvalidArgument) as info:
            opt.load_state_dict(sgd.state_dict())
        assert str(info.value).startswith(
            "the state of param 0 has no 'step', 'exp_avg', 'exp_avg_sq' (it has 'momentum_buffer'): "
            "torch.optim.Adam and AdamW keep step, exp_avg and exp_avg_sq for each param"
        )
        assert opt.state_dict()["state"] == {}  # nothing was loaded
    finally:
        opt.close()


def test_a_refused_param_group_leaves_the_optimizer_as_it_was() -> None:
    m_off, opt, m_ref, ref = _offload_and_adamw(mlp())
    batches = mlp_batches(6, fixed=False)
    train(m_off, opt, batches[:3], mlp_loss)
    before = opt.state_dict()
    with pytest.raises(InvalidArgument, match="meta device"):
        opt.add_param_group({"params": [nn.Parameter(torch.empty(4, device="meta"))]})
    assert len(opt.param_groups) == 1
    after = opt.state_dict()
    assert after["state"].keys() == before["state"].keys()
    assert_state_equal(before, after)
    _finish_like_adamw(m_off, opt, m_ref, ref, batches, done=3)
    opt.close()


def test_an_accepted_param_group_keeps_the_state_of_the_others() -> None:
    m_off, opt, m_ref, ref = _offload_and_adamw(mlp())
    head_off, head_ref = replicas(nn.Linear(8, 8), 2)
    batches = mlp_batches(6, fixed=False)

    head_off.requires_grad_(False)
    head_ref.requires_grad_(False)
    train(m_off, opt, batches[:3], mlp_loss)
    train(m_ref, ref, batches[:3], mlp_loss)
    pid = opt.client.daemon.process.pid  # type: ignore[union-attr]
    head_off.requires_grad_(True)
    head_ref.requires_grad_(True)
    opt.add_param_group({"params": list(head_off.parameters()), "lr": 5e-3})
    ref.add_param_group({"params": list(head_ref.parameters()), "lr": 5e-3})
    assert opt.client.daemon.process.pid != pid  # type: ignore[union-attr]  # a new rank, beside the old one
    train(m_off, opt, batches[3:], lambda m, b: mlp_loss(nn.Sequential(m, head_off), b))
    train(m_ref, ref, batches[3:], lambda m, b: mlp_loss(nn.Sequential(m, head_ref), b))
    assert opt.steps == 6
    assert_params_close(m_off, m_ref)
    assert_params_close(head_off, head_ref)
    opt.close()


class Adapted(nn.Module):
    """A LoRA-shaped model: a large frozen base and a small trainable low-rank update."""

    def __init__(self, width: int = 256, rank: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, width)
        self.base = nn.Linear(width, width)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)
        self.out = nn.Linear(width, 8)
        nn.init.normal_(self.up.weight, std=0.01)
        for p in (*self.inp.parameters(), *self.base.parameters(), *self.out.parameters()):
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(torch.tanh(self.base(h) + self.up(self.down(h))))


def test_frozen_params_get_no_state_and_no_storage() -> None:
    m_off, m_ref = Adapted(), Adapted()
    opt = OffloadAdam(m_off.parameters(), **HYPER)  # every param, as many LoRA scripts write it
    ref = torch.optim.AdamW(m_ref.parameters(), **HYPER)
    batches = mlp_batches(5, fixed=False)
    train(m_off, opt, batches, mlp_loss)
    train(m_ref, ref, batches, mlp_loss)
    assert_params_close(m_off, m_ref)
    trainable = [p for p in m_off.parameters() if p.requires_grad]
    stats = opt.stats()
    assert stats.frozen_params == 6
    assert stats.frozen_numel == sum(p.numel() for p in m_off.parameters() if not p.requires_grad)
    assert stats.rank.numel <= sum(p.numel() for p in trainable) * 1.1
    # torch's numbering of the state: every param of the groups counts, frozen or not
    assert opt.state_dict()["state"].keys() == ref.state_dict()["state"].keys()
    frozen = m_off.base.weight
    assert frozen not in opt.state
    assert dict(opt.state[frozen]) == {}
    with pytest.raises(InvalidState, match="frozen"):
        opt.state[frozen] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(frozen)}
    opt.close()


def test_the_pool_follows_the_trainable_params() -> None:
    m_all, m_lora = Adapted(), Adapted()
    with_base = OffloadAdam(m_all.parameters(), **HYPER)
    alone = OffloadAdam([p for p in m_lora.parameters() if p.requires_grad], **HYPER)
    a, b = with_base.stats().rank, alone.stats().rank
    assert a.numel == b.numel
    assert a.storage_nbytes <= 1.1 * b.storage_nbytes
    assert a.cpu_state_nbytes <= 1.1 * b.cpu_state_nbytes
    with_base.close()
    alone.close()


def test_an_unfrozen_param_joins_at_its_first_grad_like_adamw() -> None:
    m_off, m_ref = Adapted(), Adapted()
    opt = OffloadAdam(m_off.parameters(), **HYPER)
    ref = torch.optim.AdamW(m_ref.parameters(), **HYPER)
    batches = mlp_batches(8, fixed=False)
    train(m_off, opt, batches[:3], mlp_loss)
    train(m_ref, ref, batches[:3], mlp_loss)
    m_off.base.requires_grad_(True)
    m_ref.base.requires_grad_(True)
    train(m_off, opt, batches[3:], mlp_loss)
    train(m_ref, ref, batches[3:], mlp_loss)
    assert opt.stats().frozen_params == 4
    assert_params_close(m_off, m_ref)
    saved, reference = opt.state_dict(), ref.state_dict()
    assert saved["state"].keys() == reference["state"].keys()
    assert {i: float(e["step"]) for i, e in saved["state"].items()} == {
        i: float(e["step"]) for i, e in reference["state"].items()
    }
    opt.close()


def test_a_checkpoint_with_state_for_a_frozen_param_registers_it() -> None:
    m_src, m_off, m_ref = Adapted(), Adapted(), Adapted()
    for m in (m_src, m_ref):
        m.base.requires_grad_(True)
    src = torch.optim.AdamW(m_src.parameters(), **HYPER)
    train(m_src, src, mlp_batches(2, fixed=False), mlp_loss)
    m_ref.load_state_dict(m_src.state_dict())
    m_off.load_state_dict(m_src.state_dict())
    ref = torch.optim.AdamW(m_ref.parameters(), **HYPER)
    ref.load_state_dict(src.state_dict())
    opt = OffloadAdam(m_off.parameters(), **HYPER)  # base frozen here: not registered
    assert opt.stats().frozen_params == 6
    opt.load_state_dict(src.state_dict())
    assert opt.stats().frozen_params == 4
    m_off.base.requires_grad_(True)
    batches = mlp_batches(3, seed=5, fixed=False)
    train(m_off, opt, batches, mlp_loss)
    train(m_ref, ref, batches, mlp_loss)
    assert_params_close(m_off, m_ref)
    opt.close()


def test_identical_runs_stay_bitwise_equal_with_frozen_params() -> None:
    runs = []
    for _ in range(2):
        model = Adapted()
        opt = OffloadAdam(model.parameters(), **HYPER)
        train(model, opt, mlp_batches(4, fixed=False), mlp_loss)
        runs.append(model)
        opt.close()
    assert_params_equal(*runs)


def test_an_options_record_builds_the_optimizer_its_keywords_build() -> None:
    from tiermem import OffloadOptions

    base = mlp()
    m_kw, m_opts = replicas(base, 2)
    by_keywords = OffloadAdam(m_kw.parameters(), **HYPER, offload="nvme", max_grad_norm=0.5)
    by_options = OffloadAdam(m_opts.parameters(), **HYPER, options=OffloadOptions(offload="nvme", max_grad_norm=0.5))
    assert by_options.options == by_keywords.options
    batches = mlp_batches(3, fixed=False)
    train(m_kw, by_keywords, batches, mlp_loss)
    train(m_opts, by_options, batches, mlp_loss)
    assert_params_equal(m_kw, m_opts)
    with pytest.raises(TypeError, match="'offlaod'"):
        OffloadAdam(mlp().parameters(), offlaod="nvme")
    by_keywords.close()
    by_options.close()


def test_on_a_callers_connection_a_refused_group_changes_nothing(offload) -> None:  # type: ignore[no-untyped-def]
    from tiermem.core.errors import AdmissionError

    caller = offload.client()
    m_off, opt, m_ref, ref = _offload_and_adamw(mlp(), client=caller, offload="cpu")  # no spill to NVMe
    batches = mlp_batches(6, fixed=False)
    train(m_off, opt, batches[:3], mlp_loss)
    before = opt.state_dict()
    huge = nn.Parameter(torch.zeros(16 << 20))  # 64 MiB of params and 192 MiB of state: more than the pool
    with pytest.raises(AdmissionError):
        opt.add_param_group({"params": [huge]})
    assert opt.client is caller
    after = opt.state_dict()
    assert_state_equal(before, after)
    _finish_like_adamw(m_off, opt, m_ref, ref, batches, done=3)
    opt.close()
    caller.close()


def test_on_a_callers_connection_an_accepted_group_moves_to_a_connection_of_its_own(offload) -> None:  # type: ignore[no-untyped-def]
    caller = offload.client()
    m_off, opt, m_ref, ref = _offload_and_adamw(mlp(), client=caller)
    head_off, head_ref = replicas(nn.Linear(8, 8), 2)
    batches = mlp_batches(6, fixed=False)
    train(m_off, opt, batches[:3], mlp_loss)
    train(m_ref, ref, batches[:3], mlp_loss)
    opt.add_param_group({"params": list(head_off.parameters())})
    ref.add_param_group({"params": list(head_ref.parameters())})
    assert opt.client is not caller and opt.client.socket_path == caller.socket_path
    train(m_off, opt, batches[3:], lambda m, b: mlp_loss(nn.Sequential(m, head_off), b))
    train(m_ref, ref, batches[3:], lambda m, b: mlp_loss(nn.Sequential(m, head_ref), b))
    assert_params_close(m_off, m_ref)
    assert_params_close(head_off, head_ref)
    opt.close()
    caller.stats()  # the caller's connection is theirs, open and detached
    caller.close()

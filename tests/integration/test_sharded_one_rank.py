"""The sharded optimizers in a one-rank gloo group inside the test process, against a real daemon.

The many-rank runs are ``test_zero2.py`` and ``test_zero3_*.py`` (torchrun);
these check what does not need several ranks, quickly: the errors a user
meets, in-place edits of params between steps, and checkpoints into and out
of ``torch.optim.AdamW``.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import DaemonProcess
from offload_helpers import record_state_dict_hooks
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from tiermem.client.distributed import LayerShardedAdam, ShardedGradScaler, ShardedOffloadAdam, ShardedPagedAdam
from tiermem.client.distributed.reshard import is_rank_file
from tiermem.client.link import connect
from tiermem.core.errors import InvalidArgument, InvalidState, RankLost


def model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))


def loss_of(m: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 6, generator=g)
    return m(x).pow(2).mean()


def biggest_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def sharded_and_adamw(
    daemon: DaemonProcess, lr: float
) -> tuple[torch.nn.Module, ShardedOffloadAdam, torch.nn.Module, torch.optim.AdamW]:
    """Two copies of ``model()``: one under ``ShardedOffloadAdam`` on ``daemon``, one under ``torch.optim.AdamW``."""
    ours, ref = model(), model()
    opt = ShardedOffloadAdam(ours.parameters(), lr=lr, client=connect(daemon.socket_path))
    return ours, opt, ref, torch.optim.AdamW(ref.parameters(), lr=lr)


def train_alike(
    pairs: Sequence[tuple[torch.nn.Module, torch.optim.Optimizer]],
    steps: Iterable[int],
    after_step: Callable[[torch.nn.Module], None] | None = None,
) -> None:
    """For each step, each (model, optimizer): backward of ``loss_of(model, step)``, step, zero_grad, [after_step]."""
    for step in steps:
        for m, o in pairs:
            loss_of(m, step).backward()
            o.step()
            o.zero_grad()
            if after_step is not None:
                after_step(m)


def test_it_needs_an_initialised_process_group():
    with pytest.raises(InvalidState, match=r"torch\.distributed initialised"):
        ShardedOffloadAdam(model().parameters())


def test_a_param_listed_twice_is_refused(daemon, one_rank_group):
    lin = torch.nn.Linear(3, 2)
    with pytest.raises(InvalidArgument, match=r"lists one param twice \(positions 0 and 2.*ShardedOffloadAdam takes"):
        ShardedOffloadAdam([lin.weight, lin.bias, lin.weight], client=connect(daemon.socket_path))


def test_a_plain_grad_scaler_is_refused_naming_the_sharded_one(daemon, one_rank_group):
    m = model()
    opt = ShardedOffloadAdam(m.parameters(), client=connect(daemon.socket_path))
    try:
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(loss_of(m, 0)).backward()
        with pytest.raises(InvalidState, match="ShardedGradScaler"):
            scaler.step(opt)
        good = ShardedGradScaler("cpu")
        opt.zero_grad()
        good.scale(loss_of(m, 0)).backward()
        good.step(opt)
        good.update()
        assert opt.steps == 1 and not opt.last_found_inf
    finally:
        opt.close()


def test_params_edited_in_place_between_steps_are_honoured_as_in_adamw(daemon, one_rank_group):
    ours, opt, ref, ref_opt = sharded_and_adamw(daemon, lr=0.05)

    def clip(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for p in m.parameters():
                p.clamp_(-0.1, 0.1)  # WGAN's clip, in place, between steps

    try:
        train_alike(((ours, opt), (ref, ref_opt)), range(4), after_step=clip)
        assert biggest_diff(ours, ref) <= 1e-6
    finally:
        opt.close()


def test_checkpoints_go_to_and_come_from_torch_adamw(daemon, one_rank_group):
    ours, opt, ref, ref_opt = sharded_and_adamw(daemon, lr=0.02)
    try:
        train_alike(((ours, opt), (ref, ref_opt)), range(3))
        full = opt.full_state_dict()
        into_torch = torch.optim.AdamW(copy.deepcopy(ref).parameters(), lr=0.02)
        into_torch.load_state_dict(full)
        for i, entry in ref_opt.state_dict()["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(into_torch.state_dict()["state"][i][key], entry[key], atol=1e-7)
        # and back: torch's checkpoint loaded into a sharded optimizer continues as torch does
        opt.load_state_dict(ref_opt.state_dict())
        train_alike(((ours, opt), (ref, ref_opt)), range(3, 5))
        assert biggest_diff(ours, ref) <= 1e-6
    finally:
        opt.close()


def test_zero2_takes_torchs_weight_decay_switch_in_a_group_and_refuses_an_amsgrad_checkpoint(daemon, one_rank_group):
    """A group with ``decoupled_weight_decay=False`` (Adam's L2 decay) was stepped as AdamW; an AMSGrad
    checkpoint loaded as plain AdamW, its ``max_exp_avg_sq`` dropped."""
    ours, ref = model(), model()

    def groups(m: torch.nn.Module) -> list[dict[str, object]]:
        first, *rest = m.parameters()
        return [{"params": [first], "decoupled_weight_decay": False}, {"params": rest}]

    other = model()
    amsgrad = torch.optim.AdamW(groups(other), lr=0.02, amsgrad=True)
    train_alike(((other, amsgrad),), range(1))
    opt = ShardedOffloadAdam(groups(ours), lr=0.02, weight_decay=0.1, client=connect(daemon.socket_path))
    ref_opt = torch.optim.AdamW(groups(ref), lr=0.02, weight_decay=0.1)
    try:
        for steps in (range(2), range(2, 5)):
            train_alike(((ours, opt), (ref, ref_opt)), steps)
            with pytest.raises(InvalidArgument, match=r"param_groups\[0\] has amsgrad=True"):
                opt.load_state_dict(amsgrad.state_dict())  # changes nothing
        assert biggest_diff(ours, ref) <= 1e-6
    finally:
        opt.close()


@pytest.mark.parametrize("which", ["zero2", "layers", "paged"])
def test_torchs_state_dict_hooks_run_on_the_sharded_optimizers(daemon, one_rank_group, which):
    """torch.optim's state-dict hooks were never called by the sharded optimizers' own ``state_dict`` and
    ``load_state_dict``; they run as on AdamW, around the rank file."""
    m = model()
    if which == "zero2":
        opt = ShardedOffloadAdam(m.parameters(), lr=0.02, client=connect(daemon.socket_path))
    else:
        opt = zero3(which, m, daemon)
    calls: list[str] = []
    record_state_dict_hooks(opt, calls)
    try:
        train_alike(((m, opt),), range(2))
        saved = opt.state_dict()
        assert saved["extra"] == {"ema_decay": 0.999}
        opt.load_state_dict(saved)
        assert calls == ["save pre", "save post", "load pre {'ema_decay': 0.999}", "load post"]
    finally:
        opt.close()


@pytest.mark.parametrize("which", ["zero2", "layers", "paged"])
def test_consolidate_state_dict_makes_the_next_state_dict_the_whole_state_until_a_step(daemon, one_rank_group, which):
    """``ZeroRedundancyOptimizer``'s protocol, which PyTorch Lightning and Fabric follow for any optimizer that has
    ``consolidate_state_dict``: every rank calls it, then rank 0 alone saves ``state_dict()``.  Before, the
    sharded optimizers had none, so Lightning saved rank 0's rank file alone and the other ranks could not
    resume from it.  Now ``state_dict()`` after it is the whole state in AdamW's format (which AdamW loads and
    trains on alike), until the next step; a rank outside the group is refused."""
    m, ref = model(), model()
    if which == "zero2":
        opt: torch.optim.Optimizer = ShardedOffloadAdam(m.parameters(), lr=1e-2, client=connect(daemon.socket_path))
    else:
        opt = zero3(which, m, daemon)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    try:
        train_alike(((m, opt), (ref, ref_opt)), range(2))
        with pytest.raises(InvalidArgument, match="to=1 is not a rank"):
            opt.consolidate_state_dict(1)
        assert is_rank_file(opt.state_dict())
        opt.consolidate_state_dict()
        whole, full = opt.state_dict(), opt.full_state_dict()
        assert not is_rank_file(whole) and whole["param_groups"] == full["param_groups"]
        assert all(torch.equal(whole["state"][i][k], v) for i, e in full["state"].items() for k, v in e.items())
        assert opt.state_dict()["state"].keys() == full["state"].keys()  # again, until a step
        adamw = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        adamw.load_state_dict(whole)
        train_alike(((m, opt), (ref, adamw)), range(2, 4))
        assert is_rank_file(opt.state_dict())
        ours = m.state_dict()  # gathered for ZeRO-3
        assert max(float((ours[k] - v).abs().max()) for k, v in ref.state_dict().items()) <= 1e-6
    finally:
        opt.close()


@pytest.mark.parametrize("which", ["zero2", "layers", "paged"])
def test_opt_state_is_torchs_entries_over_this_ranks_stretches(daemon, one_rank_group, which):
    """Each param that requires grad has an entry from the start (what torch.distributed.checkpoint saves and
    loads into: with an empty ``opt.state`` it would step the optimizer to make some); its tensors are this
    rank's stretches (here, one rank's: all of it).  Handing an entry back unchanged, as Lightning does when it
    moves an optimizer, is accepted; any other write is refused."""
    m = model()
    m[2].bias.requires_grad_(False)
    opt = ShardedOffloadAdam(m.parameters(), lr=0.02, client=connect(daemon.socket_path)) if which == "zero2" else None
    opt = opt or zero3(which, m, daemon)
    try:
        assert len(opt.state) == 3 and m[2].bias not in opt.state and m[0].weight in opt.state
        assert float(opt.state[m[0].weight]["step"].flat(0, 1)[0]) == 0.0
        train_alike(((m, opt),), range(2))
        full = opt.full_state_dict()["state"]
        for i, p in enumerate(list(m.parameters())[:3]):  # (the by-layer placeholders are 0-element)
            entry, whole = opt.state[p], full[i]["exp_avg_sq"]
            assert sorted(entry) == ["exp_avg", "exp_avg_sq", "step"] and entry["exp_avg"].shape == whole.shape
            assert float(entry["step"].flat(0, 1)[0]) == 2.0
            assert torch.equal(entry["exp_avg_sq"].flat(0, whole.numel()), whole.reshape(-1))
            opt.state[p] = {key: value.to("cpu") for key, value in entry.items()}  # Lightning's move: nothing
            opt.state[p] = {key: value.clone() for key, value in entry.items()}  # and back from a GPU: nothing
        with pytest.raises(InvalidState, match=r"a sharded optimizer's opt\.state cannot be written.*load_state_dict"):
            opt.state[m[0].weight] = {"step": torch.tensor(0.0)}
        entry = opt.state[m[0].weight]
        with pytest.raises(InvalidState, match="cannot be written"):
            opt.state[m[0].weight] = {key: value.to(torch.float64) for key, value in entry.items()}
        send_to_device = pytest.importorskip("accelerate.utils.operations").send_to_device
        moved = send_to_device(opt.state_dict(), torch.device("meta"))  # accelerate's placement of the state
        assert moved["state"][0]["exp_avg"].device.type == "meta"
        with pytest.raises(InvalidState, match="cannot be written"):
            del opt.state[m[0].bias]
        train_alike(((m, opt),), range(2, 3))
        assert int(opt.full_state_dict()["state"][0]["step"]) == 3
    finally:
        opt.close()


def train_bf16(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: Iterable[int]) -> None:
    for step in steps:
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        m(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("which", ["layers", "layers-paged", "paged"])
def test_a_bf16_zero3_model_resumes_exactly_through_torch_distributed_checkpoint(
    daemon, one_rank_group, which, tmp_path
):
    """``set_state_dict`` loads the optimizer, then the model: the model's load wrote its bf16 values whole as
    the masters, over the fp32 ones the optimizer's had just restored (1 bf16 ulp off AdamW's resume after two
    steps).  A master element that rounds to the loaded value is kept now, so a reload of what the model holds
    changes nothing and the resume is exact."""

    def make(m: torch.nn.Module, lr: float) -> LayerShardedAdam | ShardedPagedAdam:
        client = connect(daemon.socket_path)
        if which == "paged":
            return ShardedPagedAdam(m, lr=lr, device_budget="1MiB", client=client)
        return LayerShardedAdam(m, lr=lr, paged=which == "layers-paged", client=client)

    uninterrupted, resumed = model().to(torch.bfloat16), model().to(torch.bfloat16)
    opt = make(uninterrupted, 0.02)
    try:
        train_bf16(uninterrupted, opt, range(3))
        model_state, optim_state = get_state_dict(uninterrupted, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp_path)
        train_bf16(uninterrupted, opt, range(3, 5))
        expected = {k: v.clone() for k, v in uninterrupted.state_dict().items()}
    finally:
        opt.close()
    opt = make(resumed, 0.5)
    try:
        model_state, optim_state = get_state_dict(resumed, opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=tmp_path)
        set_state_dict(resumed, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        train_bf16(resumed, opt, range(3, 5))
        for name, value in resumed.state_dict().items():
            assert torch.equal(value, expected[name]), name
    finally:
        opt.close()


def test_what_torch_distributed_checkpoint_cannot_take_of_a_sharded_optimizer_is_refused_naming_the_way(
    daemon, one_rank_group, tmp_path
):
    """``async_save`` stages each tensor whole, and ``full_state_dict=True`` gathers only DTensor and
    ShardedTensor: the first is refused as it stages, the second's result (this rank's stretches) when loaded."""
    m = model()
    opt = ShardedOffloadAdam(m.parameters(), lr=0.02, client=connect(daemon.socket_path))
    try:
        train_alike(((m, opt),), range(2))
        model_state, optim_state = get_state_dict(m, opt)
        with pytest.raises(InvalidState, match="not its async_save, whose staging copies each tensor whole: use dcp"):
            dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp_path / "async")
        _, whole = get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        torch.save(whole, tmp_path / "optim.pt")
        before = opt.full_state_dict()
        with pytest.raises(InvalidArgument, match=r"is one rank's stretches of a sharded optimizer's state.*shards"):
            set_optimizer_state_dict(m, opt, torch.load(tmp_path / "optim.pt"))
        assert torch.equal(opt.full_state_dict()["state"][0]["exp_avg"], before["state"][0]["exp_avg"])
    finally:
        opt.close()


def test_a_shard_of_another_layout_is_refused_before_anything_changes(daemon, one_rank_group):
    m = model()
    opt = ShardedOffloadAdam(m.parameters(), client=connect(daemon.socket_path))
    try:
        loss_of(m, 0).backward()
        opt.step()
        saved = opt.state_dict()
        assert saved["format"] == "tiermem.zero3" and (saved["rank"], saved["world_size"]) == (0, 1)
        before = opt.full_state_dict()
        values = [p.detach().clone() for p in m.parameters()]
        # rank 0's file of a 2-rank save: the other rank held the second half of param 0
        wrong = copy.deepcopy(saved)
        wrong["world_size"] = 2
        half = next(pc for pc in wrong["pieces"] if pc["param"] == 0)
        cut = (half["hi"] - half["lo"]) // 2
        for key in ("value", "exp_avg", "exp_avg_sq"):
            half[key] = half[key][:cut]
        half["hi"] = half["lo"] + cut
        with pytest.raises(InvalidArgument, match=r"in none of the 1 rank file\(s\) of this 2-rank checkpoint"):
            opt.load_state_dict(wrong)
        wrong = copy.deepcopy(saved)
        wrong["params"][0]["shape"] = wrong["params"][0]["shape"][::-1]  # as many elements, another shape
        with pytest.raises(InvalidArgument, match=r"param 0 is .* of shape"):
            opt.load_state_dict(wrong)
        after = opt.full_state_dict()
        assert all(
            torch.equal(before["state"][i][k], after["state"][i][k]) for i in before["state"] for k in ("exp_avg",)
        )
        assert all(torch.equal(a, b.detach()) for a, b in zip(values, m.parameters(), strict=True))
        opt.load_state_dict(saved)  # this rank's own file loads back
        assert opt.steps == 1
    finally:
        opt.close()


def test_two_optimizers_of_one_process_get_distinct_default_job_ids(daemon, one_rank_group, monkeypatch):
    """Two models in one run (a GAN's two, say): the second default id is the run's with ``-2``, in the order
    they are made (a relaunch finds each one's state); one made after a close takes the freed id back."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run42")
    a, b = model(), model()
    first = ShardedOffloadAdam(a.parameters(), lr=0.05, client=connect(daemon.socket_path))
    second = ShardedOffloadAdam(b.parameters(), lr=0.05, client=connect(daemon.socket_path))
    try:
        assert (first.job_id, second.job_id) == ("torchrun-run42", "torchrun-run42-2")
        for m, opt in ((a, first), (b, second)):
            loss_of(m, 0).backward()
            opt.step()
            assert opt.steps == 1
        first.close()
        again = ShardedOffloadAdam(a.parameters(), lr=0.05, client=connect(daemon.socket_path))
        assert again.job_id == "torchrun-run42"
        again.close()
    finally:
        first.close()
        second.close()


def test_zero3_under_a_plain_grad_scaler_is_refused_naming_the_sharded_one(daemon, one_rank_group):
    """Their grads are in the daemon, where torch's GradScaler cannot look: it would check nothing."""
    for make in (
        lambda m: LayerShardedAdam(m, paged=True, client=connect(daemon.socket_path)),
        lambda m: ShardedPagedAdam(m, device_budget="1MiB", offload="cpu", client=connect(daemon.socket_path)),
    ):
        m = model()
        opt = make(m)
        try:
            scaler = torch.amp.GradScaler("cpu")
            scaler.scale(loss_of(m, 0)).backward()
            with pytest.raises(InvalidState, match=r"use tiermem\.distributed\.ShardedGradScaler"):
                scaler.step(opt)
            opt.zero_grad()
            good = ShardedGradScaler("cpu")
            scaler_loss = good.scale(loss_of(m, 1))
            scaler_loss.backward()
            good.step(opt)
            good.update()
            assert opt.last_found_inf is False
        finally:
            opt.close()


def test_loss_scaling_of_layers_updated_during_backward_is_refused(daemon, one_rank_group):
    m = model()
    opt = LayerShardedAdam(m, client=connect(daemon.socket_path))
    try:
        scaler = ShardedGradScaler("cpu")
        scaler.scale(loss_of(m, 0)).backward()
        with pytest.raises(InvalidState, match=r"loss scaling needs LayerShardedAdam\(paged=True\)"):
            scaler.step(opt)
    finally:
        opt.close()


MAKERS = (
    lambda m, c: ShardedOffloadAdam(m.parameters(), client=c),
    lambda m, c: LayerShardedAdam(m, client=c),
    lambda m, c: ShardedPagedAdam(m, offload="cpu", device_budget="1MiB", client=c),
)
"""Each sharded optimizer over a model and a connection to the test's daemon."""


def test_the_sharded_optimizers_refuse_deepcopy_and_pickle_naming_what_to_save(daemon, one_rank_group):
    for make in MAKERS:
        opt = make(model(), connect(daemon.socket_path))
        try:
            with pytest.raises(TypeError, match=rf"{type(opt).__name__} holds a connection.*full_state_dict\(\)"):
                copy.deepcopy(opt)
            with pytest.raises(TypeError, match=r"full_state_dict\(\)"):
                pickle.dumps(opt)
        finally:
            opt.close()


def test_every_sharded_optimizer_refuses_a_group_added_after_it_was_made(daemon, one_rank_group):
    """Each strategy sharded the groups it was given: a later one would never be stepped (ZeRO-2 once took it
    silently)."""
    for make in MAKERS:
        opt = make(model(), connect(daemon.socket_path))
        try:
            with pytest.raises(InvalidArgument, match=rf"^{type(opt).__name__} .*make a new one$"):
                opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
            assert len(opt.param_groups) == 1
        finally:
            opt.close()


def test_what_a_thin_constructor_names_of_its_strategy_reads_it_and_cannot_be_assigned(daemon, one_rank_group):
    """``opt.max_grad_norm`` is the strategy's: an assignment would otherwise shadow it and change nothing."""
    opt = ShardedOffloadAdam(model().parameters(), max_grad_norm=1.0, client=connect(daemon.socket_path))
    try:
        assert opt.max_grad_norm == opt.strategy.max_grad_norm == 1.0
        with pytest.raises(AttributeError, match=r"opt\.strategy\.max_grad_norm"):
            opt.max_grad_norm = 2.0
        assert opt.strategy.max_grad_norm == 1.0
    finally:
        opt.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_a_model_made_on_the_meta_device_gets_the_values_building_it_would_and_trains_like_adamw(
    daemon, one_rank_group, offload
):
    """Never whole in the trainer: each submodule is materialized, ``reset_parameters()`` (then ``init``),
    its shard written to the daemon, and released; with the generator the model would have been built with,
    the values are those of building it on the host."""
    ref = model()  # seeds and builds: the values a meta model must get
    with torch.device("meta"):
        ours = model()  # seeds the same; building on the meta device draws nothing
    inits: list[str] = []
    opt = ShardedPagedAdam(
        ours,
        device_budget="1MiB",
        offload=offload,
        lr=0.02,
        client=connect(daemon.socket_path),
        init=lambda m: inits.append(type(m).__name__),
    )
    adamw = torch.optim.AdamW(ref.parameters(), lr=0.02)
    try:
        assert inits == ["Linear", "Linear"]
        assert max(p.untyped_storage().nbytes() for p in ours.parameters()) <= 4  # placeholders only
        for a, b in zip(ours.state_dict().values(), ref.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        train_alike(((ours, opt), (ref, adamw)), range(3))
        for a, b in zip(ours.state_dict().values(), ref.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b)
    finally:
        opt.close()


def test_a_meta_model_with_meta_buffers_is_refused_naming_them(one_rank_group):
    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12))
    with pytest.raises(InvalidArgument, match=r"buffer\(s\) \['1.running_mean', .* are on the meta device"):
        ShardedPagedAdam(m, device_budget="1MiB")


def test_layer_sharded_refuses_params_off_the_host_naming_the_optimizer_for_a_gpu(one_rank_group):
    """It gathers each layer into host memory; a model elsewhere failed at its first gather, as a lost rank."""
    with torch.device("meta"):
        m = model()
    with pytest.raises(InvalidArgument, match=r"must be on the CPU; they are on \['meta'\]\. .*ShardedPagedAdam"):
        LayerShardedAdam(m)


def test_layer_sharded_refuses_tied_weights_naming_both_and_the_optimizer_that_takes_them(one_rank_group):
    """A tied param is in two units, which would each own, gather and update it; the refusal blamed the user
    for listing a param twice in a group they never wrote."""
    head = torch.nn.Linear(8, 8, bias=False)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), head)
    head.weight = m[0].weight
    with pytest.raises(InvalidArgument, match=r"2\.weight is 0\.weight \(tied weights.*ShardedPagedAdam"):
        LayerShardedAdam(m)


@pytest.mark.parametrize("paged", [False, True], ids=["layers", "paged-layers"])
def test_layer_sharded_trains_around_a_frozen_layer_like_adamw(daemon, one_rank_group, paged):
    """A layer whose params are all frozen (a frozen embedding, a LoRA base) is no unit: it stays whole in the
    model, untouched.  It failed the constructor with an IndexError when it was the model's first."""
    ours, ref = model(), model()
    for m in (ours, ref):
        m[0].requires_grad_(False)
    frozen = ours[0].weight.detach().clone()
    opt = LayerShardedAdam(ours, lr=1e-2, paged=paged, client=connect(daemon.socket_path))
    reference = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    train_alike([(ours, opt), (ref, reference)], range(4))
    assert torch.equal(ours[0].weight, frozen)
    assert [u.name for u in opt.units] == ["2 (Linear)"]
    trained = opt.gathered_params()
    opt.close()
    for p, q in zip(trained, [p for p in ref.parameters() if p.requires_grad], strict=True):
        torch.testing.assert_close(p.view(q.shape), q)


def zero3(which: str, m: torch.nn.Module, daemon: DaemonProcess) -> LayerShardedAdam | ShardedPagedAdam:
    """``LayerShardedAdam`` (``layers``) or ``ShardedPagedAdam`` (``paged``, the whole model in its budget) over
    ``m``, on ``daemon``, at lr 1e-2."""
    client = connect(daemon.socket_path)
    if which == "layers":
        return LayerShardedAdam(m, lr=1e-2, client=client)
    return ShardedPagedAdam(m, lr=1e-2, device_budget="1MiB", client=client)


@pytest.mark.parametrize("which", ["layers", "paged"])
def test_a_compiled_zero3_model_trains_like_adamw(daemon, one_rank_group, which):
    """``torch.compile`` of a ZeRO-3 model: dynamo traced into the gather/release hooks, which swap the params'
    data (``wrong number of dimensions1``, ``expected size 16==16, stride 0==8``).  The hooks now run as
    Python between the compiled pieces; inductor's rounding: close, not bitwise."""
    ours, ref = model(), model()
    opt = zero3(which, ours, daemon)
    train_alike([(torch.compile(ours), opt), (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))], range(4))
    trained = ours.state_dict()  # each gathers its params for it
    opt.close()
    for (name, p), q in zip(trained.items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("which", ["layers", "paged"])
def test_copying_or_pickling_a_zero3_model_is_refused_naming_what_to_copy(daemon, one_rank_group, which):
    """The model holds placeholders between forwards; ``copy.deepcopy`` blamed the optimizer and
    ``torch.save(model)`` pickle's internals."""
    m, ref = model(), model()
    opt = zero3(which, m, daemon)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    try:
        train_alike(((m, opt), (ref, ref_opt)), range(2))
        how = {"layers": "sharded by layer by LayerShardedAdam", "paged": "paged by ShardedPagedAdam"}[which]
        wanted = rf"params are {how}.*placeholders.*model\.state_dict\(\) gathers them \(every rank calls it\)"
        with pytest.raises(TypeError, match=wanted):
            copy.deepcopy(m)
        with pytest.raises(TypeError, match=wanted):
            torch.save(m, io.BytesIO())
        train_alike(((m, opt), (ref, ref_opt)), range(2, 4))
        for (name, p), q in zip(m.state_dict().items(), ref.state_dict().values(), strict=True):
            torch.testing.assert_close(p, q, msg=name)
    finally:
        opt.close()


@pytest.mark.parametrize("which", ["layers", "paged"])
def test_zero3_with_an_evaluation_under_inference_mode_before_each_step_trains_like_adamw(
    daemon, one_rank_group, which
):
    """A layer gathered under ``torch.inference_mode()`` was gathered into an inference tensor; used as the
    params' data in the next training forward, autograd gave them no grad, so ZeRO-3 by layer silently
    stopped updating that layer (0.008 off AdamW in 4 steps), and ZeRO-3 paged failed
    (``Inplace update to inference tensor outside InferenceMode``)."""
    ours, ref = model(), model()
    opt = zero3(which, ours, daemon)

    def evaluate(m: torch.nn.Module) -> None:
        m.eval()
        with torch.inference_mode():
            m(torch.ones(3, 6))
        m.train()

    reference = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(4):
        evaluate(ours)
        train_alike([(ours, opt), (ref, reference)], [step])
    trained = ours.state_dict()
    opt.close()
    for (name, p), q in zip(trained.items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, msg=name)


def test_a_closed_layer_sharded_optimizer_leaves_no_hook_on_the_model(daemon, one_rank_group):
    """A closed one would otherwise gather (a collective) on the model's next forward."""
    m = model()
    opt = LayerShardedAdam(m, client=connect(daemon.socket_path), collective_timeout_s=5)
    loss_of(m, 0).backward()
    opt.step()
    opt.close()
    for module in m.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks and not module._backward_pre_hooks
        assert not module._state_dict_hooks and not module._load_state_dict_pre_hooks
        assert not module._load_state_dict_post_hooks
    assert not any(p._post_accumulate_grad_hooks for p in m.parameters())


def test_a_collective_timeout_must_be_a_positive_number_of_seconds(one_rank_group):
    for bad in (0, -1.0, float("inf"), "30", True):
        with pytest.raises(InvalidArgument, match="collective_timeout_s must be a number of seconds > 0"):
            ShardedPagedAdam(model(), device_budget="1MiB", collective_timeout_s=bad)
        with pytest.raises(InvalidArgument, match="collective_timeout_s must be a number of seconds > 0"):
            ShardedOffloadAdam(model().parameters(), collective_timeout_s=bad)


def test_zero2_steps_run_on_the_schedule_with_its_limit(daemon, one_rank_group):
    """ZeRO-2's step collectives go through the same bounded schedule as ZeRO-3's (a stuck one is RankLost
    after collective_timeout_s, not after the group's timeout); one rank reduces nothing, and all-reduces
    its statistics once."""
    m = model()
    opt = ShardedOffloadAdam(m.parameters(), client=connect(daemon.socket_path), collective_timeout_s=7)
    try:
        assert opt.schedule.timeout_s == 7.0
        loss_of(m, 0).backward()
        opt.step()
        assert opt.schedule.last_counts == {"all-reduce": 1}
    finally:
        opt.close()


def test_a_failed_collective_is_rank_lost_naming_it_and_its_group_is_not_reused(one_rank_group):
    from tiermem.client.distributed.schedule import Collectives

    def stuck(*args: object, group: object) -> None:
        raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")

    schedule = Collectives(None, 0, lambda: 4, timeout_s=5)
    schedule.run("all-gather", "h.0 (Linear)", torch.distributed.all_reduce, torch.zeros(1))
    with pytest.raises(RankLost) as lost:
        schedule.run("reduce-scatter", "h.1 (Linear)", stuck)
    assert str(lost.value).startswith(
        "rank 0: the reduce-scatter of h.1 (Linear) (the step's collective 2, limit 5 s) of step 5 failed"
    )
    assert lost.value.during.startswith("reduce-scatter of h.1") and lost.value.last_step == 4
    assert schedule.counts == {"all-gather": 1, "reduce-scatter": 1}
    failed = schedule.group
    schedule.close()
    fresh = Collectives(None, 0, lambda: 0, timeout_s=5)
    assert fresh.group is not failed
    kept = fresh.group
    fresh.close()
    again = Collectives(None, 0, lambda: 0, timeout_s=5)  # a closed schedule's group serves the next one
    assert again.group is kept
    again.close()


def test_the_group_takes_collectives_on_the_host_for_gloo(one_rank_group):
    """NCCL's groups take device tensors only; gloo's take host tensors (the norm's all-reduce uses this)."""
    from tiermem.client.distributed.group import collective_device

    assert collective_device(None) == torch.device("cpu")


@pytest.mark.parametrize("paged", [False, True], ids=["resident", "paged"])
def test_layer_sharded_models_state_dict_gathers_and_load_state_dict_reaches_the_owner(daemon, one_rank_group, paged):
    """As torch users save and load a model: ``model.state_dict()`` holds the layers' values (not the
    placeholders) and loads into a plain model; ``model.load_state_dict()`` replaces them as it does under
    AdamW (the moments stay); a state dict of the wrong shape is refused with torch's error, changing nothing."""
    ours, ref = model(), model()
    opt = LayerShardedAdam(ours, paged=paged, lr=0.02, client=connect(daemon.socket_path))
    adamw = torch.optim.AdamW(ref.parameters(), lr=0.02)
    try:
        train_alike(((ours, opt), (ref, adamw)), range(2))
        saved = ours.state_dict()
        assert [tuple(v.shape) for v in saved.values()] == [tuple(v.shape) for v in ref.state_dict().values()]
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(saved[key], value)
        plain = model()
        plain.load_state_dict(saved)  # a checkpoint any torch model of this shape takes
        assert all(p.numel() == 0 for p in ours.parameters())  # the layers are released again

        other = {k: v + 0.25 for k, v in ref.state_dict().items()}
        ours.load_state_dict(other)
        ref.load_state_dict(other)
        assert all(p.numel() == 0 for p in ours.parameters())
        train_alike(((ours, opt), (ref, adamw)), range(2, 4))
        for a, b in zip(opt.gathered_params(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b)

        before = opt.gathered_params()
        wrong = dict(ours.state_dict())
        wrong["0.weight"] = torch.zeros(3, 3)
        wrong["2.bias"] = torch.full((2,), 7.0)
        with pytest.raises(RuntimeError, match=r"size mismatch for 0\.weight"):
            ours.load_state_dict(wrong)
        after = opt.gathered_params()
        torch.testing.assert_close(after[0], before[0])  # refused: not written
        torch.testing.assert_close(after[3], torch.full((2,), 7.0))  # torch copies what matched, as it does
        with pytest.raises(InvalidArgument, match="assign=False"):
            ours.load_state_dict(other, assign=True)
    finally:
        opt.close()


def test_layer_sharded_state_dict_holds_what_the_modules_do_not(daemon, one_rank_group):
    """The modules hold placeholders, so the rank file holds the values too: of the layers (paged: read from
    the daemon) and of a frozen param every rank keeps whole.  A new optimizer over a model of other values
    takes all of it and trains on as the first one does; its gathered state is AdamW's over the trainable
    params."""
    first, second = model(), model()
    for m in (first, second):
        m[0].bias.requires_grad_(False)
    with torch.no_grad():
        for p in second.parameters():
            p.fill_(0.5)
    ours = LayerShardedAdam(first, paged=True, lr=0.02, client=connect(daemon.socket_path))
    theirs = LayerShardedAdam(second, paged=True, lr=0.9, client=connect(daemon.socket_path))
    try:
        with pytest.raises(InvalidArgument, match="one param group"):
            ours.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
        for step in range(2):
            loss_of(first, step).backward()
            ours.step()
            ours.zero_grad()
        saved = ours.state_dict()
        assert saved["format"] == "tiermem.zero3" and len(saved["pieces"]) == 4
        theirs.load_state_dict(copy.deepcopy(saved))
        assert theirs.param_groups[0]["lr"] == 0.02
        torch.testing.assert_close(second[0].bias, first[0].bias)
        train_alike(((first, ours), (second, theirs)), range(2, 4))
        for a, b in zip(ours.gathered_params(), theirs.gathered_params(), strict=True):
            torch.testing.assert_close(a, b)
        full = theirs.full_state_dict()
        assert sorted(full["state"]) == [0, 2, 3] and full["param_groups"][0]["params"] == [0, 2, 3]
        fresh = list(model().parameters())
        trainable = [fresh[0], fresh[2], fresh[3]]  # AdamW over the params LayerShardedAdam steps
        adamw = torch.optim.AdamW(trainable, lr=0.5)
        adamw.load_state_dict(full)
        assert adamw.param_groups[0]["lr"] == 0.02 and float(adamw.state[trainable[0]]["step"]) == 4
    finally:
        ours.close()
        theirs.close()


def test_a_checkpoint_of_another_model_is_refused_before_anything_changes(daemon, one_rank_group, tmp_path):
    wide = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    other = ShardedPagedAdam(wide, device_budget="1MiB", offload="cpu", client=connect(daemon.socket_path))
    m = model()
    opt = ShardedPagedAdam(m, device_budget="1MiB", offload="cpu", client=connect(daemon.socket_path))
    try:
        other.save_shard(tmp_path / "wide")
        loss_of(m, 0).backward()
        opt.step()
        before = opt.full_state_dict()
        with pytest.raises(InvalidArgument, match=r"param 0 is '0.weight' of shape \[16, 6\] in the checkpoint"):
            opt.load_shards(tmp_path / "wide")
        mine = opt.shard_state_dict()
        stray = {**mine, "world_size": 2}  # rank 0 of a two-rank save, whose rank 1 is not given
        with pytest.raises(InvalidArgument, match=r"1 rank file\(s\) are missing: rank\(s\) 1"):
            opt.load_shards([stray])
        after = opt.full_state_dict()
        for i, entry in before["state"].items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(entry[key], after["state"][i][key])
    finally:
        other.close()
        opt.close()


@pytest.mark.parametrize(("offload", "width"), [("cpu", 512), ("nvme", 1024)])
def test_a_private_daemon_is_sized_for_the_paged_optimizer(one_rank_group, offload: str, width: int) -> None:
    """No node daemon: the rank starts a private one sized for what ShardedPagedAdam asks (the staged
    exchange's 16 bytes per element), so small models train instead of failing admission."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))
    opt = ShardedPagedAdam(m, device_budget="8MiB", offload=offload, lr=1e-3)
    try:
        for step in range(2):
            m(torch.randn(4, width, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert opt.steps == 2
    finally:
        opt.close()


@pytest.mark.parametrize("kind", ["zero2", "zero3-layers", "zero3-paged"])
def test_the_sharded_optimizers_keep_compressed_moments(one_rank_group, kind: str) -> None:
    """``state_dtype`` reaches the rank's daemon (a private one, sized for int8 state): the moments are kept
    as int8 codes, the model trains as AdamW does within what they cost, and the checkpoint is AdamW's."""
    ours, ref = model(), model()
    if kind == "zero2":
        opt: torch.optim.Optimizer = ShardedOffloadAdam(ours.parameters(), lr=0.02, state_dtype="int8")
    elif kind == "zero3-layers":
        opt = LayerShardedAdam(ours, lr=0.02, paged=True, state_dtype="int8")
    else:
        opt = ShardedPagedAdam(ours, device_budget="8MiB", offload="cpu", lr=0.02, state_dtype="int8")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.02)
    try:
        inner = opt.inner  # type: ignore[attr-defined]
        assert inner is not None and inner.stats().rank.state_dtype == "int8"  # what the daemon keeps
        train_alike(((ours, opt), (ref, ref_opt)), range(5))
        # after 5 steps of lr 0.02 (moves of about 0.1, moments within their 12% steps): the next loss agrees
        # (a ZeRO-3 model's params are placeholders between steps: its loss gathers them)
        losses = [float(loss_of(m, 5)) for m in (ours, ref)]
        assert abs(losses[0] - losses[1]) <= 0.02 * losses[1], losses
        full = opt.full_state_dict()  # type: ignore[attr-defined]
        into_torch = torch.optim.AdamW(copy.deepcopy(ref).parameters(), lr=0.02)
        into_torch.load_state_dict(full)
        for i, entry in ref_opt.state_dict()["state"].items():
            mine = into_torch.state_dict()["state"][i]
            assert mine["exp_avg_sq"].dtype == torch.float32
            assert float((mine["exp_avg_sq"] - entry["exp_avg_sq"]).norm() / entry["exp_avg_sq"].norm()) < 0.2
    finally:
        opt.close()  # type: ignore[attr-defined]


def test_zero2_rank_files_resume_in_a_new_optimizer_and_consolidate_to_adamw(daemon, one_rank_group, tmp_path):
    """ZeRO-2 writes the rank files the ZeRO-3 optimizers write (``save_shard``): a new optimizer over a model
    of other values takes its values, state, steps and hyper-parameters from them and trains on as the
    first one does; merged (``tiermem consolidate``'s reading), they are ``full_state_dict()``."""
    from tiermem.client.distributed.reshard import adamw_state_dict, open_shards

    ours, opt, ref, ref_opt = sharded_and_adamw(daemon, lr=0.02)
    other = model()
    with torch.no_grad():
        for p in other.parameters():
            p.fill_(0.5)
    again = ShardedOffloadAdam(other.parameters(), lr=0.9, client=connect(daemon.socket_path))
    try:
        train_alike(((ours, opt), (ref, ref_opt)), range(2))
        path = opt.save_shard(tmp_path / "ckpt")
        assert path.name == "zero3-rank00000-of-00001.pt"
        full = opt.full_state_dict()
        again.load_shards(tmp_path / "ckpt")
        assert again.param_groups[0]["lr"] == 0.02 and again.steps == 2
        assert biggest_diff(other, ours) == 0.0
        train_alike(((ours, opt), (other, again)), range(2, 4))
        assert biggest_diff(ours, other) == 0.0
        merged = adamw_state_dict(open_shards(tmp_path / "ckpt"))
        assert sorted(merged["state"]) == sorted(full["state"])
        for i, entry in full["state"].items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(merged["state"][i][key].reshape(-1), entry[key].reshape(-1)), (i, key)
    finally:
        opt.close()
        again.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_rank_file_holds_the_params_as_they_are_stepped_edited_or_never_stepped(daemon, one_rank_group, tier):
    """The values in ``state_dict()`` are the model's: a param edited in place after the last step, and one that
    never had a grad (its daemon master was never written on NVMe), come back as they are, not as a stale or
    empty master; loading the file back changes nothing."""
    m = model()
    spare = torch.nn.Linear(3, 3)  # in the optimizer, never in the forward
    params = [*m.parameters(), *spare.parameters()]
    opt = ShardedOffloadAdam(params, lr=0.02, offload=tier, client=connect(daemon.socket_path))
    try:
        train_alike(((m, opt),), range(2))
        with torch.no_grad():
            m[0].weight.clamp_(-0.1, 0.1)  # an edit the daemon has not seen yet
        saved = opt.state_dict()
        whole: list[list[torch.Tensor]] = [[] for _ in params]
        for piece in sorted(saved["pieces"], key=lambda pc: (pc["param"], pc["lo"])):
            whole[piece["param"]].append(piece["value"])
        for i, p in enumerate(params):
            assert torch.equal(torch.cat(whole[i]), p.detach().reshape(-1)), f"param {i} on {tier}"
        before = [p.detach().clone() for p in params]
        opt.load_state_dict(saved)
        assert all(torch.equal(a, p.detach()) for a, p in zip(before, params, strict=True))
    finally:
        opt.close()


@pytest.mark.parametrize("delayed", [False, True], ids=["synchronous", "delayed"])
def test_zero2_collectives_use_the_daemons_storage_as_the_buckets_slices(daemon, one_rank_group, delayed: bool):
    """Where a bucket's pieces fill this rank's slice side by side in the daemon's shared storage, the
    reduce-scatter writes the daemon's grad buffer and the all-gather reads its params, with no copy through
    the transfer buffer; the delayed update alternates two grad buffers, so there the slices are copies.
    The training matches AdamW's."""
    ours, ref = model(), model()
    opt = ShardedOffloadAdam(
        ours.parameters(), lr=0.02, client=connect(daemon.socket_path), delayed_update=delayed, warmup_steps=0
    )
    try:
        buckets = opt.strategy.rounds.buckets
        assert buckets and all(b.pieces for b in buckets)
        for bucket in buckets:
            first = bucket.pieces[0].entry
            assert first is not None  # the shared exchange: every piece is in the daemon's storage
            if delayed:
                assert bucket.grad_slice is None and bucket.param_slice is None
            else:
                assert bucket.param_slice is not None and bucket.grad_slice is not None
                assert bucket.param_slice.data_ptr() == first.view.data_ptr()
                assert bucket.grad_slice.data_ptr() == first.grad_views[0].data_ptr()
                assert bucket.grad_slice.numel() == bucket.plan.slice_numel
        if not delayed:
            adamw = torch.optim.AdamW(ref.parameters(), lr=0.02)
            train_alike([(ours, opt), (ref, adamw)], range(3))
            assert biggest_diff(ours, ref) <= 1e-6
    finally:
        opt.close()


@pytest.mark.parametrize("kind", ["zero2", "layers-paged", "paged"])
def test_a_relaunched_rank_reattaches_to_its_state_and_trains_on_like_adamw(daemon, one_rank_group, kind):
    """A trainer that ended without closing (``keep_state``, as a crash leaves it) and is launched again with
    the same job id: the derived token reattaches it, the values come back over a model of other values,
    and training goes on as AdamW's.  The ZeRO-3 ones exchange through the staged window, whose reattach the
    daemon refused before."""

    def make(m: torch.nn.Module) -> torch.optim.Optimizer:
        client = connect(daemon.socket_path)
        job = f"relaunch-{kind}"
        if kind == "zero2":
            return ShardedOffloadAdam(m.parameters(), lr=0.02, client=client, job_id=job)
        if kind == "layers-paged":
            return LayerShardedAdam(m, paged=True, lr=0.02, client=client, job_id=job)
        return ShardedPagedAdam(m, device_budget="1MiB", offload="cpu", lr=0.02, client=client, job_id=job)

    ours, ref = model(), model()
    adamw = torch.optim.AdamW(ref.parameters(), lr=0.02)
    opt = make(ours)
    train_alike(((ours, opt), (ref, adamw)), range(3))
    opt.close(keep_state=True)
    again = model()
    with torch.no_grad():
        for p in again.parameters():
            p.fill_(0.5)
    opt = make(again)
    try:
        assert opt.steps == 3 and opt.inner.state_from == "live"
        for a, b in zip(again.state_dict().values(), ref.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b)
        train_alike(((again, opt), (ref, adamw)), range(3, 5))
        for a, b in zip(again.state_dict().values(), ref.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b)
    finally:
        opt.close()


RELEASED_EDITS = {
    "init-in-place": (lambda m: torch.nn.init.zeros_(m[2].bias), "written in place"),
    "new-data": (lambda m: setattr(m[2].weight, "data", torch.zeros(2, 12)), "given new data"),
    "half": (lambda m: m.half(), "converted to torch.float16"),
}


@pytest.mark.parametrize("edit", list(RELEASED_EDITS))
@pytest.mark.parametrize("paged", [False, True], ids=["layers", "paged-layers"])
def test_layer_sharded_refuses_a_released_param_edited_outside_a_forward_and_trains_on(
    daemon, one_rank_group, paged, edit
):
    """A released layer's params are empty placeholders: ``nn.init.zeros_`` and ``p.data = t`` were silently
    dropped at the next gather (0.24 off AdamW), and ``model.half()`` failed inside torch.  The next gather
    now refuses it, naming the param and ``load_state_dict()``, and puts the placeholders back."""
    m, ref = model(), model()
    opt = LayerShardedAdam(m, lr=1e-2, paged=paged, client=connect(daemon.socket_path))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    try:
        train_alike(((m, opt), (ref, ref_opt)), range(2))
        change, what = RELEASED_EDITS[edit]
        change(m)
        with pytest.raises(InvalidState, match=rf"param '\d\.\w+' \(.*\) was {what}.*load_state_dict\(\)"):
            loss_of(m, 2)
        train_alike(((m, opt), (ref, ref_opt)), range(2, 4))
        for (name, p), q in zip(m.state_dict().items(), ref.state_dict().values(), strict=True):
            torch.testing.assert_close(p, q, msg=name)
    finally:
        opt.close()


class _WithHead(torch.nn.Module):
    """``model()`` and a head of its own: what a DDP wraps when the optimizer is given only ``body``."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = model(), torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("kind", ["layers", "paged"])
def test_a_ddp_around_a_zero3_model_reduces_nothing_and_is_refused_where_that_would_lose_grads(
    daemon, one_rank_group, kind
):
    """ZeRO-3 reduces its grads itself: a DDP around the model (made first, as Lightning does) has its
    all-reduce turned off in every forward, and the run trains as AdamW does.  Refused at the first forward,
    naming the way out: a DDP whose module has trainable params the optimizer does not hold (they would go
    unreduced), and ``static_graph=True`` (which reduces whatever the flag says)."""

    def make(m: torch.nn.Module) -> torch.optim.Optimizer:
        client = connect(daemon.socket_path)
        if kind == "layers":
            return LayerShardedAdam(m, lr=1e-2, client=client)
        return ShardedPagedAdam(m, lr=1e-2, offload="cpu", device_budget="1MiB", client=client)

    m, ref = model(), model()
    ddp = torch.nn.parallel.DistributedDataParallel(m)
    opt, ref_opt = make(m), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    try:
        train_alike(((ddp, opt), (ref, ref_opt)), range(3))
        assert ddp.require_backward_grad_sync is False
        for (name, p), q in zip(m.state_dict().items(), ref.state_dict().values(), strict=True):
            torch.testing.assert_close(p, q, msg=name)
    finally:
        opt.close()
    whole = _WithHead()
    ddp = torch.nn.parallel.DistributedDataParallel(whole)
    opt = make(whole.body)
    try:
        with pytest.raises(InvalidArgument, match=r"trainable params that \w+ does not hold \(head.weight, head.bias"):
            loss_of(ddp, 0)
    finally:
        opt.close()
    m = model()
    ddp = torch.nn.parallel.DistributedDataParallel(m, static_graph=True)
    opt = make(m)
    try:
        with pytest.raises(InvalidArgument, match=r"static_graph=True.*drop static_graph=True"):
            loss_of(ddp, 0)
    finally:
        opt.close()


@pytest.mark.parametrize("kind", ["layers", "paged"])
def test_consolidate_model_state_serves_the_next_model_state_dict_once_or_until_a_step_and_never_after_a_change(
    daemon, one_rank_group, kind
):
    """``consolidate_model_state(to)``: every rank gathers the model, and rank ``to``'s next
    ``model.state_dict()`` takes those values with no collective (HF Trainer saves the model on rank 0
    alone), once; a step, a load of the model or of the optimizer drops them first, so they are never older
    than the params.  With ``until_step`` (the callback's, as training ends, for ``save_model()`` and then
    ``push_to_hub()``), every ``model.state_dict()`` takes them until a step, ``release_model_state()`` or
    ``close()``.  ``to`` must be a rank of the group."""
    m, ref = model(), model()
    client = connect(daemon.socket_path)
    if kind == "layers":
        opt = LayerShardedAdam(m, lr=1e-2, client=client)
    else:
        opt = ShardedPagedAdam(m, lr=1e-2, offload="cpu", device_budget="1MiB", client=client)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    try:
        with pytest.raises(InvalidArgument, match=r"to=1 is not a rank of this optimizer's process group of 1"):
            opt.consolidate_model_state(1)
        train_alike(((m, opt), (ref, ref_opt)), range(2))
        opt.consolidate_model_state(0)
        kept = {name: opt.kept_model.value(p) for name, p in m.named_parameters()}
        state = m.state_dict()
        assert all(state[name] is value for name, value in kept.items())  # taken, not gathered again
        assert not opt.kept_model.kept  # once
        for (name, p), q in zip(state.items(), ref.state_dict().values(), strict=True):
            torch.testing.assert_close(p, q, msg=name)
        for change in (
            lambda: train_alike(((m, opt), (ref, ref_opt)), range(2, 3)),
            lambda: m.load_state_dict(ref.state_dict()),
            lambda: opt.load_state_dict(ref_opt.state_dict()),
        ):
            opt.consolidate_model_state(0)
            assert opt.kept_model.kept
            change()
            assert not opt.kept_model.kept
        for (name, p), q in zip(m.state_dict().items(), ref.state_dict().values(), strict=True):
            torch.testing.assert_close(p, q, msg=name)
        opt.consolidate_model_state(0, until_step=True)
        kept = {name: opt.kept_model.value(p) for name, p in m.named_parameters()}
        for _ in range(3):
            state = m.state_dict()
            assert all(state[name] is value for name, value in kept.items())
        opt.release_model_state()
        state = m.state_dict()
        assert not opt.kept_model.kept and all(state[name] is not value for name, value in kept.items())
        for (name, p), q in zip(state.items(), ref.state_dict().values(), strict=True):
            torch.testing.assert_close(p, q, msg=name)
        opt.consolidate_model_state(0, until_step=True)
        train_alike(((m, opt), (ref, ref_opt)), range(3, 4))
        assert not opt.kept_model.kept
        opt.consolidate_model_state(0, until_step=True)
    finally:
        opt.close()
    assert not opt.kept_model.kept


def test_hf_callback_hands_trainers_clip_to_a_zero3_optimizer_which_then_trains_as_if_made_with_it(
    daemon, one_rank_group, tmp_path, caplog
):
    """HF Trainer clips at ``max_grad_norm`` (1.0 by default); a ZeRO-3 model holds no grads in the trainer, so
    that clip finds none and clips nothing (before, ``WholeOptimizerState`` only warned).  The callback hands
    Trainer's value to the optimizer as training begins (``set_max_grad_norm``), which then trains exactly as
    one made with it; one that clips itself keeps its own; ``LayerShardedAdam`` without ``paged=True`` cannot
    clip, and the callback warns.  Once a grad of the step was reduced, the rule is refused until the step."""
    import transformers

    from tiermem.client.distributed.hf_trainer import WholeOptimizerState

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_grad_norm=0.05)
    models = [model() for _ in range(3)]
    opts = [
        ShardedPagedAdam(
            m, lr=1e-2, offload="cpu", device_budget="1MiB", max_grad_norm=clip, client=connect(daemon.socket_path)
        )
        for m, clip in zip(models, (None, 0.05, 2.0), strict=True)
    ]
    layer = LayerShardedAdam(model(), lr=1e-2, client=connect(daemon.socket_path))
    try:
        with caplog.at_level("INFO", logger="tiermem"):
            for opt in (*opts, layer):
                WholeOptimizerState().on_train_begin(args, None, None, optimizer=opt)
        assert [o.max_grad_norm for o in opts] == [0.05, 0.05, 2.0] and layer.max_grad_norm is None
        said = [r.getMessage() for r in caplog.records]
        assert sum("clips at Trainer's max_grad_norm=0.05" in m for m in said) == 1, said
        warned = [m for m in said if "clips nothing" in m]
        assert len(warned) == 1 and "LayerShardedAdam" in warned[0] and "paged=True" in warned[0], said
        train_alike(list(zip(models[:2], opts[:2], strict=True)), range(3))
        assert opts[0].last_grad_norm is not None and opts[0].last_grad_norm > 0.05  # it clipped
        for (name, p), q in zip(models[0].state_dict().items(), models[1].state_dict().values(), strict=True):
            assert torch.equal(p, q), name
        loss_of(models[0], 3).backward()
        with pytest.raises(InvalidState, match=r"after some of this step's grads were reduced"):
            opts[0].set_max_grad_norm(None)
        opts[0].step()
        opts[0].set_max_grad_norm(None)
        assert opts[0].max_grad_norm is None
        with pytest.raises(InvalidArgument, match=r"max_grad_norm needs paged=True"):
            layer.set_max_grad_norm(1.0)
    finally:
        for opt in (*opts, layer):
            opt.close()


@pytest.mark.parametrize("kind", ["layers", "paged"])
def test_zero3_clips_accumulated_scaled_grads_as_grad_scaler_and_clip_grad_norm(daemon, one_rank_group, kind):
    """Two backward passes a step under ``ShardedGradScaler``, clipped: the norm of the summed grads is the
    daemon's (GRAD_NORM, of the scaled grads, unscaled in the decision), the overflow of one pass skips the
    step, and the params follow torch's ``GradScaler`` + ``clip_grad_norm_`` + AdamW over the same passes."""
    clip = 0.1
    m, ref = model(), model()
    client = connect(daemon.socket_path)
    if kind == "layers":
        opt: Any = LayerShardedAdam(m, lr=1e-2, paged=True, max_grad_norm=clip, client=client)
    else:
        opt = ShardedPagedAdam(m, lr=1e-2, offload="cpu", device_budget="1MiB", max_grad_norm=clip, client=client)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler, ref_scaler = ShardedGradScaler("cpu", init_scale=2.0**10), torch.amp.GradScaler("cpu", init_scale=2.0**10)
    try:
        for step in range(4):
            for net, s in ((m, scaler), (ref, ref_scaler)):
                for part in range(2):
                    loss = loss_of(net, 10 * step + part) / 2 * (math.inf if step == 2 else 1.0)
                    s.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            ref_scaler.unscale_(ref_opt)
            ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
            ref_scaler.step(ref_opt)
            ref_scaler.update()
            ref_opt.zero_grad()
            if step == 2:
                assert opt.last_found_inf and opt.skipped_steps == 1
            else:
                assert opt.last_grad_norm == pytest.approx(ref_norm, rel=1e-5) and ref_norm > clip
        assert scaler.get_scale() == ref_scaler.get_scale() == 2.0**9
        for (name, p), q in zip(m.state_dict().items(), ref.state_dict().values(), strict=True):
            torch.testing.assert_close(p, q, msg=name)
    finally:
        opt.close()

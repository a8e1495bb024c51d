"""ZeRO-3 with param paging over ``torchrun`` ranks against one daemon: ``ShardedPagedAdam``.

``zero3_paged_worker.py`` trains a small MLP (odd sizes: padded shards) on two
and three ranks, each param sharded across them, each shard only in its rank's daemon,
with two param groups (no weight decay and half the learning rate on the
biases), clipped by the global norm under a StepLR schedule.  Checked: the gathered
``model.state_dict()`` equals ``torch.optim.AdamW`` + ``clip_grad_norm_`` on
the whole batch in one process (fp32; the reduce-scatter sums the ranks' parts
of the batch, so a few ulps), the global norms equal ``clip_grad_norm_``'s, no rank's modules hold
param data between steps, the pager stayed within its budget, and a step over
two backward passes is clipped by the norm of their sum, as the daemons hold it.  A rank killed mid-step
fails the others with ``RankLost`` (raised by a collective of the pager's I/O
thread) instead of hanging.  With bf16 and int8 moments the model stays within a
bound per dtype of AdamW, and a run resumed from its checkpoint ends bit for bit
where the run without one ends.

Checkpoints across world sizes (``zero3_reshard_worker.py``, both ZeRO-3
optimizers, a scenario of each launch): saved at two ranks, as rank files and
as the gathered ``full_state_dict()``; resumed at three ranks (a scenario of
the three-rank launch), at one (in this process) and in ``torch.optim.AdamW``
(after ``tiermem consolidate``, run as a command), each then training on like
``torch.optim.AdamW`` on the whole batch.  The same through
``torch.distributed.checkpoint`` (``get_state_dict``, ``dcp.save``), for all
three sharded optimizers: saved at two ranks, resumed at three and in
``torch.optim.AdamW``; and ``torch.optim.AdamW``'s own such checkpoint resumed
in each.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zero3_reshard_worker as reshard
from child_env import child_env
from conftest import run_tiermem_cli, start_daemon
from launch import Launch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from tiermem.client import cli
from tiermem.client.distributed import ShardedPagedAdam
from tiermem.client.distributed.reshard import file_name
from tiermem.client.link import connect

WORKER = str(Path(__file__).with_name("zero3_paged_worker.py"))
RESHARD = str(Path(__file__).with_name("zero3_reshard_worker.py"))
DAEMON = {"jobs": {"grace_period_s": 60.0, "max_jobs": 16}}


def _torchrun(daemon_factory, tmp_path: Path, ranks: int, *extra: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    d = daemon_factory(DAEMON)
    env = child_env()
    env.update(
        TIERMEM_SOCKET_PATH=d.socket_path,
        TIERMEM_NO_EMBED="1",
        TMPDIR=str(tmp_path),
        TIERMEM_SECRET_FILE=str(tmp_path / "job-secret"),
    )
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", WORKER,
         "--out", str(tmp_path / "paged.json"), *extra],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


# the two-rank scenarios in one launch against one daemon (``scenarios.py``), the three-rank one in another
TWO_RANKS = {
    "cpu-2": ["--offload", "cpu"],
    "nvme-2": ["--offload", "nvme"],
    "nvme-2-checkpoint-resumed": ["--offload", "nvme", "--resume-at", "3"],
    "scaler": ["--offload", "cpu", "--scaler", "--inf-step", "2"],
    "meta-2": ["--offload", "nvme", "--meta"],
}
# compressed moments: how far from fp32 AdamW the model ends, per state_dtype (twice the gap
# measured 1.2e-4 and 2.0e-3 after 5 steps at lr 2e-2)
COMPRESSED_GAP = {"bf16": 2.5e-4, "int8": 4e-3}
for dtype in COMPRESSED_GAP:
    TWO_RANKS[dtype] = ["--offload", "cpu", "--state-dtype", dtype]
    TWO_RANKS[f"{dtype}-checkpoint-resumed"] = [*TWO_RANKS[dtype], "--resume-at", "3"]
THREE_RANKS = {"nvme-3": ["--offload", "nvme"]}


def _launch(
    tmp_path_factory: pytest.TempPathFactory, nproc: int, plan: dict[str, list[str]], workers: dict[str, str]
) -> Iterator[Launch]:
    tmp = tmp_path_factory.mktemp(f"zero3-paged-{nproc}")
    d = start_daemon(tmp / "tiermemd", DAEMON)
    try:
        yield Launch(WORKER, nproc, plan, tmp, d.socket_path, workers).run()
    finally:
        d.cleanup()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    plan = {**TWO_RANKS, "reshard-save": ["--save"]}
    yield from _launch(tmp_path_factory, 2, plan, {"reshard-save": RESHARD})


def saved(two_ranks: Launch) -> Path:
    """The checkpoints the two ranks saved (``zero3_reshard_worker.py --save``)."""
    return reshard.saved_in(two_ranks.check("reshard-save"))


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory, two_ranks: Launch) -> Iterator[Launch]:
    plan = {**THREE_RANKS, "reshard-load": ["--load", str(reshard.saved_in(two_ranks.out("reshard-save")))]}
    yield from _launch(tmp_path_factory, 3, plan, {"reshard-load": RESHARD})


@pytest.mark.parametrize("name", ["cpu-2", "nvme-2", "nvme-3", "nvme-2-checkpoint-resumed", "meta-2"])
def test_sharded_paged_params_train_like_adamw_with_a_global_clip(request, name):
    """``-checkpoint-resumed``: before step 3 every rank checkpoints, and a new model and optimizer load it.
    ``meta-2``: each rank made the model on the meta device under a seed of its own.  A last step adds two
    backward passes' grads in the daemons: every rank clips it by the norm of their sum (``clip_grad_norm_``'s
    of the same passes), which its daemon gives it (GRAD_NORM); before, it was refused on every rank."""
    launch: Launch = request.getfixturevalue("three_ranks" if name in THREE_RANKS else "two_ranks")
    result = json.loads(launch.check(name).read_text())
    worst = 0.0
    for key, ref in result["reference"].items():
        ours = result["state"][key]
        flat_ours = [v for row in ours for v in row] if isinstance(ours[0], list) else ours
        flat_ref = [v for row in ref for v in row] if isinstance(ref[0], list) else ref
        worst = max(worst, *(abs(a - b) for a, b in zip(flat_ours, flat_ref, strict=True)))
    assert worst <= 1e-5, worst
    _check_norms(result)
    for r in result["ranks"]:
        assert max(r["held"]) <= 4, f"rank {r['rank']}'s modules hold param data between steps: {r['held']}"
        assert 0 < r["peak"] <= result["budget"], (r["peak"], result["budget"])
        assert r["accumulated"] == pytest.approx(result["reference_accumulated"], rel=1e-5), r["accumulated"]
    print(f"\nzero3 paged, {name}: within {worst:.1e} of AdamW + clip_grad_norm_")


def _check_norms(result: dict) -> None:
    pairs = [(o, r) for o, r in zip(result["norms"], result["reference_norms"], strict=True) if o is not None]
    for ours, ref in pairs:
        assert ours == pytest.approx(ref, rel=1e-5), (result["norms"], result["reference_norms"])
    assert any(r > 0.5 for _, r in pairs), "the clip never acted: the test would not see it"


def _worst(result: dict) -> float:
    worst = 0.0
    for key, ref in result["reference"].items():
        ours = torch.tensor(result["state"][key])
        worst = max(worst, float((ours - torch.tensor(ref)).abs().max()))
    return worst


def test_a_sharded_scaler_skips_a_global_overflow_and_clips_the_unscaled_grads(two_ranks):
    """ShardedGradScaler over ShardedPagedAdam, 2 ranks: the last rank's loss is inf at step 2, both ranks
    skip it and halve the scale, as torch's GradScaler over the whole batch does; the other steps are
    unscaled and clipped by the daemons like GradScaler.unscale_ + clip_grad_norm_ + AdamW."""
    result = json.loads(two_ranks.check("scaler").read_text())
    assert result["skipped"] == 1, result["skipped"]
    assert result["scale"] == result["ref_scale"] == 2.0**11, (result["scale"], result["ref_scale"])
    assert result["norms"][2] is None and sum(n is None for n in result["norms"]) == 1, result["norms"]
    _check_norms(result)
    worst = _worst(result)
    assert worst <= 1e-5, worst
    print(f"\nzero3 paged, scaled, one overflow skipped: within {worst:.1e} of GradScaler + AdamW")


@pytest.mark.parametrize("dtype", list(COMPRESSED_GAP))
def test_compressed_moments_resume_bitwise_and_stay_near_adamw(two_ranks, dtype):
    """state_dtype bf16 / int8 at two ranks: the run checkpointed before step 3 and resumed in a new model and
    optimizer ends bit for bit where the run without a checkpoint ends, and both stay within the dtype's gap of
    fp32 AdamW + clip_grad_norm_ on the whole batch."""
    plain = json.loads(two_ranks.check(dtype).read_text())
    resumed = json.loads(two_ranks.check(f"{dtype}-checkpoint-resumed").read_text())
    assert resumed["state"] == plain["state"], "the resumed run ended elsewhere"
    worst = _worst(plain)
    assert worst <= COMPRESSED_GAP[dtype], worst
    for r in plain["ranks"]:
        assert 0 < r["peak"] <= plain["budget"], (r["peak"], plain["budget"])
    print(f"\nzero3 paged, {dtype} moments: within {worst:.1e} of AdamW + clip_grad_norm_")


def test_a_rank_killed_mid_step_fails_the_other_with_rank_lost(daemon_factory, tmp_path):
    started = time.monotonic()
    done = _torchrun(daemon_factory, tmp_path, 2, "--kill-step", "2")
    assert done.returncode != 0
    report = tmp_path / "paged.json.0"
    assert report.exists(), done.stderr[-4000:]
    survivor = json.loads(report.read_text())
    assert survivor["error"] == "RankLost", survivor
    print(f"\nzero3 paged, a rank killed: the other got RankLost in {survivor['during']}")
    assert survivor["at"] - started < 120, "the survivor waited for its collective's timeout"


# ----------------------------------------------------------------- checkpoints across world sizes


def _assert_trains_on_like_adamw(kind: str, ours: dict[str, torch.Tensor]) -> None:
    """``ours``: the model's values after resuming at step SAVED_AT and MORE steps more."""
    expected, _ = reshard.reference(kind, reshard.SAVED_AT + reshard.MORE)
    assert sorted(ours) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(ours[key]), value, msg=lambda m, key=key: f"{key}: {m}")
    start, _ = reshard.reference(kind, 0)
    assert max(float((ours[k] - start[k]).abs().max()) for k in start) > 1e-3, "nothing was trained"


@pytest.mark.parametrize("how", ["shards", "full"])
@pytest.mark.parametrize("kind", reshard.KINDS)
def test_a_checkpoint_saved_at_two_ranks_resumes_at_three_like_adamw(three_ranks, two_ranks, kind, how):
    """``shards``: every rank loads its new stretches from the two rank files (params, buffer, state, the
    groups' learning rates); ``full``: the gathered AdamW-format dict and the gathered model.  Either way into a
    model of other values and an optimizer made with another learning rate, then two more steps."""
    saved(two_ranks)  # its failure first, if it failed
    result = json.loads(three_ranks.check("reshard-load").read_text())[f"{kind}-{how}"]
    _assert_trains_on_like_adamw(kind, {k: torch.tensor(v) for k, v in result.items()})


@pytest.mark.parametrize("kind", reshard.DCP_KINDS)
def test_a_torch_distributed_checkpoint_saved_at_two_ranks_resumes_at_three_like_adamw(three_ranks, two_ranks, kind):
    """``get_state_dict`` and ``dcp.save`` at two ranks, each writing its own stretches; at three, the new
    optimizer's ``get_state_dict`` as the template, ``dcp.load`` (each rank reads the elements it holds now)
    and ``set_state_dict``, into a model of other values and an optimizer with another learning rate."""
    saved(two_ranks)
    result = json.loads(three_ranks.check("reshard-load").read_text())[f"{kind}-dcp"]
    _assert_trains_on_like_adamw(kind, {k: torch.tensor(v) for k, v in result.items()})


@pytest.mark.parametrize("kind", reshard.DCP_KINDS)
def test_a_torch_distributed_checkpoint_of_two_ranks_resumes_in_torch_adamw(two_ranks, one_rank_group, kind):
    """What the two ranks saved is torch's own format by param name: a plain model and torch.optim.AdamW load
    it the usual way, hold AdamW's state after the same steps, and train on like it."""
    model = reshard.make_model(seed=7)
    opt = torch.optim.AdamW(reshard.groups(kind, model), lr=0.5, weight_decay=0.01)
    _dcp_load(model, opt, saved(two_ranks) / f"{kind}-dcp")
    _, ref_opt = reshard.reference(kind, reshard.SAVED_AT)
    _assert_same_adam_state(opt.state_dict(), ref_opt)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    reshard.train(model, opt, range(reshard.SAVED_AT, reshard.SAVED_AT + reshard.MORE))
    _assert_trains_on_like_adamw(kind, dict(model.state_dict()))


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("kind", reshard.DCP_KINDS)
def test_torch_adamws_distributed_checkpoint_resumes_in_a_sharded_optimizer(
    two_ranks, one_rank_group, tmp_path, kind, flat
):
    """The other way: AdamW's ``dcp.save`` loads into each sharded optimizer, also with torchtitan's
    ``flatten_optimizer_state_dict`` (whose load reads every key of the loading optimizer's groups from the
    checkpoint).  And taking a state dict changes nothing: ``get_state_dict`` steps an optimizer whose
    ``opt.state`` is empty, which a sharded one's never is."""
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    reference = reshard.make_model()
    ref_opt = torch.optim.AdamW(reshard.groups(kind, reference), lr=reshard.LR, weight_decay=0.01)
    reshard.train(reference, ref_opt, range(reshard.SAVED_AT))
    model_state, optim_state = get_state_dict(reference, ref_opt, options=options)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp_path / "adamw")
    model = reshard.make_model(seed=7)
    opt = reshard.make_optimizer(kind, model, lr=0.5, client=connect(two_ranks.socket_path))
    try:
        _dcp_load(model, opt, tmp_path / "adamw", options)
        before = opt.full_state_dict()
        assert len(opt.state) == len(list(model.parameters())) and opt.steps == reshard.SAVED_AT
        get_state_dict(model, opt)
        _assert_same_adam_state(opt.full_state_dict(), ref_opt)
        assert torch.equal(opt.full_state_dict()["state"][0]["exp_avg"], before["state"][0]["exp_avg"])
        reshard.train(model, opt, range(reshard.SAVED_AT, reshard.SAVED_AT + reshard.MORE))
        _assert_trains_on_like_adamw(kind, reshard.values(model, opt))
    finally:
        opt.close()


def _dcp_load(
    model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path, options: StateDictOptions | None = None
) -> None:
    model_state, optim_state = get_state_dict(model, opt, options=options)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


@pytest.mark.parametrize("kind", reshard.KINDS)
def test_a_checkpoint_saved_at_two_ranks_resumes_at_one_with_adamws_state(two_ranks, one_rank_group, kind):
    """One rank takes both ranks' stretches; its state right after loading is torch.optim.AdamW's own after the
    same steps (keyed by the index in model.parameters()), and it trains on like AdamW."""
    model = reshard.make_model(seed=7)
    opt = reshard.make_optimizer(kind, model, lr=0.5, client=connect(two_ranks.socket_path))
    try:
        opt.load_shards(saved(two_ranks) / kind)
        _, ref_opt = reshard.reference(kind, reshard.SAVED_AT)
        _assert_same_adam_state(opt.full_state_dict(), ref_opt)
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
        reshard.train(model, opt, range(reshard.SAVED_AT, reshard.SAVED_AT + reshard.MORE))
        _assert_trains_on_like_adamw(kind, reshard.values(model, opt))
    finally:
        opt.close()


def test_a_layer_sharded_save_resumes_in_the_paged_optimizer(two_ranks, one_rank_group):
    """The format does not depend on the saving layout: LayerShardedAdam's rank files (whole layers per owner)
    load into ShardedPagedAdam (a stretch of every param per rank) with the same param groups."""
    model = reshard.make_model(seed=7)
    opt = ShardedPagedAdam(
        model, lr=0.5, weight_decay=0.01, offload="cpu", device_budget=4096, client=connect(two_ranks.socket_path)
    )
    try:
        opt.load_shards(saved(two_ranks) / "layers")
        reshard.train(model, opt, range(reshard.SAVED_AT, reshard.SAVED_AT + reshard.MORE))
        _assert_trains_on_like_adamw("layers", dict(model.state_dict()))
    finally:
        opt.close()


def _assert_same_adam_state(ours: dict, ref_opt: torch.optim.AdamW) -> None:
    """``ours`` (AdamW's format, keyed by the index in model.parameters()) holds ``ref_opt``'s state."""
    ref = ref_opt.state_dict()
    mine = [i for g in ours["param_groups"] for i in g["params"]]
    theirs = [i for g in ref["param_groups"] for i in g["params"]]
    assert len(mine) == len(theirs) and sorted(ours["state"]) == sorted(mine)
    for i, j in zip(mine, theirs, strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours["state"][i][key], ref["state"][j][key])


@pytest.mark.parametrize("kind", reshard.KINDS)
def test_tiermem_consolidate_makes_a_checkpoint_that_torch_adamw_resumes(two_ranks, tmp_path, kind):
    """The command merges the two rank files into a model state dict and an AdamW-format dict equal to the
    collective full_state_dict(); a plain model and torch.optim.AdamW load them and train on like AdamW."""
    model_file, optim_file = tmp_path / "model.pt", tmp_path / "optim.pt"
    done = run_tiermem_cli(
        "consolidate", str(saved(two_ranks) / kind), "--model", str(model_file), "--optimizer", str(optim_file)
    )
    assert done.returncode == 0, done.stderr
    saver = {"paged": "ShardedPagedAdam", "layers": "LayerShardedAdam"}[kind]
    assert f"2 rank file(s) of a {saver} save at step {reshard.SAVED_AT}" in done.stdout, done.stdout
    consolidated = torch.load(optim_file)
    gathered = torch.load(saved(two_ranks) / f"{kind}-full.pt")
    assert consolidated["param_groups"] == gathered["param_groups"]
    for i, entry in gathered["state"].items():
        for key, value in entry.items():
            assert torch.equal(consolidated["state"][i][key], value), (i, key)
    _, ref_opt = reshard.reference(kind, reshard.SAVED_AT)
    _assert_same_adam_state(consolidated, ref_opt)
    model = reshard.make_model(seed=7)
    model.load_state_dict(torch.load(model_file))
    opt = torch.optim.AdamW(reshard.groups(kind, model), lr=0.5, weight_decay=0.01)
    opt.load_state_dict(consolidated)
    reshard.train(model, opt, range(reshard.SAVED_AT, reshard.SAVED_AT + reshard.MORE))
    _assert_trains_on_like_adamw(kind, dict(model.state_dict()))


def test_tiermem_consolidate_names_a_missing_or_foreign_rank_file(two_ranks, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(saved(two_ranks) / "paged", broken)
    (broken / file_name(1, 2)).unlink()
    out = tmp_path / "model.pt"
    done = run_tiermem_cli("consolidate", str(broken), "--model", str(out))
    assert done.returncode == 1, done
    assert f"1 rank file(s) are missing: {broken / file_name(1, 2)}" in done.stderr, done.stderr
    assert not out.exists()
    # rank 1 of another save (the layer-sharded one) in its place
    shutil.copy(saved(two_ranks) / "layers" / file_name(1, 2), broken / file_name(1, 2))
    assert cli.main(["consolidate", str(broken), "--model", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{broken / file_name(1, 2)}: its optimizer differs from {broken / file_name(0, 2)}'s" in err, err
    # a path that is not there, and a device that is neither a directory nor a file, say which they are
    assert cli.main(["consolidate", str(tmp_path / "nowhere"), "--model", str(out)]) == 1
    assert f"{tmp_path / 'nowhere'} does not exist: give a directory of rank files" in capsys.readouterr().err
    assert cli.main(["consolidate", "/dev/null", "--model", str(out)]) == 1
    assert "/dev/null is neither a directory of rank files nor a rank file" in capsys.readouterr().err
    # nothing to write is a usage error
    with pytest.raises(SystemExit) as exc:
        cli.main(["consolidate", str(broken)])
    assert exc.value.code == 2
    assert "give --model PATH, --optimizer PATH or both" in capsys.readouterr().err

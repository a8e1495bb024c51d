"""ZeRO-2 over torch.distributed: ``torchrun`` (gloo) ranks against real daemons, equal to one process.

Each run is ``zero2_worker.py`` under ``torchrun``: the ranks train through
``ShardedOffloadAdam`` and rank 0 compares the result with ``torch.optim.AdamW``
trained in one process on the same global batch.  Tolerance: the ranks' grads
are summed by the reduce-scatter in another order than autograd sums the
global batch's mean, so they differ by a few fp32 ulps; Adam divides by the
root of the second moment, which keeps such differences at their size, so
after a few steps params agree to 1e-6 (measured: 5e-8).  With bf16 and int8
moments the ranks still end equal and reload bitwise, and the params stay
within a bound per dtype of AdamW.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from child_env import child_env
from conftest import DaemonProcess, start_daemon
from launch import Launch

WORKER = str(Path(__file__).with_name("zero2_worker.py"))
TOLERANCE = 1e-6
LONG_GRACE = {"jobs": {"grace_period_s": 300.0, "max_jobs": 16}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(
    tmp: Path,
    nproc: int,
    args: list[str],
    *,
    socket_path: str | None,
    nnodes: int = 1,
    node_rank: int = 0,
    port: int | None = None,
    run_id: str = "zero2",
) -> subprocess.Popen[bytes]:
    env = child_env()
    env["TMPDIR"] = str(tmp)
    env["TIERMEM_SECRET_FILE"] = str(tmp / "job-secret")  # the user's job secret, kept out of the home directory
    if socket_path is not None:
        env["TIERMEM_SOCKET_PATH"] = socket_path
    env["TIERMEM_NO_EMBED"] = "1" if socket_path else "0"
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1:
        launch.append("--standalone")
    else:
        launch += [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}",
        ]
    log = open(tmp / f"torchrun-{node_rank}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([*launch, WORKER, "--out", str(tmp / "result"), *args], env=env, stdout=log, stderr=log)


def results(tmp: Path, world: int, base: str = "result") -> list[dict[str, Any]]:
    """Every rank's report: ``<tmp>/<base>.<rank>`` (``base`` ``out`` for a scenario of a launch)."""
    out = []
    for r in range(world):
        path = tmp / f"{base}.{r}"
        out.append(json.loads(path.read_text()) if path.exists() else {"missing": r})
    return out


def finish(tmp: Path, *procs: subprocess.Popen[bytes], timeout_s: float = 240.0) -> list[int]:
    codes = [p.wait(timeout=timeout_s) for p in procs]
    return codes


def logs(tmp: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(tmp.glob("torchrun-*.log")))


def _attached(log: str, job: str, rank: int, world: int) -> bool:
    """The daemon's log says that rank ``rank`` of ``job`` attached to it (first, joining, or again)."""
    return re.search(rf"(created|joined|reattached) job {re.escape(repr(job))} rank {rank}/{world} ", log) is not None


def check_equal(tmp: Path, world: int, *, skipped: int = 0, base: str = "result") -> dict[str, Any]:
    ranks = results(tmp, world, base)
    first = ranks[0]
    assert "param_diff" in first, (ranks, logs(tmp))
    assert first["moved"] > 1e-2, "training did not move the params"
    assert first["param_diff"] <= TOLERANCE and first["state_diff"] <= TOLERANCE, first
    assert first["step_equal"] and first["same_params_with_state"], first
    assert all(r["skipped"] == skipped for r in ranks), ranks
    assert first["ref_skipped"] == skipped and first["scale"] == first["ref_scale"], first
    if "ref_norm" in first:  # the reduced grads themselves (Adam's update hides a wrong scale of them)
        assert abs(first["last_norm"] - first["ref_norm"]) <= 1e-5 * first["ref_norm"], first
    assert len({r["job_id"] for r in ranks}) == 1
    print(f"\n{world} ranks: {json.dumps(first)}")
    return first


# the two-rank runs against one daemon, in one launch (``scenarios.py``)
TWO_RANKS = {
    tier: ["--tier", tier, "--steps", "6", "--clip", "0.05", "--scaler", "--inf-step", "2", "--reload"]
    for tier in ("cpu", "nvme")
}
OVERLAP = ["--steps", "5", "--clip", "0.05", "--scaler", "--inf-step", "2", "--overlap", "--accumulate", "2"]
TWO_RANKS["no_sync"] = [*OVERLAP, "--no-sync"]
TWO_RANKS["accumulated"] = OVERLAP
TWO_RANKS["delayed"] = ["--steps", "6", "--clip", "0.05", "--delayed", "2", "--overlap", "--reload"]
TWO_RANKS["torch_clip"] = ["--steps", "3", "--scaler", "--torch-clip", "0.05", "--overlap"]
TWO_RANKS["ddp_torch_clip"] = ["--steps", "4", "--scaler", "--torch-clip", "0.05", "--ddp"]
TWO_RANKS["refused_load"] = ["--steps", "2", "--refused-load"]
# compressed moments: how far from fp32 AdamW the params end, per state_dtype (twice the gap
# measured 2.9e-4 and 4.8e-3 after 6 steps at lr 2e-2)
COMPRESSED_GAP = {"bf16": 6e-4, "int8": 1e-2}
for dtype in COMPRESSED_GAP:
    TWO_RANKS[dtype] = ["--state-dtype", dtype, "--steps", "6", "--clip", "0.05", "--reload"]


# plain DDP with OffloadAdam on each rank (``ddp_worker.py``), in the same launch
DDP_WORKER = str(Path(__file__).with_name("ddp_worker.py"))
DDP = {"ddp": [], "ddp_released": ["--release"], "ddp_released_staged": ["--release", "--exchange", "staged"]}


# HF Trainer at two ranks (``hf_trainer_worker.py``), in the same launch: ShardedOffloadAdam with its
# checkpoint callback, a resume of its step-3 checkpoint in new objects, and AdamW under the same Trainer
HF_WORKER = str(Path(__file__).with_name("hf_trainer_worker.py"))
ACCELERATE_WORKER = str(Path(__file__).with_name("accelerate_worker.py"))


def hf_plan(tmp: Path) -> dict[str, list[str]]:
    trained = str(tmp / "hf-zero2-run")
    return {
        "hf_zero2": ["--optimizer", "zero2", "--output-dir", trained],
        "hf_zero2_resumed": ["--optimizer", "zero2", "--output-dir", str(tmp / "hf-resumed"), "--resume", trained],
        "hf_adamw": ["--optimizer", "adamw", "--output-dir", str(tmp / "hf-adamw-run")],
        "hf_paged": ["--optimizer", "paged", "--output-dir", str(tmp / "hf-paged-run")],
        "hf_paged_resumed": [
            *("--optimizer", "paged", "--output-dir", str(tmp / "hf-paged-resumed")),
            *("--resume", str(tmp / "hf-paged-run")),
        ],
        "hf_layer": ["--optimizer", "layer", "--output-dir", str(tmp / "hf-layer-run")],
        "hf_paged_accumulated": [
            "--optimizer",
            "paged",
            "--accumulate",
            "2",
            "--output-dir",
            str(tmp / "hf-paged-acc"),
        ],
        "hf_adamw_accumulated": [
            "--optimizer",
            "adamw",
            "--accumulate",
            "2",
            "--output-dir",
            str(tmp / "hf-adamw-acc"),
        ],
        "accelerate": [],
        "accelerate_paged": ["--optimizer", "paged"],
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Launch, DaemonProcess]]:
    tmp = tmp_path_factory.mktemp("zero2")
    d = start_daemon(tmp / "tiermemd", LONG_GRACE)
    try:
        hf = hf_plan(tmp)
        plan = {**TWO_RANKS, **DDP, **hf}
        workers = {
            **dict.fromkeys(DDP, DDP_WORKER),
            **dict.fromkeys(hf, HF_WORKER),
            **dict.fromkeys(("accelerate", "accelerate_paged"), ACCELERATE_WORKER),
        }
        yield Launch(WORKER, 2, plan, tmp, d.socket_path, workers=workers).run(), d
    finally:
        d.cleanup()


def test_offload_adam_under_plain_ddp_trains_like_adamw_and_released_grads_are_refused(two_ranks):
    """DDP writes the averaged grads into ``p.grad`` when backward ends.  ``OffloadAdam`` steps on them like
    AdamW; with ``release_grads`` its hooks had handed the local grads to the daemon already, and the step
    added DDP's averages to them, silently (0.07 off AdamW after 4 steps): now every rank refuses the first
    step, naming DDP, with nothing applied."""
    ranks = [json.loads(p.read_text()) for p in sorted(_scenario(two_ranks, "ddp").glob("out.*"))]
    assert len(ranks) == 2 and all(r["error"] is None and r["diff"] <= 1e-6 for r in ranks), ranks
    for name in ("ddp_released", "ddp_released_staged"):
        ranks = [json.loads(p.read_text()) for p in sorted(_scenario(two_ranks, name).glob("out.*"))]
        assert len(ranks) == 2, (name, ranks)
        for r in ranks:
            assert r["error"] == "GradsAfterRelease" and "DDP" in r["message"], (name, r)
            assert r["steps"] == 0 and r["unchanged"], (name, r)


def test_a_load_refused_on_one_rank_is_refused_on_every_rank_at_once_and_changes_nothing(two_ranks):
    """Every rank loads rank 0's rank file, which holds none of rank 1's stretches.  Rank 1 refused it and rank
    0 loaded it, and went on to its next collective, where it waited out ``collective_timeout_s`` (30 s) and
    raised ``RankLost`` without the cause.  Now ``load_state_dict`` is collective: the ranks exchange their
    checks' outcomes first, so rank 0 refuses too, naming rank 1 and its reason; nothing changed on either,
    and both train on."""
    ranks = results(_scenario(two_ranks, "refused_load"), 2, "out")
    first, second = ranks
    assert first["refused_load"]["error"] == "InvalidArgument", first
    assert "rank 1 of 2 refused this load_state_dict, so no rank loaded it" in first["refused_load"]["message"]
    assert "rank(s) 1" in first["refused_load"]["message"], first  # rank 1's own reason, passed on
    assert second["refused_load"]["error"] == "InvalidArgument" and "rank(s) 1" in second["refused_load"]["message"]
    for r in ranks:
        assert r["load_changed_nothing"] and r["steps"] == 2, r


def test_hf_trainer_at_two_ranks_trains_like_adamw_and_resumes_every_rank_from_its_checkpoint(two_ranks):
    """HF Trainer (DDP, its clip at 1.0, checkpoints every 3 steps) with ShardedOffloadAdam logs AdamW's losses
    under the same Trainer.  Its ``optimizer.pt`` is rank 0's ``state_dict()``: with ``WholeOptimizerState`` it
    holds every rank's state, and ``resume_from_checkpoint`` in new objects ends where the uninterrupted run
    does (before, rank 1's resume was refused: its elements were in no file)."""
    launch = two_ranks[0]
    runs = {name: launch.check(name) for name in ("hf_zero2", "hf_zero2_resumed", "hf_adamw")}
    losses = {name: json.loads(Path(f"{out}.json").read_text())["losses"] for name, out in runs.items()}
    final = {name: torch.load(f"{out}.pt") for name, out in runs.items()}
    assert len(losses["hf_zero2"]) == 6 and losses["hf_zero2"] == pytest.approx(losses["hf_adamw"], rel=1e-5)
    assert losses["hf_zero2_resumed"][3:] == pytest.approx(losses["hf_zero2"][3:], rel=1e-6), losses
    for key, value in final["hf_adamw"].items():
        torch.testing.assert_close(final["hf_zero2"][key], value, rtol=0, atol=1e-6, msg=key)
        torch.testing.assert_close(final["hf_zero2_resumed"][key], final["hf_zero2"][key], rtol=0, atol=1e-7, msg=key)


def test_hf_trainer_at_two_ranks_trains_zero3_paged_like_adamw_and_refuses_ddp_over_layer_placeholders(two_ranks):
    """Trainer wraps the model in DDP after the optimizer is made.  ``ShardedPagedAdam`` reduces its grads
    itself, so DDP's all-reduce is turned off in its forwards; its placeholders survive Trainer's
    ``model.to("cpu:0")`` (a copy of each, which changed nothing: before, the first forward refused it as an
    edit), and it logs AdamW's losses under Trainer's clip, which the callback hands to it.  Trainer saves
    the model on rank 0 alone, which left rank 0 in a gather no other rank joined (``RankLost`` after 30 s):
    ``WholeOptimizerState`` gathers it on every rank first, and a resume from step 3 in new objects ends where
    the uninterrupted run does.
    ``trainer.save_model()`` after training (twice, as ``push_to_hub()`` saves again) left rank 0 in the same
    lone gather, and saved nothing: the callback gathers the model as training ends, kept on rank 0 until the
    next step, so both saves hold the trained params; rank 1's own ``model.state_dict()`` meanwhile, which
    rank 0 would not join, is refused at once, and after ``release_model_state()`` every rank gathers the
    saved values again.  ``save_on_each_node=True`` is refused where training begins (it was at the first
    save).
    DDP made over ``LayerShardedAdam``'s empty placeholders holds grad accumulators sized 0 (before: backward
    failed, "TBackward0 returned an invalid gradient"): every rank refuses at the first forward, saying to
    wrap first or use ShardedPagedAdam."""
    launch = two_ranks[0]
    names = ("hf_paged", "hf_paged_resumed", "hf_adamw")
    losses = {name: json.loads(Path(f"{launch.check(name)}.json").read_text())["losses"] for name in names}
    assert len(losses["hf_paged"]) == 6 and losses["hf_paged"] == pytest.approx(losses["hf_adamw"], rel=1e-5)
    assert losses["hf_paged_resumed"][3:] == pytest.approx(losses["hf_paged"][3:], rel=1e-6), losses
    final = {name: torch.load(f"{launch.check(name)}.pt") for name in names}
    for key, value in final["hf_adamw"].items():
        torch.testing.assert_close(final["hf_paged"][key], value, rtol=0, atol=2e-6, msg=key)  # 9.3e-7 here
        torch.testing.assert_close(final["hf_paged_resumed"][key], final["hf_paged"][key], rtol=0, atol=1e-7, msg=key)
    for name in ("hf_paged", "hf_paged_resumed"):
        out = launch.check(name)
        after = [json.loads(out.with_name(f"out.after.{rank}").read_text()) for rank in range(2)]
        assert all(r["same_as_saved"] and r["saved_keys"] == len(final[name]) for r in after), after
        assert after[0]["refused"] == "" and "opt.release_model_state() on every rank" in after[1]["refused"]
        assert all("save_on_each_node=False" in r["each_node"] for r in after), after
    out = launch.check("hf_layer")
    refused = [json.loads(p.read_text()) for p in sorted(out.parent.glob(f"{out.name}.json.*"))]
    assert len(refused) == 2, refused
    for r in refused:
        assert r["error"] == "InvalidArgument" and "placeholders" in r["message"], r
        assert "ShardedPagedAdam" in r["message"] and "before making the optimizer" in r["message"], r


def test_hf_trainer_clips_zero3_paged_accumulated_grads_by_the_norm_of_their_sum(two_ranks):
    """``gradient_accumulation_steps=2`` with Trainer's clip at 1.0, which the callback hands to
    ``ShardedPagedAdam``: the passes' grads are added in the daemons, and each rank's daemon gives the sum of
    squares of its shards (GRAD_NORM), so the clip is ``clip_grad_norm_``'s over the whole batch and the run
    logs AdamW's losses.  Before, clipping such a step was refused on every rank (so the callback could only
    warn, and the run trained unclipped)."""
    launch = two_ranks[0]
    runs = {name: launch.check(name) for name in ("hf_paged_accumulated", "hf_adamw_accumulated")}
    logs = {name: json.loads(Path(f"{out}.json").read_text()) for name, out in runs.items()}
    assert max(logs["hf_adamw_accumulated"]["grad_norms"]) > 1.0, logs  # the clip acts
    losses = [logs[name]["losses"] for name in runs]
    assert len(losses[0]) == 6 and losses[0] == pytest.approx(losses[1], rel=1e-5), losses
    final = [torch.load(f"{out}.pt") for out in runs.values()]
    for key, value in final[1].items():
        torch.testing.assert_close(final[0][key], value, rtol=0, atol=2e-6, msg=key)


def test_accelerate_save_state_after_consolidate_state_dict_resumes_every_rank_exactly(two_ranks):
    """accelerate's ``save_state`` writes ``optimizer.state_dict()`` from the main process alone; after
    ``consolidate_state_dict(0)`` on every rank that is the whole state, so ``load_state`` into new objects made
    from other values resumes every rank: the run ends where the uninterrupted one does, bit for bit, and
    accelerate's clip of DDP's grads warns of nothing.  The same with ``ShardedPagedAdam`` (ZeRO-3), whose
    model accelerate's ``save_state`` gathers on every rank, and which trains as ZeRO-2 does."""
    finals = {}
    for name in ("accelerate", "accelerate_paged"):
        out = two_ranks[0].check(name)
        final = finals[name] = torch.load(f"{out}.pt")
        gap = (final["resumed"] - final["uninterrupted"]).abs().max()
        assert torch.equal(final["resumed"], final["uninterrupted"]), (name, gap)
        for rank in results(out.parent, 2, "out"):
            assert rank["warnings"] == [] and rank["steps"] == 6, (name, rank)
    # ZeRO-3 paged, prepared with the model (accelerate's DDP made after it, its all-reduce off), clipping at
    # the same global norm as accelerate's clip of DDP's grads: the same run
    gap = float((finals["accelerate_paged"]["uninterrupted"] - finals["accelerate"]["uninterrupted"]).abs().max())
    assert gap <= 1e-6, gap


def _scenario(two_ranks: tuple[Launch, DaemonProcess], name: str) -> Path:
    """The directory of scenario ``name``'s reports (``out.<rank>``), once it ran on both ranks."""
    return two_ranks[0].check(name).parent


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_two_ranks_against_one_daemon_equal_one_process_with_clipping_overflow_and_schedule(two_ranks, tier):
    tmp = _scenario(two_ranks, tier)
    check_equal(tmp, 2, skipped=1, base="out")
    # each rank's shard, and the full AdamW-format dict, loaded into a new job: the same state, bit for bit
    ranks = results(tmp, 2, "out")
    assert all(r["reload_exact"] == [True, True] for r in ranks), ranks
    # the step's collectives, each bounded by collective_timeout_s: one reduce-scatter and one all-gather a
    # bucket, one all-reduce of the statistics
    for r in ranks:
        assert r["collectives"] == {"reduce-scatter": r["buckets"], "all-reduce": 1, "all-gather": r["buckets"]}, r
    log = two_ranks[1].log_text()
    for r in range(2):
        assert _attached(log, ranks[0]["job_id"], r, 2), log[-2000:]
    # ShardedGradScaler unscales the grads in place, the same on every rank: not an edit to warn of
    assert not [w for r in ranks for w in r["warnings"] if "changed in place" in w], ranks


def test_torchs_clip_of_the_local_grads_is_told_once_per_rank_naming_max_grad_norm(two_ranks):
    """``torch.nn.utils.clip_grad_norm_`` after ``unscale_``, as HF Trainer, accelerate and Lightning clip: the
    grads are each rank's own, so each is clipped by its own norm, and the step averages them (not DDP's clip
    of the mean).  Before, silently; now each rank warns once, naming the way that clips the mean."""
    ranks = results(_scenario(two_ranks, "torch_clip"), 2, "out")
    for r in ranks:
        told = [w for w in r["warnings"] if "changed in place" in w]
        assert len(told) == 1, r["warnings"]
        assert "clip_grad_norm_" in told[0] and "max_grad_norm=" in told[0] and "HF Trainer" in told[0], told


def test_under_ddp_torchs_clip_is_of_the_mean_and_trains_like_adamw_without_a_warning(two_ranks):
    """The model wrapped in DDP, as HF Trainer wraps it at two ranks: DDP writes the mean of the ranks' grads
    into ``p.grad`` as backward ends, so ``clip_grad_norm_`` after it is the global clip (AdamW with the same
    clip on the global batch, within the usual ulps), and the step does not warn of it."""
    tmp = _scenario(two_ranks, "ddp_torch_clip")
    check_equal(tmp, 2, base="out")
    assert not [w for r in results(tmp, 2, "out") for w in r["warnings"] if "changed in place" in w]


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "accumulated"])
def test_overlapped_reduce_scatter_equals_one_process(two_ranks, no_sync):
    """overlap_comm: buckets reduced during backward; two micro-batches a step, the first inside no_sync()
    (reduced once) or not (reduced per backward, found changed at step() and reduced again, with a warning)."""
    tmp = _scenario(two_ranks, "no_sync" if no_sync else "accumulated")
    check_equal(tmp, 2, skipped=1, base="out")
    warnings = [w for r in results(tmp, 2, "out") for w in r["warnings"]]
    told = [w for w in warnings if "no_sync()" in w]
    assert (told == []) if no_sync else (len(told) == 2), warnings  # once per rank


def test_the_delayed_update_follows_the_one_step_late_rule(two_ranks):
    """delayed_update=True after two synchronous steps, clipped, scheduled, with overlap_comm: each step's
    all-gather brings the update before it, as the rule does in one process (an fp32 master copy with AdamW,
    installed into the model one step late); flush() brings the last one on every rank, and the shard and the
    full dict reload bit for bit."""
    tmp = _scenario(two_ranks, "delayed")
    check_equal(tmp, 2, base="out")
    ranks = results(tmp, 2, "out")
    assert all(r["warnings"] == [] and r["reload_exact"] == [True, True] for r in ranks), ranks


@pytest.mark.parametrize("dtype", list(COMPRESSED_GAP))
def test_compressed_moments_keep_the_ranks_equal_reload_bitwise_and_stay_near_adamw(two_ranks, dtype):
    """state_dtype bf16 / int8 at two ranks: every rank ends with the same params (the all-gather's), the shard
    and the full dict reload into a new job bit for bit, and the params stay within the dtype's gap of fp32
    AdamW on the global batch (the moments are rounded at every step, so the gap is theirs, not the ulps')."""
    ranks = results(_scenario(two_ranks, dtype), 2, "out")
    first = ranks[0]
    assert "param_diff" in first, ranks
    assert first["moved"] > 1e-2, "training did not move the params"
    assert len({r["params_sha256"] for r in ranks}) == 1, ranks
    assert all(r["reload_exact"] == [True, True] for r in ranks), ranks
    assert first["step_equal"] and first["same_params_with_state"], first
    assert first["param_diff"] <= COMPRESSED_GAP[dtype], first
    print(f"\nzero2, {dtype} moments: params within {first['param_diff']:.1e} of AdamW")


def test_four_ranks_equal_one_process(daemon_factory, tmp_path):
    d = daemon_factory(LONG_GRACE)
    args = ["--steps", "5", "--clip", "0.05", "--scaler", "--inf-step", "3"]
    assert finish(tmp_path, torchrun(tmp_path, 4, args, socket_path=d.socket_path)) == [0], logs(tmp_path)
    check_equal(tmp_path, 4, skipped=1)


def test_two_nodes_of_two_ranks_each_talk_to_their_own_daemon(daemon_factory, tmp_path):
    daemons = [daemon_factory(LONG_GRACE) for _ in range(2)]
    port = _free_port()
    args = ["--steps", "5", "--clip", "0.05"]
    procs = [
        torchrun(tmp_path, 2, args, socket_path=d.socket_path, nnodes=2, node_rank=k, port=port)
        for k, d in enumerate(daemons)
    ]
    assert finish(tmp_path, *procs) == [0, 0], logs(tmp_path)
    check_equal(tmp_path, 4)
    job = results(tmp_path, 4)[0]["job_id"]
    for k, d in enumerate(daemons):
        log = d.log_text()
        mine = {2 * k, 2 * k + 1}
        for r in range(4):
            assert _attached(log, job, r, 4) == (r in mine), f"daemon {k}, rank {r}:\n{log[-2000:]}"


def test_an_attach_refused_on_one_node_fails_every_rank_at_the_start_and_none_hangs(daemon_factory, tmp_path):
    """The inner optimizers attach on every rank or on none: node 1's daemon already holds the job under another
    token, so rank 1's attach is refused; rank 0 attached on its own node, and must fail too (not go on into a
    step the other rank never takes), naming rank 1, and detach leaving the job's state for a relaunch."""
    import torch

    from tiermem.client.link import connect
    from tiermem.client.offload.optimizer import OffloadAdam

    daemons = [daemon_factory(LONG_GRACE) for _ in range(2)]
    squatter = OffloadAdam(
        [torch.nn.Parameter(torch.zeros(4))],
        client=connect(daemons[1].socket_path),
        job_id="refused",
        token="another run's token, not this one's: " + "0" * 32,
        create_job=True,
    )
    squatter.close(keep_state=True)
    port = _free_port()
    args = ["--steps", "2", "--job-id", "refused"]
    procs = [
        torchrun(tmp_path, 1, args, socket_path=d.socket_path, nnodes=2, node_rank=k, port=port, run_id="refused")
        for k, d in enumerate(daemons)
    ]
    codes = finish(tmp_path, *procs, timeout_s=120)  # a hang would time out here
    assert codes[0] != 0 and codes[1] != 0, logs(tmp_path)  # torchrun's code for a rank that returned 4
    first, second = results(tmp_path, 2)
    assert second["error"] == "AuthError", second
    assert first["error"] == "InvalidState" and "the attach failed on rank 1" in first["message"], first
    assert _attached(daemons[0].log_text(), "refused", 0, 2), daemons[0].log_text()[-2000:]


def test_without_a_node_daemon_the_ranks_of_a_node_share_one_private_daemon(tmp_path):
    """...and the rank that started it, closing first, stops it only once the other rank has closed."""
    args = ["--steps", "4", "--late-close", "1.5"]
    assert finish(tmp_path, torchrun(tmp_path, 2, args, socket_path=None)) == [0], logs(tmp_path)
    check_equal(tmp_path, 2)
    sockets = {r["socket"] for r in results(tmp_path, 2)}
    assert len(sockets) == 1, sockets
    closes = [json.loads((tmp_path / f"result.{r}.close").read_text()) for r in range(2)]
    assert closes[1]["warnings"] == [], closes  # its detach reached the daemon
    assert closes[0]["close_s"] >= 1.0, closes  # the owner waited for it


def test_a_rank_killed_mid_step_fails_the_others_with_rank_lost_and_a_relaunch_continues(daemon_factory, tmp_path):
    d = daemon_factory(LONG_GRACE)
    ident = ["--job-id", "zero2-kill"]  # as torchrun's run id: the relaunch derives the same token
    t0 = time.monotonic()
    proc = torchrun(tmp_path, 2, ["--steps", "6", "--kill-step", "3", *ident], socket_path=d.socket_path)
    finish(tmp_path, proc)
    ended = time.monotonic() - t0
    survivor = results(tmp_path, 2)[0]
    assert survivor.get("error") == "RankLost", (survivor, logs(tmp_path))
    assert survivor["during"].startswith("reduce-scatter of bucket ") and "state is at step 3" in survivor["message"]
    assert "limit 30 s" in survivor["during"], survivor  # collective_timeout_s, not the group's 30 minutes
    print(f"\nkilled rank: the other got RankLost ({survivor['during']}); torchrun ended after {ended:.1f} s")
    for path in tmp_path.glob("result.*"):
        path.unlink()
    proc = torchrun(tmp_path, 2, ["--steps", "6", *ident], socket_path=d.socket_path)
    assert finish(tmp_path, proc) == [0], logs(tmp_path)
    first = check_equal(tmp_path, 2)
    assert first["started_at"] == 3

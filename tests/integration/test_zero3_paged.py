"""ZeRO-3 with param paging over ``torchrun`` ranks against one daemon: ``ShardedPagedAdam``.

``zero3_paged_worker.py`` trains a small MLP (odd sizes: padded shards) on two
and three ranks, each param sharded across them, each shard only in its rank's daemon,
with two param groups (no weight decay and half the learning rate on the
biases), clipped by the global norm under a StepLR schedule.  Checked: the gathered
``model.state_dict()`` equals ``torch.optim.AdamW`` + ``clip_grad_norm_`` on
the whole batch in one process (fp32; the reduce-scatter sums the ranks' parts
of the batch, so a few ulps), the global norms equal ``clip_grad_norm_``'s, no rank's modules hold
param data between steps, the pager stayed within its budget, and clipping
after gradient accumulation is refused on every rank.  A rank killed mid-step
fails the others with ``RankLost`` (raised by a collective of the pager's I/O
thread) instead of hanging.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import start_daemon
from launch import Launch

WORKER = str(Path(__file__).with_name("zero3_paged_worker.py"))
DAEMON = {"jobs": {"grace_period_s": 60.0, "max_jobs": 16}}


def _torchrun(daemon_factory, tmp_path: Path, ranks: int, *extra: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    d = daemon_factory(DAEMON)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
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
}
THREE_RANKS = {"nvme-3": ["--offload", "nvme"]}


def _launch(tmp_path_factory: pytest.TempPathFactory, nproc: int, plan: dict[str, list[str]]) -> Iterator[Launch]:
    tmp = tmp_path_factory.mktemp(f"zero3-paged-{nproc}")
    d = start_daemon(tmp / "tiermemd", DAEMON)
    try:
        yield Launch(WORKER, nproc, plan, tmp, d.socket_path).run()
    finally:
        d.cleanup()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    yield from _launch(tmp_path_factory, 2, TWO_RANKS)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    yield from _launch(tmp_path_factory, 3, THREE_RANKS)


@pytest.mark.parametrize("name", ["cpu-2", "nvme-2", "nvme-3", "nvme-2-checkpoint-resumed"])
def test_sharded_paged_params_train_like_adamw_with_a_global_clip(request, name):
    """``-checkpoint-resumed``: before step 3 every rank checkpoints, and a new model and optimizer load it."""
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
        assert "accumulated" in r["error"], r["error"]
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

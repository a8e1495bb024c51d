"""ZeRO's four-layer scalar example as ZeRO-3 by layer over four ``torchrun`` ranks against one daemon.

``zero3_worker.py`` trains it with ``LayerShardedAdam`` (rank m owns layer m)
and reports the reduced grads of the first step, the final params, the
placeholders the modules hold and every rank's event trace.  Checked: the
grads equal the example's analytic formulas on the global batch; the params
equal ``torch.optim.AdamW`` in one process (fp32, the same global mean: a
few ulps); each layer is gathered before its forward and released after; in
backward layer m is gathered again, its grads reduced to rank m and
released, and rank m's daemon gets layer m's update before layer m-1's
backward starts (from the second step on; the first step is synchronous).

A checkpoint saved by three of the ranks (a process group of their own) loads
on all four (``zero3_reshard_worker.py``, both ZeRO-3 optimizers; the saves
at two ranks are ``test_zero3_paged.py``'s).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zero3_reshard_worker as reshard
from conftest import start_daemon
from launch import Launch

WORKER = str(Path(__file__).with_name("zero3_worker.py"))
RESHARD = str(Path(__file__).with_name("zero3_reshard_worker.py"))
LAYERS = 4


def expected_trace(rank: int, overlapped: bool) -> list[list[object]]:
    forward: list[list[object]] = []
    for m in range(LAYERS):
        forward += [["gather", m], ["release", m]]
    backward: list[list[object]] = []
    for m in reversed(range(LAYERS)):
        backward += [["gather", m], ["reduce", m], ["release", m]]
        if overlapped and m == rank:
            backward.append(["update", m])
    return forward + backward + ([] if overlapped else [["update", rank]])


# every scenario of this module, in one launch of four ranks against one daemon (``scenarios.py``)
PLAN = {
    "schedule": ["--schedule"],
    "paged_nvme": ["--paged", "--offload", "nvme", "--micro", "2", "--schedule"],
    "paged_clip": ["--paged", "--clip", "0.05"],
    "paged_clip_accumulated": ["--paged", "--clip", "0.05", "--micro", "2"],
    "paged_scaled": ["--paged", "--scaler", "sharded", "--inf-step", "1", "--clip", "0.05", "--steps", "5"],
    "checkpoint": ["--checkpoint", "non-reentrant"],
    "checkpoint_reentrant": ["--checkpoint", "reentrant"],
    "paged_checkpoint": ["--paged", "--checkpoint", "non-reentrant"],
}


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Launch, str]]:
    tmp = tmp_path_factory.mktemp("zero3-layers")
    d = start_daemon(tmp / "tiermemd", {"jobs": {"grace_period_s": 60.0, "max_jobs": 16}})
    try:
        done = Launch(WORKER, 4, {name: ["--steps", "4", *args] for name, args in PLAN.items()}, tmp, d.socket_path)
        saved = reshard.saved_in(done.out("reshard"))  # by ranks 0-2, then loaded by all four
        done.plan["reshard"] = ["--save", "--save-ranks", "3", "--load", str(saved)]
        done.workers["reshard"] = RESHARD
        yield done.run(), d.log_text()
    finally:
        d.cleanup()


def _result(launch: tuple[Launch, str], name: str) -> dict:
    done, log = launch
    out = done.check(name)
    refused = {int(p.name.rsplit(".", 1)[1]): p.read_text() for p in out.parent.glob("out.refused.*")}
    if refused:
        return {"refused": refused}
    return {**json.loads(out.read_text()), "log": log}


def test_four_layers_on_four_ranks_follow_the_example_step_by_step(launch):
    """With an LR schedule on both sides: the overlapped updates of a step run during its backward, so each
    owner must hand the scheduler's new rate to its daemon before then, not at step()."""
    result = _result(launch, "schedule")
    for ours, formula in zip(result["reduced"], result["analytic"], strict=True):
        assert abs(ours - formula) <= 1e-6 * max(1.0, abs(formula)), (result["reduced"], result["analytic"])
    diff = max(abs(a - b) for a, b in zip(result["final"], result["reference"], strict=True))
    assert diff <= 1e-6, (result["final"], result["reference"])
    assert max(abs(a - b) for a, b in zip(result["final"], [0.6, 0.1, 0.7, 0.2], strict=False)) > 1e-3
    for r in result["ranks"]:
        assert r["held"] == [0] * (2 * LAYERS), f"rank {r['rank']} holds param data between steps: {r['held']}"
        assert r["saved"] == r["final"] == result["final"], f"rank {r['rank']}'s model.state_dict(): {r['saved']}"
        loaded = [a - b for a, b in zip(r["loaded"], r["final"], strict=True)]  # the fp32 sums
        assert all(abs(d - 1.0) <= 1e-6 for d in loaded), f"rank {r['rank']} after load_state_dict: {r['loaded']}"
        traces = r["traces"]
        assert traces[0] == expected_trace(r["rank"], overlapped=False), traces[0]
        for step, trace in enumerate(traces[1:], start=1):
            assert trace == expected_trace(r["rank"], overlapped=True), f"rank {r['rank']} step {step}: {trace}"
    log = result["log"]
    for r in range(LAYERS):
        assert f" rank {r}/4 " in log, log[-2000:]
    print(f"\nzero3 by layer: params within {diff:.1e} of AdamW; grads = the analytic formulas")


@pytest.mark.parametrize("name", ["checkpoint", "checkpoint_reentrant", "paged_checkpoint"])
def test_activation_checkpointing_recomputes_gathered_layers_and_trains_like_adamw(launch, name):
    """``torch.utils.checkpoint`` (either kind) runs a layer's forward again inside its backward: the layer
    must be there for it and stay for its backward, and nothing may be gathered ahead then, where a layer's
    update may be in flight.  That recompute used to find the layer gathered and fail (non-reentrant:
    ``cannot unpack non-iterable NoneType``) or gather the next layer's old values ahead and train 0.03
    off AdamW in 5 steps (reentrant), silently.  Now: AdamW's params, and each layer gathered, reduced and
    released once in each backward, as without checkpointing."""
    result = _result(launch, name)
    diff = max(abs(a - b) for a, b in zip(result["final"], result["reference"], strict=True))
    assert diff <= 1e-6, (result["final"], result["reference"])
    paged = name.startswith("paged")
    for r in result["ranks"]:
        assert r["held"] == [0] * (2 * LAYERS), f"rank {r['rank']} holds param data between steps: {r['held']}"
        for step, trace in enumerate(r["traces"]):
            expected = paged_trace(r["rank"], 1) if paged else expected_trace(r["rank"], overlapped=step > 0)
            assert trace == expected, f"rank {r['rank']} step {step}: {trace}"


def paged_trace(rank: int, micro: int) -> list[list[object]]:
    """Each backward pass reduces every layer to its owner; the owner's update runs at step()."""
    one: list[list[object]] = []
    for m in range(LAYERS):
        one += [["gather", m], ["release", m]]
    for m in reversed(range(LAYERS)):
        one += [["gather", m], ["reduce", m], ["release", m]]
    return one * micro + [["update", rank]]


def test_paged_layers_live_only_in_their_owners_nvme_tier_and_accumulate_there(launch):
    """ZeRO-Infinity's placement by layer: no rank holds a param or a grad between uses, the owner reads its
    layer from its daemon (NVMe tier; paging under pressure is test_param_paging's) before each broadcast
    and writes the reduced grads there, two backward
    passes a step accumulating in the daemon; the params still equal AdamW on the whole batch."""
    result = _result(launch, "paged_nvme")
    diff = max(abs(a - b) for a, b in zip(result["final"], result["reference"], strict=True))
    assert diff <= 1e-6, (result["final"], result["reference"])
    for r in result["ranks"]:
        assert r["held"] == [0] * (2 * LAYERS), f"rank {r['rank']}'s model holds param data: {r['held']}"
        assert r["saved"] == r["final"] == result["final"], f"rank {r['rank']}'s model.state_dict(): {r['saved']}"
        loaded = [a - b for a, b in zip(r["loaded"], r["final"], strict=True)]  # the fp32 sums
        assert all(abs(d - 1.0) <= 1e-6 for d in loaded), f"rank {r['rank']} after load_state_dict: {r['loaded']}"
        assert max(r["pieces"]) <= 4, f"rank {r['rank']} keeps a copy of its layer: {r['pieces']} bytes"
        assert r["nvme"]["placement"] == "nvme", f"rank {r['rank']}'s state is not on the NVMe tier: {r['nvme']}"
        for step, trace in enumerate(r["traces"]):
            assert trace == paged_trace(r["rank"], 2), f"rank {r['rank']} step {step}: {trace}"
    print(f"\nzero3 by layer, paged on NVMe, 2 micro-batches: params within {diff:.1e} of AdamW")


@pytest.mark.parametrize("name", ["paged_clip", "paged_clip_accumulated"])
def test_paged_layers_clip_by_the_global_norm_as_clip_grad_norm(launch, name):
    """max_grad_norm with paged=True: the owners' sums of squares all-reduced at step(), the coefficient
    applied by each owner's daemon; the clip is active at three of the four steps (norms 0.30, 0.15, 0.016,
    0.059 against 0.05).  ``_accumulated``: two backward passes a step, whose owners' figures are each
    pass's; the norm of their sum exists only in the daemons, where the passes' grads were added, and each
    owner asks its daemon for it (GRAD_NORM).  Before, that step was refused on every rank."""
    result = _result(launch, name)
    assert "refused" not in result, result
    for ours, ref in zip(result["norms"], result["ref_norms"], strict=True):
        assert abs(ours - ref) <= 1e-5 * ref, (result["norms"], result["ref_norms"])
    assert sum(ref > 0.05 for ref in result["ref_norms"]) >= 2, result["ref_norms"]
    diff = max(abs(a - b) for a, b in zip(result["final"], result["reference"], strict=True))
    assert diff <= 1e-6, (result["final"], result["reference"])
    print(f"\nzero3 by layer, {name}: norms equal clip_grad_norm_'s, params within {diff:.1e} of AdamW")


def test_paged_layers_under_a_sharded_scaler_skip_a_global_overflow_and_clip_unscaled(launch):
    """ShardedGradScaler over LayerShardedAdam(paged=True): the last rank's loss is inf at step 1, so its
    reduced grads overflow at every owner; all four ranks skip that step and back off the scale together,
    the other steps are unscaled and clipped in the daemons, as torch's GradScaler + clip_grad_norm_ + AdamW
    in one process."""
    result = _result(launch, "paged_scaled")
    assert result["skipped"] == result["ref_skipped"] == 1, result
    assert result["scale"] == result["ref_scale"] == 2.0**9, result
    pairs = [(ours, ref) for ours, ref in zip(result["norms"], result["ref_norms"], strict=True) if ours is not None]
    assert len(pairs) == 4, result["norms"]
    for ours, ref in pairs:
        assert abs(ours - ref) <= 1e-5 * ref, (result["norms"], result["ref_norms"])
    diff = max(abs(a - b) for a, b in zip(result["final"], result["reference"], strict=True))
    assert diff <= 1e-6, (result["final"], result["reference"])
    print(f"\nzero3 by layer, paged, scaled + clipped, one overflow skipped: params within {diff:.1e} of AdamW")


WAYS = [(k, h) for k in reshard.KINDS for h in ("shards", "full")] + [(k, "dcp") for k in reshard.DCP_KINDS]


@pytest.mark.parametrize(("kind", "how"), WAYS)
def test_a_checkpoint_saved_by_three_ranks_resumes_on_four_like_adamw(launch, kind, how):
    """``shards``: each of the four ranks takes its stretches from the three rank files (layer owners and
    param shards both move); ``full``: the gathered dicts; ``dcp``: ``torch.distributed.checkpoint``, each rank
    reading the elements it holds now (ZeRO-2 too).  Then two more steps, as AdamW on the whole batch."""
    done, _ = launch
    result = json.loads(done.check("reshard").read_text())[f"{kind}-{how}"]
    expected, _ = reshard.reference(kind, reshard.SAVED_AT + reshard.MORE)
    assert sorted(result) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(torch.tensor(result[key]), value, msg=lambda m, key=key: f"{key}: {m}")

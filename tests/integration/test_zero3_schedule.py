"""The ZeRO-3 optimizers' collectives come from one schedule that no timing can reorder.

``zero3_schedule_worker.py`` trains a small MLP at two and three ranks (gloo)
with random delays injected through the optimizers' ``probe`` into the
pager's I/O thread, the grad hooks, the fetches and the collectives (each
rank its own delays): ``ShardedPagedAdam`` at prefetch 0, 1, 2 and 4, with
budgets of one submodule's params, three and the whole model, and
``LayerShardedAdam`` (overlapped and paged), several seeds.  Every run must
finish (a collective that waits past its limit is ``RankLost``, which fails
the run, not the launch) and train like ``torch.optim.AdamW`` on the global
batch.  The same runs count the collectives of each step: one all-gather per
fetch of a submodule, one reduce-scatter per submodule's grads.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import start_daemon
from launch import Launch

WORKER = str(Path(__file__).with_name("zero3_schedule_worker.py"))
DAEMON = {"jobs": {"grace_period_s": 60.0, "max_jobs": 16}}
TIMEOUT_S = 10.0
"""Each collective's limit: a run whose ranks disagree fails within it instead of hanging."""


def paged_runs(seed: int) -> list[dict[str, Any]]:
    grid = itertools.product((0, 1, 2, 4), ("one", "three", "whole"))
    return [{"kind": "paged", "prefetch": p, "budget": b, "seed": seed + i} for i, (p, b) in enumerate(grid)]


def layer_runs(seed: int) -> list[dict[str, Any]]:
    kinds = ("layers", "layers-paged")
    return [{"kind": k, "prefetch": 0, "budget": "", "seed": seed + i} for i, k in enumerate(kinds)]


RUNS = {2: paged_runs(1) + paged_runs(21) + layer_runs(101) + layer_runs(111), 3: paged_runs(201) + layer_runs(301)}


def _launch(tmp_path_factory: pytest.TempPathFactory, nproc: int) -> Iterator[Launch]:
    tmp = tmp_path_factory.mktemp(f"zero3-schedule-{nproc}")
    d = start_daemon(tmp / "tiermemd", DAEMON)
    plan = {"fuzz": ["--runs", json.dumps(RUNS[nproc]), "--timeout-s", str(TIMEOUT_S)]}
    try:
        yield Launch(WORKER, nproc, plan, tmp, d.socket_path).run()
    finally:
        d.cleanup()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    yield from _launch(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    yield from _launch(tmp_path_factory, 3)


def _runs(launch: Launch) -> list[dict[str, Any]]:
    return json.loads(launch.check("fuzz").read_text())


def _name(run: dict[str, Any]) -> str:
    return f"{run['kind']} prefetch={run['prefetch']} budget={run['budget']} seed={run['seed']}"


@pytest.mark.parametrize("ranks", [2, 3])
def test_fuzzed_timing_never_reorders_the_collectives(request: pytest.FixtureRequest, ranks: int) -> None:
    runs = _runs(request.getfixturevalue({2: "two_ranks", 3: "three_ranks"}[ranks]))
    assert len(runs) == len(RUNS[ranks])
    failed = [f"{_name(r)}: {e['error']}" for r in runs for e in r["ranks"] if e["error"]]
    assert not failed, f"{len(failed)} rank-runs of {len(runs) * ranks} failed:\n" + "\n".join(failed)
    worst = {_name(r): r["ranks"][0]["worst"] for r in runs}
    assert max(worst.values()) <= 1e-5, worst
    assert all(e["points"] > 0 for r in runs for e in r["ranks"]), "the probe was never called"
    slowest = max(runs, key=lambda r: r["seconds"])
    print(f"\n{len(runs)} fuzzed runs at {ranks} ranks, within {max(worst.values()):.1e} of AdamW; "
          f"slowest {slowest['seconds']:.1f} s ({_name(slowest)})")  # fmt: skip


UNITS = 5
"""Submodules of the worker's model that own params: four ``Linear`` and a ``LayerNorm``."""


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_zero3_step_issues_one_collective_per_submodule_each_way(request: pytest.FixtureRequest, ranks: int) -> None:
    """Paged: one reduce-scatter per submodule's grads; one all-gather per submodule fetched in forward, and
    per submodule backward needs again (all but the first Linear, whose input takes no grad), fewer where
    prefetch keeps the last ones on the device from forward to backward.  By layer: a broadcast per layer
    each way, a reduce per layer."""
    runs = _runs(request.getfixturevalue({2: "two_ranks", 3: "three_ranks"}[ranks]))
    for run in runs:
        for step, counts in enumerate(run["ranks"][0]["counts"]):
            if run["kind"] != "paged":
                assert counts == {"broadcast": 2 * UNITS, "reduce": UNITS}, (_name(run), step, counts)
                continue
            assert counts["reduce-scatter"] == UNITS, (_name(run), step, counts)
            gathers = counts["all-gather"]
            if step == 0 or run["prefetch"] == 0:  # the first step records its uses: nothing is kept ahead
                assert gathers == 2 * UNITS - 1, (_name(run), step, counts)
            assert UNITS <= gathers <= 2 * UNITS - 1, (_name(run), step, counts)
            assert sorted(counts) == ["all-gather", "reduce-scatter"], counts
        assert all(r["counts"] == run["ranks"][0]["counts"] for r in run["ranks"]), _name(run)

"""Chaos, quick versions: trainers SIGKILLed at random points, and the daemon killed and restarted.

Each scenario prints its figures and must leave the daemon's ledger flat
(pool and swap bytes, fds, threads, RSS within a slack, files).  The long
versions run in ``benchmarks/soak.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from hostile import ChaosDaemon
from kills import client_kills, daemon_kill, run_survivor
from ledger import problems, settle, snapshot

pytestmark = pytest.mark.timeout(900)

QUICK_KILLS = 24  # about 0.5 s each; the slow variant kills 200, benchmarks/soak.py hundreds more
GRACE_S = 3.0
COMMIT_EVERY = 4

OVERRIDES = {
    "jobs": {"grace_period_s": GRACE_S, "max_jobs": 64, "max_jobs_per_uid": 64, "window_size": "64KiB"},
    "swap": {"fsync": False, "threads": 1},  # the thread engine's one worker starts with the warm-up job
}


@pytest.fixture
def kill_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosDaemon]:
    overrides = {k: dict(v) for k, v in OVERRIDES.items()}
    overrides["jobs"]["commit_every"] = COMMIT_EVERY
    daemon = ChaosDaemon(tmp_path_factory.mktemp("kills"), overrides=overrides).start()
    try:
        yield daemon
        assert daemon.stop() == 0, daemon.log_text()[-3000:]
    finally:
        daemon.cleanup()


def steady(take, wait_s: float = 1.0, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
    """A snapshot once two taken ``wait_s`` apart agree (the warm-up's connection is gone)."""
    deadline = time.monotonic() + timeout_s
    prev = take()
    while True:
        time.sleep(wait_s)
        now = take()
        if not problems(prev, now) or time.monotonic() > deadline:
            return now
        prev = now


def _flat(daemon: ChaosDaemon, capsys: pytest.CaptureFixture[str], name: str, run) -> dict:  # type: ignore[no-untyped-def]
    # one NVMe job first: the swap engine's workers start with the first one and stay (not a leak)
    run_survivor(daemon.socket_path, "warm-up", 0, 2)
    take = lambda: snapshot(daemon.pid, daemon.socket_path, daemon.watched)  # noqa: E731
    before = steady(take)
    figures = run()
    after = settle(take, before, timeout_s=30.0 + 4 * GRACE_S)
    figures["ledger_before"], figures["ledger_after"] = before.figures(), after.figures()
    with capsys.disabled():
        print(f"\nchaos {name}: {json.dumps(figures)}")
    assert not grown(before, after), grown(before, after)
    return figures


def grown(before, after) -> list[str]:  # type: ignore[no-untyped-def]
    """What the scenario left behind: fewer fds or threads than at the start is not a leak (one opened
    lazily by the warm-up closed again), anything else that differs is."""
    return [
        p
        for p in problems(before, after)
        if not (
            p.startswith(("fds:", "threads:")) and getattr(after, p.split(":")[0]) < getattr(before, p.split(":")[0])
        )
    ]


@pytest.mark.parametrize("kills", [QUICK_KILLS, pytest.param(200, marks=pytest.mark.slow)])
def test_trainers_killed_at_random_points_leave_nothing_and_survivors_train_exactly(kill_daemon, capsys, kills):
    figures = _flat(kill_daemon, capsys, "client kills", lambda: client_kills(kill_daemon, kills, seed=1))
    assert figures["victim_errors"] == 0
    assert figures["killed"] + figures["finished_before_kill"] == kills
    assert figures["killed"] >= kills // 2
    assert figures["survivors_equal_to_uninterrupted"] == figures["survivors"] == 2
    assert kill_daemon.alive()


def test_a_killed_daemon_fails_its_clients_at_once_and_the_next_one_serves_the_last_commit(kill_daemon, capsys):
    figures = daemon_kill(kill_daemon, commit_every=COMMIT_EVERY, steps_before=2 * COMMIT_EVERY + 2, steps_after=5)
    take = lambda: snapshot(kill_daemon.pid, kill_daemon.socket_path, kill_daemon.watched)  # noqa: E731
    with capsys.disabled():
        print(f"\nchaos daemon kill: {json.dumps(figures)}")
    # DaemonGone: the DaemonUnavailable that names the daemon that went away (a node daemon here)
    assert figures["client_error"] in ("DaemonGone", "DaemonUnavailable", "DaemonTimeout", "ConnectionClosed")
    assert figures["loss_reported_at_start"]
    assert figures["came_back_at_step"] == 2 * COMMIT_EVERY and figures["steps_lost"] == 2
    assert figures["refused_without_rollback"] == [2 * COMMIT_EVERY, 2 * COMMIT_EVERY + 2]
    assert figures["equal_to_uninterrupted"]
    after = settle(take, take(), timeout_s=2.0)
    assert after.pool_used_nbytes == 0 and after.swap_used_nbytes == 0

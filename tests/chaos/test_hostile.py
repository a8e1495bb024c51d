"""Chaos, quick versions: hostile frames, slow partial frames, connection storms, a stopped daemon.

One daemon serves the scenarios in turn; each prints its figures and must
leave the daemon's ledger flat (pool and swap bytes, fds, threads, RSS within
a slack, files).  The long versions run in the soak with more of everything.
Storms from another uid need root (to run a process as that uid).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostile import (
    ALLOWED_UID,
    REFUSED_UID,
    ChaosDaemon,
    connection_storm,
    hostile_frames,
    running_daemon,
    slow_frames,
    stopped_daemon,
    unread_replies,
)
from ledger import problems, settle, snapshot

QUICK_FRAMES = 10_000


@pytest.fixture(scope="module")
def chaos_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosDaemon]:
    with running_daemon(tmp_path_factory.mktemp("chaos")) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def control_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosDaemon]:
    """A second daemon, the storms' control target (``connection_storm``)."""
    with running_daemon(tmp_path_factory.mktemp("control")) as daemon:
        yield daemon


def _scenario(daemon: ChaosDaemon, capsys: pytest.CaptureFixture[str], name: str, run) -> dict:  # type: ignore[no-untyped-def]
    take = lambda: snapshot(daemon.pid, daemon.socket_path, daemon.watched)  # noqa: E731
    before = settle(take, take(), timeout_s=2.0)
    figures = run()
    after = settle(take, before)
    with capsys.disabled():
        print(f"\nchaos {name}: {json.dumps(figures)}")
        print(f"chaos {name} ledger: before {before.figures()} after {after.figures()}")
    assert not problems(before, after), problems(before, after)
    return figures


def test_hostile_frames_are_answered_and_leave_nothing_behind(chaos_daemon, capsys):
    figures = _scenario(chaos_daemon, capsys, "hostile frames", lambda: hostile_frames(chaos_daemon, QUICK_FRAMES))
    assert figures["answered"] + figures["one_way"] + figures["closed_after"] == QUICK_FRAMES


def test_slow_partial_frames_do_not_stall_a_well_behaved_client(chaos_daemon, capsys):
    figures = _scenario(chaos_daemon, capsys, "slow frames", lambda: slow_frames(chaos_daemon, 3.0))
    assert figures["good_requests"] > 0 and figures["answered"] == figures["partial_frames"] > 0


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("running a storm as another uid needs root")


@pytest.mark.parametrize("uid", [ALLOWED_UID, REFUSED_UID], ids=["allowed uid", "refused uid"])
def test_a_connection_storm_does_not_refuse_or_starve_a_well_behaved_client(chaos_daemon, control_daemon, capsys, uid):
    _need_root()
    log_before = chaos_daemon.log_text().count("refused a connection")
    figures = _scenario(
        chaos_daemon,
        capsys,
        f"storm uid {uid}",
        lambda: connection_storm(chaos_daemon, 4.0, uid=uid, control=control_daemon),
    )
    assert figures["storm_connects"] > 1000
    logged = chaos_daemon.log_text().count("refused a connection") - log_before
    refused = figures["storm_connects"] - 64 if uid == ALLOWED_UID else figures["storm_connects"]
    # refusals are counted, not logged one line each: a first line per uid and reason, then a summary per 10 s
    assert logged <= 4, f"{logged} log lines for about {refused} refused connections"


def test_a_stopped_daemon_times_clients_out_instead_of_hanging_them(chaos_daemon, capsys):
    figures = _scenario(chaos_daemon, capsys, "SIGSTOP", lambda: stopped_daemon(chaos_daemon, timeout_s=1.5))
    assert figures["requests_after_sigcont"] > 0


def test_a_client_that_never_reads_its_replies_does_not_pin_a_session_thread(chaos_daemon, capsys):
    figures = _scenario(chaos_daemon, capsys, "unread replies", lambda: unread_replies(chaos_daemon))
    assert figures["requests_sent"] > figures["replies_read_after"] > 0


def test_the_scenarios_left_the_daemon_directory_as_they_found_it(chaos_daemon):
    assert Path(chaos_daemon.socket_dir).is_dir() and chaos_daemon.alive()

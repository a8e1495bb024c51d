from __future__ import annotations

import errno
import pickle

import pytest

from tiermem.core import errors
from tiermem.core.errors import (
    ConfigError,
    CorruptionError,
    PoolExhausted,
    SwapIOError,
    TiermemError,
    UnknownKey,
    error_from_wire,
)


def test_pool_exhausted_names_requested_free_and_largest_block() -> None:
    err = PoolExhausted(requested=3 << 30, free=2 << 30, largest_free=1 << 30)
    assert (err.requested, err.free, err.largest_free) == (3 << 30, 2 << 30, 1 << 30)
    assert "requested 3GiB" in str(err) and "free 2GiB" in str(err) and "largest free block 1GiB" in str(err)


def test_swap_io_error_names_path_offset_and_errno() -> None:
    err = SwapIOError("/nvme0/swap.0", 8192, 4096, errno.EIO)
    assert "/nvme0/swap.0" in str(err) and "8192" in str(err) and "EIO" in str(err)
    short = SwapIOError("/x", 0, 4096, 0, "read 100 of 4096 bytes")
    assert "read 100 of 4096 bytes" in str(short)


def test_rank_lost_names_the_collective_the_step_and_a_forward_run_on_some_ranks_only() -> None:
    """A ZeRO-3 forward on rank 0 only (an evaluation under ``if rank == 0:``) pairs its gathers with the other
    ranks' training collectives; where their sizes agree, the ranks then wait out the limit on collectives no
    other rank runs.  The message must point there, not only at a dead rank."""
    err = errors.RankLost("all-gather of 0 (Linear) (the step's collective 5, limit 8 s)", 1, 2, RuntimeError("x"))
    text = str(err)
    assert text.startswith("rank 1: the all-gather of 0 (Linear) (the step's collective 5, limit 8 s) of step 3")
    assert "this rank's state is at step 2" in text
    assert "out of step" in text and "run on some ranks only (under `if rank == 0:`)" in text


def test_commit_deferred_names_the_manifest_the_errno_what_stands_and_the_fix() -> None:
    err = errors.CommitDeferred("/nvme0/swap/j.manifest", errno.ENOSPC, ["a", "b"], 7)
    assert err.keys == ["a", "b"] and err.errno == errno.ENOSPC
    for part in ("/nvme0/swap/j.manifest", "ENOSPC", "2 key(s)", "generation 7", "free space in /nvme0/swap"):
        assert part in str(err)


@pytest.mark.parametrize(
    "err",
    [
        ConfigError("pool.size", "must be >= 0, got -1"),
        PoolExhausted(10, 5, 4),
        SwapIOError("/x", 4096, 512, errno.ENOSPC),
        CorruptionError("layer0.exp_avg", "/swap/f0", 4096),
        UnknownKey("w", "job a"),
        errors.AuthError("uid 1000 is not allowed"),
        errors.UnsafePathError("/tmp/tiermem-1000", "is owned by uid 1001", owner_uid=1001, expected_uids={1000, 0}),
        errors.DaemonGone("/tmp/tiermemd-x/tiermemd.sock", "STEP", pid=1234, exit_code=-9, ended="killed by SIGKILL"),
        errors.InvalidType("lr must be a real number, got '0.1'"),
        errors.CommitDeferred("/swap/j.manifest", errno.ENOSPC, ["chunk0.state"], 4),
    ],
)
def test_errors_survive_the_wire_as_the_same_type(err: TiermemError) -> None:
    back = error_from_wire(pickle.loads(pickle.dumps(err.to_wire())))
    assert type(back) is type(err)
    assert str(back) == str(err)
    for name in type(err).fields:
        assert getattr(back, name) == getattr(err, name)


def test_unknown_wire_error_type_becomes_base_error_keeping_the_name() -> None:
    back = error_from_wire({"type": "FutureError", "message": "new kind", "fields": {}})
    assert type(back) is TiermemError
    assert "FutureError" in str(back)


def test_malformed_wire_error_still_becomes_an_error() -> None:
    back = error_from_wire({"type": "PoolExhausted", "fields": "nonsense"})
    assert isinstance(back, PoolExhausted)
    assert back.requested is None


def test_daemon_gone_of_a_private_daemon_names_pid_status_and_the_lost_state() -> None:
    err = errors.DaemonGone("/tmp/d/tiermemd.sock", "STEP", pid=1234, exit_code=-9, ended="killed by SIGKILL")
    assert isinstance(err, errors.DaemonUnavailable)
    assert (err.path, err.during, err.pid, err.exit_code) == ("/tmp/d/tiermemd.sock", "STEP", 1234, -9)
    assert str(err).startswith("the private tiermemd (pid 1234, killed by SIGKILL) is gone, and with it the optimizer")
    assert "neither outlives it" in str(err) and "load the last checkpoint" in str(err)
    failed = errors.DaemonGone("/tmp/d/tiermemd.sock", "STEP", pid=7, exit_code=3, log_tail="swap directory unusable\n")
    assert "(pid 7, exit code 3)" in str(failed) and str(failed).endswith("Its log ends: swap directory unusable")
    alive = errors.DaemonGone("/tmp/d/tiermemd.sock", "STATS", pid=7, log_path="/tmp/d/tiermemd.log")
    assert "(pid 7, still running) closed the connection during STATS" in str(alive) and "/tmp/d/tiermemd.log" in str(
        alive
    )


def test_daemon_gone_of_a_node_daemon_names_its_socket_and_what_survives() -> None:
    err = errors.DaemonGone("/run/tiermem/tiermemd.sock", "STEP")
    assert str(err).startswith("the node daemon at /run/tiermem/tiermemd.sock closed the connection during STEP")
    assert "jobs.grace_period_s" in str(err) and "opt.token" in str(err)

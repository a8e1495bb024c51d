"""Failures a user or client causes get messages that say what was wrong (issue: the unclear ones)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cgroup_scratch import own_v1_cgroup, scratch_cgroup
from child_env import child_env
from conftest import daemon_settings, run_daemon_to_exit
from daemon_client import LR, WEIGHT_DECAY, Trainer, adamw_reference, grads_for

from tiermem.client.connection import Connection
from tiermem.core.errors import AuthError, BoundsError, InvalidArgument, InvalidState, TiermemError
from tiermem.core.protocol import (
    Attach,
    AttachOk,
    BucketReady,
    Detach,
    GradNorm,
    GradNormReply,
    MemRef,
    ParamGroup,
    Ping,
    Pong,
    StateRead,
    Step,
)
from tiermemd.main import to_toml


def test_a_socket_path_under_a_file_exits_5_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    (tmp_path / "plain-file").write_text("")
    done = run_daemon_to_exit(tmp_path, str(tmp_path / "plain-file" / "tiermemd.sock"))
    assert done.returncode == 5, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "plain-file" in errors[0] and "Not a directory" in errors[0], done.stderr


def test_an_overlong_socket_path_names_its_length_and_the_limit(tmp_path: Path) -> None:
    path = str(tmp_path / ("d" * 120) / "tiermemd.sock")
    done = run_daemon_to_exit(tmp_path, path)
    assert done.returncode == 2, done.stderr  # a setting that cannot work: a configuration error, not restarted
    assert f"{len(path)} bytes long" in done.stderr and "limited to 107 bytes" in done.stderr
    assert ": None" not in done.stderr and "Traceback" not in done.stderr


def test_a_non_ascii_token_is_refused_as_an_auth_error_and_the_session_goes_on(daemon) -> None:
    with Connection.open(daemon.socket_path, timeout_s=30) as owner:
        reply, fds = owner.request_fds(Attach(job_id="non-ascii", rank=0, world_size=1, window_nbytes=4096))
        for fd in fds:
            os.close(fd)
        assert isinstance(reply, AttachOk)
        try:
            with Connection.open(daemon.socket_path, timeout_s=30) as guest:
                with pytest.raises(AuthError, match="needs its token"):
                    guest.request(
                        Attach(job_id="non-ascii", rank=0, world_size=1, window_nbytes=4096, token="t\u00f6ken-\u2603")
                    )
                assert guest.request(Ping()) == Pong()  # not an internal error: the session is still there
        finally:
            owner.request(Detach(keep_state=False))


def test_failed_token_guesses_are_logged_once_then_counted(daemon) -> None:
    job = "guessed"

    def logged() -> list[str]:
        return [line for line in daemon.log_text().splitlines() if "wrong job token" in line]

    before = len(logged())
    with Connection.open(daemon.socket_path, timeout_s=30) as owner:
        _, fds = owner.request_fds(Attach(job_id=job, rank=0, world_size=1, window_nbytes=4096))
        for fd in fds:
            os.close(fd)
        try:
            with Connection.open(daemon.socket_path, timeout_s=30) as guest:
                for i in range(40):
                    with pytest.raises(AuthError):
                        guest.request(Attach(job_id=job, rank=0, world_size=1, window_nbytes=4096, token=f"{i:032x}"))
        finally:
            owner.request(Detach(keep_state=False))
    time.sleep(0.2)
    lines = logged()
    # the first guess of this uid is logged with its pid and uid; the others go into a periodic count
    assert lines and len(lines) - before <= 1, lines


def test_an_oversized_state_read_says_it_is_too_large_and_names_the_limit(daemon) -> None:
    trainer = Trainer(daemon.socket_path, "oversized-read", [20000, 24], seed=3)  # tensor 0 > the window
    trainer.start_fresh()
    try:
        window = trainer.window.nbytes
        with pytest.raises(BoundsError, match=rf"too large: this rank's staging window holds {window} bytes"):
            trainer.conn.request(StateRead(0, "exp_avg", 0, MemRef(trainer.window_id, 0, window + 4)))
        with pytest.raises(BoundsError, match=r"too large for tensor 1 exp_avg: it holds 96 bytes"):
            trainer.conn.request(StateRead(1, "exp_avg", 0, MemRef(trainer.window_id, 0, 100)))
        with pytest.raises(TiermemError, match=r"length 99 is not 4-byte aligned"):  # a part of an element
            trainer.conn.request(StateRead(1, "exp_avg", 0, MemRef(trainer.window_id, 0, 99)))
    finally:
        trainer.detach()


def test_the_ready_status_names_the_socket_the_service_manager_passed(tmp_path: Path) -> None:
    from conftest import NotifyRecorder

    sock_dir = tmp_path / "activation"
    sock_dir.mkdir(mode=0o700)
    path = str(sock_dir / "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    configured = str(tmp_path / "configured" / "tiermemd.sock")
    config = tmp_path / "tiermemd.toml"
    config.write_text(to_toml(daemon_settings(tmp_path, configured, None)))
    notify = NotifyRecorder(str(tmp_path / "notify"))
    env = child_env("NOTIFY_SOCKET", "LISTEN_")
    env.update({"NOTIFY_SOCKET": notify.path, "LISTEN_FDS": "1"})
    env["ACTIVATION_FD"] = str(listener.fileno())
    script = (
        "import os; os.dup2(int(os.environ.pop('ACTIVATION_FD')), 3); os.environ['LISTEN_PID'] = str(os.getpid()); "
        "from tiermemd.main import main; main()"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script, "--config", str(config)],
        env=env,
        pass_fds=(listener.fileno(),),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _, ready = notify.wait_for("READY", 60.0)
        assert path in ready["STATUS"] and "passed by the service manager" in ready["STATUS"]
        assert configured not in ready["STATUS"]
        with Connection.open(path, timeout_s=30) as conn:
            assert conn.request(Ping()) == Pong()
    finally:
        process.terminate()
        process.wait(60)
        notify.close()
        listener.close()


def test_a_pool_larger_than_the_node_exits_3_naming_the_numbers(tmp_path: Path) -> None:
    done = run_daemon_to_exit(tmp_path, str(tmp_path / "s" / "tiermemd.sock"), {"pool": {"size": "64TiB"}})
    assert done.returncode == 3, done.stderr
    assert "pool.size 64TiB" in done.stderr and "MemAvailable" in done.stderr and "Traceback" not in done.stderr


def test_a_pool_larger_than_its_memory_cgroup_exits_3_instead_of_being_oom_killed(tmp_path: Path) -> None:
    parent = own_v1_cgroup("memory")
    if parent is None:
        pytest.skip("no writable cgroup v1 memory controller here")
    with scratch_cgroup(parent, {"memory.limit_in_bytes": str(512 << 20)}) as cgroup:
        procs = str(cgroup / "cgroup.procs")

        def enter_cgroup() -> None:
            Path(procs).write_text(str(os.getpid()))

        done = run_daemon_to_exit(
            tmp_path,
            str(tmp_path / "s" / "tiermemd.sock"),
            {"pool": {"size": "1GiB", "arena_size": "256MiB"}},
            preexec_fn=enter_cgroup,  # the daemon must start inside the cgroup
        )
        assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
        assert str(cgroup) in done.stderr and "limit 512MiB" in done.stderr and "pool.size 1GiB" in done.stderr


def test_grad_norm_gives_the_figures_a_clipped_step_takes_changes_nothing_and_names_bad_input(daemon) -> None:
    """GRAD_NORM: the sum of squares of the rank's grads (divided by ``loss_scale``) that a STEP with
    ``max_grad_norm`` takes of the same grads, and whether one is inf/NaN, with nothing changed: the STEP
    after it applies step 1 as AdamW does.  An unknown tensor and a grad buffer the rank does not have are
    refused by name."""
    sizes = [300, 40]
    trainer = Trainer(daemon.socket_path, "grad-norm", sizes, seed=5)
    trainer.start_fresh()
    try:
        grads = grads_for(5, 1, sizes)
        for g, slot in zip(grads, trainer.slots, strict=True):
            trainer.region(slot.grads[0])[:] = g
        sq = [float((g.astype(np.float64) ** 2).sum()) for g in grads]
        whole = trainer.conn.request(GradNorm(loss_scale=2.0))
        assert isinstance(whole, GradNormReply) and not whole.nonfinite
        assert whole.sq_norm == pytest.approx(sum(sq) / 4, rel=1e-6)
        assert trainer.conn.request(GradNorm(tensor_ids=(1,))).sq_norm == pytest.approx(sq[1], rel=1e-6)
        with pytest.raises(InvalidArgument, match=r"tensor id 7 is not registered \(ids are 0..1\)"):
            trainer.conn.request(GradNorm(tensor_ids=(7,)))
        with pytest.raises(InvalidArgument, match=r"grad_buffer 1 does not exist \(the layout has 1\)"):
            trainer.conn.request(GradNorm(grad_buffer=1))
        trainer.region(trainer.slots[0].grads[0])[3] = np.inf
        overflowed = trainer.conn.request(GradNorm())
        assert overflowed.nonfinite and overflowed.sq_norm == np.inf
        trainer.region(trainer.slots[0].grads[0])[3] = grads[0][3]
        done = trainer.conn.request(Step(step=1, attempt=1, max_grad_norm=1e9))
        assert done.step == 1 and done.grad_norm == pytest.approx(sum(sq) ** 0.5, rel=1e-6)
        np.testing.assert_allclose(trainer.params(), adamw_reference(5, sizes, 1), rtol=0, atol=1e-6)
        group = ParamGroup(lr=LR, weight_decay=WEIGHT_DECAY)
        trainer.conn.send_oneway(BucketReady(step=2, attempt=2, bucket=0, tensor_ids=(0,), groups=(group,)))
        with pytest.raises(InvalidState, match=r"GRAD_NORM while attempt 2 of step 2 is open"):
            trainer.conn.request(GradNorm())
    finally:
        trainer.detach()

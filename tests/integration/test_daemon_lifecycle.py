"""tiermemd's life under a supervisor: sd_notify readiness, watchdog, SIGHUP reload, SIGTERM drain.

Each test runs a daemon of its own (they end it) with NOTIFY_SOCKET pointing at
the test's ``NotifyRecorder``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from child_env import child_env
from conftest import (
    MAX_CONNECTIONS_PER_UID,
    DaemonProcess,
    NotifyRecorder,
    RawConn,
    daemon_settings,
    error_of,
    run_daemon_to_exit,
)

from tiermem.core.protocol import MsgType, Stats, StatsReply
from tiermem.core.protocol.frame import PROTOCOL_VERSION
from tiermem.core.units import MiB
from tiermemd.main import to_toml
from tiermemd.service import DRAIN_TIMEOUT_S

STOP_BOUND_S = DRAIN_TIMEOUT_S + 30.0
"""SIGTERM to exit: the drain timeout, plus start-up-sized slack for a loaded machine."""


def ping_frame(request_id: int) -> bytes:
    return struct.pack("<2sBBHHII", b"TM", PROTOCOL_VERSION, MsgType.PING, 0, 0, request_id, 0)


def ping_ok(path: str, request_id: int = 1) -> tuple[RawConn, bool, str]:
    """A new raw connection, whether it got a PONG (False: the daemon refused it), and what came instead."""
    conn = RawConn(path)
    reply = conn.request(ping_frame(request_id))
    ok = reply is not None and reply.type == MsgType.PONG
    return conn, ok, "" if ok else ("no reply" if reply is None else repr(error_of(reply)))


def test_ready_says_an_unlocked_pool_was_the_operators_choice_when_pool_mlock_is_false(daemon_factory):
    """With ``pool.mlock = false`` the ready line said ``NOT locked (see the RLIMIT_MEMLOCK warning)``, pointing
    the operator at a warning that was never logged."""
    d = daemon_factory({"pool": {"mlock": False}})
    _, ready = d.notify.wait_for("READY", 0)
    assert "pool 64MiB not locked (pool.mlock = false)" in ready["STATUS"], ready["STATUS"]
    assert "RLIMIT_MEMLOCK" not in d.log_text()


def test_ready_comes_after_the_pool_then_watchdog_reloads_and_stopping(daemon_factory):
    d = daemon_factory(env={"WATCHDOG_USEC": "400000"})
    index, ready = d.notify.wait_for("READY", 0)
    assert index == 0, f"messages before READY=1: {d.notify.messages[:index]}"
    assert int(ready["MAINPID"]) == d.pid
    assert "pool 64MiB" in ready["STATUS"] and d.socket_path in ready["STATUS"]
    # by the time READY=1 was sent the pool existed and the socket was live
    with d.connection() as conn:
        reply = conn.request(Stats())
    assert isinstance(reply, StatsReply)
    assert reply.node.pool.capacity_nbytes == reply.node.pool.locked_nbytes == 64 * MiB

    # WATCHDOG_USEC=400ms: pings at least every half period, i.e. from the main loop's 0.5 s tick
    first_wd, _ = d.notify.wait_for("WATCHDOG", 5.0)
    d.notify.wait_for("WATCHDOG", 5.0, after=first_wd + 1)

    # SIGHUP with an invalid file keeps the old settings (and says so in STATUS)
    d.config_path.write_text("[pool]\nsize = 'lots'\n")
    mark = len(d.notify.messages)
    d.process.send_signal(signal.SIGHUP)
    _, refused = d.notify.wait_for("READY", 10.0, after=mark)
    assert "invalid" in refused["STATUS"]
    conns = []
    try:
        for i in range(MAX_CONNECTIONS_PER_UID):
            conn, ok, why = ping_ok(d.socket_path, i + 1)
            conns.append(conn)
            assert ok, f"the old connection limit should still apply: {why}"
    finally:
        for conn in conns:
            conn.close()

    # SIGHUP re-reads the --config file: a lower connection limit applies to new connections
    d.settings["server"]["max_connections_per_uid"] = 2
    d.settings.setdefault("swap", {})["queue_depth"] = 8  # not applied by a SIGHUP: said so, naming it
    d.config_path.write_text(to_toml(d.settings))
    mark = len(d.notify.messages)
    d.process.send_signal(signal.SIGHUP)
    reload_index, _ = d.notify.wait_for("RELOADING", 10.0, after=mark)
    _, again = d.notify.wait_for("READY", 10.0, after=reload_index)
    assert again["STATUS"] == "reloaded"
    # the acceptor restarted with the new policy: a restart the daemon asked for is no error in its log
    assert "acceptor started" in d.log_text()
    assert "the acceptor (pid" not in d.log_text(), d.log_text()[-3000:]
    assert "SIGHUP: changed, but applied only by a restart: swap.queue_depth (0 -> 8)" in d.log_text()
    held = []
    try:
        for i in range(2):
            # the sessions closed above may still be ending on a loaded machine (test_server_admission checks
            # that a hung-up peer frees its slot at once): a refusal must not last, not be impossible
            deadline = time.monotonic() + 5.0
            while True:
                conn, ok, why = ping_ok(d.socket_path, i + 1)
                if ok or time.monotonic() > deadline:
                    break
                conn.close()
                time.sleep(0.05)
            held.append(conn)
            assert ok, f"connection {i + 1} of 2 was refused for 5 s: {why}\n{d.log_text()[-3000:]}"
        third = RawConn(d.socket_path)
        held.append(third)
        _, kind, message = error_of(third.request(ping_frame(3)))
        assert kind == "AdmissionError" and "max_connections_per_uid" in message
    finally:
        for conn in held:
            conn.close()

    mark = len(d.notify.messages)
    t0 = time.monotonic()
    assert d.stop(signal.SIGTERM, timeout_s=STOP_BOUND_S) == 0
    print(f"idle daemon: SIGTERM to exit {time.monotonic() - t0:.2f} s")
    d.notify.wait_for("STOPPING", 1.0, after=mark)


@pytest.mark.parametrize("sizes", ["2000000,500000"])
def test_sigterm_during_steps_ends_them_cleanly_and_the_daemon_exits_0(daemon_factory, run_client, sizes):
    d = daemon_factory()
    client = run_client("train", d, "--job", "busy", "--sizes", sizes, "--steps", "1000000", "--grads", "fixed")
    client.wait_step(3)
    with d.connection() as conn:
        assert isinstance(conn.request(Stats()), StatsReply)
    mark = len(d.notify.messages)
    in_flight = client.wait_pending()["pending"]
    t0 = time.monotonic()
    d.process.send_signal(signal.SIGTERM)
    result = client.result(timeout_s=STOP_BOUND_S, ok=False)
    client_s = time.monotonic() - t0
    code = d.wait_exit(timeout_s=STOP_BOUND_S)
    exit_s = time.monotonic() - t0
    print(
        f"SIGTERM while step {in_flight} was sent: the client ended after {client_s:.2f} s with {result}; "
        f"the daemon exited after {exit_s:.2f} s"
    )
    assert code == 0, d.log_text()[-3000:]
    # refused while the daemon drains, or found the session closed: its next request after the drain (on a
    # loaded machine the client may be that late) meets a closed connection, which is DaemonGone
    assert result.get("error") in {"DaemonStopping", "DaemonUnavailable", "DaemonGone"}, result
    assert result["last_step"] >= in_flight - 1  # the step in flight completed, or failed with a typed error
    d.notify.wait_for("STOPPING", 1.0, after=mark)
    assert d.notify.count("WATCHDOG") == 0, "WATCHDOG=1 sent although WATCHDOG_USEC was not set"


# The parent starts the daemon from a thread that ends once the daemon listens (as a client library's
# helper thread would), then idles until it is killed.
PARENT_STARTING_FROM_A_THREAD = r"""
import os, subprocess, sys, threading, time
box = {}
def start():
    box["daemon"] = subprocess.Popen([sys.executable, "-m", "tiermemd.main", "--config", sys.argv[1],
                                      "--exit-with-parent"], stderr=open(sys.argv[2], "wb"))
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.02)
thread = threading.Thread(target=start)
thread.start()
thread.join()
print(box["daemon"].pid, flush=True)
time.sleep(600)
"""


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_exit_with_parent_follows_the_parent_process_not_the_thread_that_started_it(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    socket_path = str(root / "tiermemd.sock")
    config = root / "tiermemd.toml"
    config.write_text(to_toml(daemon_settings(root, socket_path, None)))
    notify = NotifyRecorder(str(root / "notify"))
    env = child_env("NOTIFY_SOCKET")
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_STARTING_FROM_A_THREAD, str(config), str(root / "log"), socket_path],
        env={**env, "NOTIFY_SOCKET": notify.path},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        daemon_pid = int(parent.stdout.readline())
        notify.wait_for("READY", 120.0)
        time.sleep(1.5)  # several main-loop ticks after the starting thread ended
        assert notify.count("STOPPING") == 0, "the daemon stopped when the thread that started it ended"
        assert not process_gone(daemon_pid)
        parent.kill()
        parent.wait()
        notify.wait_for("STOPPING", 10.0)
        deadline = time.monotonic() + STOP_BOUND_S
        while not process_gone(daemon_pid):
            assert time.monotonic() < deadline, "the daemon outlived its parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        notify.close()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["socket in use", "swap dir unusable"])
def test_start_up_failures_exit_with_their_documented_codes(daemon, tmp_path, case):
    root = tmp_path / "d"
    root.mkdir()
    if case == "socket in use":
        overrides, expected = {}, 5
        socket_path = daemon.socket_path  # the shared daemon is alive on it
    else:
        (root / "not-a-dir").write_text("")
        overrides, expected = {"swap": {"dirs": [str(root / "not-a-dir" / "swap")]}}, 4
        socket_path = str(root / "tiermemd.sock")
    done = run_daemon_to_exit(root, socket_path, overrides)
    assert done.returncode == expected, done.stderr[-2000:]
    if case == "swap dir unusable":  # which setting, which path, and why
        blocker = root / "not-a-dir"
        assert f"swap.dirs {blocker / 'swap'} unusable: {blocker} is not a directory; fix swap.dirs" in done.stderr
    with daemon.connection() as conn:  # a failed second daemon left the live one's socket alone
        assert isinstance(conn.request(Stats()), StatsReply)


@pytest.mark.parametrize("shared", ["state_dir", "swap dir"])
def test_a_second_daemon_on_a_live_daemons_directories_exits_4_naming_it(daemon_factory, tmp_path, shared):
    """Given the state or a swap directory of a live daemon (and a socket of its own), a second daemon would take
    the live one's swap files for orphans and remove them: it refuses to start instead, naming the holder."""
    first = daemon_factory()
    root = tmp_path / "second"
    root.mkdir()
    if shared == "state_dir":
        overrides = {"server": {"state_dir": first.settings["server"]["state_dir"]}}
        directory = first.settings["server"]["state_dir"]
    else:
        overrides = {"swap": {"dirs": [str(root / "own-swap"), *first.settings["swap"]["dirs"]]}}
        directory = first.settings["swap"]["dirs"][0]
    done = run_daemon_to_exit(root, str(root / "tiermemd.sock"), overrides)
    assert done.returncode == 4, done.stderr[-2000:]
    assert f"{Path(directory).resolve()} is in use by another tiermemd (pid {first.pid})" in done.stderr
    assert "Traceback" not in done.stderr
    with first.connection() as conn:
        assert isinstance(conn.request(Stats()), StatsReply)
    assert not (root / "tiermemd.sock").exists()


def test_status_of_a_stopped_daemon_gives_up_after_its_timeout(daemon_factory):
    """A daemon that does not answer (SIGSTOP; hung): ``tiermem status --timeout 1`` says so and exits 1 within
    seconds, instead of waiting out a trainer's 60 s."""
    d = daemon_factory()
    d.process.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "tiermem.client.cli", "status", "--socket", d.socket_path, "--timeout", "1"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        took = time.monotonic() - t0
    finally:
        d.process.send_signal(signal.SIGCONT)
    assert done.returncode == 1, done.stderr
    assert "tiermem status:" in done.stderr and "Traceback" not in done.stderr
    assert took < 30, f"status took {took:.1f} s"


def test_a_hung_acceptor_is_killed_and_replaced_and_connections_go_on(daemon_factory):
    """The acceptor stopped (SIGSTOP: what a wedged one looks like): its heartbeat stops, and within
    ``ACCEPTOR_SILENCE_S`` the daemon kills it, says so, and a new one accepts the connections."""
    from tiermemd.admission import ACCEPTOR_SILENCE_S

    d = daemon_factory()
    (first,) = re.findall(r"acceptor started \(pid (\d+)\)", d.log_text())
    os.kill(int(first), signal.SIGSTOP)
    deadline = time.monotonic() + ACCEPTOR_SILENCE_S + 30
    while len(re.findall(r"acceptor started", d.log_text())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    log = d.log_text()
    assert f"the acceptor (pid {first}) sent nothing for" in log, log[-3000:]
    assert len(re.findall(r"acceptor started", log)) == 2, log[-3000:]
    with d.connection() as conn:
        assert isinstance(conn.request(Stats()), StatsReply)


def _wait_for(what: str, done: Callable[[], bool], d: DaemonProcess, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s:\n{d.log_text()[-3000:]}"
        time.sleep(0.1)


def _pings(path: str) -> bool:
    try:
        conn, ok, _ = ping_ok(path, 2)
    except OSError:
        return False
    conn.close()
    return ok


@pytest.mark.parametrize("accept_process", [True, False], ids=["acceptor", "accept-thread"])
def test_a_removed_socket_file_is_bound_again_and_one_put_in_its_place_is_left_alone(daemon_factory, accept_process):
    """An operator's ``rm`` (or a cleanup of the socket's directory) no longer cuts the node off a running
    daemon; a socket another process renamed over the path is not ours to take or to remove at shutdown."""
    d = daemon_factory({"server": {"accept_process": accept_process}})
    held, ok, why = ping_ok(d.socket_path)
    assert ok, why
    os.unlink(d.socket_path)
    _wait_for("new connection after the socket file was removed", lambda: _pings(d.socket_path), d)
    assert "listening there again" in d.log_text()
    reply = held.request(ping_frame(3))  # a client connected before keeps its session
    assert reply is not None and reply.type == MsgType.PONG
    held.close()

    shutil.rmtree(d.socket_dir)  # the whole directory, as a cleanup of /run or /tmp would
    _wait_for("new connection after the socket directory was removed", lambda: _pings(d.socket_path), d)

    other = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    other_path = os.path.join(d.socket_dir, "other.sock")
    other.bind(other_path)
    other.listen()
    os.rename(other_path, d.socket_path)
    _wait_for("report of the replaced socket", lambda: "no longer names this daemon's socket" in d.log_text(), d)
    try:
        assert d.stop() == 0
        assert stat.S_ISSOCK(os.lstat(d.socket_path).st_mode), "the daemon removed a socket that was not its own"
        assert "not this daemon's socket any more" in d.log_text()
    finally:
        other.close()

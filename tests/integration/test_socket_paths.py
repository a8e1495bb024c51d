"""Nobody gets in through /tmp: socket and state paths another local user cannot take over.

Real sockets, real second processes, real second uids.  The attacker is a
forked child that dropped to ``nobody``; the victim is a forked child running
as a uid of its own with no passwd entry (so its per-user path is
``/tmp/tiermem-<uid>``, nobody else's).  Tests that switch uids need root and
are skipped without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import select
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from child_env import child_env
from forked import Forked, become, error_fields

from tiermem.client.connection import connect_trusted
from tiermem.client.link import NODE_SOCKET, connect
from tiermem.core.errors import ConfigError, UnsafePathError
from tiermem.core.protocol import Stats, StatsReply
from tiermem.net.sockpath import Trust, remove_socket
from tiermemd.listener import bind_listener

IS_ROOT = os.geteuid() == 0
NOBODY = 65534
needs_root = pytest.mark.skipif(not IS_ROOT, reason="acting as a second uid needs root (setuid in a forked child)")

# --------------------------------------------------------------------------- processes of other uids


class Listening:
    """A forked listener on a socket: counts the connections it accepts and the bytes it receives.

    ``prepare`` returns the socket, bound and not yet listening.  It runs as
    ``uid`` when ``bind_as_uid`` (the socket file is then ``uid``'s), else as
    root before the child becomes ``uid``; either way the child calls listen()
    as ``uid``, so ``SO_PEERCRED`` names ``uid`` whoever owns the file.
    """

    def __init__(self, prepare: Callable[[], socket.socket], uid: int, *, bind_as_uid: bool = False) -> None:
        self._stop_r, self._stop_w = os.pipe()
        self._ready_r, self._ready_w = os.pipe()
        self._child = Forked(self._serve, prepare, uid, bind_as_uid)
        os.close(self._stop_r)
        os.close(self._ready_w)
        ready, _, _ = select.select([self._ready_r], [], [], 20)
        assert ready, "the listener did not start"
        os.close(self._ready_r)

    def _serve(
        self, prepare: Callable[[], socket.socket], uid: int, bind_as_uid: bool
    ) -> dict[str, int]:  # pragma: no cover
        os.close(self._stop_w)
        os.close(self._ready_r)
        if bind_as_uid:
            become(uid, uid)
        sock = prepare()
        if not bind_as_uid:
            become(uid, uid)
        sock.listen(64)
        os.close(self._ready_w)  # EOF tells the parent it listens
        sock.setblocking(False)
        accepted = received = 0
        peers: list[socket.socket] = []
        while True:
            ready, _, _ = select.select([sock, self._stop_r, *peers], [], [], 5)
            stopping = self._stop_r in ready
            while True:  # every connection already queued counts, even when asked to stop
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break
                accepted += 1
                conn.setblocking(False)
                peers.append(conn)
            for peer in list(peers):
                try:
                    data = peer.recv(1 << 16)
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    data = b""
                received += len(data)
                if not data:
                    peers.remove(peer)
                    peer.close()
            if stopping:
                break
        return {"accepted": accepted, "received": received}

    def stop(self) -> dict[str, int]:
        os.close(self._stop_w)
        out = self._child.outcome()
        assert "ok" in out, out
        return out["ok"]  # type: ignore[no-any-return]


def _unused_uid() -> int:
    """A uid no account has and no /tmp/tiermem-<uid> exists for: the victim's."""
    for uid in range(61000 + os.getpid() % 1000, 64000):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            if not os.path.lexists(f"/tmp/tiermem-{uid}"):
                return uid
    raise AssertionError("no free uid for the victim")


@pytest.fixture
def victim() -> Iterator[int]:
    uid = _unused_uid()
    yield uid
    shutil.rmtree(f"/tmp/tiermem-{uid}", ignore_errors=True)


def _victim_connects(env: dict[str, str], attempts: int) -> list[dict[str, Any]]:  # pragma: no cover - child
    """What ``connect()`` did, ``attempts`` times, in the victim's process."""
    outcomes = []
    for _ in range(attempts):
        try:
            client = connect(env=env, embed=False, timeout_s=5)
        except Exception as exc:
            outcomes.append({"error": type(exc).__name__, "message": str(exc), "fields": error_fields(exc)})
        else:
            client.close()
            outcomes.append({"connected": True})
    return outcomes


def _make_attacker_dir(path: str) -> None:  # pragma: no cover - child, as nobody
    os.mkdir(path, 0o777)
    os.chmod(path, 0o777)


def _bind_in(path: str, *, mode: int = 0o777) -> Callable[[], socket.socket]:
    def prepare() -> socket.socket:  # pragma: no cover - child
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        os.fchmod(sock.fileno(), mode)
        sock.bind(path)
        return sock

    return prepare


def _bind_as(path: str, uid: int) -> Callable[[], socket.socket]:
    """Bind with ``uid`` as the effective uid (the file is that uid's), then take root back to drop for good."""

    def prepare() -> socket.socket:  # pragma: no cover - child
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        os.seteuid(uid)
        try:
            sock.bind(path)
        finally:
            os.seteuid(0)
        return sock

    return prepare


# --------------------------------------------------------------------------- the client


@needs_root
def test_a_directory_another_user_made_at_the_per_user_path_is_refused_naming_it_and_its_owner(victim):
    where = f"/tmp/tiermem-{victim}"
    assert "ok" in Forked(_make_attacker_dir, where, uid=NOBODY).outcome()
    (outcome,) = Forked(_victim_connects, {}, 1, uid=victim).outcome()["ok"]
    assert outcome["error"] == "UnsafePathError", outcome
    assert outcome["fields"] == {"path": where, "owner_uid": NOBODY, "expected_uids": [0, victim]}
    assert outcome["message"].startswith(f"refusing {where}: is owned by uid {NOBODY} (nobody); expected root or ")


@needs_root
def test_an_attacker_listening_at_the_victims_per_user_path_gets_no_connection(victim):
    where = f"/tmp/tiermem-{victim}"
    assert "ok" in Forked(_make_attacker_dir, where, uid=NOBODY).outcome()
    attacker = Listening(_bind_in(f"{where}/tiermemd.sock"), uid=NOBODY, bind_as_uid=True)
    try:
        outcomes = Forked(_victim_connects, {}, 50, uid=victim).outcome()["ok"]
    finally:
        seen = attacker.stop()
    assert seen == {"accepted": 0, "received": 0}
    assert {o.get("error") for o in outcomes} == {"UnsafePathError"}, outcomes[:3]
    assert all(o["fields"]["path"] == where for o in outcomes)


@needs_root
def test_a_foreign_socket_left_in_a_directory_that_now_looks_private_gets_no_connection(victim):
    """The directory was the attacker's when they bound; now it is the victim's, 0700: the socket file gives it away."""
    where = f"/tmp/tiermem-{victim}"
    assert "ok" in Forked(_make_attacker_dir, where, uid=NOBODY).outcome()
    sock_path = f"{where}/tiermemd.sock"
    attacker = Listening(_bind_in(sock_path), uid=NOBODY, bind_as_uid=True)
    try:
        os.chown(where, victim, victim)
        os.chmod(where, 0o700)
        outcomes = Forked(_victim_connects, {}, 20, uid=victim).outcome()["ok"]
    finally:
        seen = attacker.stop()
    assert seen == {"accepted": 0, "received": 0}
    assert {o.get("error") for o in outcomes} == {"UnsafePathError"}
    assert outcomes[0]["fields"] == {"path": sock_path, "owner_uid": NOBODY, "expected_uids": [0, victim]}
    assert f"is a socket owned by uid {NOBODY} (nobody)" in outcomes[0]["message"]


@needs_root
def test_a_listener_of_another_uid_behind_a_trusted_file_is_refused_after_connect_before_a_byte(victim):
    """Directory and socket file are the victim's; the process that listens is not: SO_PEERCRED decides."""
    where = f"/tmp/tiermem-{victim}"
    os.mkdir(where, 0o700)
    os.chown(where, victim, victim)
    attacker = Listening(_bind_as(f"{where}/tiermemd.sock", victim), uid=NOBODY)
    try:
        assert os.lstat(f"{where}/tiermemd.sock").st_uid == victim
        outcomes = Forked(_victim_connects, {}, 20, uid=victim).outcome()["ok"]
    finally:
        seen = attacker.stop()
    assert seen["received"] == 0  # it saw connections (the kernel completed them) but never a byte
    assert {o.get("error") for o in outcomes} == {"UnsafePathError"}
    assert outcomes[0]["fields"]["owner_uid"] == NOBODY
    assert f"runs as uid {NOBODY} (nobody); expected root or uid {victim}" in outcomes[0]["message"]


@needs_root
def test_a_named_socket_takes_a_daemon_of_another_uid_only_when_the_caller_names_that_uid(tmp_path):
    sock_dir = Path(tempfile.mkdtemp(prefix="tmsp-"))
    sock_path = str(sock_dir / "service.sock")
    service = Listening(_bind_in(sock_path, mode=0o666), uid=NOBODY)  # root's file, nobody's listener
    try:
        with pytest.raises(UnsafePathError) as refused:
            connect(sock_path, embed=False)
        assert refused.value.path == sock_path and refused.value.owner_uid == NOBODY
        assert "a client names another with daemon_uid=" in str(refused.value)
        client = connect(sock_path, embed=False, daemon_uid=NOBODY)
        assert client.socket_path == sock_path
        client.close()
    finally:
        seen = service.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert seen["accepted"] >= 1
    assert seen["received"] == 0  # connect() itself sends nothing; the refused one saw nothing either


def test_an_untrusted_per_user_candidate_is_skipped_for_a_private_daemon_that_passes_the_checks(tmp_path):
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    (runtime / "tiermem").mkdir(mode=0o777)
    os.chmod(runtime / "tiermem", 0o777)  # the per-user directory, writable by all
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    with pytest.raises(UnsafePathError, match="is writable by group and others"):
        connect(env=env, embed=False)
    client = connect(env=env, pool_size=16 << 20, settings={"adam.compile": False})
    try:
        assert client.daemon is not None
        private = Path(client.daemon.dir)
        info = private.lstat()
        assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700
        assert isinstance(client.request(Stats()), StatsReply)
    finally:
        client.close()
    assert not private.exists()


def test_falling_back_from_a_socket_nobody_answers_on_to_a_private_daemon_is_a_warning(tmp_path, caplog):
    """``$TIERMEM_SOCKET_PATH`` names a stale socket (the node's service is down): the trainer still gets a
    private daemon, and says so on stderr (a warning: logging's last resort prints it), naming the socket."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    named = tmp_path / "node" / "tiermemd.sock"
    named.parent.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stale:
        stale.bind(str(named))  # bound, never listening, closed: what a killed daemon leaves
    env = {"XDG_RUNTIME_DIR": str(runtime), "TIERMEM_SOCKET_PATH": str(named)}
    with caplog.at_level(logging.INFO, logger="tiermem.client.link"):
        client = connect(env=env, pool_size=16 << 20, settings={"adam.compile": False})
    client.close()
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert f"no tiermemd answers at {named}" in warning.getMessage()
    assert "TIERMEM_NO_EMBED=1" in warning.getMessage()

    if os.path.exists(NODE_SOCKET):
        return  # this machine has a node socket: the part below is about one without
    caplog.clear()  # nothing named and no socket file anywhere: a machine without the service, said at INFO
    with caplog.at_level(logging.INFO, logger="tiermem.client.link"):
        client = connect(env={"XDG_RUNTIME_DIR": str(runtime)}, pool_size=16 << 20, settings={"adam.compile": False})
    client.close()
    assert [r.levelno for r in caplog.records if "private one" in r.getMessage()] == [logging.INFO]


def test_a_socket_straight_in_a_shared_sticky_directory_is_told_to_use_a_directory_of_its_own(tmp_path):
    """A socket path right in /tmp (world-writable, sticky): the refusal's fix is a directory of the daemon's own
    in there, not to remove /tmp."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(UnsafePathError) as refused:
        bind_listener(str(shared / "t.sock"))
    assert f"put the socket in a directory of its own, such as {shared / 'tiermemd' / 't.sock'}" in str(refused.value)
    assert "remove it" not in str(refused.value)


# --------------------------------------------------------------------------- the daemon


def _run_daemon(socket_path: str, state_dir: Path) -> subprocess.CompletedProcess[str]:
    env = child_env("NOTIFY_SOCKET", "LISTEN_")
    args = ["--socket", socket_path, "--pool-size", "8MiB", "--no-mlock", "--state-dir", str(state_dir)]
    return subprocess.run(
        [sys.executable, "-m", "tiermemd.main", *args, "--swap-dir", str(state_dir / "swap")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    "case",
    [
        pytest.param("foreign", marks=needs_root),
        "symlink",
        "writable",
    ],
)
def test_the_daemon_will_not_bind_in_a_directory_it_cannot_trust_and_exits_5_naming_it(tmp_path, case):
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    sock_dir = tmp_path / "sockets"
    if case == "foreign":
        sock_dir.mkdir(mode=0o755)
        os.chown(sock_dir, NOBODY, NOBODY)
        expected = f"refusing {sock_dir}: is owned by uid {NOBODY} (nobody)"
    elif case == "symlink":
        sock_dir.symlink_to(real)
        expected = f"refusing {sock_dir}: is a symbolic link"
    else:
        sock_dir.mkdir()
        os.chmod(sock_dir, 0o777)
        expected = f"refusing {sock_dir}: is writable by group and others (mode 0777)"
    done = _run_daemon(str(sock_dir / "tiermemd.sock"), tmp_path / "state")
    assert done.returncode == 5, done.stderr[-2000:]
    assert expected in done.stderr
    assert os.listdir(real) == []  # nothing was bound through the symlink
    assert not (sock_dir / "tiermemd.sock").exists()


@needs_root
def test_a_state_directory_another_user_owns_is_refused_with_exit_4(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, NOBODY, NOBODY)
    done = _run_daemon(str(tmp_path / "s" / "tiermemd.sock"), state)
    assert done.returncode == 4, done.stderr[-2000:]
    assert f"refusing {state}" in done.stderr and f"owned by uid {NOBODY} (nobody)" in done.stderr


def test_a_socket_path_under_a_file_exits_5_with_the_reason(tmp_path):
    (tmp_path / "file").write_text("")
    done = _run_daemon(str(tmp_path / "file" / "tiermemd.sock"), tmp_path / "state")
    assert done.returncode == 5, done.stderr[-2000:]
    assert f"cannot use {tmp_path / 'file'} as the socket directory" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_socket_gets_its_mode_and_group_whatever_the_umask_and_its_new_directory_search_only(tmp_path):
    sock_path = tmp_path / "run" / "tiermemd.sock"
    others = [g for g in os.getgroups() if g != os.getegid()]
    gid = NOBODY if IS_ROOT else others[0] if others else os.getegid()  # a group other than our own where we can
    old = os.umask(0o077)
    try:
        sock = bind_listener(sock_path, mode=0o660, group=gid)
    finally:
        os.umask(old)
    try:
        info = sock_path.lstat()
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == gid
        parent = sock_path.parent.lstat()
        assert stat.S_IMODE(parent.st_mode) == 0o750 and parent.st_gid == gid
    finally:
        sock.close()
        assert remove_socket(sock_path)
    assert not sock_path.exists()


def test_a_directory_the_daemon_did_not_create_keeps_its_mode(tmp_path):
    existing = tmp_path / "mine"
    existing.mkdir(mode=0o700)
    sock = bind_listener(existing / "d.sock", mode=0o666)
    try:
        assert stat.S_IMODE(existing.lstat().st_mode) == 0o700
        assert stat.S_IMODE((existing / "d.sock").lstat().st_mode) == 0o666
    finally:
        sock.close()


def _put_back(parent: str, real: str) -> None:  # pragma: no cover - child
    """The real socket directory back at ``parent``, whatever stands there now (the decoy link, or a new
    directory that bind_listener made while the real one was away)."""
    if os.path.islink(parent):
        os.unlink(parent)
    elif os.path.isdir(parent):
        shutil.rmtree(parent, ignore_errors=True)
    os.rename(real, parent)


def _race(how: str, tmp: str, stop_fd: int, other_end: int) -> int:  # pragma: no cover - child
    """Attack the socket at ``tmp/sockdir/tiermemd.sock`` until ``stop_fd`` reads EOF; returns the moves made.

    ``parent``: swap ``sockdir`` between the real directory and a symlink to ``decoy`` (whose
    ``tiermemd.sock`` is a symlink to the secret).  ``entry``: as soon as the socket file appears,
    rename a symlink to the secret over it.
    """
    os.close(other_end)
    parent, sock = f"{tmp}/sockdir", f"{tmp}/sockdir/tiermemd.sock"
    real = f"{tmp}/sockdir.real"
    moves = 0
    while not select.select([stop_fd], [], [], 0)[0]:
        with contextlib.suppress(OSError):
            if how == "parent":
                if os.path.lexists(real):  # an earlier swap was cut short: put the directory back first
                    _put_back(parent, real)
                    continue
                os.rename(parent, real)
                os.symlink(f"{tmp}/decoy", parent)  # fails if bind_listener made a new directory in the gap
                moves += 1
                time.sleep(0.0002)
                _put_back(parent, real)
                time.sleep(0.0002)
            elif stat.S_ISSOCK(os.lstat(sock).st_mode):
                os.symlink(f"{tmp}/secret", f"{parent}/.swap")
                os.rename(f"{parent}/.swap", sock)
                moves += 1
                time.sleep(0.0005)
                os.unlink(sock)
    return moves


@pytest.mark.parametrize("how", ["parent", "entry"])
def test_a_symlink_swapped_in_during_bind_never_redirects_the_chmod(tmp_path, how):
    """The attack that won against a chmod by path: between bind and chmod, the socket's parent becomes
    a symlink to a directory whose ``tiermemd.sock`` points at a private file, or the socket file itself
    is replaced by such a link.  The racer here may write the directory (the daemon refuses a directory
    anyone else may change); even so the private file's mode never changes, because nothing after bind
    goes through a path.  (The chmod by path this replaced lost the ``entry`` race about 150 times in
    30,000 binds on these machines.)"""
    secret = tmp_path / "secret"
    secret.write_text("root only")
    os.chmod(secret, 0o600)
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "tiermemd.sock").symlink_to(secret)
    parent = tmp_path / "sockdir"
    parent.mkdir(mode=0o700)
    stop_r, stop_w = os.pipe()
    racer = Forked(_race, how, str(tmp_path), stop_r, stop_w)
    os.close(stop_r)
    bound = refused = 0
    start = time.monotonic()
    try:
        while time.monotonic() - start < 30 and not (time.monotonic() - start > 2 and bound and refused):
            try:
                sock = bind_listener(parent / "tiermemd.sock", mode=0o666)
            except (UnsafePathError, ConfigError):
                refused += 1
                continue
            bound += 1
            sock.close()
            assert stat.S_IMODE(secret.lstat().st_mode) == 0o600
    finally:
        os.close(stop_w)
        moves = racer.outcome()
    assert moves.get("ok", 0) > 0, moves
    assert stat.S_IMODE(secret.lstat().st_mode) == 0o600
    assert secret.read_text() == "root only"
    assert (decoy / "tiermemd.sock").is_symlink()
    assert bound > 0 and refused > 0, (bound, refused)


def _connects_trusting_root(path: str) -> bool:  # pragma: no cover - child
    connect_trusted(path, Trust.of(os.geteuid(), what="root's")).close()
    return True


@needs_root
def test_a_search_only_directory_is_enough_for_the_client_checks_as_for_connect():
    """A client may search but not list the node daemon's directory (mode 0711): the checks still run."""
    sock_dir = Path(tempfile.mkdtemp(prefix="tmsp-"))
    try:
        os.chmod(sock_dir, 0o711)
        sock = bind_listener(sock_dir / "d.sock", mode=0o666)
        try:
            assert Forked(_connects_trusting_root, str(sock_dir / "d.sock"), uid=NOBODY).outcome() == {"ok": True}
        finally:
            sock.close()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_a_trusted_connect_reaches_this_users_daemon(tmp_path):
    sock_path = tmp_path / "own" / "d.sock"
    sock = bind_listener(sock_path, mode=0o600)
    try:
        conn = connect_trusted(sock_path, Trust.of(os.geteuid(), what="this user's"))
        conn.close()
    finally:
        sock.close()


def test_the_fix_never_says_to_remove_a_shared_or_a_sound_directory(tmp_path):
    """A refused socket path used to end "remove <its directory> if you did not create it": for a regular file
    named as the socket, that said to remove its sound directory; for /tmp/x.sock, to remove /tmp."""
    trust = Trust.of(os.geteuid(), what="this test's daemon")
    not_a_socket = tmp_path / "daemon.sock"
    not_a_socket.write_text("")
    with pytest.raises(UnsafePathError) as info:
        connect_trusted(not_a_socket, trust)
    assert (
        str(info.value)
        == f"refusing {not_a_socket}: is not a socket; point the client at a socket of this test's daemon"
    )

    shared = Path(tempfile.mkdtemp(prefix="shared-"))
    try:
        shared.chmod(0o1777)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.bind(str(shared / "s.sock"))
        with pytest.raises(UnsafePathError) as info:
            connect_trusted(shared / "s.sock", trust)
        assert str(info.value).endswith(
            f"put the daemon's socket in a directory of its own (anyone may add entries to {shared})"
        )
        sock.close()
        shared.chmod(0o0777)  # not sticky: a directory someone may have made to catch the client
        with pytest.raises(UnsafePathError, match=f"remove {shared} if you did not create it"):
            connect_trusted(shared / "s.sock", trust)
    finally:
        shutil.rmtree(shared)

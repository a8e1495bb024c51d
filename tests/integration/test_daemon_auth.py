"""Who may use tiermemd: other uids are refused at connect, other jobs without the token at attach."""

from __future__ import annotations

import json
import os
import select
import subprocess

import pytest
from conftest import DaemonProcess
from daemon_client import Trainer

from tiermem.client.connection import Connection
from tiermem.core.errors import AdmissionError, AuthError
from tiermem.core.protocol import Ping, Pong

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")

# Runs as `nobody` under the system interpreter (the project's virtualenv may not be readable by that
# user), so it speaks the protocol with the standard library only: one PING, then read to the end.
RAW_PING_AS_ANOTHER_UID = r"""
import json, socket, struct, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.settimeout(10)
sock.connect(sys.argv[1])
frames = []
try:
    sock.send(struct.pack("<2sBBHHII", b"TM", 1, 0x0A, 0, 0, 1, 0))
except OSError as exc:
    frames.append({"send_error": exc.errno})
while True:
    try:
        data = sock.recv(1 << 20)
    except ConnectionResetError:  # reported once, ahead of frames still queued for us
        try:
            data = sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except OSError:
            break
    if not data:
        break
    _, _, kind, _, _, rid, n = struct.unpack_from("<2sBBHHII", data)
    frames.append({"type": kind, "request_id": rid, "payload": json.loads(data[16:16 + n] or b"{}")})
print(json.dumps({"uid": __import__("os").getuid(), "frames": frames}))
"""


@needs_root
@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason=f"{SYSTEM_PYTHON} is needed to run as another uid")
def test_a_process_of_another_uid_is_refused_with_an_auth_error(daemon: DaemonProcess):
    sessions_before = daemon.stats().server.sessions
    out = subprocess.run(
        [SYSTEM_PYTHON, "-I", "-c", RAW_PING_AS_ANOTHER_UID, daemon.socket_path],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result["uid"] == NOBODY
    errors = [f for f in result["frames"] if f.get("type") == 0xFF]
    assert [f["payload"]["type"] for f in errors] == ["AuthError"], result
    assert str(NOBODY) in errors[0]["payload"]["message"]
    assert not [f for f in result["frames"] if f.get("type") == 0x8A], "a refused peer got an answer to its PING"
    assert daemon.stats().server.sessions <= sessions_before


def _connection_as_nobody(socket_path: str) -> str:
    """Fork, become ``nobody``, send a PING through ``Connection``; returns the error type it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no pytest, no threads of ours beyond this one
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                with Connection.open(socket_path, timeout_s=10.0) as conn:
                    conn.request(Ping())
                outcome = "no error"
            except Exception as exc:
                outcome = type(exc).__name__
            os.write(w, outcome.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    ready, _, _ = select.select([r], [], [], 30.0)
    outcome = os.read(r, 256).decode() if ready else "timed out"
    os.close(r)
    if not ready:
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    return outcome


@needs_root
def test_the_client_library_raises_auth_error_for_a_refused_uid(daemon: DaemonProcess):
    assert _connection_as_nobody(daemon.socket_path) == "AuthError"


def test_the_client_library_sees_a_refusal_at_connect_as_a_failure_not_a_hang(daemon: DaemonProcess):
    if os.geteuid() != 0:
        pytest.skip("switching to another uid needs root")
    assert _connection_as_nobody(daemon.socket_path) in {"AuthError", "ProtocolError", "DaemonUnavailable"}


def test_a_process_of_another_job_cannot_attach_without_the_token(daemon: DaemonProcess, run_client):
    owner = Trainer(daemon.socket_path, "alpha", [32])
    owner.start_fresh()
    try:
        other = run_client("attach", daemon, "--job", "beta", "--target", "alpha").result()
        assert other["errors"] == {"none": "AuthError", "own": "AuthError", "random": "AuthError"}
        # the same checks from this process, through the client library: the typed error comes back typed
        for token in (None, "0" * 32):
            with daemon.client() as client, pytest.raises(AuthError, match="token"):
                client.attach("alpha", window_nbytes=4096, token=token)
        # the right token admits another rank, never a second driver of a live rank
        with daemon.client() as client, pytest.raises(AdmissionError, match="already attached"):
            client.attach("alpha", window_nbytes=4096, token=owner.token)
    finally:
        owner.detach()
    assert daemon.wait_stats(lambda s: s.jobs == 0, 10.0).jobs == 0


def test_the_token_lets_a_second_rank_join_the_job(daemon: DaemonProcess):
    with daemon.client() as first:
        info = first.attach("gamma", rank=0, world_size=2, window_nbytes=4096)
        with daemon.client() as second:
            joined = second.attach("gamma", rank=1, world_size=2, window_nbytes=4096, token=info.token)
            assert isinstance(second.request(Ping()), Pong)
            assert joined.token == info.token
            second.detach()
        first.detach()
    assert daemon.wait_stats(lambda s: s.jobs == 0, 10.0).jobs == 0

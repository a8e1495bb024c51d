"""Chaos, quick version: every cross-job and cross-uid access is refused, and job ids are scoped per uid.

A job of root's trains on one daemon; a process running as another uid (a
forked child that ``os.setuid``s to nobody, a uid the daemon allows) then
tries to reach it: attach with its id and token, attach with its id and
no token, guess tokens, and fill the job table.  Every attempt must be
refused or land in a job of its own that holds none of root's bytes; root's
job must train on unharmed and the ledger end flat.  Needs root (to switch
uid).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator

import pytest
import torch
from hostile import ALLOWED_UID, ChaosDaemon, running_daemon
from ledger import problems, settle, snapshot

from tiermem.client.connection import Connection
from tiermem.client.link import connect
from tiermem.client.offload import OffloadAdam
from tiermem.core.errors import AdmissionError, AuthError, UnknownJob
from tiermem.core.protocol import Attach, AttachOk, Detach

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root"),
]

MAX_JOBS = 4  # so max_jobs_per_uid is 2
GUESSES = 200


@pytest.fixture
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosDaemon]:
    with running_daemon(tmp_path_factory.mktemp("isolation"), {"jobs": {"max_jobs": MAX_JOBS}}) as d:
        yield d


def _as_other_uid(socket_path: str, job_id: str, token: str) -> dict[str, int]:
    """In a forked child running as ``ALLOWED_UID``: every way at root's job; the tally comes back as JSON."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        tally = {"attempts": 0, "granted_roots_job": 0, "refused": 0, "own_jobs": 0, "saw_state": 0}
        try:
            os.setgid(ALLOWED_UID)
            os.setuid(ALLOWED_UID)

            def attach(jid: str, tok: str | None) -> AttachOk | None:
                tally["attempts"] += 1
                with Connection.open(socket_path, timeout_s=30.0) as conn:
                    try:
                        reply, fds = conn.request_fds(
                            Attach(job_id=jid, rank=0, world_size=1, window_nbytes=0, token=tok)
                        )
                    except (AuthError, UnknownJob, AdmissionError):
                        tally["refused"] += 1
                        return None
                    for fd in fds:
                        os.close(fd)
                    assert isinstance(reply, AttachOk)
                    if reply.job_token == token:
                        tally["granted_roots_job"] += 1
                    tally["saw_state"] += reply.state_step != 0 or reply.state_from != "new"
                    conn.request(Detach(keep_state=True))
                    return reply

            attach(job_id, token)  # root's id and root's token: uid 65534 has no such job
            for _ in range(GUESSES):  # guessed tokens
                attach(job_id, secrets.token_hex(16))
            own = attach(job_id, None)  # the same id without a token: a job of this uid's own
            tally["own_jobs"] += own is not None
            tally["own_jobs"] += attach(f"{job_id}-b", None) is not None
            attach(f"{job_id}-c", None)  # a third: over max_jobs_per_uid
            code = 0
        except BaseException as exc:  # report, never raise out of a forked child
            tally["error"] = repr(exc)  # type: ignore[assignment]
            code = 1
        os.write(w, json.dumps(tally).encode())
        os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    result = json.loads(data)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, result
    return result


def test_another_uid_never_reaches_a_job_and_cannot_fill_the_node(daemon: ChaosDaemon, capsys) -> None:  # type: ignore[no-untyped-def]
    take = lambda: snapshot(daemon.pid, daemon.socket_path, daemon.watched)  # noqa: E731
    before = settle(take, take(), timeout_s=2.0)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    reference = torch.nn.Linear(16, 16)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    client = connect(daemon.socket_path, embed=False)
    opt = OffloadAdam(model.parameters(), lr=1e-2, client=client, job_id="shared-name")
    x = torch.randn(4, 16)
    for m, o in ((model, opt), (reference, ref_opt)):
        m(x).square().sum().backward()
        o.step()
        o.zero_grad()

    tally = _as_other_uid(daemon.socket_path, "shared-name", opt.token or "")
    # root can still start a job: the other uid could take only its share of max_jobs
    second = OffloadAdam(torch.nn.Linear(4, 4).parameters(), client=connect(daemon.socket_path, embed=False))
    for m, o in ((model, opt), (reference, ref_opt)):
        m(x).square().sum().backward()
        o.step()
        o.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    second.close()
    opt.close()
    client.close()
    after = settle(take, before, timeout_s=20.0)
    with capsys.disabled():
        print(f"\nchaos isolation: {json.dumps(tally)}")
    assert tally["granted_roots_job"] == 0 and tally["saw_state"] == 0
    assert tally["attempts"] == GUESSES + 4
    assert tally["refused"] == GUESSES + 2  # root's token, the guesses, and the job over the per-uid limit
    assert tally["own_jobs"] == 2
    assert not problems(before, after), problems(before, after)

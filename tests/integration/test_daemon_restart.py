"""A restarted tiermemd reopens a job's NVMe state from its manifest and job file.

Real daemon processes (two in a row on the same state and swap directories), a
real client in this process, SIGTERM in between.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tiermem
from tiermem.client.link import Client, connect
from tiermem.client.offload import OffloadAdam
from tiermem.core.errors import DaemonUnavailable, InvalidState

pytestmark = pytest.mark.timeout(240)


def _start(root: Path) -> tuple[subprocess.Popen[bytes], Client]:
    sock = root / "tiermemd.sock"
    config = root / "tiermemd.toml"
    config.write_text(
        f'[pool]\nsize = "96MiB"\n[swap]\ndirs = ["{root / "swap"}"]\n'
        "cache_chunks = 6\nprefetch_depth = 2\nborrow = false\n"
        f"[adam]\nchunk_numel = 1024\ncompile = false\n[jobs]\ngrace_period_s = 60.0\n"
        f'[server]\nsocket = "{sock}"\nstate_dir = "{root / "state"}"\n'
    )
    log = open(root / "daemon.log", "ab")  # noqa: SIM115 - the child writes it
    proc = subprocess.Popen([sys.executable, "-m", "tiermemd.main", "--config", str(config)], stderr=log, stdout=log)
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            return proc, connect(str(sock), embed=False)
        except DaemonUnavailable:
            if proc.poll() is not None:
                pytest.fail(f"tiermemd exited {proc.returncode}: {(root / 'daemon.log').read_text()[-2000:]}")
            time.sleep(0.05)
    proc.kill()
    pytest.fail("tiermemd did not come up")


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.Tanh(), torch.nn.Linear(96, 48))


def _train(pairs: list[tuple[torch.nn.Module, torch.optim.Optimizer]], steps: int, data: list[torch.Tensor]) -> None:
    x, y = data
    for _ in range(steps):
        for model, opt in pairs:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()


def test_restarted_daemon_reopens_nvme_state_and_training_continues_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = [torch.randn(16, 48), torch.randn(16, 48)]
    offloaded, reference = _model(), _model()
    reference.load_state_dict(offloaded.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.05)

    proc, client = _start(tmp_path)
    opt = OffloadAdam(
        offloaded.parameters(), lr=3e-3, weight_decay=0.05, offload="nvme", client=client, job_id="restart-me"
    )
    _train([(offloaded, opt), (reference, ref_opt)], 7, data)
    token = opt.token
    nvme = opt.stats().rank.nvme
    assert nvme is not None and nvme.page_outs > 0  # the state really lives on the swap files

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    client.conn.close()
    job_files = list((tmp_path / "state" / "jobs").glob("*.job.json"))
    assert len(job_files) == 1 and oct(job_files[0].stat().st_mode & 0o777) == "0o600"
    assert any(p.suffix == ".manifest" for p in (tmp_path / "swap").iterdir())

    proc, client = _start(tmp_path)
    try:
        fresh = _model()  # a restarted training process: its params come back from the daemon
        reopened = OffloadAdam(
            fresh.parameters(),
            lr=3e-3,
            weight_decay=0.05,
            offload="nvme",
            client=client,
            job_id="restart-me",
            token=token,
        )
        assert reopened.stats().rank.last_step == 7
        for a, b in zip(fresh.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b)
        _train([(fresh, reopened), (reference, ref_opt)], 5, data)
        for a, b in zip(fresh.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b)
        saved = reopened.state_dict()["state"]
        for index, entry in ref_opt.state_dict()["state"].items():
            torch.testing.assert_close(saved[index]["exp_avg_sq"], entry["exp_avg_sq"])
            assert float(saved[index]["step"]) == float(entry["step"]) == 12.0
        reopened.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    # the job detached cleanly: nothing of it is left on disk
    assert list((tmp_path / "state" / "jobs").glob("*.job.json")) == []
    assert [p.name for p in (tmp_path / "swap").iterdir()] == []


def test_a_job_file_that_does_not_parse_is_set_aside(tmp_path: Path) -> None:
    jobs = tmp_path / "state" / "jobs"
    jobs.mkdir(parents=True)
    (jobs / "broken.job.json").write_text("{not json")
    proc, client = _start(tmp_path)
    try:
        assert client.stats().node.jobs == 0
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert (jobs / "broken.job.json.bad").exists()
    assert "unreadable" in (tmp_path / "daemon.log").read_text()


def test_compressed_nvme_state_is_reopened_as_it_was_stored(tmp_path: Path) -> None:
    """int8 moments on NVMe survive a restart bit for bit (the job file keeps their format, so the chunks are
    read as codes and scales); a reattach that asks for another format is refused by name."""
    torch.manual_seed(1)
    data = [torch.randn(16, 48), torch.randn(16, 48)]
    model = _model()
    proc, client = _start(tmp_path)
    opt = OffloadAdam(model.parameters(), lr=3e-3, offload="nvme", client=client, job_id="q", state_dtype="int8")
    _train([(model, opt)], 6, data)
    before = opt.state_dict()["state"]
    params = [p.detach().clone() for p in model.parameters()]
    token = opt.token
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    client.conn.close()

    proc, client = _start(tmp_path)
    try:
        with pytest.raises(InvalidState, match="restored otherwise: state_dtype int8, not fp32"):
            OffloadAdam(_model().parameters(), lr=3e-3, offload="nvme", client=client, job_id="q", token=token)
        fresh = _model()
        reopened = OffloadAdam(
            fresh.parameters(), lr=3e-3, offload="nvme", client=client, job_id="q", token=token, state_dtype="int8"
        )
        assert reopened.stats().rank.state_dtype == "int8"
        for a, b in zip(fresh.parameters(), params, strict=True):
            assert torch.equal(a, b)
        after = reopened.state_dict()["state"]
        for index, entry in before.items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(after[index][key], entry[key]), (index, key)
        reopened.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def _values(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's values as ``model.state_dict()`` gives them (a paged model's gathered from the daemon)."""
    return list(model.state_dict().values())


@pytest.mark.parametrize("how", ["staged", "paged", "paged-meta"])
def test_a_staged_job_reattaches_live_and_after_a_restart(tmp_path: Path, how: str) -> None:
    """The staged exchange (a GPU model's, and every paged one's) reattached nowhere: the daemon compared
    the client's "grads in the state" flag with its own, which the staged exchange always sets.  A model
    made again on the meta device takes the trained values from the daemon, not from an init."""
    torch.manual_seed(0)
    data = [torch.randn(16, 48), torch.randn(16, 48)]
    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.05)
    token: str | None = None

    def attach(client: Client) -> tuple[torch.nn.Module, OffloadAdam]:
        if how == "paged-meta" and token is not None:
            with torch.device("meta"):
                model = _model()
        else:
            model = _model()  # fresh values: a reattach brings the trained ones back
            if token is None:
                model.load_state_dict(reference.state_dict())
        opt = OffloadAdam(
            model.parameters(),
            lr=3e-3,
            weight_decay=0.05,
            offload="nvme",
            exchange="staged",
            client=client,
            job_id="staged-job",
            token=token,
        )
        if how != "staged":
            tiermem.offload_params(model, opt, device_budget="64KiB")
        return model, opt

    def same_as_reference(model: torch.nn.Module) -> None:
        for a, b in zip(_values(model), _values(reference), strict=True):
            torch.testing.assert_close(a, b)

    proc, client = _start(tmp_path)
    try:
        model, opt = attach(client)
        _train([(model, opt), (reference, ref_opt)], 4, data)
        token = opt.token
        opt.close(keep_state=True)
        model, opt = attach(connect(str(tmp_path / "tiermemd.sock"), embed=False))  # live: the daemon kept it
        assert (opt.state_from, opt.steps) == ("live", 4)
        same_as_reference(model)
        _train([(model, opt), (reference, ref_opt)], 3, data)
        same_as_reference(model)
        opt.close(keep_state=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    proc, client = _start(tmp_path)
    try:
        model, opt = attach(client)
        assert (opt.state_from, opt.steps) == ("shutdown", 7)
        same_as_reference(model)
        _train([(model, opt), (reference, ref_opt)], 2, data)
        same_as_reference(model)
        opt.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0

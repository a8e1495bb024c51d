"""The distributed job's token: derived from the job id and the user's secret file, or random without one."""

from __future__ import annotations

import os
import stat

from tiermem.client.distributed.identity import default_job_id, job_token


def test_the_same_job_id_gives_the_same_token_and_another_id_another(tmp_path):
    env = {"TIERMEM_SECRET_FILE": str(tmp_path / "cfg" / "job-secret")}
    first = job_token("torchrun-run-7", env)
    assert len(first) == 32 and int(first, 16) >= 0
    assert job_token("torchrun-run-7", env) == first  # a relaunch of the run
    assert job_token("torchrun-run-8", env) != first
    info = os.stat(tmp_path / "cfg" / "job-secret")
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_size == 32
    assert stat.S_IMODE(os.stat(tmp_path / "cfg").st_mode) == 0o700


def test_another_secret_gives_another_token(tmp_path):
    a = job_token("run", {"TIERMEM_SECRET_FILE": str(tmp_path / "a")})
    b = job_token("run", {"TIERMEM_SECRET_FILE": str(tmp_path / "b")})
    assert a != b


def test_a_secret_others_may_read_is_not_used(tmp_path, caplog):
    path = tmp_path / "job-secret"
    path.write_bytes(b"x" * 32)
    path.chmod(0o644)
    env = {"TIERMEM_SECRET_FILE": str(path)}
    tokens = {job_token("run", env) for _ in range(3)}
    assert len(tokens) == 3, "a secret readable by others must not make the token (it falls back to random)"
    assert "mode 0600" in caplog.text and "token=" in caplog.text


def test_a_secret_behind_a_symlink_is_not_followed(tmp_path):
    real = tmp_path / "real"
    real.write_bytes(b"y" * 32)
    real.chmod(0o600)
    link = tmp_path / "job-secret"
    link.symlink_to(real)
    env = {"TIERMEM_SECRET_FILE": str(link)}
    assert job_token("run", env) != job_token("run", env)  # refused (O_NOFOLLOW): random each time


def test_the_default_job_id_is_torchruns_run_id():
    assert default_job_id({"TORCHELASTIC_RUN_ID": "abc"}) == "torchrun-abc"
    assert default_job_id({"TORCHELASTIC_RUN_ID": "none"}).startswith("dist-")
    assert default_job_id({}) != default_job_id({})

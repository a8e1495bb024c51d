"""``tiermem estimate`` as a real command: against a running tiermemd's budget, without one, and bad input."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import run_tiermem_cli

from tiermem.client.capacity import probe_daemon


def tiermem(*args: str, home: str) -> subprocess.CompletedProcess[str]:
    home_env = {"HOME": home, "XDG_RUNTIME_DIR": home, "XDG_STATE_HOME": home, "TIERMEM_NO_EMBED": "1"}
    return run_tiermem_cli(*args, env=home_env)


@pytest.fixture
def private_daemon(daemon_factory):
    # the client trusts only a socket nobody else can write
    return daemon_factory({"server": {"socket_mode": 0o600}})


def test_probe_reads_the_pool_budget_of_a_running_daemon(private_daemon):
    budget = probe_daemon(private_daemon.socket_path)
    assert budget is not None
    assert budget.pool_capacity_nbytes == 64 << 20  # the fixture's pool.size
    assert budget.pool_free_nbytes == budget.pool_capacity_nbytes  # no job holds any of it yet
    assert budget.swap_capacity_nbytes > 0


def test_estimate_fits_against_the_daemons_pool(private_daemon, tmp_path):
    done = tiermem(
        "estimate", "--params", "5e6", "--gpus", "1", "--gpu-memory", "80GB", "--json",
        "--socket", private_daemon.socket_path, "--config", str(private_daemon.config_path),
        home=str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["node"]["pool_nbytes"] == 64 << 20
    assert report["chunk_numel"] == 1 << 18  # read from the daemon's settings
    rows = {(r["offload"], r["stage"]): r for r in report["estimates"]}
    cpu = rows[("cpu", 0)]
    assert cpu["host_nbytes_per_rank"] == 16 * 5_000_000 + report["window_nbytes"]
    assert cpu["fits"]["host"] is False  # 80 MB of state in a 64 MiB pool
    assert "daemon pool: needs" in cpu["reasons"][0]
    nvme = rows[("nvme", 0)]
    assert nvme["host_nbytes_per_rank"] == 7 * (1 << 18) * 18 + report["window_nbytes"]  # fp16 params kept apart
    assert nvme["fits"] == {"gpu": True, "host": True, "nvme": True, "all": True}


def test_estimate_without_a_daemon_uses_host_memory_and_prints_the_paper_table(tmp_path):
    done = tiermem(
        "estimate", "--params", "7.5e9", "--gpus", "64", "--offload", "none", "--no-daemon",
        "--swap-dir", str(tmp_path), "--gpu-memory", "32GB",
        home=str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    rows = [line for line in lines if line[:1] == ["none"]]
    assert [(r[1], r[2], r[-1]) for r in rows] == [
        ("0", "120.0", "GPU"),
        ("1", "31.4", "yes"),
        ("2", "16.6", "yes"),
        ("3", "1.9", "yes"),
    ]
    assert "GB = 1e9 bytes" in done.stdout
    assert f"free disk of {tmp_path}" in done.stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--params", "-5", "--gpus", "2"], "argument --params: params must be positive"),
        (["--params", "1e9", "--gpus", "8", "--nodes", "3"], "gpus (8) must be a multiple of nodes (3)"),
        (["--params", "1e9", "--gpus", "8", "--stage", "5"], "argument --stage: invalid choice: 5"),
        (["--params", "1e9", "--gpus", "0"], "argument --gpus: must be positive"),
        (["--params", "1e9", "--gpus", "8", "--offload", "gpu"], "argument --offload: invalid choice: 'gpu'"),
        (["--params", "1e9", "--gpus", "8", "--gpu-memory", "lots"], "argument --gpu-memory: expected a size"),
    ],
)
def test_bad_input_exits_2_naming_it(args, words, tmp_path):
    done = tiermem("estimate", "--no-daemon", *args, home=str(tmp_path))
    assert done.returncode == 2
    assert words in done.stderr
    assert done.stdout == ""


def test_help_lists_estimate_and_its_options(tmp_path):
    top = tiermem("--help", home=str(tmp_path))
    assert top.returncode == 0 and "estimate" in top.stdout
    sub = tiermem("estimate", "--help", home=str(tmp_path))
    assert sub.returncode == 0
    options = ("--params", "--gpus", "--nodes", "--stage", "--offload", "--state-dtype", "--json", "--gpu-memory")
    for option in (*options, "--swap-dir"):
        assert option in sub.stdout
    assert "4P + 12P/N" in sub.stdout


def test_compressed_moments_are_counted_in_the_pool_and_on_nvme(tmp_path):
    """``--state-dtype int8``: the daemon's share of a 7B ZeRO-3 run on 8 GPUs at 10.03 B/param in the pool
    and 12.03 on NVMe, against fp32's 16 and 18; the GPU's share unchanged."""
    runs = {}
    for state in ("fp32", "int8"):
        done = tiermem(
            "estimate", "--params", "7e9", "--gpus", "8", "--stage", "3", "--state-dtype", state, "--no-daemon",
            "--json", home=str(tmp_path),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        runs[state] = {e["offload"]: e for e in json.loads(done.stdout)["estimates"]}
    shard = -(-7 * 10**9 // 8)
    window = runs["fp32"]["cpu"]["host_nbytes_per_rank"] - 16 * shard
    assert runs["int8"]["cpu"]["host_nbytes_per_rank"] == -(-10_03125 * shard // 10**5) + window
    assert runs["int8"]["nvme"]["nvme_nbytes_per_rank"] == -(-12_03125 * shard // 10**5)
    assert runs["int8"]["cpu"]["gpu_nbytes"] == runs["fp32"]["cpu"]["gpu_nbytes"]

"""``tiermem estimate`` as a real command: against a running tiermemd's budget, without one, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import child_env
from conftest import run_tiermem_cli

from tiermem.client.capacity import free_disk, probe_daemon
from tiermem.client.estimate_cli import DEFAULT_NODE_CONFIG
from tiermem.core.errors import AdmissionError
from tiermem.core.estimate import NodeCapacity, RunShape, estimate, fit, format_gb
from tiermem.core.modes import Exchange, Placement
from tiermem.core.protocol import ParamGroup, TensorSpec
from tiermem.net.privatedir import PRIVATE_SWAP


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
    assert report["cache_chunks"] == 6  # read from the daemon's settings (swap.cache_chunks)
    assert nvme["host_nbytes_per_rank"] == 6 * (1 << 18) * 18 + report["window_nbytes"]  # fp16 params kept apart
    assert nvme["fits"] == {"gpu": True, "host": True, "nvme": True, "all": True}


def admit_nvme_rank(daemon, job_id: str, numel: int, state_dtype: str) -> dict[str, int]:
    """Register one rank of ``numel`` fp16 elements on the NVMe tier as mixed-precision training does (the staged
    exchange); what the daemon's budget holds for it then, by resource.  Raises what admission raises."""
    client = daemon.client()
    try:
        client.attach(job_id, window_nbytes=1 << 20)
        spec = TensorSpec(name="w", shape=(numel,), dtype="float16", placement=Placement.NVME)
        client.register([spec], [ParamGroup(lr=1e-3)], exchange=Exchange.STAGED, state_dtype=state_dtype)
        held = {b.resource: b.held_nbytes for b in client.stats().node.budgets}
        client.detach()
        return held
    finally:
        client.close()


@pytest.mark.parametrize(
    ("numel", "state_dtype"), [(1_000_000, "fp32"), (777_777, "int8"), (3_000_001, "bf16")], ids=str
)
def test_estimates_nvme_figures_are_what_admission_reserves(private_daemon, tmp_path, numel, state_dtype):
    """The estimate's swap per rank is the swap the daemon reserves for the same rank on the same disk (two
    copies of the state, each chunk's parts in whole pages, and the chunk cache), and its pool share less the
    window is the cache the daemon reserves: to the byte, with the daemon's own settings."""
    done = tiermem(
        "estimate", "--params", str(numel), "--gpus", "1", "--stage", "0", "--offload", "nvme",
        "--state-dtype", state_dtype, "--gpu-memory", "80GB", "--json",
        "--socket", private_daemon.socket_path, "--config", str(private_daemon.config_path),
        home=str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    (row,) = report["estimates"]
    held = admit_nvme_rank(private_daemon, f"sized-{numel}", numel, state_dtype)
    assert row["nvme_nbytes_per_rank"] == held["swap"]
    assert row["host_nbytes_per_rank"] - report["window_nbytes"] == held["pool"]
    assert held["swap"] > 2 * 12 * numel  # two copies of at least 12 B a param (int8), not one of 18


def test_a_model_the_estimate_says_does_not_fit_is_refused_and_one_it_says_fits_is_admitted(daemon_factory):
    """A job's swap quota (``jobs.max_swap``) is the swap it may take: of two models whose 18 B a param fit it,
    the estimate says the larger does not (two copies and the cache do not), and admission agrees."""
    quota = 64 << 20
    daemon = daemon_factory({"server": {"socket_mode": 0o600}, "jobs": {"max_swap": quota}})
    node = NodeCapacity(gpu_nbytes=80 * 10**9, host_nbytes=10**12, nvme_nbytes=quota, nvme_from="jobs.max_swap")
    verdicts = {}
    for numel in (1_000_000, 2_000_000):
        assert 18 * numel <= quota  # the old count said both fit
        shape = RunShape(params=numel, gpus=1, chunk_numel=1 << 18, cache_chunks=6)
        verdicts[numel] = fit(estimate(shape, 0, "nvme"), node).nvme
    assert verdicts == {1_000_000: True, 2_000_000: False}
    assert admit_nvme_rank(daemon, "fits", 1_000_000, "fp32")["swap"] <= quota
    with pytest.raises(AdmissionError, match="swap"):
        admit_nvme_rank(daemon, "too-big", 2_000_000, "fp32")


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


def test_no_settings_file_measures_a_private_daemons_swap(tmp_path):
    if Path(DEFAULT_NODE_CONFIG).exists():
        pytest.skip(f"{DEFAULT_NODE_CONFIG} exists: the node settings' swap.dirs apply")
    tmpdir = tmp_path / "t"  # short: a private directory's socket must fit AF_UNIX under it
    tmpdir.mkdir()
    env = {k: v for k, v in child_env().items() if k != "TIERMEM_CONFIG"}  # no settings file at all
    env.update(HOME=str(tmp_path / "home"), TMPDIR=str(tmpdir), TIERMEM_NO_EMBED="1")
    env.pop("XDG_STATE_HOME", None)

    def estimate_cli(*args: str) -> str:
        cmd = [sys.executable, "-m", "tiermem.client.cli", "estimate", "--params", "1e8", "--gpus", "1", *args]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout

    # not the daemon settings' default (under $HOME): with no settings file no node daemon uses it
    where = f"free disk of {tmpdir} ({PRIVATE_SWAP})"
    assert f"NVMe  {format_gb(free_disk([tmpdir])[0])} ({where})" in estimate_cli("--offload", "nvme", "--no-daemon")
    assert json.loads(estimate_cli("--no-daemon", "--json"))["node"]["nvme_from"] == where


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--params", "-5", "--gpus", "2"], "argument --params: params must be positive"),
        (["--params", "1e9", "--gpus", "8", "--nodes", "3"], "gpus (8) must be a multiple of nodes (3)"),
        (["--params", "1e9", "--gpus", "8", "--stage", "5"], "argument --stage: invalid choice: 5"),
        (["--params", "1e9", "--gpus", "0"], "argument --gpus: must be positive"),
        (["--params", "1e9", "--gpus", "8", "--offload", "gpu"], "argument --offload: invalid choice: 'gpu'"),
        (["--params", "1e9", "--gpus", "8", "--gpu-memory", "lots"], "argument --gpu-memory: expected a size"),
        (["--params", "1e9", "--gpus", "8", "--gpu-memory", "0"], "argument --gpu-memory: must be more than 0 bytes"),
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
    and twice 12.03 on NVMe, against fp32's 16 and 18; the GPU's share unchanged."""
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
    # on NVMe: two copies of 12.03 B a param (each chunk's parts in whole pages: only the last chunk's round up)
    nvme = runs["int8"]["nvme"]
    twice_state = nvme["nvme_nbytes_per_rank"] - (nvme["host_nbytes_per_rank"] - window)
    assert 2 * -(-12_03125 * shard // 10**5) <= twice_state < 2 * (-(-12_03125 * shard // 10**5) + 3 * 4096)
    assert runs["int8"]["cpu"]["gpu_nbytes"] == runs["fp32"]["cpu"]["gpu_nbytes"]

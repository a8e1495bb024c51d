"""``tiermem demo`` end to end: its progress display, its table and its loss-curve PNG."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from child_env import child_env


def demo(*args: str, cwd, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = child_env("GOMP_", "OMP_WAIT_")
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "tiermem.client.cli", "demo", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def table_rows(stdout: str) -> dict[str, list[str]]:
    rows = [line.split() for line in stdout.splitlines() if re.match(r"^(adamw|cpuadam|offload)\S*\s+\d", line)]
    return {row[0]: row for row in rows}


def test_demo_shows_progress_prints_its_table_and_writes_the_loss_png(tmp_path):
    done = demo("--runs", "adamw", "--steps", "12", "--params", "1e5", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert re.search(r"adamw\s*: 100%\|.*\| 12/12 .*loss=", done.stderr)  # tqdm's bar, with the loss
    assert "adamw" in table_rows(done.stdout)
    png = tmp_path / "tiermem-demo-loss.png"  # the default: the current directory
    assert f"loss curves: {png}" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_quiet_names_an_unwritable_plot_path(tmp_path):
    target = tmp_path / "missing" / "loss.png"
    done = demo("--runs", "adamw", "--steps", "6", "--params", "1e5", "--quiet", "--plot", str(target), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "%|" not in done.stderr  # no progress bar
    assert f"loss curves: not written: cannot write {target}" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_demo_runs_compressed_state_and_says_what_its_rows_mean(tmp_path):
    done = demo("--runs", "adamw,offload-int8", "--steps", "6", "--params", "1e5", "--quiet", "--no-plot", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = table_rows(done.stdout)
    assert set(rows) == {"adamw", "offload-int8"}
    assert float(rows["offload-int8"][1]) == pytest.approx(float(rows["adamw"][1]), rel=0.05)
    assert "offload-int8 keep the Adam moments compressed" in done.stdout
    assert "offload-dpu updates" not in done.stdout  # each note only under its own rows


def test_demo_nvme_run_pages_its_state_through_the_disk(tmp_path):
    done = demo("--runs", "adamw,offload-nvme", "--steps", "6", "--params", "1e5", "--quiet", "--no-plot", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = table_rows(done.stdout)
    assert rows["offload-nvme"][1] == rows["adamw"][1]
    paged = rows["offload-nvme"][-1]
    assert re.fullmatch(r"[\d.]+(KiB|MiB|GiB)", paged), paged  # a state that fits a cache whole shows 0B
    assert "offload-nvme keeps its state on disk in 8 chunks and caches 4 of them" in done.stdout


def test_demo_that_cannot_start_its_daemon_says_why_in_one_line(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    done = demo(
        "--runs", "adamw,offload-nvme", "--steps", "2", "--params", "1e5", "--quiet", "--no-plot",
        "--swap-dir", str(not_a_dir / "swap"), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tiermem demo: no tiermemd at "), last
    assert f"swap.dirs {not_a_dir / 'swap'} unusable: {not_a_dir} is not a directory" in last, last


def test_demo_says_how_its_trainers_openmp_workers_wait(tmp_path):
    done = demo("--runs", "adamw", "--steps", "6", "--params", "1e5", "--quiet", "--no-plot", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "trainer OpenMP: GOMP_SPINCOUNT=20000 (idle workers spin for 20,000 polls" in done.stderr
    assert "trainer OpenMP: GOMP_SPINCOUNT=20000" in done.stdout  # under the table too
    done = demo(
        "--runs", "adamw", "--steps", "6", "--params", "1e5", "--quiet", "--no-plot", cwd=tmp_path,
        extra_env={"OMP_WAIT_POLICY": "PASSIVE"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "trainer OpenMP: OMP_WAIT_POLICY=PASSIVE (from the environment)" in done.stdout
    assert "GOMP_SPINCOUNT" not in done.stdout


def test_demo_refuses_an_unknown_run_naming_the_choices(tmp_path):
    done = demo("--runs", "adamw,offload-fp8", "--quiet", "--no-plot", cwd=tmp_path)
    assert done.returncode == 2
    assert "unknown run(s) ['offload-fp8']" in done.stderr and "offload-int8" in done.stderr


def test_no_plot_clears_the_path():
    from tiermem.client.cli import build_parser

    assert build_parser().parse_args(["demo"]).plot == "tiermem-demo-loss.png"
    assert build_parser().parse_args(["demo", "--no-plot"]).plot == ""


@pytest.mark.slow
def test_demo_offloaded_runs_match_adamw_and_share_the_png(tmp_path):
    done = demo(
        "--runs", "adamw,offload-cpu,offload-nvme", "--steps", "20", "--params", "2e5",
        "--swap-dir", str(tmp_path / "swap"), "--plot", str(tmp_path / "runs.png"), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = table_rows(done.stdout)
    assert set(rows) == {"adamw", "offload-cpu", "offload-nvme"}
    assert rows["offload-cpu"][1] == rows["adamw"][1]  # the same final loss to 4 decimals
    assert (tmp_path / "runs.png").stat().st_size > 0

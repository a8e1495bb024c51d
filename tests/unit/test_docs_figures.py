"""Figures of README.md's headline table and of the benchmarks/README.md index, read from the JSON files they cite.

A figure that drifts from its file fails; a row whose run left no JSON says so in the table and is skipped
with that reason.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = (ROOT / "benchmarks" / "README.md").read_text()
README = (ROOT / "README.md").read_text()


def result(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The rows of the first Markdown table after `heading`, as lists of stripped cells (header and rule dropped)."""
    after = text.split(heading, 1)[1]
    block: list[str] = []
    for line in after.splitlines():
        if line.startswith("|"):
            block.append(line)
        elif block:
            break
    assert block, heading
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in block[2:]]


def cited_json(cell: str) -> list[str]:
    """JSON files named in a cell, globs expanded."""
    names: list[str] = []
    for pattern in re.findall(r"`([A-Za-z0-9_*.-]+\.json)`", cell):
        found = sorted(p.name for p in RESULTS.glob(pattern))
        assert found, f"{pattern} names no file under benchmarks/results/"
        names.extend(found)
    return names


HEADLINE = {row[0]: row for row in table_rows(README, "## Headline figures")}


def headline(prefix: str) -> list[str]:
    (row,) = [row for what, row in HEADLINE.items() if what.startswith(prefix)]
    return row


def figures(row: list[str], source: str) -> str:
    """The row's figure cell after checking that its JSON cell names `source`; skips a row whose JSON was not kept."""
    what, figure, _load, json_cell = row
    if json_cell.startswith("not kept"):
        pytest.skip(f"{what}: {json_cell}; rerun its benchmark with --json to record it")
    assert cited_json(json_cell) == [source], what
    return figure


@pytest.mark.parametrize("what", sorted(HEADLINE))
def test_every_headline_row_names_its_json_or_says_it_was_not_kept(what: str) -> None:
    json_cell = HEADLINE[what][3]
    assert json_cell.startswith("not kept (figures in git:") or cited_json(json_cell), what


def cpu_adam_ratios(numel: int) -> tuple[float, float, float]:
    """tiermem's speed over the probe's, torch fused's and DeepSpeed's, at ``numel`` params."""
    rows = result("cpu_adam.json")["sizes"][str(numel)]
    return tuple(rows[name]["tiermem_ratio"] for name in ("bound: same-bytes probe", "torch fused", "deepspeed"))


def test_headline_cpu_adam_row() -> None:
    figure = figures(headline("CPU Adam update"), "cpu_adam.json")
    probe, fused, deepspeed = cpu_adam_ratios(64 << 20)
    assert result("cpu_adam.json")["deepspeed"].startswith("DeepSpeedCPUAdam from deepspeed ")
    assert (
        f"{probe:.2f}x the speed of a same-bytes memory probe; {fused:.2f}x torch's fused AdamW, "
        f"{deepspeed:.2f}x DeepSpeedCPUAdam"
    ) in figure


def swap_ratios(qd: int) -> tuple[float, float, float, float]:
    """The store's write and read GB/s over fio's and over DeepSpeed's, 1 MiB requests at queue depth ``qd``."""
    (row,) = [r for r in result("swap.json")["rows"] if r["block"] == 1 << 20 and r["qd"] == qd]
    store, fio, ds = row["store"], row["fio"], row["deepspeed"]
    return store[0] / fio[0], store[1] / fio[1], store[0] / ds[0], store[1] / ds[1]


def test_headline_swap_row() -> None:
    figure = figures(headline("swap store"), "swap.json")
    assert result("swap.json")["size"] == 4 << 30
    fio_w, fio_r, ds_w, ds_r = swap_ratios(32)
    assert f"{fio_w:.2f}x / {fio_r:.2f}x fio; {ds_w:.2f}x / {ds_r:.2f}x DeepSpeed's aio_handle" in figure


def infinity_best(params: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Our paged step's row of ``infinity.json`` at ``params``, and DeepSpeed's fastest config's."""
    runs = {r["name"]: r for r in result("infinity.json")["sizes"][params]["rows"] if "step_s" in r}
    ours = runs.pop("tiermem")
    return ours, min(runs.values(), key=lambda r: r["step_s"])


def test_headline_infinity_row_is_infinity_json() -> None:
    figure = figures(headline("paged NVMe step"), "infinity.json")
    (ours, best), (ours_100m, best_100m) = infinity_best("300000000"), infinity_best("100000000")
    assert (
        f"{ours['step_s'] / best['step_s']:.2f}x DeepSpeed ZeRO-Infinity's best step "
        f"({ours_100m['step_s'] / best_100m['step_s']:.2f}x at 100M) at {ours['peak_rss'] / best['peak_rss']:.2f}x "
        "its peak host memory"
    ) in figure
    assert ours["loss_gap"] < 1e-5 < best["loss_gap"]


def demo_openmp_ratios() -> dict[tuple[str, str], float]:
    return {(r["setting"], r["run"]): r["vs_default_adamw"] for r in result("demo-openmp.json")["rows"]}


def test_headline_demo_step_row_is_demo_openmp_json() -> None:
    figure = figures(headline("training step of the demo GPT"), "demo-openmp.json")
    ratios = demo_openmp_ratios()
    assert f"CPU tier {ratios['demo', 'offload-cpu']:.3f}x, NVMe tier {ratios['demo', 'offload-nvme']:.3f}x" in figure
    assert f"AdamW itself {ratios['demo', 'adamw']:.3f}x" in figure


def memory_300m_ratios() -> tuple[float, float, float]:
    peaks = {r["mode"]: r["peak_nbytes"] for r in result("memory-300m.json")["runs"]}
    adamw = peaks["adamw"]
    return peaks["offload-cpu-release"] / adamw, peaks["offload-cpu"] / adamw, peaks["offload-nvme-release"] / adamw


def test_headline_memory_row_is_memory_300m_json() -> None:
    figure = figures(headline("peak host memory"), "memory-300m.json")
    low, high, nvme = memory_300m_ratios()
    assert f"CPU tier {low:.2f}-{high:.2f}x in-process AdamW; NVMe tier with grads released {nvme:.2f}x" in figure


def scale_2g() -> dict[str, Any]:
    return {r["mode"]: r for r in result("scale.json")["results"]}


def test_headline_largest_model_row_is_scale_json() -> None:
    figure = figures(headline("largest model"), "scale.json")
    runs = scale_2g()
    paged, adamw = runs["offload-nvme-paged"], runs["adamw"]
    assert result("scale.json")["limit_nbytes"] == 2 * 2**30
    assert paged["capped"]
    ratio = paged["largest_params"] / adamw["largest_params"]
    assert (
        f">= {paged['largest_params'] / 1e9:.2f}B params with param paging on NVMe (the search's cap), "
        f"{ratio:.1f}x in-process AdamW's {adamw['largest_params'] / 1e6:.0f}M; step {paged['step_over_bound']:.2f}x"
    ) in figure


# --- benchmarks/README.md: the index -------------------------------------------------------------------------

INDEX_ROWS = table_rows(INDEX, "# Benchmarks")


def index_row(script: str, source: str) -> str:
    (row,) = [row for row in INDEX_ROWS if row[0] == script and source in cited_json(row[3])]
    return row[4]


def test_the_index_stays_under_10_kb() -> None:
    assert len(INDEX.encode()) <= 10_000


def committed(under: str) -> set[str]:
    """Names of the files git tracks under `under`; skips where there is no git checkout to ask."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", under], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no git checkout to ask which files are committed: {exc}")
    return {Path(p).name for p in listed}


def test_every_script_in_the_index_exists_and_every_committed_benchmark_is_indexed() -> None:
    indexed = {row[0] for row in INDEX_ROWS}
    assert all((ROOT / "benchmarks" / script).is_file() for script in indexed), indexed
    scripts = {name for name in committed("benchmarks") if name.endswith(".py")}
    helpers = {name for name in scripts if name.endswith("_worker.py")} | {"report.py"}
    missing = scripts - helpers - indexed
    assert not missing, f"benchmarks without a row in benchmarks/README.md: {sorted(missing)}"


def test_every_json_the_index_cites_is_committed() -> None:
    cited = {name for row in INDEX_ROWS for name in cited_json(row[3])}
    cited |= {name for row in HEADLINE.values() for name in cited_json(row[3])}
    missing = cited - committed("benchmarks/results")
    assert not missing, f"cited but not committed (benchmarks/results is gitignored): {sorted(missing)}"


def test_index_rows_shared_with_the_headline_table_agree_with_their_json() -> None:
    ratios = demo_openmp_ratios()
    demo = index_row("bench_demo_openmp.py", "demo-openmp.json")
    assert f"CPU tier {ratios['demo', 'offload-cpu']:.3f}x, NVMe tier {ratios['demo', 'offload-nvme']:.3f}x" in demo
    assert f"libgomp default {ratios['libgomp default', 'offload-cpu']:.3f}x" in demo
    assert f"`PASSIVE` AdamW {ratios['passive', 'adamw']:.3f}x" in demo
    low, high, nvme = memory_300m_ratios()
    assert f"CPU tier {low:.2f}-{high:.2f}x, NVMe tier with grads released {nvme:.2f}x" in index_row(
        "bench_memory.py", "memory-300m.json"
    )
    paged = scale_2g()["offload-nvme-paged"]
    assert f"{paged['largest_params'] / 1e9:.2f}B paged" in index_row("bench_scale.py", "scale.json")
    fio_w, fio_r, ds_w, ds_r = swap_ratios(32)
    swap = index_row("bench_swap.py", "swap.json")
    assert f"store {fio_w:.2f}x / {fio_r:.2f}x fio, {ds_w:.2f}x / {ds_r:.2f}x aio_handle" in swap
    assert "QD8 {:.2f}x / {:.2f}x fio".format(*swap_ratios(8)[:2]) in swap
    cpu_adam = index_row("bench_cpu_adam.py", "cpu_adam.json")
    for numel, label in ((64 << 20, "64M"), (16 << 20, "16M")):
        probe, fused, deepspeed = cpu_adam_ratios(numel)
        assert f"{label}: {probe:.2f}x" in cpu_adam and f"{fused:.2f}x" in cpu_adam and f"{deepspeed:.2f}x" in cpu_adam


def test_index_scale_rows_are_their_json() -> None:
    runs = result("scale-4g.json")["runs"]
    (paged,) = runs["paged_2_2e9"]["results"]
    (adamw,) = runs["adamw_bisect"]["results"]
    ratio = paged["largest_params"] / adamw["largest_params"]
    assert (
        f"paged {paged['largest_params'] / 1e9:.2f}B, {ratio:.1f}x AdamW's {adamw['largest_params'] / 1e6:.0f}M"
        in index_row("bench_scale.py", "scale-4g.json")
    )
    (auto,) = result("scale-layout-2b-bf16-auto.json")["results"]
    assert f"{auto['pager_requests']:,} requests" in index_row("bench_scale.py", "scale-layout-2b-bf16-auto.json")
    by_dtype = {r["state_dtype"]: r for r in result("scale-layout-1b-state-dtypes.json")["results"]}
    fp32, bf16, int8 = by_dtype["fp32"], by_dtype["bf16"], by_dtype["int8"]
    row = index_row("bench_scale.py", "scale-layout-1b-state-dtypes.json")
    moved = [by_dtype[d]["paged_nbytes"] / fp32["paged_nbytes"] for d in ("bf16", "int8")]
    took = [bf16["step_s"] / fp32["step_s"], int8["step_s"] / fp32["step_s"]]
    assert f"disk bytes {moved[0]:.2f}x / {moved[1]:.2f}x, time {took[0]:.2f}x / {took[1]:.2f}x" in row


def test_index_ranks_overlap_and_lowbit_rows_are_their_json() -> None:
    (four,) = [r for r in result("ranks-32m.json")["rows"] if r["ranks"] == 4]
    rounds = four["update_vs_single_rounds"]
    assert f"4 ranks: {four['update_vs_single']:.2f}x (rounds {min(rounds):.2f}-{max(rounds):.2f})" in index_row(
        "bench_ranks.py", "ranks-32m.json"
    )
    spans = [r["on_vs_off"] for run in result("overlap-32m.json").values() for r in run["rows"]]
    assert f"{min(spans):.2f}-{max(spans):.2f}x" in index_row("bench_overlap.py", "overlap-32m.json")
    size = result("lowbit-adam.json")["sizes"][str(64 * 2**20)]
    row = index_row("bench_lowbit_adam.py", "lowbit-adam.json")
    assert f"bf16 {size['tiermem bf16']['vs_probe']:.2f}x, int8 {size['tiermem int8']['vs_probe']:.2f}x" in row
    torchao = size["torchao AdamW8bit"]["seconds"] / size["tiermem int8"]["seconds"]
    assert f"int8 {torchao:.1f}x torchao" in row


def test_index_accumulated_clip_row_is_its_json() -> None:
    clip = result("accumulated-clip.json")
    low, high = sorted(clip["over_no_clip"].values())
    row = index_row("bench_accumulated_clip.py", "accumulated-clip.json")
    assert f"{clip['params'] / 1e6:.1f}M: GRAD_NORM {clip['grad_norm_ms']:.1f} ms, step {low:.2f}-{high:.2f}x" in row


def test_index_launch_and_soak_rows_are_their_json() -> None:
    stress = result("stress-zero3-paged-after.json")
    assert f"{stress['finished']} of {stress['launches']} finished" in index_row(
        "stress_zero3_paged.py", "stress-zero3-paged-after.json"
    )
    soak = result("soak.json")
    kills = soak["totals"]
    row = index_row("soak.py", "soak.json")
    assert f"{soak['rounds']} rounds: {kills['client_kills']['killed']} trainers, " in row
    assert f"{kills['daemon_kill']['daemon_restarts']} daemons killed" in row
    assert not soak["ledger_problems"] and "0 ledger problems" in row
    runs = result("soak-torchrun.json")["runs"]
    assert f"{len(runs)} launches" in index_row("soak_torchrun.py", "soak-torchrun.json")
    burst = {b["daemon"]: b for b in result("connections.json")["burst"]}
    row = index_row("bench_connections.py", "connections.json")
    assert f"{burst['this']['connect_failed']} of {burst['this']['connections']:,} connects failed" in row
    assert f"(before: {burst['baseline']['connect_failed']})" in row


def test_index_infinity_row_is_its_json() -> None:
    row = index_row("bench_infinity.py", "infinity.json")
    sizes = result("infinity.json")["sizes"]
    ratios, peaks = [], []
    for params in ("100000000", "300000000"):
        runs = {r["name"]: r for r in sizes[params]["rows"] if "step_s" in r}
        ours = runs.pop("tiermem")
        best = min(runs.values(), key=lambda r: r["step_s"])
        ratios.append(f"{ours['step_s'] / best['step_s']:.2f}x")
        peaks.append((ours["peak_rss"] / 2**30, best["peak_rss"] / 2**30))
        assert ours["loss_gap"] < 1e-5 < best["loss_gap"]
    rerun = {r["name"]: r for r in result("infinity-300m-rerun.json")["sizes"]["300000000"]["rows"] if "step_s" in r}
    ours_again = rerun.pop("tiermem")
    again = ours_again["step_s"] / min(r["step_s"] for r in rerun.values())
    assert f"step {ratios[0]} DeepSpeed's best at 100M, {ratios[1]} at 300M ({again:.2f}x in the rerun)" in row
    (ours_100m, its_100m), (ours_300m, its_300m) = peaks
    assert f"peak RSS {ours_100m:.2f} / {ours_300m:.2f} GiB against its {its_100m:.2f} / {its_300m:.2f}" in row


def test_index_gpu_row_is_its_json() -> None:
    paging = result("gpu-check-h200-paging.json")["paging"]
    row = index_row("gpu_check.py", "gpu-check-h200-paging.json")
    assert f"paged 25M GPT {paging['paged']['step_over_unpaged']:.2f}x unpaged" in row
    assert f"({paging['paged_16MiB_window']['step_over_unpaged']:.2f}x, 16 MiB window)" in row
    bandwidth = result("gpu-check-h200.json")["bandwidth"]
    assert f"window copies {bandwidth['window (cudaHostRegister) h2d GB/s']:.0f} GB/s" in row


def busy(name: str) -> dict[tuple[str, int], dict[str, Any]]:
    """bench_busy's rows by (size, neighbour count)."""
    return {(r["size"], r["neighbours"]): r for r in result(name)["rows"]}


def test_index_busy_rows_are_their_json() -> None:
    after, before = busy("busy-ops.json"), busy("busy-ops-before.json")
    row = index_row("bench_busy.py", "busy-ops.json")
    for size in ("16M", "100M"):
        now = " / ".join(f"{after[size, n]['busy_ratio']:.2f}x" for n in (1, 2))
        then = " / ".join(f"{before[size, n]['busy_ratio']:.2f}x" for n in (1, 2))
        assert f"{size} {now} (before {then})" in row
    train, train_before, spin = busy("busy-train.json"), busy("busy-train-before.json"), busy("busy-train-spin20k.json")
    row = index_row("bench_busy.py", "busy-train-mean.json")
    assert f"{train['100M', 1]['busy_ratio']:.2f}x (before {train_before['100M', 1]['busy_ratio']:.2f}x)" in row
    assert f"{spin['100M', 1]['busy_ratio']:.2f}x / {spin['100M', 2]['busy_ratio']:.2f}x with" in row
    mean, block3 = busy("busy-train-mean.json"), busy("busy-train-block3.json")

    def both(rows: dict[tuple[str, int], dict[str, Any]], key: str) -> str:
        return f"{rows['100M', 1][key]:.2f}x / {rows['100M', 2][key]:.2f}x"

    assert f"busy ratio {both(mean, 'busy_ratio')}, by means {both(mean, 'busy_ratio_mean')}" in row
    assert f"no optimizer {both(mean, 'none_slowdown_mean')}, AdamW {both(mean, 'adamw_slowdown_mean')}" in row
    assert f"CPU tier {both(mean, 'cpu_slowdown_mean')}" in row
    one = block3["100M", 1]
    assert f"{one['busy_ratio']:.2f}x by medians and {one['busy_ratio_mean']:.2f}x by means" in row
    assert f"(no optimizer {one['none_slowdown_mean']:.2f}x, CPU tier {one['cpu_slowdown_mean']:.2f}x)" in row


def test_index_paged_bytes_row_is_its_json() -> None:
    row = index_row("bench_scale.py", "scale-fp32-300m.json")
    for name, label in (("100m", "100M"), ("300m", "300M"), ("1b", "1B")):
        (now,) = result(f"scale-fp32-{name}.json")["results"]
        (then,) = result(f"scale-fp32-{name}-before.json")["results"]
        assert f"{label} {now['moved_per_param']:.1f} ({now['over_min']:.2f}x; before {then['over_min']:.2f}x)" in row

"""benchmarks/report.py: the benchmarks' JSON in, a markdown report and PNG plots out, missing inputs named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_modules import benchmark_module

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report():
    with benchmark_module("report", name="bench_report") as module:
        yield module


def cpu_row(rate: float, tiermem_rate: float) -> dict:
    return {"seconds": 1 / rate, "params_per_s": rate, "tiermem_ratio": tiermem_rate / rate}


CPU_ADAM = {  # the shape bench_cpu_adam.py writes
    "threads": 2,
    "torch": "2.13.0+cpu",
    "deepspeed": "not importable",
    "sizes": {
        str(n): {
            "bound: triad": {"seconds": 0.01, "gb_s": 9.0, "bytes_per_element": 12},
            "bound: same-bytes probe": cpu_row(0.5e9, 0.6e9),
            "tiermem": cpu_row(0.6e9, 0.6e9),
            "torch fused": cpu_row(0.3e9, 0.6e9),
            "torch foreach": cpu_row(0.03e9, 0.6e9),
        }
        for n in (1 << 20, 1 << 24)
    },
}
SWAP = {  # bench_swap.py: (write, read) GB/s per system
    "size": 512 << 20,
    "repeats": 1,
    "notes": [],
    "rows": [
        {"block": bs, "qd": qd, "fio": [0.5, 1.0], "engine": [0.5, 1.1], "store": [0.45, 1.2]}
        for bs in (1 << 20, 128 << 10)
        for qd in (1, 8, 32)
    ],
    "tier": {"fio_s": 2.0, "store_s": 1.9, "page_out_s": 1.0, "page_in_s": 0.5},
    "aiofiles": [0.3, 0.8],
}


def memory_run(mode: str, peak: int, numel: int = 100_000_000, status: str = "ok") -> dict:
    return {
        "mode": mode,
        "dtype": "float32",
        "params_target": 100_000_000,
        "status": status,
        "peak_nbytes": peak,
        "numel": numel,
    }


MEMORY_OLD = {
    "machine": {"date": "2026-12-01T09:00:00+0000"},
    "runs": [memory_run("adamw", 2_000_000_000), memory_run("offload-nvme", 3_000_000_000)],
}
MEMORY_NEW = {
    "machine": {"date": "2026-12-01T11:00:00+0000"},
    "runs": [memory_run("offload-nvme", 1_000_000_000), memory_run("offload-cpu", 0, status="failed")],
}


def step_row(size: str, mode: str, step: float, ratio: float) -> dict:
    median = {
        "step_s": step,
        "fwd_bwd_s": 0.6 * step,
        "opt_step_s": 0.35 * step,
        "grad_copy_s": 0.05 * step,
        "wait_s": 0.2 * step,
        "param_copy_s": 0.0,
    }
    return {"size": size, "params": int(float(size[:-1]) * 1e6), "mode": mode, "median": median, "ratio": ratio}


TRAIN_STEP = {
    "args": {"batch": 8, "block": 64, "steps": 6, "warmup": 2},
    "results": [step_row("10M", "torch", 0.5, 1.0), step_row("10M", "cpu", 0.55, 1.1)],
}


def write_results(root: Path, **files: object) -> Path:
    root.mkdir(exist_ok=True)
    for name, data in files.items():
        (root / f"{name}.json").write_text(json.dumps(data))
    return root


def test_every_figure_with_its_json_gets_a_table_and_a_plot(report, tmp_path):
    results = write_results(
        tmp_path / "results",
        cpu_adam=CPU_ADAM,
        swap=SWAP,
        **{"memory-old": MEMORY_OLD, "memory-new": MEMORY_NEW},
        train_step=TRAIN_STEP,
    )
    assert report.main(["--results", str(results)]) == 0
    for png in ("cpu_adam.png", "swap.png", "bytes_per_param.png", "step_breakdown.png"):
        assert (results / png).read_bytes()[:8] == PNG, png
    assert not (results / "largest_model.png").exists()
    text = (results / "report.md").read_text()
    assert "| CPU Adam, 16M params | 0.60 Gparam/s, 1.20x the memory probe; 2.00x torch fused |" in text
    assert "| swap store, 1 MiB requests at QD32 | 0.45 / 1.20 GB/s write / read, 0.90x / 1.20x fio |" in text
    # the newest run of each cell: offload-nvme from memory-new (10 B/param), adamw from memory-old (20)
    assert (
        "| host memory, 100M fp32 params, offload-nvme | 10.0 B/param, 0.50x in-process AdamW (20.0 B/param) |" in text
    )
    assert "| training step, 10M GPT, state on the CPU tier | 1.10x in-process fused AdamW |" in text
    assert "| largest model by mode | not measured yet |" in text
    assert "- largest model by mode: no `scale*.json`; make it with `./run.sh bench scale" in text
    assert "![Where" not in text and "](step_breakdown.png)" in text


def test_the_largest_model_plot_is_made_once_bench_scales_json_exists(report, tmp_path):
    scale = {  # the shape bench_scale.py writes
        "limit_nbytes": 2 << 30,
        "results": [
            {"mode": "adamw", "largest_params": 100_000_000, "capped": False, "step_s": 12.0},
            {"mode": "offload-nvme-paged", "largest_params": 1_200_000_000, "capped": True, "step_s": 200.0,
             "step_over_bound": 1.25},
        ],
    }  # fmt: skip
    results = write_results(tmp_path / "results", scale=scale)
    out = tmp_path / "out"
    assert report.main(["--results", str(results), "--out", str(out)]) == 0
    assert (out / "largest_model.png").read_bytes()[:8] == PNG
    text = (out / "report.md").read_text()
    assert (
        "| largest model in the memory limit | >= 1.2G params with offload-nvme-paged, 12.0x in-process AdamW; "
        "step 1.25x the disk bound |" in text
    )
    assert "| offload-nvme-paged | >= 1.2G | 12.0x | 200.0 | 1.25x |" in text
    assert "| adamw | 100M | 1.0x | 12.0 |  |" in text
    assert "2 GiB memory cgroup" in text


def test_a_scale_json_of_several_dtypes_names_them_and_compares_each_with_its_own_adamw(report, tmp_path):
    scale = {  # bench_scale.py --dtypes fp32,bf16
        "limit_nbytes": 4 << 30,
        "results": [
            {"mode": "adamw", "dtype": "fp32", "largest_params": 100_000_000, "capped": False, "step_s": 12.0},
            {"mode": "adamw", "dtype": "bf16", "largest_params": 200_000_000, "capped": False, "step_s": 10.0},
            {"mode": "offload-nvme-paged", "dtype": "fp32", "largest_params": 1_000_000_000, "capped": True,
             "step_s": 100.0},
            {"mode": "offload-nvme-paged", "dtype": "bf16", "largest_params": 1_000_000_000, "capped": True,
             "step_s": 90.0},
        ],
    }  # fmt: skip
    results = write_results(tmp_path / "results", scale=scale)
    out = tmp_path / "out"
    assert report.main(["--results", str(results), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "| mode | dtype | largest model | x adamw | step s | x disk bound |" in text
    assert "| offload-nvme-paged | fp32 | >= 1G | 10.0x | 100.0 |  |" in text
    assert "| offload-nvme-paged | bf16 | >= 1G | 5.0x | 90.0 |  |" in text


def test_a_json_of_an_unknown_shape_is_reported_not_plotted(report, tmp_path):
    results = write_results(tmp_path / "results", scale={"something": "else"}, swap={"rows": []})
    assert report.main(["--results", str(results)]) == 0
    text = (results / "report.md").read_text()
    assert (
        "- largest model by mode: no `scale*.json (present but not understood: ValueError expected rows with 'mode'"
        in text
    )
    assert "- swap I/O: no `swap.json (present but not understood: IndexError" in text
    assert not (results / "swap.png").exists()


def test_newest_memory_run_wins_and_failed_runs_are_skipped(report):
    runs = report.newest_memory_runs([("old.json", MEMORY_OLD), ("new.json", MEMORY_NEW)])
    assert runs[("offload-nvme", "float32", 100_000_000)]["file"] == "new.json"
    assert runs[("adamw", "float32", 100_000_000)]["file"] == "old.json"
    assert ("offload-cpu", "float32", 100_000_000) not in runs


def test_step_parts_add_up_to_the_step(report):
    m = TRAIN_STEP["results"][1]["median"]
    parts = report.step_parts("cpu", m)
    assert sum(parts.values()) == pytest.approx(m["step_s"])
    assert parts["waiting on the daemon (update)"] == pytest.approx(0.2 * m["step_s"])
    assert parts["forward + backward"] == pytest.approx((0.6 - 0.05) * m["step_s"])  # the hooks' copy is inside it
    torch_parts = report.step_parts("torch", TRAIN_STEP["results"][0]["median"])
    assert torch_parts["grad copy (backward hooks)"] == torch_parts["waiting on the daemon (update)"] == 0.0
    assert sum(torch_parts.values()) == pytest.approx(TRAIN_STEP["results"][0]["median"]["step_s"])


def test_a_missing_results_directory_is_an_error(report, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        report.main(["--results", str(tmp_path / "nowhere")])
    assert info.value.code == 2
    assert "is not a directory" in capsys.readouterr().err

"""benchmarks/gpu_peers.py's pure parts: the figures, the model's size, the results file and its resume.

The campaign itself needs a GPU; its CPU pipeline (``--dry-run``) is run by hand, not here.
"""

from __future__ import annotations

import json

import pytest
import torch
from benchmark_modules import benchmark_module


@pytest.fixture(scope="module")
def peers():
    with benchmark_module("gpu_peers") as module:  # it imports its worker module by name
        yield module


@pytest.fixture(scope="module")
def worker(peers):
    import gpu_peers_worker

    return gpu_peers_worker


def test_model_tflops_is_six_flops_per_param_per_token(peers) -> None:
    assert peers.model_tflops(1_500_000_000, 8192, 0.25) == pytest.approx(6 * 1.5e9 * 8192 / 0.25 / 1e12)
    assert peers.model_tflops(1_000_000, 1000, 1.0) == pytest.approx(6e-3)


def test_full_model_is_about_1_5b_params_and_the_count_matches_the_module(worker) -> None:
    cfg = worker.LlamaConfig()
    assert cfg.num_params() == 1_467_066_368  # as gpu_peers_worker's docstring says
    assert cfg.seq_len >= 1024
    for small in (
        worker.LlamaConfig.tiny(),
        worker.LlamaConfig(vocab_size=1000, dim=96, n_layers=3, n_heads=4, ffn_dim=256),
    ):
        model = worker.build_model(small, device="cpu", dtype=torch.bfloat16, seed=0)
        assert sum(p.numel() for p in model.parameters()) == small.num_params()


def test_batches_depend_only_on_seed_and_index_and_repeat_their_first_half(worker) -> None:
    cfg = worker.LlamaConfig.tiny()
    x, y = worker.batch(cfg, 2, 3, seed=0)
    x2, _ = worker.batch(cfg, 2, 3, seed=0)
    assert x.shape == y.shape == (2, cfg.seq_len)
    assert torch.equal(x, x2) and not torch.equal(x, worker.batch(cfg, 2, 4, seed=0)[0])
    assert torch.equal(x[:, 1:], y[:, :-1])
    half = (cfg.seq_len + 2) // 2
    assert torch.equal(x[:, half:], x[:, : cfg.seq_len - half])


def test_gpu_slug_names_the_card(peers) -> None:
    assert peers.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert peers.gpu_slug("NVIDIA H200") == "h200"
    assert peers.gpu_slug(None) == "cpu-tiny"


def row(step_s, losses, *, numel=1000, loss_after=None, pcie=None, status="ok"):
    return {
        "status": status,
        "numel": numel,
        "tokens_per_step": 100,
        "step_s": step_s,
        "losses": losses,
        "loss_after": loss_after,
        "pcie": pcie or {},
    }


def test_summary_takes_the_median_and_compares_with_adamw(peers) -> None:
    adamw = row([1.0, 3.0, 2.0], [5.0, 4.0, 3.0], loss_after=2.0)
    adamw["summary"] = peers.summarize(adamw, adamw)
    ours = row([4.0, 4.0, 100.0], [5.0, 4.0, 3.0], loss_after=2.002, pcie={"computed_nbytes_per_step": 4000.0})
    s = peers.summarize(ours, adamw)
    assert s["step_s_median"] == 4.0 and s["step_over_adamw"] == 2.0
    assert s["tokens_per_s"] == 25.0
    assert s["model_tflops"] == pytest.approx(6 * 1000 * 100 / 4.0 / 1e12)
    assert s["loss_vs_adamw"] == pytest.approx(1e-3) and s["loss_compared"] == "after the timed steps"
    assert (s["pcie_source"], s["pcie_bytes_per_param"]) == ("computed", 4.0)


def test_summary_prefers_the_systems_counter_and_compares_a_cut_short_row_at_its_last_step(peers) -> None:
    adamw = row([1.0], [5.0, 4.0, 3.0], loss_after=2.0)
    pcie = {"counter_nbytes_per_step": 5000.0, "nvml_nbytes_per_step": 6000.0, "computed_nbytes_per_step": 4000.0}
    cut = row([2.0], [5.0, 4.4], pcie=pcie, status="timeout 60s")
    s = peers.summarize(cut, adamw)
    assert s["loss_vs_adamw"] == pytest.approx(0.1) and s["loss_compared"] == "training loss at step 1"
    assert (s["pcie_source"], s["pcie_bytes_per_param"]) == ("counter", 5.0)


def test_a_killed_rows_progress_keeps_its_finished_steps(peers) -> None:
    lines = [
        json.dumps({"event": "ready", "setup_s": 3.0, "numel": 10}),
        json.dumps({"event": "step", "step": 0, "timed": False, "step_s": 9.0, "loss": 6.0}),
        json.dumps({"event": "step", "step": 1, "timed": True, "step_s": 1.5, "loss": 5.5}),
        '{"event": "step", "ste',  # cut mid-write
    ]
    got = peers.row_from_progress(lines)
    assert got == {"step_s": [1.5], "losses": [6.0, 5.5], "setup_s": 3.0, "numel": 10}


def test_results_file_is_rewritten_whole_and_resume_keeps_only_finished_rows(peers, tmp_path) -> None:
    path = tmp_path / "gpu-peers-h100.json"
    assert peers.load_result(path) == {"campaign": {}, "rows": {}}
    result = {"campaign": {"device": "NVIDIA H100"}, "rows": {}}
    result["rows"]["adamw"] = row([1.0], [5.0], loss_after=4.0)
    peers.write_result(path, result)
    result["rows"]["tiermem-cpu"] = row([2.0], [5.0], status="timeout 90s")
    result["rows"]["deepspeed-zero2"] = {"status": "not installed", "missing": ["deepspeed"]}
    peers.write_result(path, result)
    assert not list(tmp_path.glob("*.tmp"))
    loaded = peers.load_result(path)
    assert list(loaded["rows"]) == ["adamw", "tiermem-cpu", "deepspeed-zero2"]
    assert peers.done_rows(loaded) == {"adamw"}
    peers.refresh_summaries(loaded)
    table = peers.format_table(loaded)
    assert "timeout 90s" in table and "not installed" in table
    assert table.splitlines()[2].split()[:3] == ["adamw", "ok", "1.000"]


def test_missing_or_cuda_only_peers_are_reported_not_run_and_finished_rows_are_kept(
    peers, tmp_path, monkeypatch, capsys
) -> None:
    path = tmp_path / "gpu-peers-cpu-tiny.json"
    peers.write_result(path, {"campaign": {}, "rows": {"adamw": row([1.0], [5.0], loss_after=4.0)}})
    monkeypatch.setattr(peers, "find_spec", lambda name: object() if name == "torchao" else None)
    started = []
    monkeypatch.setattr(peers, "run_row", lambda *a, **k: started.append(a) or {})
    rc = peers.main(["--dry-run", "--out-dir", str(tmp_path), "--resume", "--systems", "adamw,deepspeed-zero2,torchao"])
    assert rc == 0 and not started
    rows = json.loads(path.read_text())["rows"]
    assert rows["adamw"]["status"] == "ok"
    assert rows["deepspeed-zero2"] == {"status": "not installed", "missing": ["deepspeed"]}
    assert rows["torchao"] == {"status": "needs CUDA"}  # its CPUOffloadOptimizer takes CUDA or XPU params only
    assert "kept from" in capsys.readouterr().out

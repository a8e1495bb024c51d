"""The memory estimator's arithmetic: the ZeRO paper's figures, the seeds' formulas, the offload tiers, fitting."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiermem.core.errors import InvalidArgument
from tiermem.core.estimate import (
    DAEMON_PROCESS_NBYTES,
    DAEMON_STATE_BYTES,
    NVME_CACHE_CHUNKS,
    NodeCapacity,
    Offload,
    RunShape,
    estimate,
    estimate_all,
    fit,
    format_gb,
    parse_params,
    render_table,
    to_json,
    zero_device_nbytes,
)
from tiermem.core.units import PAGE_SIZE, align_up

PAPER = RunShape(params=7_500_000_000, gpus=64)


def paged_state_nbytes(numel: int, chunk_numel: int) -> int:
    """An NVMe-tier rank's fp32-moment state as the daemon stores it: per chunk the fp16 params (2 B), master
    and moments (12 B) and grads (4 B), each part in whole pages."""
    full, rest = divmod(numel, chunk_numel)
    return full * 18 * chunk_numel + (sum(align_up(b * rest) for b in (2, 12, 4)) if rest else 0)


@pytest.mark.parametrize(("stage", "gb"), [(0, "120"), (1, "31.4"), (2, "16.6"), (3, "1.9")])
def test_the_zero_paper_example_to_its_precision(stage, gb):
    # ZeRO (SC20), Figure 1: 7.5B params, K = 12, N_d = 64; the paper's GB are 1e9 bytes
    digits = len(gb.partition(".")[2])
    assert round(zero_device_nbytes(PAPER, stage) / 1e9, digits) == float(gb)
    assert round(estimate(PAPER, stage, "none").gpu_nbytes / 1e9, digits) == float(gb)


def test_the_paper_figures_are_decimal_not_binary_gigabytes():
    assert round(zero_device_nbytes(PAPER, 1) / 2**30, 1) != 31.4
    assert format_gb(zero_device_nbytes(PAPER, 1)) == "31.4 GB"
    assert format_gb(zero_device_nbytes(PAPER, 0)) == "120.0 GB"


@given(params=st.integers(1, 10**13), gpus=st.integers(1, 4096))
def test_the_seed_formulas_for_every_stage(params, gpus):
    shape = RunShape(params=params, gpus=gpus)
    shard = math.ceil(params / gpus)  # each device holds ceil(P/N) elements of what is sharded
    assert zero_device_nbytes(shape, 0) == 16 * params
    assert zero_device_nbytes(shape, 1) == 4 * params + 12 * shard
    assert zero_device_nbytes(shape, 2) == 2 * params + 14 * shard
    assert zero_device_nbytes(shape, 3) == 16 * shard
    if params % gpus == 0:
        assert zero_device_nbytes(shape, 3) * gpus == 16 * params  # nothing is stored twice


@given(params=st.integers(1, 10**12), gpus=st.integers(1, 512), stage=st.sampled_from((0, 1, 2, 3)))
def test_offload_moves_only_the_optimizer_states_off_the_device(params, gpus, stage):
    shape = RunShape(params=params, gpus=gpus)
    optimizer_elements = params if stage == 0 else shape.shard_numel
    none, cpu, nvme = (estimate(shape, stage, o) for o in Offload)
    assert none.gpu_nbytes - cpu.gpu_nbytes == 12 * optimizer_elements
    assert cpu.gpu_nbytes == nvme.gpu_nbytes
    assert none.host_nbytes == none.nvme_nbytes == none.node_host_nbytes == 0
    # the daemon's record per element: fp32 master, exp_avg, exp_avg_sq and the grad it receives
    assert cpu.host_nbytes == DAEMON_STATE_BYTES * optimizer_elements + shape.window_nbytes
    assert cpu.nvme_nbytes == 0
    # on NVMe, the fp16 params too, apart from the master (what a param fetch reads), each part in whole pages;
    # the swap holds two copies of it (written out of place) and the chunk cache
    state = paged_state_nbytes(optimizer_elements, shape.chunk_numel)
    cache = nvme.host_nbytes - shape.window_nbytes
    assert cache == min(state, NVME_CACHE_CHUNKS * shape.chunk_numel * (DAEMON_STATE_BYTES + 2))
    assert nvme.nvme_nbytes == 2 * state + cache


def test_the_nvme_tier_keeps_a_bounded_cache_in_host_memory():
    shape = RunShape(params=10**12, gpus=8, window_nbytes=2 << 20, chunk_numel=1 << 22)
    est = estimate(shape, 2, Offload.NVME)
    assert est.host_nbytes == 7 * (1 << 22) * 18 + (2 << 20)  # 504 MiB of chunk cache and the window
    small = estimate(RunShape(params=1000, gpus=1), 0, Offload.NVME)
    # never more cache than state: its three parts in whole pages (2, 12 and 4 kB: 1 + 3 + 1)
    assert small.host_nbytes == 5 * PAGE_SIZE + small.shape.window_nbytes
    fixed = estimate(RunShape(params=10**12, gpus=8, cache_chunks=4), 2, Offload.NVME)
    assert fixed.host_nbytes == 4 * (1 << 22) * 18 + (2 << 20)  # the daemon's swap.cache_chunks where it sets one


def test_node_figures_count_every_rank_and_one_daemon():
    shape = RunShape(params=8_000_000_000, gpus=64, nodes=8)
    est = estimate(shape, 2, "cpu")
    assert shape.gpus_per_node == 8
    assert est.node_pool_nbytes == 8 * est.host_nbytes
    assert est.node_host_nbytes == 8 * est.host_nbytes + DAEMON_PROCESS_NBYTES
    nvme = estimate(shape, 3, "nvme")
    assert nvme.node_nvme_nbytes == 8 * nvme.nvme_nbytes
    assert nvme.nvme_nbytes > 2 * 18 * shape.shard_numel  # two copies of the state and the cache


def test_estimate_all_covers_each_offload_and_stage_once():
    rows = estimate_all(PAPER)
    assert [(e.offload.value, e.stage) for e in rows] == [(o, s) for o in ("none", "cpu", "nvme") for s in range(4)]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"params": -1, "gpus": 8}, "params must be positive"),
        ({"params": 0, "gpus": 8}, "params must be positive"),
        ({"params": 10, "gpus": 0}, "gpus must be positive"),
        ({"params": 10, "gpus": 8, "nodes": 3}, "gpus (8) must be a multiple of nodes (3)"),
        ({"params": 1.5, "gpus": 8}, "params must be an integer"),
        ({"params": 10, "gpus": True}, "gpus must be an integer"),
        ({"params": 10, "gpus": 8, "window_nbytes": -1}, "window_nbytes must be >= 0"),
    ],
)
def test_bad_shapes_are_refused_naming_the_field(kwargs, words):
    with pytest.raises(InvalidArgument) as info:
        RunShape(**kwargs)
    assert words in str(info.value)


@pytest.mark.parametrize("stage", [-1, 4, 5, True])
def test_bad_stages_are_refused(stage):
    with pytest.raises(InvalidArgument, match="ZeRO stage must be 0, 1, 2 or 3"):
        estimate(PAPER, stage, "none")


def test_a_bad_offload_is_refused_with_the_choices():
    with pytest.raises(InvalidArgument, match="offload must be one of none, cpu, nvme, got 'gpu'"):
        estimate(PAPER, 1, "gpu")


@pytest.mark.parametrize(
    ("text", "params"),
    [
        ("7.5e9", 7_500_000_000),
        ("7500000000", 7_500_000_000),
        ("7.5B", 7_500_000_000),
        ("350m", 350_000_000),
        ("1T", 10**12),
        ("125K", 125_000),
    ],
)
def test_parse_params(text, params):
    assert parse_params(text) == params


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("-1", "positive"),
        ("0", "positive"),
        ("lots", "such as 7.5e9"),
        ("1.5", "whole number"),
        ("inf", "positive"),
        ("nan", "positive"),
        ("", "such as 7.5e9"),
    ],
)
def test_parse_params_refuses_bad_counts(text, words):
    with pytest.raises(InvalidArgument, match=words):
        parse_params(text)


def test_fit_names_each_resource_that_is_short():
    shape = RunShape(params=7_500_000_000, gpus=8)
    node = NodeCapacity(
        gpu_nbytes=80 * 10**9,
        gpu_from="test",
        host_nbytes=100 * 10**9,
        host_from="test",
        nvme_nbytes=10**12,
        nvme_from="test",
    )
    plain = fit(estimate(shape, 0, "none"), node)  # 120 GB on an 80 GB device
    assert (plain.gpu, plain.host, plain.nvme, plain.fits) == (False, True, True, False)
    assert plain.reasons == ("GPU memory per device: needs 120.00 GB, test has 80.00 GB",)
    cpu = fit(estimate(shape, 1, "cpu"), node)  # 8 ranks x 15 GB of state > 100 GB of host memory
    assert (cpu.gpu, cpu.host, cpu.fits) == (True, False, False)
    nvme = fit(estimate(shape, 1, "nvme"), node)
    assert (nvme.gpu, nvme.host, nvme.nvme, nvme.fits) == (True, True, True, True)


def test_a_running_daemons_pool_budget_decides_the_host_side():
    shape = RunShape(params=10**9, gpus=1)
    est = estimate(shape, 0, "cpu")  # 16 GB of state
    roomy_host = NodeCapacity(gpu_nbytes=10**11, host_nbytes=10**12, nvme_nbytes=0)
    assert fit(est, roomy_host).host is True
    small_pool = NodeCapacity(gpu_nbytes=10**11, host_nbytes=10**12, pool_nbytes=8 * 10**9, pool_from="tiermemd")
    verdict = fit(est, small_pool)
    assert verdict.host is False
    assert verdict.reasons[0].startswith("daemon pool: needs 16.00 GB, tiermemd has 8.00 GB")


def test_unknown_capacity_is_neither_yes_nor_no():
    verdict = fit(estimate(PAPER, 3, "none"), NodeCapacity())
    assert verdict.gpu is None and verdict.fits is None
    assert fit(estimate(PAPER, 3, "none"), NodeCapacity(gpu_nbytes=10**10)).fits is True  # nothing else is needed


def test_the_table_and_the_json_carry_the_same_figures():
    node = NodeCapacity(
        gpu_nbytes=80 * 10**9,
        gpu_from="--gpu-memory",
        host_nbytes=10**11,
        host_from="meminfo",
        nvme_nbytes=10**12,
        nvme_from="disk",
    )
    rows = [(e, fit(e, node)) for e in estimate_all(PAPER)]
    text = render_table(PAPER, rows, node)
    assert text.startswith("7.5B params, 64 GPUs on 1 node(s) (64 ranks per node)")
    lines = [line.split() for line in text.splitlines()]
    none_rows = [line for line in lines if line[:1] == ["none"]]
    assert [r[2] for r in none_rows] == ["120.0", "31.4", "16.6", "1.9"]
    assert "no: GPU" in text and "80.0 GB (--gpu-memory)" in text
    data = json.loads(json.dumps(to_json(PAPER, rows, node)))
    assert data["params"] == 7_500_000_000 and len(data["estimates"]) == 12
    first = data["estimates"][0]
    assert first["gpu_nbytes"] == 120 * 10**9 and first["fits"] == {
        "gpu": False,
        "host": True,
        "nvme": True,
        "all": False,
    }
    assert data["node"]["gpu_nbytes"] == 80 * 10**9


@pytest.mark.parametrize(
    ("state_dtype", "pool", "swap"), [("fp32", 16, 18), ("bf16", 12, 14), ("int8", 10.03125, 12.03125)]
)
def test_compressed_moments_shrink_the_daemons_share_by_their_bytes(state_dtype, pool, swap):
    """master 4 + grad 4 + the two moments (4, 2 or 1 + a 256th of a 4-byte scale each), and on NVMe the fp16
    params (2); the GPU's share and the no-offload rows do not change."""
    shape = RunShape(params=7_000_000_000, gpus=8, state_dtype=state_dtype)
    base = RunShape(params=7_000_000_000, gpus=8)
    cpu, nvme = estimate(shape, 3, "cpu"), estimate(shape, 3, "nvme")
    assert cpu.host_nbytes == math.ceil(pool * shape.shard_numel) + shape.window_nbytes
    # two copies of the state on the swap, each chunk's parts in whole pages (only the short last chunk rounds up)
    twice_state = nvme.nvme_nbytes - (nvme.host_nbytes - shape.window_nbytes)
    state = math.ceil(swap * shape.shard_numel)
    assert 2 * state <= twice_state < 2 * (state + 3 * PAGE_SIZE)
    assert cpu.gpu_nbytes == estimate(base, 3, "cpu").gpu_nbytes
    assert estimate(shape, 2, "none") == dataclasses.replace(estimate(base, 2, "none"), shape=shape)
    assert to_json(shape, [], NodeCapacity())["state_dtype"] == state_dtype


def test_an_unknown_state_dtype_is_refused_by_the_estimator():
    with pytest.raises(InvalidArgument, match="state_dtype must be one of"):
        RunShape(params=1, gpus=1, state_dtype="fp8")

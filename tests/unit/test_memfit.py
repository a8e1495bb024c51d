"""The start-up check that the pool and its windows fit the daemon's memory (``tiermemd.memfit``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiermem.core.config import PoolConfig
from tiermem.core.units import GiB, MiB
from tiermemd.memfit import DoesNotFit, MemoryLimit, cgroup_limits, check_fit, fit_pool, ram_limit


def _write(path: Path, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for line in text.strip().splitlines():
        name, _, value = line.partition("=")
        (path / name).write_text(value + "\n")


def test_a_v1_memory_cgroup_limit_counts_usage_but_not_inactive_cache(tmp_path: Path) -> None:
    job = tmp_path / "memory" / "jobs" / "a"
    _write(job, f"memory.limit_in_bytes={3 * GiB}\nmemory.usage_in_bytes={1 * GiB}")
    (job / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {512 * MiB}\n")
    _write(tmp_path / "memory" / "jobs", "memory.limit_in_bytes=9223372036854771712")  # no limit
    limits = cgroup_limits("4:memory:/jobs/a\n1:cpu:/\n0::/\n", tmp_path)
    assert [limit.room for limit in limits] == [3 * GiB - 512 * MiB]
    assert str(job) in limits[0].what and "3GiB" in limits[0].what


def test_a_v2_limit_of_an_ancestor_binds_too(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    _write(tmp_path / "svc" / "job", "memory.max=max\nmemory.current=100")
    _write(tmp_path / "svc", f"memory.max={2 * GiB}\nmemory.current={GiB // 2}")
    limits = cgroup_limits("0::/svc/job\n", tmp_path)
    assert [limit.room for limit in limits] == [GiB + GiB // 2]
    assert "MemoryMax=" in limits[0].fix


def test_ram_limit_reads_mem_available() -> None:
    limit = ram_limit("MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    assert limit is not None and limit.room == 2 * MiB


def test_a_pool_over_a_limit_is_refused_naming_the_sizes_and_the_limit() -> None:
    limits = [MemoryLimit("memory cgroup /x: limit 3GiB, 0B in use", 3 * GiB, "raise it")]
    refusal = check_fit(pool_nbytes=4 * GiB, window_nbytes=128 * MiB, mlock=False, limits=limits, memlock=None)
    assert refusal is not None
    assert "pool.size 4GiB" in refusal and "128MiB" in refusal and "memory cgroup /x" in refusal
    assert check_fit(pool_nbytes=2 * GiB, window_nbytes=128 * MiB, mlock=False, limits=limits, memlock=None) is None


def test_windows_past_rlimit_memlock_are_refused_but_a_pool_past_it_runs_unlocked() -> None:
    kwargs = {"window_nbytes": 64 * MiB, "mlock": True, "limits": [], "memlock": 1 * GiB}
    refusal = check_fit(pool_nbytes=1 * GiB - 32 * MiB, **kwargs)  # type: ignore[arg-type]
    assert refusal is not None and "RLIMIT_MEMLOCK is 1GiB" in refusal
    assert check_fit(pool_nbytes=2 * GiB, **kwargs) is None  # type: ignore[arg-type]  # documented fallback
    assert check_fit(pool_nbytes=512 * MiB, **kwargs) is None  # type: ignore[arg-type]
    unlocked = {**kwargs, "mlock": False}
    assert check_fit(pool_nbytes=1 * GiB - 32 * MiB, **unlocked) is None  # type: ignore[arg-type]


def test_an_automatic_pool_takes_half_of_the_tightest_limit() -> None:
    limits = [MemoryLimit("ram", 16 * GiB, ""), MemoryLimit("cgroup", 3 * GiB, "")]
    pool = fit_pool(PoolConfig(), 128 * MiB, limits, None)
    assert pool.size == 3 * GiB // 2
    with pytest.raises(DoesNotFit, match=r"pool.size 8GiB .* does not fit cgroup"):
        fit_pool(PoolConfig(size=8 * GiB), 128 * MiB, limits, None)

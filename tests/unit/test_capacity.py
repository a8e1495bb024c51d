"""Reading what a node has: meminfo, cgroup limits (v1 and v2), free disk, the daemon's STATS budget."""

from __future__ import annotations

import dataclasses
import os

import pytest
from stats_samples import sample_node

from tiermem.client.capacity import cgroup_headroom, daemon_budget, free_disk, host_available, read_meminfo
from tiermem.core.errors import TiermemError
from tiermem.core.protocol import BudgetReport, StatsReply

MEMINFO = """\
MemTotal:       24684084 kB
MemFree:         1000000 kB
MemAvailable:   20000000 kB
HugePages_Total:       0
"""


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_meminfo_in_bytes(tmp_path):
    info = read_meminfo(write(tmp_path / "meminfo", MEMINFO))
    assert info["MemTotal"] == 24684084 * 1024
    assert info["MemAvailable"] == 20000000 * 1024
    assert info["HugePages_Total"] == 0  # a count, not kB


def test_cgroup_v1_limit_of_the_tightest_ancestor(tmp_path):
    proc = write(tmp_path / "cgroup", "9:name=systemd:/\n4:memory:/jobs/run7\n0::/\n")
    root = tmp_path / "fs"
    write(root / "memory/memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    write(root / "memory/memory.usage_in_bytes", "999999999\n")
    write(root / "memory/jobs/memory.limit_in_bytes", str(8 << 30))
    write(root / "memory/jobs/memory.usage_in_bytes", str(6 << 30))
    write(root / "memory/jobs/run7/memory.limit_in_bytes", str(16 << 30))
    write(root / "memory/jobs/run7/memory.usage_in_bytes", str(1 << 30))
    room, source = cgroup_headroom(proc, root)
    assert room == 2 << 30  # the parent's 8 GiB limit, 6 GiB used, binds before the child's own
    assert source.startswith("cgroup /jobs ")


def test_cgroup_v2_limit_and_max(tmp_path):
    proc = write(tmp_path / "cgroup", "0::/user.slice/job\n")
    root = tmp_path / "fs"
    write(root / "user.slice/memory.max", "max\n")
    write(root / "user.slice/memory.current", "5\n")
    write(root / "user.slice/job/memory.max", str(4 << 30))
    write(root / "user.slice/job/memory.current", str(1 << 30))
    assert cgroup_headroom(proc, root)[0] == 3 << 30
    write(root / "user.slice/job/memory.max", "max\n")
    assert cgroup_headroom(proc, root) is None


def test_no_memory_cgroup_means_no_limit(tmp_path):
    assert cgroup_headroom(tmp_path / "missing", tmp_path) is None
    assert cgroup_headroom(write(tmp_path / "cgroup", "3:cpuset:/\n"), tmp_path) is None


def test_host_available_takes_the_lower_of_meminfo_and_the_cgroup(tmp_path):
    meminfo = write(tmp_path / "meminfo", MEMINFO)
    proc = write(tmp_path / "cgroup", "0::/job\n")
    root = tmp_path / "fs"
    write(root / "job/memory.max", str(1 << 30))
    write(root / "job/memory.current", "0")
    assert host_available(meminfo, proc, root) == (1 << 30, "cgroup /job (limit 1.1 GB)")
    write(root / "job/memory.max", str(1 << 40))
    nbytes, source = host_available(meminfo, proc, root)
    assert nbytes == 20000000 * 1024 and source.startswith("MemAvailable")


def test_free_disk_counts_a_filesystem_once_and_measures_missing_dirs_at_their_parent(tmp_path):
    (tmp_path / "a").mkdir()
    vfs = os.statvfs(tmp_path)
    nbytes, source = free_disk([tmp_path / "a", tmp_path / "not" / "yet"])
    assert abs(nbytes - vfs.f_bavail * vfs.f_frsize) < 64 << 20  # the same filesystem, counted once
    assert str(tmp_path / "a") in source and "not" not in source


def reply_with(*budgets: BudgetReport) -> StatsReply:
    return StatsReply(node=dataclasses.replace(sample_node(), budgets=budgets))


def test_daemon_budget_from_the_stats_reply():
    reply = reply_with(
        BudgetReport("window", 1 << 30, 1 << 21),
        BudgetReport("pool", 4 * 10**9, 10**9),
        BudgetReport("swap", 5 * 10**11, 10**11),
    )
    budget = daemon_budget(reply, "/run/tiermem/tiermemd.sock")
    assert (budget.pool_free_nbytes, budget.pool_capacity_nbytes) == (3 * 10**9, 4 * 10**9)
    assert (budget.swap_free_nbytes, budget.swap_capacity_nbytes) == (4 * 10**11, 5 * 10**11)
    assert budget.socket == "/run/tiermem/tiermemd.sock"


def test_a_reply_without_a_pool_budget_is_an_error_naming_what_it_has():
    with pytest.raises(TiermemError, match=r"tiermemd at /s.sock has no pool budget \(it lists window\)"):
        daemon_budget(reply_with(BudgetReport("window", 1, 0)), "/s.sock")


def test_without_a_swap_budget_there_is_no_swap_room_and_held_never_goes_negative():
    budget = daemon_budget(reply_with(BudgetReport("pool", 10, 20)), "s")
    assert budget.pool_free_nbytes == 0 and budget.swap_capacity_nbytes == 0

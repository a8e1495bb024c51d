"""Reading what a node has: meminfo, cgroup limits (v1 and v2), free disk, the daemon's STATS budget."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from cgroup_scratch import V1_ROOT, own_v1_cgroup, scratch_cgroup
from stats_samples import sample_node

from tiermem.client.capacity import cgroup_headroom, daemon_budget, free_disk, host_available, read_meminfo
from tiermem.core.errors import TiermemError
from tiermem.core.protocol import BudgetReport, StatsReply
from tiermem.core.units import MiB
from tiermemd.memfit import cgroup_limits

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


def test_inactive_page_cache_is_not_counted_as_used(tmp_path):
    proc = write(tmp_path / "cgroup", "4:memory:/job\n")
    root = tmp_path / "fs"
    write(root / "memory/job/memory.limit_in_bytes", str(4 << 30))
    write(root / "memory/job/memory.usage_in_bytes", str(3 << 30))
    write(root / "memory/job/memory.stat", f"cache {2 << 30}\ntotal_inactive_file {1 << 30}\n")
    assert cgroup_headroom(proc, root)[0] == 2 << 30  # the kernel reclaims that cache before it OOM-kills


def test_the_estimates_headroom_is_the_room_the_daemons_start_up_check_finds(tmp_path):
    """The same files (a hybrid host: v1 controllers, v2 under unified/) give ``tiermem estimate`` and
    ``tiermemd.memfit`` the same tightest room."""
    text = "9:name=systemd:/\n4:memory:/jobs/a\n0::/jobs/a\n"
    proc = write(tmp_path / "cgroup", text)
    root = tmp_path / "fs"
    write(root / "unified/cgroup.controllers", "")
    write(root / "unified/jobs/memory.max", str(3 << 30))
    write(root / "unified/jobs/memory.current", str(1 << 30))
    write(root / "unified/jobs/memory.stat", f"inactive_file {1 << 29}\n")
    write(root / "memory/jobs/a/memory.limit_in_bytes", str(8 << 30))
    write(root / "memory/jobs/a/memory.usage_in_bytes", str(1 << 30))
    room, source = cgroup_headroom(proc, root)
    assert room == (2 << 30) + (1 << 29) and source.startswith("cgroup /jobs ")
    assert room == min(limit.room for limit in cgroup_limits(text, root))


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


V1_MEMORY = V1_ROOT / "memory"


@pytest.mark.skipif(own_v1_cgroup("memory") is None, reason="needs a writable cgroup v1 memory controller")
def test_in_a_real_cgroup_the_estimate_and_the_daemons_check_see_the_same_room() -> None:
    """A child in a 256 MiB cgroup: ``tiermem estimate``'s headroom is the room the daemon's check finds."""
    parent = own_v1_cgroup("memory")
    assert parent is not None
    with scratch_cgroup(parent, {"memory.limit_in_bytes": str(256 * MiB)}) as group:
        code = (
            "import os\n"
            f"open('{group}/cgroup.procs', 'w').write(str(os.getpid()))\n"
            "from pathlib import Path\n"
            "from tiermem.client.capacity import cgroup_headroom\n"
            "from tiermemd.memfit import cgroup_limits\n"
            "room, source = cgroup_headroom()\n"
            "limits = cgroup_limits(Path('/proc/self/cgroup').read_text(), Path('/sys/fs/cgroup'))\n"
            "tight = min(limits, key=lambda lim: lim.room)\n"
            "print(room, tight.room, source, '|', tight.what)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        numbers, _, what = out.partition("|")
        room, daemon_room, *source = numbers.split()
        assert 0 < int(room) <= 256 * MiB
        assert abs(int(room) - int(daemon_room)) < 8 * MiB  # two reads, a moment apart
        assert " ".join(source).startswith(f"cgroup /{group.relative_to(V1_MEMORY)} (limit 268.4 MB)")
        assert str(group) in what and "limit 256MiB" in what

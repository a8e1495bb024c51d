"""The CPUs the daemon's update may use: affinity capped by the cgroups' CPU quota."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
from cgroup_scratch import own_v1_cgroup, scratch_cgroup

from tiermem.engine.cpus import cpu_limit, parse_cpu_max, parse_v1_quota, usable_cpus


def test_cpu_max_parses_unlimited_and_fractions() -> None:
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("150000 100000\n") == 1.5
    assert parse_cpu_max("50000") == 0.5


def test_v1_quota_minus_one_is_unlimited() -> None:
    assert parse_v1_quota("-1\n", "100000\n") is None
    assert parse_v1_quota("250000\n", "100000\n") == 2.5


def files(mapping: dict[str, str]) -> Callable[[str], str | None]:
    return mapping.get


def test_v2_takes_the_tightest_quota_of_the_cgroup_and_its_ancestors() -> None:
    read = files(
        {
            "/sys/fs/cgroup/cpu.max": "max 100000",
            "/sys/fs/cgroup/kubepods/cpu.max": "300000 100000",
            "/sys/fs/cgroup/kubepods/pod1/cpu.max": "max 100000",
            "/sys/fs/cgroup/kubepods/pod1/tiermemd.service/cpu.max": "max 100000",
        }
    )
    assert cpu_limit("0::/kubepods/pod1/tiermemd.service\n", read) == 3.0


def test_v1_reads_the_cpu_controller_only() -> None:
    read = files(
        {
            "/sys/fs/cgroup/cpu,cpuacct/system.slice/tiermemd.service/cpu.cfs_quota_us": "150000",
            "/sys/fs/cgroup/cpu,cpuacct/system.slice/tiermemd.service/cpu.cfs_period_us": "100000",
            "/sys/fs/cgroup/cpu,cpuacct/system.slice/cpu.cfs_quota_us": "-1",
            "/sys/fs/cgroup/cpu,cpuacct/system.slice/cpu.cfs_period_us": "100000",
            "/sys/fs/cgroup/memory/system.slice/cpu.cfs_quota_us": "1",  # not the cpu controller
        }
    )
    text = "4:memory:/system.slice\n3:cpu,cpuacct:/system.slice/tiermemd.service\n1:name=systemd:/x\n"
    assert cpu_limit(text, read) == 1.5


def test_no_quota_anywhere_or_unreadable_files_mean_no_limit() -> None:
    assert cpu_limit("0::/user.slice\n", files({})) is None
    assert cpu_limit("2:cpu:/\n", files({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1"})) is None


def test_usable_cpus_is_at_most_the_affinity_and_at_least_one() -> None:
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


CPU_PARENT = own_v1_cgroup("cpu")


@pytest.mark.skipif(
    os.geteuid() != 0 or CPU_PARENT is None or not (CPU_PARENT / "cpu.cfs_quota_us").exists(),
    reason="needs root and a writable cgroup v1 cpu controller",
)
def test_a_process_in_a_one_cpu_cgroup_sees_one_cpu() -> None:
    """A real cgroup with a 1-CPU quota: a child placed in it counts one CPU, whatever its affinity says."""
    assert CPU_PARENT is not None
    with scratch_cgroup(CPU_PARENT, {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}) as group:
        code = (
            "import os, sys\n"
            f"open('{group}/cgroup.procs', 'w').write(str(os.getpid()))\n"
            "from tiermem.engine.cpus import usable_cpus\n"
            "print(usable_cpus(), len(os.sched_getaffinity(0)))\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        assert out[0] == "1"

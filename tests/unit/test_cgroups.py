"""The cgroup walk and the memory a process may still take (``tiermem.core.cgroups``), over fake files."""

from __future__ import annotations

from collections.abc import Callable

from tiermem.core.cgroups import (
    NO_LIMIT,
    CgroupMemory,
    Membership,
    ancestors,
    directories,
    memberships,
    memory_limits,
    parse_meminfo,
    tightest,
)
from tiermem.core.units import GiB, MiB

V1_NO_LIMIT = "9223372036854771712\n"
"""What cgroup v1 reads back for "no limit"."""


def files(mapping: dict[str, str]) -> Callable[[str], str | None]:
    return mapping.get


def test_proc_self_cgroup_lines_become_memberships() -> None:
    text = "9:name=systemd:/\n4:memory:/jobs/a\n3:cpu,cpuacct:/x\n0::/user.slice\n\nbroken\n"
    assert memberships(text) == [
        Membership("9", ("name=systemd",), "/"),
        Membership("4", ("memory",), "/jobs/a"),
        Membership("3", ("cpu", "cpuacct"), "/x"),
        Membership("0", (), "/user.slice"),
    ]
    assert [m.unified for m in memberships(text)] == [False, False, False, True]


def test_ancestors_run_from_the_cgroup_to_the_root() -> None:
    assert ancestors("/a/b") == ["/a/b", "/a", "/"]
    assert ancestors("a") == ["/a", "/"]
    assert ancestors("/") == ["/"]


def test_directories_sit_under_the_hierarchys_mount() -> None:
    v1 = Membership("3", ("cpu", "cpuacct"), "/a/b")
    assert directories(v1, files({}), "/r") == [
        ("/a/b", "/r/cpu,cpuacct/a/b"),
        ("/a", "/r/cpu,cpuacct/a"),
        ("/", "/r/cpu,cpuacct"),
    ]
    v2 = Membership("0", (), "/a")
    assert directories(v2, files({"/r/cgroup.controllers": "memory\n"}), "/r") == [("/a", "/r/a"), ("/", "/r")]


def test_a_hybrid_host_reads_cgroup_v2_under_unified() -> None:
    """v1 controllers mounted at the root, v2 beside them: no root cgroup.controllers, one under unified."""
    v2 = Membership("0", (), "/job")
    hybrid = files({"/r/unified/cgroup.controllers": ""})
    assert directories(v2, hybrid, "/r") == [("/job", "/r/unified/job"), ("/", "/r/unified")]
    read = files(
        {
            "/r/unified/cgroup.controllers": "",
            "/r/unified/job/memory.max": str(2 * GiB),
            "/r/unified/job/memory.current": str(GiB),
            "/r/job/memory.max": str(MiB),  # not where v2 lives on this host
            "/r/job/memory.current": "0",
        }
    )
    (level,) = memory_limits("0::/job\n", read, "/r")
    assert (level.directory, level.room_nbytes, level.version) == ("/r/unified/job", GiB, 2)


def test_v1_limits_count_usage_less_total_inactive_file() -> None:
    read = files(
        {
            "/r/memory/jobs/memory.limit_in_bytes": str(4 * GiB),
            "/r/memory/jobs/memory.usage_in_bytes": str(3 * GiB),
            "/r/memory/jobs/memory.stat": f"cache {2 * GiB}\ninactive_file 7\ntotal_inactive_file {GiB}\n",
        }
    )
    (level,) = memory_limits("4:memory:/jobs\n", read, "/r")
    assert level == CgroupMemory("/jobs", "/r/memory/jobs", 1, 4 * GiB, 2 * GiB)
    assert level.room_nbytes == 2 * GiB and level.unit_setting == "MemoryLimit="


def test_v2_limits_count_usage_less_inactive_file() -> None:
    read = files(
        {
            "/r/cgroup.controllers": "memory\n",
            "/r/svc/memory.max": str(4 * GiB),
            "/r/svc/memory.current": str(3 * GiB),
            "/r/svc/memory.stat": f"anon {GiB}\ninactive_file {512 * MiB}\nactive_file {GiB}\n",
        }
    )
    (level,) = memory_limits("0::/svc\n", read, "/r")
    assert (level.usage_nbytes, level.room_nbytes) == (3 * GiB - 512 * MiB, GiB + 512 * MiB)
    assert level.unit_setting == "MemoryMax="


def test_usage_below_the_reclaimable_cache_or_over_the_limit_stays_in_bounds() -> None:
    read = files(
        {
            "/r/a/memory.max": str(GiB),
            "/r/a/memory.current": str(2 * GiB),  # over the limit, for a moment
            "/r/memory.max": str(GiB),
            "/r/memory.current": "10",
            "/r/memory.stat": "inactive_file 100\n",
        }
    )
    over, root = memory_limits("0::/a\n", read, "/r")
    assert over.room_nbytes == 0
    assert root.usage_nbytes == 0 and root.room_nbytes == GiB


def test_every_ancestor_limits_and_the_tightest_room_wins() -> None:
    read = files(
        {
            "/r/memory/memory.limit_in_bytes": V1_NO_LIMIT,
            "/r/memory/memory.usage_in_bytes": str(100 * GiB),
            "/r/memory/jobs/memory.limit_in_bytes": str(8 * GiB),
            "/r/memory/jobs/memory.usage_in_bytes": str(6 * GiB),
            "/r/memory/jobs/run7/memory.limit_in_bytes": str(16 * GiB),
            "/r/memory/jobs/run7/memory.usage_in_bytes": str(GiB),
        }
    )
    limits = memory_limits("4:memory:/jobs/run7\n", read, "/r")
    assert [(lv.path, lv.room_nbytes) for lv in limits] == [("/jobs/run7", 15 * GiB), ("/jobs", 2 * GiB)]
    best = tightest(limits)
    assert best is not None and best.path == "/jobs"


def test_the_innermost_of_equal_rooms_is_the_tightest() -> None:
    a = CgroupMemory("/a/b", "/r/a/b", 2, GiB, 0)
    b = CgroupMemory("/a", "/r/a", 2, 2 * GiB, GiB)
    assert tightest([a, b]) is a
    assert tightest([]) is None


def test_max_huge_unreadable_or_garbled_limits_are_no_limit() -> None:
    read = files(
        {
            "/r/memory/a/memory.limit_in_bytes": V1_NO_LIMIT,
            "/r/memory/memory.limit_in_bytes": str(NO_LIMIT),
            "/r/b/memory.max": "max\n",
            "/r/memory.max": "lots\n",
        }
    )
    assert memory_limits("4:memory:/a\n0::/b\n", read, "/r") == []
    assert memory_limits("3:cpuset:/\n1:name=systemd:/\n", read, "/r") == []
    assert memory_limits("", read, "/r") == []


def test_a_limit_without_a_readable_usage_counts_nothing_in_use() -> None:
    (level,) = memory_limits("0::/\n", files({"/r/memory.max": str(GiB)}), "/r")
    assert level.room_nbytes == GiB


def test_v1_and_v2_memory_hierarchies_are_both_read() -> None:
    read = files(
        {
            "/r/memory/jobs/memory.limit_in_bytes": str(4 * GiB),
            "/r/memory/jobs/memory.usage_in_bytes": "0",
            "/r/unified/cgroup.controllers": "",
            "/r/unified/jobs/memory.max": str(GiB),
            "/r/unified/jobs/memory.current": "0",
        }
    )
    limits = memory_limits("4:memory:/jobs\n0::/jobs\n", read, "/r")
    assert [(lv.version, lv.room_nbytes) for lv in limits] == [(1, 4 * GiB), (2, GiB)]
    best = tightest(limits)
    assert best is not None and best.directory == "/r/unified/jobs"


def test_meminfo_in_bytes_with_counts_as_is() -> None:
    info = parse_meminfo("MemTotal:  100 kB\nMemAvailable:   2048 kB\nHugePages_Total:  3\nbroken\nEmpty:\n")
    assert info == {"MemTotal": 102400, "MemAvailable": 2 * MiB, "HugePages_Total": 3}

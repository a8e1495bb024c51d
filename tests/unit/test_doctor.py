"""``tiermem doctor``'s checks: pure functions from facts to findings, each problem with its fix."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tiermem.client import doctor_facts
from tiermem.client.doctor import (
    Finding,
    Status,
    check_attach,
    check_daemon,
    check_kernels,
    check_libaio,
    check_memlock,
    check_pool,
    check_swap_dir,
    check_torch,
    exit_code,
    render,
    run_checks,
    to_json,
    unreachable_summary,
)
from tiermem.client.doctor_facts import (
    Entry,
    Reach,
    SocketProbe,
    SwapDirFacts,
    TorchFacts,
    User,
    is_under,
    permits,
    read_write_paths,
    unreachable,
)
from tiermem.core.units import GiB, MiB

ALICE = User(1000, "alice", frozenset({1000}), {1000: "alice"})
NODE = "/run/tiermem/tiermemd.sock"
MINE = "/run/user/1000/tiermem/tiermemd.sock"
SOCKET = Entry(NODE, 0o140660, uid=999, gid=999, owner_name="tiermem", group_name="tiermem")
RUN_DIR = Entry("/run/tiermem", 0o40755, uid=999, gid=999)


def answered(path: str = NODE, version: str = "0.1.0", **kw: Any) -> SocketProbe:
    return SocketProbe(path, "the node's tiermemd", False, Reach.ANSWERED, version=version, **kw)


def probe(reach: Reach, detail: str = "", path: str = NODE, **kw: Any) -> SocketProbe:
    return SocketProbe(path, "the node's tiermemd", kw.pop("explicit", False), reach, detail, **kw)


def facts(**changes: Any) -> doctor_facts.Facts:
    """A healthy node: the node daemon answers, libaio, an NVMe swap dir, the kernels built, torch on a CPU."""
    base = doctor_facts.Facts(
        version="0.1.0",
        protocol=8,
        user=ALICE,
        embed=True,
        sockets=(answered(pool_nbytes=8 * GiB, locked_nbytes=8 * GiB),),
        sockets_error="",
        config=doctor_facts.ConfigFacts(
            "/etc/tiermem/tiermemd.toml", socket=NODE, allowed_gids=(999,), pool_nbytes=8 * GiB
        ),
        swap_dirs=(SwapDirFacts("/mnt/nvme0/tiermem", Entry("/mnt/nvme0/tiermem", 0o40700, 999), probed=False),),
        libaio_error="",
        aio_context_error="",
        memlock_nbytes=8 * MiB,
        cap_ipc_lock=False,
        available_nbytes=64 * GiB,
        kernels=doctor_facts.KernelFacts(
            compiler="/usr/bin/cc",
            caches=(("/home/alice/.cache/tiermem", ""),),
            lowbit_built="/home/alice/.cache/tiermem/lowbit-abc.so",
            inductor_dir="/tmp/torchinductor_alice",
            inductor_error="",
            daemon=(("lowbit", "built"),),
        ),
        torch=TorchFacts("2.13.0", cuda=""),
    )
    return dataclasses.replace(base, **changes)


def statuses(findings: list[Finding]) -> dict[str, list[Status]]:
    out: dict[str, list[Status]] = {}
    for f in findings:
        out.setdefault(f.check, []).append(f.status)
    return out


# --------------------------------------------------------------------------- permissions and paths


def test_permission_follows_owner_then_group_then_others_and_root_passes() -> None:
    assert permits(SOCKET, ALICE, 0o2) is False  # neither owner nor in group tiermem, others ---
    assert permits(SOCKET, dataclasses.replace(ALICE, gids=frozenset({1000, 999})), 0o2) is True
    assert permits(SOCKET, User(0, "root", frozenset({0})), 0o2) is True
    assert permits(Entry("/d", 0o40075, uid=1000, gid=5), ALICE, 0o1) is False  # the owner's own bits count


def test_an_unreachable_socket_is_explained_by_the_first_thing_in_the_way() -> None:
    missing_dir = Entry("/run/tiermem", missing=True)
    assert unreachable(missing_dir, Entry(NODE, missing=True), ALICE, "x") == (
        Reach.MISSING,
        "no directory /run/tiermem",
    )
    closed_dir = dataclasses.replace(RUN_DIR, mode=0o40750)
    reach, detail = unreachable(closed_dir, Entry(NODE, unknown="cannot look"), ALICE, "x")
    assert reach is Reach.NO_ACCESS and "/run/tiermem (mode 0750" in detail and "not searchable" in detail
    reach, detail = unreachable(RUN_DIR, SOCKET, ALICE, "x")
    assert reach is Reach.NO_ACCESS and "mode 0660, owner 999 (tiermem), group 999 (tiermem)" in detail
    assert unreachable(RUN_DIR, Entry(NODE, missing=True), ALICE, "x") == (Reach.MISSING, "no socket file")
    assert unreachable(RUN_DIR, dataclasses.replace(SOCKET, mode=0o140666), ALICE, "refused") == (
        Reach.NOT_LISTENING,
        "refused",
    )


def test_read_write_paths_are_read_as_systemd_reads_them() -> None:
    unit = "ReadWritePaths=/var/lib/tiermem -/mnt/nvme0\n# ReadWritePaths=/nope\nReadWritePaths=+/mnt/nvme1\n"
    assert read_write_paths(unit) == ("/var/lib/tiermem", "/mnt/nvme0", "/mnt/nvme1")
    assert read_write_paths(unit + "ReadWritePaths=\nReadWritePaths=/srv\n") == ("/srv",)
    assert is_under("/var/lib/tiermem/swap", "/var/lib/tiermem") and is_under("/srv", "/srv/")
    assert not is_under("/var/lib/tiermem2", "/var/lib/tiermem")


# --------------------------------------------------------------------------- the daemon and attaching


def test_the_reached_daemon_is_named_with_its_version_and_protocol() -> None:
    found = check_daemon(facts())
    assert found.status is Status.OK
    assert found.found == "tiermemd 0.1.0, protocol 8, at /run/tiermem/tiermemd.sock (the node's tiermemd)"
    older = check_daemon(facts(sockets=(answered(version="0.0.9"),)))
    assert older.status is Status.WARN and "this client is tiermem 0.1.0" in older.found
    assert "systemctl restart tiermemd" in older.fix


def test_reaching_the_own_daemon_past_a_node_socket_that_refused_is_a_warning() -> None:
    f = facts(sockets=(probe(Reach.NO_ACCESS, "the socket ... admits neither", socket=SOCKET), answered(MINE)))
    assert check_daemon(f).status is Status.WARN and NODE in check_daemon(f).found
    attach = check_attach(f)
    assert attach.status is Status.WARN
    assert attach.fix.startswith("usermod -aG tiermem alice")


def test_no_daemon_means_a_private_one_or_a_failure_when_embedding_is_off() -> None:
    none = (probe(Reach.MISSING, "no directory /run/tiermem"), probe(Reach.MISSING, "no socket file", MINE))
    found = check_daemon(facts(sockets=none))
    assert found.status is Status.WARN and "starts a private daemon" in found.found
    assert "no directory /run/tiermem" in found.found and "Installing the service" in found.fix
    assert check_daemon(facts(sockets=none, embed=False)).status is Status.FAIL
    named = (probe(Reach.MISSING, "no socket file", "/tmp/x.sock", explicit=True),)
    assert check_daemon(facts(sockets=named)).status is Status.WARN  # TIERMEM_SOCKET_PATH: a private daemon
    impostor = (probe(Reach.UNTRUSTED, "refusing /tmp: writable by others", "/tmp/x.sock", explicit=True),)
    assert check_daemon(facts(sockets=impostor)).status is Status.FAIL  # a named socket is never passed by
    assert check_attach(facts(sockets=impostor)).status is Status.FAIL
    assert check_attach(facts(sockets=none)).status is Status.SKIP
    assert check_pool(facts(sockets=none)).status is Status.SKIP
    # the node's socket file is there and nobody listens: installed, not running; start it, do not install it
    stale = (probe(Reach.NOT_LISTENING, "Connection refused"), probe(Reach.MISSING, "no socket file", MINE))
    down = check_daemon(facts(sockets=stale))
    assert down.status is Status.WARN and "Installing the service" not in down.fix
    assert down.fix.startswith("start the node service: systemctl start tiermemd.socket") and NODE in down.fix


def test_a_daemon_of_another_protocol_fails_naming_both() -> None:
    why = "unsupported protocol version 9; this side supports version(s) 8"
    found = check_daemon(facts(sockets=(probe(Reach.INCOMPATIBLE, why),)))
    assert found.status is Status.FAIL and why in found.found


def test_a_directory_that_keeps_the_user_out_is_fixed_by_its_group_or_its_mode() -> None:
    closed = dataclasses.replace(RUN_DIR, mode=0o40750, group_name="tiermem")
    hidden = probe(Reach.NO_ACCESS, "/run/tiermem (mode 0750 ...) is not searchable", directory=closed)
    attach = check_attach(facts(sockets=(hidden, answered(MINE))))
    assert attach.status is Status.WARN and f"trainers use {MINE}" in attach.found
    assert attach.fix == (
        "usermod -aG tiermem alice (then log in again); or make /run/tiermem 0755, as the shipped units do"
    )


def test_a_refused_uid_fails_and_is_told_to_join_the_socket_group_and_the_group_to_be_allowed() -> None:
    refused = probe(Reach.REFUSED, "uid 1000 is not allowed", socket=SOCKET)
    f = facts(sockets=(refused,), config=dataclasses.replace(facts().config, allowed_gids=()))
    attach = check_attach(f)
    assert attach.status is Status.FAIL and "allowed_gids [] in /etc/tiermem/tiermemd.toml" in attach.found
    assert attach.fix == (
        "usermod -aG tiermem alice (then log in again); list gid 999 (tiermem) in server.allowed_gids, then "
        "systemctl reload tiermemd"
    )
    assert check_daemon(f).status is Status.FAIL  # connect() stops at a daemon that accepts; ATTACH is refused
    root_group = probe(Reach.REFUSED, "no", socket=dataclasses.replace(SOCKET, gid=0, group_name="root"))
    assert 'server.socket_group = "tiermem"' in check_attach(facts(sockets=(root_group,))).fix


def test_an_unlocked_pool_and_a_low_memlock_are_warnings() -> None:
    assert check_pool(facts()).status is Status.OK
    half = facts(sockets=(answered(pool_nbytes=8 * GiB, locked_nbytes=0),))
    assert check_pool(half).status is Status.WARN and "LimitMEMLOCK=infinity" in check_pool(half).fix
    assert "pool.mlock" not in check_pool(half).fix  # it is true already (the default)
    off = dataclasses.replace(half, config=dataclasses.replace(half.config, mlock=False))
    assert "pool.mlock = true in the config (it is false)" in check_pool(off).fix
    alone = facts(sockets=(probe(Reach.MISSING, "no socket file"),))
    low = check_memlock(alone)
    assert low.status is Status.WARN and "locks at most 8MiB of its pool (8GiB configured)" in low.found
    assert check_memlock(facts()).status is Status.OK  # the node daemon's limit is its unit's
    assert check_memlock(dataclasses.replace(alone, cap_ipc_lock=True)).status is Status.OK
    assert check_memlock(dataclasses.replace(alone, memlock_nbytes=None)).status is Status.OK


# --------------------------------------------------------------------------- I/O


def test_missing_libaio_is_buffered_io_unless_the_engine_insists() -> None:
    f = facts(libaio_error="the libaio package or libaio.so.1 is missing (No module named 'libaio')")
    assert check_libaio(f).status is Status.WARN and "apt-get install libaio1" in check_libaio(f).fix
    insists = dataclasses.replace(f, config=dataclasses.replace(f.config, engine="libaio"))
    assert check_libaio(insists).status is Status.FAIL
    aio = check_libaio(facts(aio_context_error="creating a kernel AIO context of depth 128 failed"))
    assert aio.status is Status.WARN and "fs.aio-max-nr" in aio.fix


def swap_dir(entry: Entry | None = None, *, probed: bool = True, **found: Any) -> SwapDirFacts:
    """The swap directory /s as its probe found it: ``entry`` (by default mode 0700, uid 1000) and ``found``."""
    return SwapDirFacts("/s", entry or Entry("/s", 0o40700, 1000), probed=probed, **found)


MISSING_SWAP_DIR = Entry("/s", missing=True)


@pytest.mark.parametrize(
    ("swap", "status", "words"),
    [
        (swap_dir(free_nbytes=100 * GiB), Status.OK, "O_DIRECT"),
        (swap_dir(Entry("/s", 0o40500, 1000), write_error="Permission denied"), Status.FAIL,
         "not writable: Permission denied"),
        (swap_dir(direct_io_error="/s does not support O_DIRECT"), Status.WARN, "buffered"),
        (swap_dir(free_nbytes=GiB // 2), Status.WARN, "little"),
        (swap_dir(MISSING_SWAP_DIR), Status.OK, "creates it"),
        (swap_dir(MISSING_SWAP_DIR, write_error="/ is not writable"), Status.FAIL, "missing"),
        (swap_dir(Entry("/s", 0o40700, 999, owner_name="tiermem"), probed=False), Status.SKIP,
         "owned by uid 999 (tiermem)"),
        (swap_dir(covered=False), Status.FAIL, "ReadWritePaths"),
    ],
)  # fmt: skip
def test_a_swap_directory_is_judged_by_what_its_probe_found(swap: SwapDirFacts, status: Status, words: str) -> None:
    found = check_swap_dir(swap, facts())
    assert (found.status, found.check) == (status, "swap") and words in found.found
    assert found.status in (Status.OK, Status.SKIP) or found.fix


def test_no_odirect_fails_when_the_engine_insists_on_libaio() -> None:
    f = facts()
    swap = swap_dir(direct_io_error="no O_DIRECT")
    assert check_swap_dir(swap, dataclasses.replace(f, config=dataclasses.replace(f.config, engine="libaio"))).status
    assert check_swap_dir(swap, f).status is Status.WARN


# --------------------------------------------------------------------------- kernels, torch, CUDA


def test_kernels_report_the_cache_used_the_build_and_the_daemons_state() -> None:
    ok = check_kernels(facts())
    assert [f.status for f in ok] == [Status.OK, Status.OK]
    assert "lowbit-abc.so" in ok[0].found and "lowbit built" in ok[1].found
    no_cc = check_kernels(facts(kernels=dataclasses.replace(facts().kernels, compiler="")))
    assert no_cc[0].status is Status.WARN and no_cc[0].fix == "apt-get install gcc"
    failed = check_kernels(facts(kernels=dataclasses.replace(facts().kernels, daemon=(("lowbit", "failed"),))))
    assert failed[-1].status is Status.WARN and "fallback" in failed[-1].found
    home = (("/nonexistent/.cache/tiermem", "missing, and cannot be created"), ("/tmp/tiermem-kernels-1000", ""))
    fallback = check_kernels(facts(kernels=dataclasses.replace(facts().kernels, caches=home)))[0]
    assert fallback.status is Status.OK and "/tmp/tiermem-kernels-1000, not /nonexistent" in fallback.found


def test_kernel_caches_that_could_not_be_looked_at_say_why() -> None:
    broken = dataclasses.replace(facts().kernels, caches=(), lowbit_built="", lowbit_error="ImportError: no module")
    found = check_kernels(facts(kernels=broken))[0]
    assert found.status is Status.WARN and "ImportError: no module" in found.found and "reinstall" in found.fix


def test_a_node_unit_without_a_kernel_cache_dir_recompiles_at_every_restart() -> None:
    f = facts(kernels=dataclasses.replace(facts().kernels, unit_installed=True))
    found = [k for k in check_kernels(f) if k.status is Status.WARN]
    assert len(found) == 1 and "PrivateTmp" in found[0].found and "/var/lib/tiermem/kernels" in found[0].fix
    outside = dataclasses.replace(f.config, cache_dir="/opt/kernels")
    k = dataclasses.replace(f.kernels, cache_covered=False)
    assert any("ReadWritePaths" in x.found for x in check_kernels(dataclasses.replace(f, config=outside, kernels=k)))


def test_torch_fails_when_it_does_not_import_and_cuda_is_checked_only_with_a_gpu() -> None:
    assert [f.status for f in check_torch(facts())] == [Status.OK, Status.SKIP]
    broken = check_torch(facts(torch=TorchFacts("", error="ImportError: libcudart.so.12")))
    assert [f.status for f in broken] == [Status.FAIL]
    gpu = TorchFacts("2.13.0", cuda="12.8", devices=("cuda:0 NVIDIA H100",), pin_error="")
    assert [f.status for f in check_torch(facts(torch=gpu))] == [Status.OK, Status.OK]
    unpinned = dataclasses.replace(gpu, pin_error="cudaHostRegister returned cudaError 1 (invalid argument)")
    assert check_torch(facts(torch=unpinned))[1].status is Status.WARN


# --------------------------------------------------------------------------- the report


def test_the_exit_code_says_whether_the_node_can_train() -> None:
    healthy = run_checks(facts())
    assert exit_code(healthy) == 0 and exit_code(healthy, strict=True) == 0
    slow = run_checks(facts(libaio_error="missing"))
    assert exit_code(slow) == 0 and exit_code(slow, strict=True) == 1
    assert exit_code(run_checks(facts(torch=TorchFacts("", error="x")))) == 1


def test_the_report_shows_every_finding_and_fix_within_its_width() -> None:
    f = facts(sockets=(probe(Reach.REFUSED, "uid 1000 is not allowed", socket=SOCKET),), libaio_error="missing")
    findings = run_checks(f)
    text = render(f, findings)
    assert text.startswith("tiermem doctor 0.1.0 (protocol 8) as uid 1000 (alice), groups 1000 (alice)\n")
    assert max(len(line) for line in text.splitlines()) <= 100
    for finding in findings:
        assert f"{finding.status.value:<5} {finding.check}" in text
    assert text.count("fix: ") == sum(1 for x in findings if x.fix)
    assert text.rstrip().endswith("This node cannot train through tiermem: 2 check(s) failed, 2 warning(s).")
    payload = to_json(f, findings, exit_code(findings))
    assert payload["can_train"] is False and payload["socket"] is None
    assert {"check": "libaio", "status": "warn"}.items() <= payload["findings"][5].items()


def test_the_status_line_names_each_socket_and_what_was_in_the_way() -> None:
    line = unreachable_summary([probe(Reach.MISSING, "no directory /run/tiermem"), probe(Reach.BROKEN, path=MINE)])
    assert line == f"nothing answers on {NODE} (no directory /run/tiermem) or {MINE} (broken)"

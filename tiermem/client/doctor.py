"""``tiermem doctor``: whether this node can train through tiermem, and what to change where it cannot.

Owns the checks and their report.  Two layers:

- the checks (``check_*``, ``run_checks``): pure functions from ``Facts`` to
  ``Finding``s, each a status, what was found and a one-line fix;
- the gathering (``tiermem.client.doctor_probe``): the one part that touches
  the node (sockets, files, rlimits, the compiler, torch and CUDA), run once,
  into the records of ``tiermem.client.doctor_facts``.

What is checked, as the user who runs it (an operator, or a trainer's user):

- ``config``: the node's settings file (``--config``, ``$TIERMEM_CONFIG``,
  ``/etc/tiermem/tiermemd.toml``) is valid;
- ``daemon``: the daemon a trainer of this user would reach, found as
  ``tiermem.client.link.connect`` finds it, with its version and protocol;
- ``attach``: whether this user may attach to it (socket and directory modes,
  the user's groups, ``server.allowed_uids`` / ``allowed_gids``);
- ``pool``: the reached daemon's pool, locked or not; ``memlock``:
  ``RLIMIT_MEMLOCK`` here and the pinned pool it allows a daemon started here;
- ``libaio``: the ``libaio`` package and a kernel AIO context;
- ``swap <dir>``: each swap directory writable, O_DIRECT, free space, and
  writable under the installed unit's ``ReadWritePaths=``;
- ``kernels``: the compiler, this user's kernel caches (writable; the
  compressed-moment kernel built), and the node daemon's kernels
  (``tiermem_kernel_state`` from its metrics endpoint);
- ``torch``, ``cuda``: torch imports; where a GPU is present,
  ``cudaHostRegister`` pins a shared-memory window as trainers pin theirs.

Exit codes (a contract for scripts): 0 the node can train (warnings say
where it runs slower or alone); 1 a check failed: training through tiermem
would fail here (or, with ``--strict``, a warning was found); 2 bad usage.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TextIO

from tiermem.client.doctor_facts import (
    CONNECTED,
    Entry,
    Facts,
    KernelFacts,
    Reach,
    SocketProbe,
    SwapDirFacts,
    User,
    owner,
)
from tiermem.client.subcommand import Subparsers, add_command
from tiermem.core.units import GiB, format_size
from tiermem.net import privatedir

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "Finding",
    "Status",
    "add_parser",
    "exit_code",
    "render",
    "run_checks",
    "run_doctor",
    "to_json",
    "unreachable_summary",
]

EXIT_OK = 0
EXIT_FAILED = 1
LOW_SWAP_NBYTES = 1 * GiB
"""Free space of a swap directory below which the NVMe tier is too small to be of use."""


class Status(enum.Enum):
    OK = "ok"
    WARN = "warn"
    """Training works, slower or alone (a private daemon, buffered I/O, the fallback kernel)."""
    FAIL = "fail"
    """Training through tiermem fails here."""
    SKIP = "skip"
    """Nothing to check (no GPU, no daemon to ask, a directory only its owner may probe)."""


@dataclass(frozen=True)
class Finding:
    check: str
    status: Status
    found: str
    fix: str = ""


# --------------------------------------------------------------------------- pure checks


_SKIPPED = (Reach.NO_ACCESS, Reach.UNTRUSTED)
"""A daemon is there, but a trainer of this user passes it by (a named socket it does not: see ``_decisive``)."""
_SAME_TIERMEM = "install the same tiermem for the service and the trainers, then systemctl restart tiermemd"


def _decisive(facts: Facts) -> SocketProbe | None:
    """The socket that decides what a trainer gets: the first it connects to (``connect`` stops there), or a
    named one it refuses to trust (``UnsafePathError``); None: it starts a private daemon, or fails."""
    for p in facts.sockets:
        if p.reach in CONNECTED or (p.explicit and p.reach is Reach.UNTRUSTED):
            return p
    return None


def _reached(facts: Facts) -> SocketProbe | None:
    p = _decisive(facts)
    return p if p is not None and p.reach is Reach.ANSWERED else None


def _fallback(facts: Facts) -> tuple[Status, str]:
    """What a trainer does when it connects nowhere: start a private daemon (WARN), or fail."""
    if facts.embed:
        return Status.WARN, "each training process starts a private daemon of its own"
    return Status.FAIL, "trainers fail: TIERMEM_NO_EMBED=1 forbids a private daemon"


def unreachable_summary(probes: Sequence[SocketProbe]) -> str:
    """One line on why none of ``probes`` answered: each socket and what stood in the way."""
    return "nothing answers on " + " or ".join(f"{p.path} ({p.detail or p.reach.value})" for p in probes)


def check_config(facts: Facts) -> Finding:
    c = facts.config
    if c.path is None:
        return Finding("config", Status.OK, "no node settings file: a private daemon's defaults apply")
    if c.error:
        return Finding(
            "config",
            Status.FAIL,
            f"{c.path}: {c.error} (tiermemd exits 2)",
            f"tiermemd --check-config --config {c.path}",
        )
    return Finding("config", Status.OK, f"{c.path} is valid")


def check_daemon(facts: Facts) -> Finding:
    if facts.sockets_error:
        return Finding("daemon", Status.FAIL, f"cannot tell which daemon trainers reach: {facts.sockets_error}")
    decisive = _decisive(facts)
    if decisive is None:
        tried = "; ".join(f"{p.path}: {p.detail or p.reach.value}" for p in facts.sockets)
        status, then = _fallback(facts)
        if any(p.reach in _SKIPPED for p in facts.sockets):
            return Finding("daemon", status, f"no tiermemd this user may use ({tried}); {then}", "see attach")
        stale = [p.path for p in facts.sockets if p.reach is Reach.NOT_LISTENING]
        if stale:  # a socket file is there and nothing listens: a service that is installed and not running
            fix = f"start the node service: systemctl start tiermemd.socket (the socket file {stale[0]} is there "
            fix += "and nothing listens on it: the service stopped or failed; journalctl -u tiermemd says why)"
        elif facts.embed:
            fix = "install the node service: docs/operating.md, Installing the service"
        else:
            fix = "start the node service (systemctl start tiermemd.socket), or unset TIERMEM_NO_EMBED"
        return Finding("daemon", status, f"no tiermemd answers ({tried}); {then}", fix)
    if decisive.reach is Reach.ANSWERED:
        where = f"tiermemd {decisive.version}, protocol {facts.protocol}, at {decisive.path} ({decisive.whose})"
        if decisive.version != facts.version:
            return Finding("daemon", Status.WARN, f"{where}; this client is tiermem {facts.version}", _SAME_TIERMEM)
        passed = [p for p in facts.sockets[: facts.sockets.index(decisive)] if p.reach in _SKIPPED]
        if passed:
            skipped = "; ".join(f"{p.path}: {p.reach.value}" for p in passed)
            return Finding("daemon", Status.WARN, f"{where}, not {skipped}", "see attach")
        return Finding("daemon", Status.OK, where)
    if decisive.reach is Reach.INCOMPATIBLE:
        return Finding("daemon", Status.FAIL, f"{decisive.path}: {decisive.detail}", _SAME_TIERMEM)
    if decisive.reach is Reach.REFUSED:
        return Finding(
            "daemon", Status.FAIL, f"{decisive.path} refuses this user: trainers fail with AuthError (see attach)"
        )
    if decisive.reach is Reach.UNTRUSTED:
        return Finding("daemon", Status.FAIL, f"trainers raise UnsafePathError (see attach): {decisive.path}")
    return Finding(
        "daemon",
        Status.FAIL,
        f"{decisive.path} accepted a connection but did not answer: {decisive.detail}",
        "journalctl -u tiermemd; systemctl restart tiermemd",
    )


def check_attach(facts: Facts) -> Finding:
    user, config = facts.user, facts.config
    who = f"{user.label}, groups {', '.join(user.group(g) for g in sorted(user.gids)) or 'none'}"
    decisive = _decisive(facts)
    if decisive is not None and decisive.reach is Reach.REFUSED:
        named = bool(config.path) and not config.error and config.socket == decisive.path
        allowed = (
            f"server.allowed_uids {list(config.allowed_uids)}, allowed_gids {list(config.allowed_gids)} "
            f"in {config.path}"
            if named
            else "the daemon's server.allowed_uids and allowed_gids"
        )
        return Finding(
            "attach",
            Status.FAIL,
            f"the daemon at {decisive.path} refuses {who}: not in {allowed}; trainers fail with AuthError",
            _join_fix(user, decisive.socket, config.allowed_gids if named else None),
        )
    if decisive is not None and decisive.reach is Reach.UNTRUSTED:
        return Finding(
            "attach",
            Status.FAIL,
            f"{decisive.path}: {decisive.detail}",
            "set TIERMEM_DAEMON_USER to the user the service runs as, or remove the impostor's directory",
        )
    end = facts.sockets.index(decisive) if decisive is not None else len(facts.sockets)
    passed = next((p for p in facts.sockets[:end] if p.reach in _SKIPPED), None)
    if passed is None:
        if decisive is None or decisive.reach is not Reach.ANSWERED:
            return Finding("attach", Status.SKIP, f"{who}: no daemon to attach to")
        return Finding("attach", Status.OK, f"{who}: admitted by the daemon at {decisive.path}")
    status, then = (Status.WARN, f"trainers use {decisive.path}") if decisive is not None else _fallback(facts)
    if passed.reach is Reach.UNTRUSTED:
        return Finding(
            "attach",
            status,
            f"{passed.path} is passed by: {passed.detail}; {then}",
            "set TIERMEM_DAEMON_USER to the user the service runs as, or remove the impostor's directory",
        )
    gids = config.allowed_gids if config.socket == passed.path else None
    sock, directory = passed.socket, passed.directory
    if sock is not None and not sock.missing and not sock.unknown and "socket" in passed.detail:
        fix = _join_fix(user, sock, gids)
    elif directory is not None and not directory.missing and not directory.unknown and directory.gid != 0:
        fix = f"{_join_fix(user, directory, gids)}; or make {directory.path} 0755, as the shipped units do"
    else:
        fix = f"make {os.path.dirname(passed.path)} searchable: 0755, as the shipped units make /run/tiermem"
    return Finding("attach", status, f"{who}: {passed.path}: {passed.detail}; {then}", fix)


def _join_fix(user: User, sock: Entry | None, allowed_gids: tuple[int, ...] | None) -> str:
    """How ``user`` joins the trainers of a socket: its group, listed in ``server.allowed_gids``."""
    if sock is None or sock.missing or sock.unknown or sock.gid == 0:
        return (
            'set server.socket_group = "tiermem" and list its gid in server.allowed_gids, add the trainers\' '
            "users to it (usermod -aG tiermem USER), then restart tiermemd"
        )
    group = sock.group_name or str(sock.gid)
    steps = [] if sock.gid in user.gids else [f"usermod -aG {group} {user.name} (then log in again)"]
    if allowed_gids is None or sock.gid not in allowed_gids:
        steps.append(f"list gid {sock.gid} ({group}) in server.allowed_gids, then systemctl reload tiermemd")
    return "; ".join(steps) or "ask the daemon's operator: it refuses this uid although its group is allowed"


def check_pool(facts: Facts) -> Finding:
    reached = _reached(facts)
    if reached is None:
        return Finding("pool", Status.SKIP, "no daemon to ask")
    pool = f"the daemon's pool {format_size(reached.pool_nbytes)}, {format_size(reached.locked_nbytes)} locked"
    if reached.locked_nbytes < reached.pool_nbytes:
        return Finding(
            "pool",
            Status.WARN,
            f"{pool}: the rest may be swapped out",
            "LimitMEMLOCK=infinity in tiermemd.service (as shipped)"
            + ("" if facts.config.mlock else ", and pool.mlock = true in the config (it is false)"),
        )
    return Finding("pool", Status.OK, pool)


def check_memlock(facts: Facts) -> Finding:
    c = facts.config
    pool = c.pool_nbytes or facts.available_nbytes // 2
    if facts.cap_ipc_lock or facts.memlock_nbytes is None:
        why = "CAP_IPC_LOCK" if facts.cap_ipc_lock else "RLIMIT_MEMLOCK unlimited"
        return Finding("memlock", Status.OK, f"{why}: a daemon started here locks all of its pool")
    limit = facts.memlock_nbytes
    found = (
        f"RLIMIT_MEMLOCK {format_size(limit)}: a daemon started here locks at most {format_size(limit)} of its "
        f"pool ({format_size(pool)} {'configured' if c.pool_nbytes else 'by default: half the available memory'})"
    )
    if limit >= pool or not c.mlock:
        return Finding("memlock", Status.OK, found)
    if _reached(facts) is not None:
        return Finding("memlock", Status.OK, f"{found}; the node daemon's limit is its unit's (see pool)")
    return Finding(
        "memlock",
        Status.WARN,
        found + ": the rest runs unlocked",
        "run the node service (LimitMEMLOCK=infinity), or raise memlock in /etc/security/limits.d/",
    )


def check_libaio(facts: Facts) -> Finding:
    problem = facts.libaio_error or facts.aio_context_error
    if not problem:
        return Finding("libaio", Status.OK, "libaio loads and a kernel AIO context opens: O_DIRECT swap I/O")
    status = Status.FAIL if facts.config.engine == "libaio" else Status.WARN
    then = 'swap.engine = "libaio" cannot start (exit 4)' if status is Status.FAIL else "swap I/O is buffered"
    fix = (
        "apt-get install libaio1 (libaio1t64 on newer Debian), pip install libaio"
        if facts.libaio_error
        else "raise fs.aio-max-nr (sysctl) or lower swap.queue_depth"
    )
    return Finding("libaio", status, f"{problem}; {then} (the thread engine)", fix)


def check_swap_dir(d: SwapDirFacts, facts: Facts) -> Finding:
    where = d.path if facts.config.path else f"{d.path} ({privatedir.PRIVATE_SWAP})"
    free = "" if d.free_nbytes is None else f"; {format_size(d.free_nbytes)} free"
    if d.covered is False:
        return Finding(
            "swap",
            Status.FAIL,
            f"{where}: outside the unit's ReadWritePaths=, read-only to the daemon under ProtectSystem=strict (exit 4)",
            f"add {d.path} to ReadWritePaths= in tiermemd.service",
        )
    if not d.probed:
        whose = d.entry.unknown or ("missing" if d.entry.missing else f"owned by uid {owner(d.entry)}")
        return Finding("swap", Status.SKIP, f"{where}: {whose}: for its daemon's user to probe{free}")
    if d.entry.missing:
        if d.write_error:
            return Finding("swap", Status.FAIL, f"{where}: missing, and {d.write_error} (exit 4)", f"mkdir -p {d.path}")
        return Finding("swap", Status.OK, f"{where}: missing, the daemon creates it at start{free}")
    if d.write_error:
        return Finding(
            "swap",
            Status.FAIL,
            f"{where}: not writable: {d.write_error} (tiermemd exits 4)",
            "remount it read-write, or list another directory in swap.dirs",
        )
    if d.direct_io_error:
        status = Status.FAIL if facts.config.engine == "libaio" else Status.WARN
        return Finding(
            "swap", status, f"{where}: {d.direct_io_error}: swap I/O is buffered{free}", "use a directory on the NVMe"
        )
    if d.free_nbytes is not None and d.free_nbytes < LOW_SWAP_NBYTES:
        return Finding("swap", Status.WARN, f"{where}: writable, O_DIRECT{free}: little room", "free some space")
    return Finding("swap", Status.OK, f"{where}: writable, O_DIRECT{free}")


def check_kernels(facts: Facts) -> list[Finding]:
    k = facts.kernels
    out: list[Finding] = []
    if not k.compiler:
        out.append(
            Finding(
                "kernels",
                Status.WARN,
                "no C compiler: compressed moments (state_dtype bf16/int8) run the plain-torch path, several times "
                "slower, and fp16/bf16 updates the eager one",
                "apt-get install gcc",
            )
        )
    else:
        out.append(_this_users_kernels(k))
    if k.inductor_error:
        out.append(
            Finding(
                "kernels",
                Status.WARN,
                f"inductor's cache {k.inductor_dir}: {k.inductor_error}",
                "set TORCHINDUCTOR_CACHE_DIR to a directory of this user",
            )
        )
    c = facts.config
    if c.path and not c.error and k.unit_installed and not c.cache_dir:
        out.append(
            Finding(
                "kernels",
                Status.WARN,
                "adam.cache_dir is empty: under the unit's PrivateTmp the node daemon's inductor kernels land in a "
                "private /tmp, recompiled at every restart",
                f'adam.cache_dir = "/var/lib/tiermem/kernels" in {c.path}',
            )
        )
    if k.cache_covered is False:
        out.append(
            Finding(
                "kernels",
                Status.WARN,
                f"adam.cache_dir {c.cache_dir} is outside the unit's ReadWritePaths=: the node daemon builds in /tmp",
                f"add {c.cache_dir} to ReadWritePaths=, or put it under /var/lib/tiermem",
            )
        )
    if k.daemon is None:
        if k.daemon_why:
            out.append(Finding("kernels", Status.SKIP, f"the node daemon's: {k.daemon_why}"))
        return out
    states = ", ".join(f"{name} {state}" for name, state in k.daemon)
    failed = [name for name, state in k.daemon if state == "failed"]
    if failed:
        out.append(
            Finding(
                "kernels",
                Status.WARN,
                f"the node daemon's: {states}: the slower fallback runs",
                "journalctl -u tiermemd says why (install gcc; check adam.cache_dir)",
            )
        )
    else:
        out.append(Finding("kernels", Status.OK, f"the node daemon's: {states or 'none reported'}"))
    return out


def _this_users_kernels(k: KernelFacts) -> Finding:
    if k.lowbit_error:
        return Finding(
            "kernels",
            Status.WARN,
            f"the compressed-moment kernel's caches could not be looked at ({k.lowbit_error})",
            "reinstall tiermem in this environment (pip install -e . or the wheel)",
        )
    usable = next((d for d, problem in k.caches if not problem), None)
    skipped = "; ".join(f"{d}: {problem}" for d, problem in k.caches if problem)
    inductor = f"; inductor's cache {k.inductor_dir}" if k.inductor_dir and not k.inductor_error else ""
    if usable is None:
        return Finding(
            "kernels",
            Status.WARN,
            f"no kernel cache this user may use ({skipped}): each process builds anew into a temporary directory",
            "give this user a home directory, or set adam.cache_dir to a directory of its own, mode 0700",
        )
    built = f"built ({k.lowbit_built})" if k.lowbit_built else "not built yet (2-20 s at a daemon's start)"
    where = f"{usable}, not {skipped}" if skipped else usable
    return Finding("kernels", Status.OK, f"this user's cache {where}: the compressed-moment kernel {built}{inductor}")


def check_torch(facts: Facts) -> list[Finding]:
    t = facts.torch
    if not t.version:
        return [Finding("torch", Status.FAIL, f"torch does not import: {t.error}", "pip install 'torch>=2.3'")]
    out = [Finding("torch", Status.OK, f"torch {t.version}" + (f", CUDA {t.cuda}" if t.cuda else ", CPU build"))]
    if not t.devices:
        out.append(Finding("cuda", Status.SKIP, "no GPU visible: CPU training only"))
    elif t.pin_error:
        out.append(
            Finding(
                "cuda",
                Status.WARN,
                f"{', '.join(t.devices)}: cudaHostRegister of a shared window failed ({t.pin_error}): GPU copies are "
                "pageable, slower",
                "check the driver (nvidia-smi) and that the container may pin memory",
            )
        )
    else:
        out.append(Finding("cuda", Status.OK, f"{', '.join(t.devices)}: a shared window pins (cudaHostRegister)"))
    return out


def run_checks(facts: Facts) -> list[Finding]:
    """Every finding about ``facts``, in the order the report shows them."""
    return [
        check_config(facts),
        check_daemon(facts),
        check_attach(facts),
        check_pool(facts),
        check_memlock(facts),
        check_libaio(facts),
        *(check_swap_dir(d, facts) for d in facts.swap_dirs),
        *check_kernels(facts),
        *check_torch(facts),
    ]


# --------------------------------------------------------------------------- the report


def exit_code(findings: Sequence[Finding], *, strict: bool = False) -> int:
    """0 when the node can train (1 with a failure, or with ``strict`` a warning)."""
    bad = {Status.FAIL, Status.WARN} if strict else {Status.FAIL}
    return EXIT_FAILED if any(f.status in bad for f in findings) else EXIT_OK


def verdict(findings: Sequence[Finding]) -> str:
    failed = sum(f.status is Status.FAIL for f in findings)
    warned = sum(f.status is Status.WARN for f in findings)
    if failed:
        return f"This node cannot train through tiermem: {failed} check(s) failed, {warned} warning(s)."
    return f"This node can train through tiermem ({warned} warning(s))."


def render(facts: Facts, findings: Sequence[Finding], width: int = 100) -> str:
    """The report as text: a header, one entry per finding with its fix, the verdict."""
    user = facts.user
    groups = ", ".join(user.group(g) for g in sorted(user.gids)) or "none"
    lines = [f"tiermem doctor {facts.version} (protocol {facts.protocol}) as {user.label}, groups {groups}", ""]
    for f in findings:
        head = f"{f.status.value:<5} {f.check:<9} "
        lines += textwrap.wrap(f.found, width, initial_indent=head, subsequent_indent=" " * 16) or [head]
        if f.fix:
            lines += textwrap.wrap(f.fix, width, initial_indent=" " * 16 + "fix: ", subsequent_indent=" " * 21)
    return "\n".join([*lines, "", verdict(findings)]) + "\n"


def to_json(facts: Facts, findings: Sequence[Finding], code: int) -> dict[str, object]:
    reached = _reached(facts)
    return {
        "can_train": not any(f.status is Status.FAIL for f in findings),
        "exit_code": code,
        "version": facts.version,
        "protocol": facts.protocol,
        "user": {"uid": facts.user.uid, "name": facts.user.name, "gids": sorted(facts.user.gids)},
        "socket": reached.path if reached is not None else None,
        "findings": [{**asdict(f), "status": f.status.value} for f in findings],
    }


# --------------------------------------------------------------------------- the command

EPILOG = """\
exit codes: 0 the node can train through tiermem (warnings say where it runs slower or alone: a private
daemon, buffered swap I/O, the fallback kernel); 1 a check failed, training through tiermem fails here
(with --strict: or a warning was found); 2 bad usage.
"""


DESCRIPTION = (
    "Checks, as the user who runs it: the node's settings; the tiermemd a trainer of this user "
    "would reach (found as trainers find it), its version and protocol, and whether this user may "
    "attach (uid, groups, allowed_gids, socket and directory modes); the daemon's pool and "
    "RLIMIT_MEMLOCK; libaio and a kernel AIO context; each swap directory (writable, O_DIRECT, free "
    "space, inside the unit's ReadWritePaths); the kernel caches and the kernels built; torch, and "
    "CUDA with cudaHostRegister where a GPU is present. Each problem comes with a one-line fix."
)


def add_parser(sub: Subparsers) -> None:
    help_line = "check that this node can train through tiermem, with a fix for each problem"
    doctor = add_command(sub, "doctor", help=help_line, run=run_doctor, description=DESCRIPTION, epilog=EPILOG)
    doctor.add_argument(
        "--socket",
        metavar="PATH",
        help="check as if TIERMEM_SOCKET_PATH named PATH (default: $TIERMEM_SOCKET_PATH, else the node's socket, "
        "then yours)",
    )
    doctor.add_argument(
        "--config",
        metavar="PATH",
        help="the node's settings (default: $TIERMEM_CONFIG, else /etc/tiermem/tiermemd.toml when it exists)",
    )
    doctor.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    doctor.add_argument("--strict", action="store_true", help="exit 1 on a warning too")
    doctor.add_argument(
        "--timeout", type=float, default=10.0, metavar="SECONDS", help="how long a daemon may take to answer"
    )


def run_doctor(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from tiermem.client.doctor_probe import gather

    out = sys.stdout if out is None else out
    facts = gather(socket_path=args.socket, config_path=args.config, timeout_s=args.timeout, env=os.environ)
    findings = run_checks(facts)
    code = exit_code(findings, strict=args.strict)
    if args.json:
        print(json.dumps(to_json(facts, findings, code), indent=1), file=out)
    else:
        print(render(facts, findings), end="", file=out)
    return code

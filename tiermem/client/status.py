"""``tiermem status``: one screen of the node's tiermemd, like nvidia-smi for memory tiers.

Owns the rendering of a STATS reply (``tiermem.core.protocol.report``) as text
(``render``) or JSON, and the loop of ``--watch``.  Rates (bytes/s, updates/s)
come from two replies and the time between them, so a single shot shows
totals only.  The daemon lists every job for root and its own uid, else only
the caller's uid's jobs.

Exit codes: 0 shown; 1 no daemon could be reached (one line says which
sockets were tried and what stood in the way of each).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from tiermem.client.subcommand import Subparsers, add_command
from tiermem.core.errors import TiermemError, UnsafePathError
from tiermem.core.protocol import JobReport, NodeReport, StatsReply
from tiermem.core.units import format_size

if TYPE_CHECKING:
    from tiermem.client.link import Client

__all__ = ["Sample", "add_parser", "render", "run_status"]

WIDTH = 97
_CLEAR = "\x1b[H\x1b[2J"


@dataclass(frozen=True)
class Sample:
    """One STATS reply and when it was taken (``time.monotonic()``)."""

    reply: StatsReply
    at: float


def _rate(now: Sample, before: Sample | None, pick: str) -> float | None:
    if before is None or now.at <= before.at:
        return None
    a, b = _path(before.reply.node, pick), _path(now.reply.node, pick)
    return max(0.0, (b - a) / (now.at - before.at))


def _path(node: NodeReport, dotted: str) -> float:
    value: object = node
    for part in dotted.split("."):
        value = getattr(value, part)
    return float(value)  # type: ignore[arg-type]


def _size_rate(rate: float | None) -> str:
    return "" if rate is None else f" ({format_size(rate)}/s)"


def _count_rate(rate: float | None, unit: str = "/s") -> str:
    return "" if rate is None else f" ({rate:.1f}{unit})"


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _line(text: str) -> str:
    inner = WIDTH - 4
    return f"| {text[:inner]:<{inner}} |"


def _count(n: float) -> str:
    """A count the way a person reads it: 950, 8.3k, 7.5M, 1.2G."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def render(now: Sample, before: Sample | None = None, *, socket_path: str = "") -> str:
    """The status screen for ``now`` (rates against ``before`` when given)."""
    node = now.reply.node
    rule = "+" + "-" * (WIDTH - 2) + "+"
    title = f"tiermemd {node.version}" + (f" on {socket_path}" if socket_path else "")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        "\n".join(
            [f"{title:<{WIDTH - len(stamp)}}{stamp}", rule, *_node_lines(now, before), rule, *_job_lines(now), rule]
        )
        + "\n"
    )


def _node_lines(now: Sample, before: Sample | None) -> list[str]:
    """The node's rows: pool, swap, Adam, budgets, clients, errors (rates against ``before``)."""
    node = now.reply.node
    pool, swap, adam, server, pre = node.pool, node.swap, node.adam, node.server, node.prefetch
    out: list[str] = []
    out.append(
        _line(
            f"Pool     {format_size(pool.capacity_nbytes):>9} used {format_size(pool.used_nbytes)} "
            f"({_pct(pool.used_nbytes, pool.capacity_nbytes)})  free {format_size(pool.free_nbytes)}  "
            f"largest free {format_size(pool.largest_free_nbytes)}"
        )
    )
    frag = 0.0 if not pool.free_nbytes else 1.0 - pool.largest_free_nbytes / pool.free_nbytes
    out.append(
        _line(
            f"         locked {format_size(pool.locked_nbytes)}  blocks {pool.blocks}  fragmentation {frag:.2f}  "
            f"compactions {pool.compactions} ({format_size(pool.moved_nbytes)} moved)"
        )
    )
    out.append(
        _line(
            f"Swap     {format_size(swap.capacity_nbytes):>9} budget  reserved {format_size(swap.reserved_nbytes)}  "
            f"used {format_size(swap.used_nbytes)}"
        )
    )
    out.append(
        _line(
            f"         read {format_size(swap.read_nbytes)}{_size_rate(_rate(now, before, 'swap.read_nbytes'))}  "
            f"written {format_size(swap.written_nbytes)}{_size_rate(_rate(now, before, 'swap.written_nbytes'))}"
        )
    )
    hit = _pct(pre.hits, pre.acquires) if pre.acquires else "-"
    out.append(
        _line(
            f"         prefetch hits {hit} of {pre.acquires}  stalled {pre.stall_s:.2f}s  "
            f"CPU tasks queued {node.queued_tasks}"
        )
    )
    mean = f"{adam.update_s / adam.updates * 1e3:.1f}ms" if adam.updates else "-"
    params_rate = _rate(now, before, "adam.updated_elements")
    out.append(
        _line(
            f"Adam     updates {adam.updates}{_count_rate(_rate(now, before, 'adam.updates'))}  "
            f"params {_count(adam.updated_elements)}"
            f"{'' if params_rate is None else f' ({_count(params_rate)}/s)'}  "
            f"{mean} per update  steps {adam.steps}"
        )
    )
    period = f"{adam.busy_period_s / adam.busy_periods * 1e3:.1f}ms" if adam.busy_periods else "-"
    filled = _pct(round(adam.cpu_busy_s * 1e6), round(adam.busy_period_s * 1e6)) if adam.busy_period_s else "-"
    busy = f"CPU busy {adam.cpu_busy_s:.2f}s  periods {adam.busy_periods}  {period} each, {filled} in tasks"
    out.append(_line(f"         {busy}"))
    budgets = [f"{b.resource} {format_size(b.held_nbytes)} of {format_size(b.capacity_nbytes)}" for b in node.budgets]
    for i in range(0, len(budgets), 2):
        out.append(_line(f"{'Budgets' if i == 0 else '':<9}" + "  ".join(budgets[i : i + 2])))
    out.append(
        _line(
            f"Clients  {server.sessions} connected  attaches {server.attaches}  disconnects {server.disconnects}  "
            f"refused {server.refused}"
        )
    )
    failed = sum(job.failed_ranks for job in now.reply.jobs)
    out.append(
        _line(
            f"Errors   protocol {server.protocol_errors}  auth {server.auth_errors}  swap I/O {swap.io_errors}  "
            f"checksum {swap.checksum_failures}  failed ranks {failed}  skipped {adam.skipped_steps}"
        )
    )
    return out


def _job_lines(now: Sample) -> list[str]:
    """The jobs' table: a header, a row per job this user may see, and what it hides."""
    node = now.reply.node
    out = [
        _line(
            _job_row(
                "JOB", "UID", "STATE", "RANKS", "STEP", "WINDOW", "STORAGE", "CPU", "NVME", "ADAM", "DPU", "KERNEL"
            )
        )
    ]
    for job in now.reply.jobs:
        out.append(_line(_job_cells(job)))
    shown = len(now.reply.jobs)
    if not shown:
        out.append(_line("(no jobs)" if node.jobs == 0 else f"({node.jobs} job(s), none of this user's)"))
    elif node.jobs > shown:
        out.append(_line(f"(+{node.jobs - shown} job(s) of other users)"))
    return out


def _job_row(*cells: str) -> str:
    widths = (12, 5, 8, 5, 6, 7, 8, 8, 8, 4, 3, 8)
    return " ".join(f"{c[:w]:<{w}}" for c, w in zip(cells, widths, strict=True))


def _job_cells(job: JobReport) -> str:
    failed = f"!{job.failed_ranks}" if job.failed_ranks else ""
    return _job_row(
        job.job_id,
        str(job.owner_uid),
        job.state,
        f"{job.ranks}/{job.world_size}{failed}",
        str(job.last_step),
        format_size(job.window_nbytes),
        format_size(job.storage_nbytes),
        format_size(job.cpu_state_nbytes),
        format_size(job.nvme_state_nbytes),
        _one_or_mix(job.state_dtypes),
        "1" if job.staleness_steps else "0",
        _one_or_mix(job.kernel_paths),
    )


def _one_or_mix(values: tuple[str, ...]) -> str:
    """A job's ranks' one value (how they keep the Adam moments, the kernel path their updates ran), ``mix``
    where they differ, ``-`` before any has one."""
    if not values:
        return "-"
    return values[0] if len(values) == 1 else "mix"


DESCRIPTION = (
    "Asks the node's tiermemd for its figures (a STATS request) and shows them on one screen: the "
    "host-memory pool, the NVMe swap tier, the budgets, the CPU Adam updates, the clients and their "
    "errors, and one line per job with its bytes per tier. Root and the daemon's user see every job, "
    "other users their own. Rates need two samples: use --watch."
)


def add_parser(sub: Subparsers) -> None:
    help_line = "show the node's tiermemd: pool, swap, jobs with their usage per tier, throughput, errors"
    status = add_command(sub, "status", help=help_line, run=run_status, description=DESCRIPTION)
    status.add_argument(
        "--socket", metavar="PATH", help="the daemon's socket (default: $TIERMEM_SOCKET_PATH, the node's, yours)"
    )
    status.add_argument("--json", action="store_true", help="print the STATS reply as JSON (one object per sample)")
    status.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long the daemon may stay silent before status gives up (default 10; a trainer waits 60)",
    )
    status.add_argument(
        "--watch",
        nargs="?",
        const=2.0,
        type=float,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until interrupted; a daemon that stops answering is asked for "
        "again at each interval",
    )


def _unreachable(socket_path: str | None) -> str:
    """Why no daemon answers, in one line: each socket a client tries and what stood in the way."""
    import os

    from tiermem.client.doctor import unreachable_summary
    from tiermem.client.doctor_probe import gather_user, probe_sockets

    probes, error = probe_sockets(socket_path, os.environ, gather_user(), timeout_s=5.0)
    return (error or unreachable_summary(probes)) + "; tiermem doctor says what to change"


def run_status(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from tiermem.client.link import connect  # imports torch: only when the command runs

    out = sys.stdout if out is None else out
    if not args.timeout > 0:
        print(f"tiermem status: --timeout needs a positive number of seconds, got {args.timeout}", file=sys.stderr)
        return 2
    if args.watch is not None and not args.watch > 0:
        print(f"tiermem status: --watch needs a positive number of seconds, got {args.watch}", file=sys.stderr)
        return 2
    try:
        client = connect(args.socket, embed=False, timeout_s=args.timeout)
    except UnsafePathError as exc:
        print(f"tiermem status: no tiermemd to show: {exc}", file=sys.stderr)
        return 1
    except TiermemError:
        print(f"tiermem status: no tiermemd to show: {_unreachable(args.socket)}", file=sys.stderr)
        return 1
    try:
        if args.watch is None:
            with client:
                _show(client, None, args, out)
            return 0
        _watch(client, args, out)
    except (KeyboardInterrupt, BrokenPipeError):  # Ctrl-C, or a reader that stopped (``| head``)
        return 0
    except TiermemError as exc:  # the first request refused (a uid the daemon does not allow, say)
        print(f"tiermem status: the daemon at {client.socket_path}: {exc}", file=sys.stderr)
        return 1
    return 0


def _show(client: Client, before: Sample | None, args: argparse.Namespace, out: TextIO) -> Sample:
    """One STATS request, printed as a screen (rates against ``before``) or a JSON line; the sample."""
    now = Sample(client.stats(), time.monotonic())
    if args.json:
        print(json.dumps({"socket": client.socket_path, **now.reply.to_payload()}), file=out)
    else:
        screen = render(now, before, socket_path=client.socket_path)
        print((_CLEAR if args.watch is not None and out.isatty() else "") + screen, end="", file=out)
    out.flush()
    return now


def _watch(client: Client, args: argparse.Namespace, out: TextIO) -> None:
    """``--watch``: a sample every ``args.watch`` seconds until interrupted.  A daemon that goes away after
    it answered once (a restart, a stop) is said once on stderr and asked for again at every interval; the
    first sample of the one that answers again has no rates (its counters began anew)."""
    before: Sample | None = None
    seen = lost = False
    try:
        while True:
            try:
                before = _show(client, before, args, out)
            except TiermemError as exc:
                if not seen:
                    raise  # refused from the start: asking again changes nothing
                client.close()
                if not lost:  # once per outage, however many tries it takes
                    print(
                        f"tiermem status: the daemon stopped answering: {exc}; asking again every {args.watch:g} s",
                        file=sys.stderr,
                    )
                lost = True
                client = _reconnect(args)
                before = None
                continue
            if lost:
                print(f"tiermem status: {client.socket_path} answers again", file=sys.stderr)
            seen, lost = True, False
            time.sleep(args.watch)
    finally:
        client.close()


def _reconnect(args: argparse.Namespace) -> Client:
    from tiermem.client.link import connect

    while True:
        time.sleep(args.watch)
        try:
            return connect(args.socket, embed=False, timeout_s=args.timeout)
        except TiermemError:
            continue

"""``tiermemd``: command line, configuration, logging and exit codes.

Exit codes: ``tiermemd.exits`` (a contract with the supervisor).

Only this module configures logging (stderr, which journald captures).

The daemon shares the node's cores with the trainers, so its OpenMP workers
(the CPU Adam kernel's) sleep between parallel regions instead of spinning:
``OMP_WAIT_POLICY=PASSIVE`` is set here, before torch and its OpenMP runtime
load, unless the operator set a policy.  libgomp's default spins for
milliseconds after every region; on the demo GPT that was 5 ms of a core per
step, taken from the trainer's forward.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see the module docstring; before torch loads

from tiermem import __version__
from tiermem.core.config import DaemonConfig, config_to_dict, load_config
from tiermem.core.errors import ConfigError
from tiermemd.exits import EXIT_CONFIG, EXIT_OK

__all__ = ["main"]

DEFAULT_NODE_CONFIG = "/etc/tiermem/tiermemd.toml"

log = logging.getLogger("tiermemd")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiermemd",
        description=(
            "The tiermem per-node service: owns a pinned host-memory pool and NVMe swap files and runs "
            "the CPU Adam update for the training processes of this node. Settings come from the TOML "
            "file, then TIERMEM_<SECTION>_<KEY> environment variables, then these flags."
        ),
        epilog=(
            "exit codes: 0 clean shutdown, 1 internal error, 2 invalid configuration (or a name in it this "
            "node lacks), 3 the pool does not fit the memory cgroup, RAM or RLIMIT_MEMLOCK, or could not be "
            "allocated, 4 swap or state directory unusable, not private, held by another tiermemd, or reordered "
            "under a job's state, 5 socket in use, not bindable, or in a directory another user could change, "
            "or the metrics endpoint cannot be served, 6 stopped but some state could not be committed at "
            "shutdown (the log names the step each job comes back at). "
            f"With no --config, {DEFAULT_NODE_CONFIG} is read when it exists (or TIERMEM_CONFIG)."
        ),
    )
    parser.add_argument("--config", metavar="PATH", help="TOML settings file")
    parser.add_argument("--socket", metavar="PATH", help="control socket path (server.socket)")
    parser.add_argument("--pool-size", metavar="SIZE", help='host pool size, e.g. "64GiB" (pool.size)')
    parser.add_argument(
        "--swap-dir", metavar="DIR", action="append", help="swap directory, repeatable: one per NVMe (swap.dirs)"
    )
    parser.add_argument("--metrics-port", metavar="N", type=int, help="Prometheus port, 0 = off (metrics.port)")
    parser.add_argument("--state-dir", metavar="DIR", help="manifests and default swap location (server.state_dir)")
    parser.add_argument("--no-mlock", action="store_true", help="do not lock the pool in memory (pool.mlock=false)")
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="validate the settings, and the names they give on this node, and exit (0 if valid)",
    )
    parser.add_argument("--print-config", action="store_true", help="print the effective settings as TOML and exit")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default: INFO"
    )
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop (as on SIGTERM) when the parent process exits; used by clients that start a private daemon",
    )
    parser.add_argument(
        "--private-dir",
        metavar="DIR",
        help="the private directory this daemon runs in (socket, state, swap): removed when it exits; used with "
        "--exit-with-parent by clients that start a private daemon",
    )
    parser.add_argument("--version", action="version", version=f"tiermemd {__version__}")
    return parser


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "server.socket": args.socket,
        "pool.size": args.pool_size,
        "swap.dirs": tuple(args.swap_dir) if args.swap_dir else None,
        "metrics.port": args.metrics_port,
        "server.state_dir": args.state_dir,
        "pool.mlock": False if args.no_mlock else None,
    }


def resolve_config(args: argparse.Namespace, env: dict[str, str]) -> DaemonConfig:
    path = args.config or env.get("TIERMEM_CONFIG")
    if path is None and os.path.exists(DEFAULT_NODE_CONFIG):
        path = DEFAULT_NODE_CONFIG
    return load_config(path, env=env, overrides=flag_overrides(args))


def check_names(config: DaemonConfig, env: dict[str, str]) -> None:
    """What the settings name on this node, checked before anything starts (and by ``--check-config``): the
    socket path fits ``AF_UNIX``, the socket's group exists, the metrics address resolves.  Each would
    otherwise fail the start later with exit 5, which a service manager restarts in a loop; a configuration
    error (exit 2) is not restarted."""
    import socket

    from tiermem.net.sockpath import socket_path_problem
    from tiermemd.listener import gid_of

    if not env.get("LISTEN_FDS"):  # socket activation: the service manager made the socket
        problem = socket_path_problem(config.server.socket) if config.server.socket else None
        if problem is not None:
            raise ConfigError("server.socket", problem)
        if config.server.socket_group:
            gid_of(config.server.socket_group)
    if config.metrics.port:
        try:
            socket.getaddrinfo(config.metrics.address, config.metrics.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ConfigError(
                "metrics.address", f"{config.metrics.address!r} does not resolve on this node ({exc.strerror})"
            ) from None


def to_toml(tables: dict[str, dict[str, Any]]) -> str:
    """TOML text for plain tables of str/int/float/bool/tuple values."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return '"' + "".join(_toml_char(c) for c in str(v)) + '"'

    out = []
    for section, values in tables.items():
        out.append(f"[{section}]")
        out.extend(f"{key} = {oct(v) if key.endswith('_mode') else value(v)}" for key, v in values.items())
        out.append("")
    return "\n".join(out)


def _toml_char(c: str) -> str:
    """One character of a TOML basic string: quote, backslash and control characters escaped."""
    if c in ('"', "\\"):
        return "\\" + c
    if c < " " or c == "\x7f":
        return f"\\u{ord(c):04x}"
    return c


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = dict(os.environ)
    configure_logging(args.log_level)
    try:
        config = resolve_config(args, env)
        if args.print_config:
            sys.stdout.write(to_toml(config_to_dict(config)))
            return EXIT_OK
        check_names(config, env)
    except ConfigError as exc:
        print(f"tiermemd: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.check_config:
        print("tiermemd: configuration is valid", file=sys.stderr)
        return EXIT_OK
    # --exit-with-parent watches the parent *process* from the main loop; PR_SET_PDEATHSIG would fire
    # when the *thread* that started us exits (a client may start its private daemon from any thread).
    parent = os.getppid() if args.exit_with_parent else None
    if parent == 1:
        log.info("--exit-with-parent: the parent exited before start-up; not starting")
        return EXIT_OK
    from tiermemd.service import run_service

    code = run_service(config, env, reload_config=lambda: resolve_config(args, env), parent_pid=parent)
    if args.private_dir and (code == EXIT_OK or parent is None or os.getppid() != parent):
        # a live parent that sees a failure reads the log in there first, then removes the directory itself
        from tiermem.net import privatedir

        if not privatedir.is_private_dir(args.private_dir):
            log.warning("--private-dir %s is not a private tiermemd directory; left in place", args.private_dir)
        elif privatedir.remove(args.private_dir):
            log.info("removed the private directory %s", args.private_dir)
    # Everything is released and flushed: skip the interpreter's teardown of torch (seconds, during
    # which a second SIGTERM would kill the process and turn a clean exit into -15).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

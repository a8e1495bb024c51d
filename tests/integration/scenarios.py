"""Several runs of one ``torchrun`` worker in one launch, so that torch, the ranks and gloo start once.

A launch of ``torchrun --nproc-per-node 4`` costs about 10 s on two cores
before a worker does anything (five interpreters importing torch), more than
most runs themselves.  The ZeRO tests that share a daemon and a world size
therefore run their scenarios in one launch: every rank calls the worker's
``main(argv)`` once per scenario, in order, over one process group that this
launcher makes; each scenario makes and closes its own optimizers (a job of
its own in the daemon), and each test then reads its scenario's outputs.

Usage, under ``torchrun``::

    scenarios.py WORKER_FILE PLAN_JSON

``PLAN_JSON`` is a file holding ``[[name, [arg, ...]], ...]``; an entry
``[name, [arg, ...], OTHER_WORKER_FILE]`` runs that worker's ``main`` instead
(a scenario of another worker in the same launch).  A scenario
that raises writes its traceback to ``<PLAN_JSON dir>/<name>.error.<rank>``
and ends the launch (its peers may be waiting in a collective; torchrun ends
them); the scenarios after it did not run.

The workers' own start and end (``join_group``, ``end_run``), their JSON
outputs (``write_json``) and their exit as a script (``leave``) are here too.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch.distributed as dist


class Closeable(Protocol):
    def close(self) -> None: ...


def _load(worker_file: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(worker_file.stem, worker_file)
    assert spec is not None and spec.loader is not None, worker_file
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker


def main() -> int:
    worker_file, plan_file = Path(sys.argv[1]), Path(sys.argv[2])
    workers = {worker_file: _load(worker_file)}
    # one process group for every run: torch's default group made again over the launcher's store can meet
    # the previous group's keys there and hang; the workers use a group that is already made
    dist.init_process_group("gloo")
    rank = os.environ.get("RANK", "0")
    for name, argv, *other in json.loads(plan_file.read_text()):
        path = Path(other[0]) if other else worker_file
        if path not in workers:
            workers[path] = _load(path)
        try:
            code = workers[path].main(argv)
        except BaseException:
            (plan_file.parent / f"{name}.error.{rank}").write_text(traceback.format_exc())
            return 1
        if code:
            (plan_file.parent / f"{name}.error.{rank}").write_text(f"main returned {code}")
            return code
    dist.destroy_process_group()
    return 0


def join_group(*, outlive_a_killed_peer: bool = False) -> tuple[int, int, bool]:
    """A worker's start: (rank, world size, owned) in the launch's process group, made here when the worker
    runs alone under torchrun (``owned``: ``end_run`` destroys it).

    ``outlive_a_killed_peer``: for a run that kills a rank.  torchrun's agent sees the killed rank within its
    monitor interval (0.1 s) and SIGTERMs the others; a survivor that is still computing when the peer dies
    would be ended before its collective fails: it stays until it has reported the error it caught (then the
    agent's kill after 30 s bounds a hang)."""
    if outlive_a_killed_peer:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    owned = not dist.is_initialized()  # this launcher makes one group for all of its runs
    if owned:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), owned


def end_run(owned: bool, *closing: Closeable) -> int:
    """A worker's end: close ``closing`` (its optimizers), destroy the group if it made it; ``main``'s 0."""
    for each in closing:
        each.close()
    if owned:
        dist.destroy_process_group()
    return 0


class Warnings(logging.Handler):
    """The warnings a scenario's code logs (add it to the ``tiermem`` logger; remove it at the scenario's end)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def write_json(path: str | Path, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f)


def leave(code: int) -> None:
    """End a rank whose outputs are written without interpreter finalization, in which torch's gloo now and
    then aborts a rank that already destroyed its process group (SIGABRT, "terminate called without an active
    exception"; ``benchmarks/soak_torchrun.py`` measures it), failing a launch whose results are all in."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())

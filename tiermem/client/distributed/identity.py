"""Who a distributed job is: its id (from the launcher) and its token (derived, so a relaunch finds its state).

The job id is the launcher's rendezvous id (``TORCHELASTIC_RUN_ID``, which
``torchrun`` keeps across the restarts of one run, ``--rdzv-id`` in a
multi-node launch), else one that rank 0 draws.  The token is what a daemon
asks of every later attach to the job; rank 0 computes it and broadcasts it
before anyone attaches:

- ``HMAC-SHA256(user secret, job id)``, where the user secret is 32 random
  bytes in a file only its owner may read (``$TIERMEM_SECRET_FILE``, else
  ``~/.config/tiermem/job-secret``, made on first use with mode 0600).  A
  relaunch of the same run (``torchrun --max-restarts``, or the same
  ``--rdzv-id`` by hand) then computes the same token and reattaches to the
  job's state in every node's daemon, with no token to carry over; another
  job of the same user (another id) gets another token.  On a cluster the
  home directory is usually shared, so rank 0 computes the same token on
  whichever node it lands.
- Where the file cannot be made or read (no home, read-only), a random token
  (a warning says so): that run can then be continued only with ``token=``
  (``opt.token``).

Several sharded optimizers live in one process (two models, say): the
first gets the run's id, the next ones ``<id>-2``, ``<id>-3``... in the order
they are made, the lowest index no open optimizer of the process holds, so a
relaunch that builds them in the same order finds each one's state, and one
made again after ``close()`` gets the closed one's id back.

Why not random per run: torchrun restarts every worker after a failure, rank 0
included, and nothing of the first attempt's memory survives to tell the new
rank 0 the old token.  Why not the job id alone: a token anyone can compute
from the id protects nothing.  Other users never reach the job anyway (job
ids are per uid); the secret keeps a process of the same user that cannot
read it (another container, a sandbox) from joining a job by naming it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["agree_identity", "job_token", "release_job_id", "secret_path"]

log = logging.getLogger(__name__)

_SECRET_NBYTES = 32


def secret_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    explicit = env.get("TIERMEM_SECRET_FILE")
    if explicit:
        return Path(explicit)
    return Path(env.get("HOME") or os.path.expanduser("~")) / ".config" / "tiermem" / "job-secret"


def _read_or_make(path: Path) -> bytes:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, secrets.token_bytes(_SECRET_NBYTES))
        finally:
            os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PermissionError(f"{path} must belong to uid {os.getuid()} with mode 0600")
        data = os.read(fd, 4 * _SECRET_NBYTES)
    finally:
        os.close(fd)
    if len(data) < _SECRET_NBYTES:
        raise ValueError(f"{path} holds {len(data)} bytes, fewer than {_SECRET_NBYTES}")
    return data


def job_token(job_id: str, env: Mapping[str, str] | None = None) -> str:
    """The token of job ``job_id`` for this user (see the module docstring); random if there is no secret."""
    path = secret_path(env)
    try:
        secret = _read_or_make(path)
    except (OSError, ValueError) as exc:
        log.warning(
            "no job secret (%s): this run's token is random, so a relaunch must pass token= (opt.token) to "
            "continue from the daemon's state",
            exc,
        )
        return secrets.token_hex(16)
    return hmac.new(secret, job_id.encode(), hashlib.sha256).hexdigest()[:32]


def default_job_id(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    return f"torchrun-{run_id}" if run_id and run_id != "none" else f"dist-{uuid.uuid4().hex[:16]}"


_held: set[str] = set()
_held_lock = threading.Lock()


def _claim_default(env: Mapping[str, str] | None = None) -> str:
    """``default_job_id``, or with ``-2``, ``-3``... the first one no open optimizer of this process holds."""
    base = default_job_id(env)
    with _held_lock:
        chosen, n = base, 1
        while chosen in _held:
            n += 1
            chosen = f"{base}-{n}"
        _held.add(chosen)
    return chosen


def release_job_id(job_id: str) -> None:
    """The optimizer that held ``job_id`` (a default one) is closed: the next one made may take it."""
    with _held_lock:
        _held.discard(job_id)


def agree_identity(
    collective: Callable[..., Any], group: Any, rank: int, job_id: str | None, token: str | None
) -> tuple[str, str]:
    """Rank 0's job id and token (given, or ``default_job_id`` and ``job_token``), broadcast to every rank."""
    proposal: list[Any] = [None, None]
    if rank == 0:
        chosen = job_id or _claim_default()
        proposal = [chosen, token or job_token(chosen)]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    collective("broadcast of the job id", dist.broadcast_object_list, proposal, src=src)
    return str(proposal[0]), str(proposal[1])

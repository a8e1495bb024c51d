"""Job files: what a restarted daemon needs to reopen jobs whose state is on NVMe.

At shutdown the daemon flushes every NVMe-placed rank (dirty chunks written,
swap manifest committed) and writes one JSON file per job under
``<state_dir>/jobs/``: owner uid, token, world size, and per rank its tensors,
param groups, grad buffers and step counts.  At start it reads them back; the
jobs come back ORPHANED (waiting for their token within the grace period) and a
rank's state is reopened from its swap store when its client registers again.

Files are written atomically (temp file, fsync, rename, fsync of the
directory) with mode 0600, since they hold the job token.  A file that does not
parse is reported and set aside (renamed ``*.bad``), never half-trusted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiermem.errors import ProtocolError
from tiermem.protocol import ParamGroup, TensorSpec

__all__ = ["JobRecord", "RankRecord", "load_job_files", "remove_job_file", "write_job_file"]

log = logging.getLogger(__name__)
_VERSION = 2


@dataclass(frozen=True)
class RankRecord:
    rank: int
    placement: str
    specs: tuple[TensorSpec, ...]
    groups: tuple[ParamGroup, ...]
    grad_buffers: int
    steps: tuple[int, ...]
    last_step: int
    failed_step: int = 0
    """Nonzero: the update of this step failed part-way; the rank comes back FAILED."""
    exchange: str = "shared"
    grads_in_state: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "placement": self.placement,
            "specs": [s.to_payload() for s in self.specs],
            "groups": [g.to_payload() for g in self.groups],
            "grad_buffers": self.grad_buffers,
            "steps": list(self.steps),
            "last_step": self.last_step,
            "failed_step": self.failed_step,
            "exchange": self.exchange,
            "grads_in_state": self.grads_in_state,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankRecord:
        specs = tuple(TensorSpec.from_payload(x) for x in d["specs"])
        steps = tuple(int(x) for x in d["steps"])
        if len(steps) != len(specs):
            raise ValueError(f"{len(steps)} step counts for {len(specs)} tensors")
        return cls(
            rank=int(d["rank"]),
            placement=str(d["placement"]),
            specs=specs,
            groups=tuple(ParamGroup.from_payload(x) for x in d["groups"]),
            grad_buffers=int(d["grad_buffers"]),
            steps=steps,
            last_step=int(d["last_step"]),
            failed_step=int(d.get("failed_step", 0)),
            exchange=str(d.get("exchange", "shared")),
            grads_in_state=bool(d.get("grads_in_state", False)),
        )


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    owner_uid: int
    token: str
    world_size: int
    ranks: tuple[RankRecord, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": _VERSION,
            "job_id": self.job_id,
            "owner_uid": self.owner_uid,
            "token": self.token,
            "world_size": self.world_size,
            "ranks": [r.to_json() for r in self.ranks],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> JobRecord:
        if d.get("version") != _VERSION:
            raise ValueError(f"job file version {d.get('version')!r}, this daemon reads {_VERSION}")
        return cls(
            job_id=str(d["job_id"]),
            owner_uid=int(d["owner_uid"]),
            token=str(d["token"]),
            world_size=int(d["world_size"]),
            ranks=tuple(RankRecord.from_json(r) for r in d["ranks"]),
        )


def _path(directory: Path, job_id: str, uid: int) -> Path:
    from tiermemd.nvme import store_name

    return directory / f"{store_name(job_id, 0, uid).rsplit('.r', 1)[0]}.job.json"


def write_job_file(directory: Path, record: JobRecord) -> Path:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    final = _path(directory, record.job_id, record.owner_uid)
    tmp = final.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(record.to_json()).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def remove_job_file(directory: Path, job_id: str, uid: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        _path(directory, job_id, uid).unlink()


def load_job_files(directory: Path) -> list[JobRecord]:
    """Every readable job file; unreadable ones are renamed ``*.bad`` and reported."""
    if not directory.is_dir():
        return []
    records = []
    for path in sorted(directory.glob("*.job.json")):
        try:
            records.append(JobRecord.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError, TypeError, ProtocolError) as exc:
            log.error("job file %s is unreadable (%s); set aside as %s.bad", path, exc, path.name)
            with contextlib.suppress(OSError):
                path.rename(path.with_name(path.name + ".bad"))
    return records

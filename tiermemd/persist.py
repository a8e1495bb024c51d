"""Job files: what a restarted daemon needs to reopen jobs whose state is on NVMe.

One JSON file per job under ``<state_dir>/jobs/``: owner uid, token, world
size, whether the daemon that wrote it stopped cleanly, and per rank its
tensors, param groups, grad buffers and step counts.  A rank's state itself is
in its swap store; the job file says which *step* that state is at.

The two must agree, and they are written separately (the manifest by the swap
store, this file here), so the step counts are tied to the manifest's
generation: before a rank commits generation ``G + 1`` its job file is
written with the counts of ``G + 1`` *and* those of ``G`` (``previous``).
Whatever happens next (the commit succeeds, fails, or the daemon is killed in
between), the manifest on disk is at ``G`` or ``G + 1`` and ``resolve`` picks
the counts of that generation.  A manifest that is missing, unreadable, or
at a generation the file does not describe means the state is lost: the rank
is reported at start and a reattach gets ``DataLostError``, never zeros.

At start the daemon reads the files back; the jobs come back ORPHANED
(waiting for their token within the grace period) and a rank's state is
reopened from its swap store when its client registers again.

Files are written atomically (temp file, fsync, rename, fsync of the
directory) with mode 0600, since they hold the job token.  A file that does not
parse is reported and set aside (renamed ``*.bad``), never half-trusted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tiermem.core.errors import ProtocolError
from tiermem.core.lowbit import STATE_DTYPES
from tiermem.core.modes import Exchange, Placement
from tiermem.core.protocol import ParamGroup, TensorSpec

__all__ = [
    "JobRecord",
    "RankRecord",
    "StepCounts",
    "job_file_path",
    "load_job_files",
    "remove_job_file",
    "write_job_file",
]

log = logging.getLogger(__name__)
_VERSION = 4
"""4: each state chunk's params, moments and grads are separate swap records (``chunk{c}.{part}``); a
job file of an earlier version names a store of whole chunks, which this daemon cannot reopen."""


@dataclass(frozen=True)
class StepCounts:
    """The step counts of a rank as of one generation of its swap manifest."""

    generation: int
    last_step: int
    steps: tuple[int, ...]
    failed_step: int = 0
    skipped_steps: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "last_step": self.last_step,
            "steps": list(self.steps),
            "failed_step": self.failed_step,
            "skipped_steps": self.skipped_steps,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepCounts:
        return cls(
            generation=int(d["generation"]),
            last_step=int(d["last_step"]),
            steps=tuple(int(x) for x in d["steps"]),
            failed_step=int(d.get("failed_step", 0)),
            skipped_steps=int(d.get("skipped_steps", 0)),
        )


@dataclass(frozen=True)
class RankRecord:
    rank: int
    placement: Placement
    specs: tuple[TensorSpec, ...]
    groups: tuple[ParamGroup, ...]
    grad_buffers: int
    steps: tuple[int, ...]
    last_step: int
    failed_step: int = 0
    """Nonzero: the update of this step failed part-way; the rank comes back FAILED."""
    skipped_steps: int = 0
    """Steps skipped (``GradScaler`` overflows) up to ``last_step``: the rank's skip count survives a restart."""
    exchange: Exchange = Exchange.SHARED
    grads_in_state: bool = False
    state_dtype: str = "fp32"
    """How the moments are stored (``tiermem.core.lowbit``): a reopened rank reads its chunks with it."""
    generation: int = 0
    """The swap manifest generation ``steps``, ``last_step`` and ``failed_step`` describe."""
    previous: StepCounts | None = None
    """The counts of the generation before, while a commit of ``generation`` may not have finished."""
    clean: bool = True
    """Not stored in the rank's entry: whether the daemon that wrote the file stopped cleanly."""
    lost: str = ""
    """Not stored: why the rank's state cannot be reopened (set by ``resolve``); empty when it can."""

    @property
    def counts(self) -> StepCounts:
        return StepCounts(self.generation, self.last_step, self.steps, self.failed_step, self.skipped_steps)

    def pending(self, generation: int, durable: StepCounts | None) -> RankRecord:
        """This record as the counts of ``generation``, with ``durable`` (the generation before) kept."""
        return replace(self, generation=generation, previous=durable, lost="")

    def resolve(self, generation: int | None, why: str = "") -> RankRecord:
        """The record with the counts of manifest ``generation`` (None: no readable manifest, ``why``)."""
        if generation is None:
            return replace(self, lost=why or "its swap manifest is missing")
        if generation == self.generation:
            return replace(self, previous=None, lost="")
        if self.previous is not None and generation == self.previous.generation:
            p = self.previous
            return replace(
                self,
                generation=p.generation,
                last_step=p.last_step,
                steps=p.steps,
                failed_step=p.failed_step,
                skipped_steps=p.skipped_steps,
                previous=None,
                lost="",
            )
        known = [self.generation] + ([self.previous.generation] if self.previous else [])
        return replace(
            self,
            lost=f"its swap manifest is at generation {generation}, the job file knows the step counts of "
            f"generation(s) {known} only",
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "placement": self.placement.value,
            "specs": [s.to_payload() for s in self.specs],
            "groups": [g.to_payload() for g in self.groups],
            "grad_buffers": self.grad_buffers,
            "steps": list(self.steps),
            "last_step": self.last_step,
            "failed_step": self.failed_step,
            "skipped_steps": self.skipped_steps,
            "exchange": self.exchange.value,
            "grads_in_state": self.grads_in_state,
            "state_dtype": self.state_dtype,
            "generation": self.generation,
            "previous": self.previous.to_json() if self.previous is not None else None,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], *, clean: bool = True) -> RankRecord:
        specs = tuple(TensorSpec.from_payload(x) for x in d["specs"])
        steps = tuple(int(x) for x in d["steps"])
        previous = StepCounts.from_json(d["previous"]) if d.get("previous") is not None else None
        for counts in (steps, previous.steps if previous else steps):
            if len(counts) != len(specs):
                raise ValueError(f"{len(counts)} step counts for {len(specs)} tensors")
        state_dtype = str(d.get("state_dtype", "fp32"))
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype {state_dtype!r} is not one of {list(STATE_DTYPES)}")
        return cls(
            rank=int(d["rank"]),
            placement=Placement(d["placement"]),
            specs=specs,
            groups=tuple(ParamGroup.from_payload(x) for x in d["groups"]),
            grad_buffers=int(d["grad_buffers"]),
            steps=steps,
            last_step=int(d["last_step"]),
            failed_step=int(d.get("failed_step", 0)),
            skipped_steps=int(d.get("skipped_steps", 0)),
            exchange=Exchange(d.get("exchange", Exchange.SHARED.value)),
            grads_in_state=bool(d.get("grads_in_state", False)),
            state_dtype=state_dtype,
            generation=int(d["generation"]),
            previous=previous,
            clean=clean,
        )


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    owner_uid: int
    token: str
    world_size: int
    ranks: tuple[RankRecord, ...]
    clean: bool = True
    """Written by a daemon that stopped cleanly (every rank committed at shutdown); False for the files a
    running daemon keeps (periodic commits, reopened jobs): found at start, they mean it was killed."""

    def to_json(self) -> dict[str, Any]:
        return {
            "version": _VERSION,
            "job_id": self.job_id,
            "owner_uid": self.owner_uid,
            "token": self.token,
            "world_size": self.world_size,
            "clean": self.clean,
            "ranks": [r.to_json() for r in self.ranks],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> JobRecord:
        if d.get("version") != _VERSION:
            raise ValueError(
                f"job file version {d.get('version')!r}, this daemon reads {_VERSION} (the swap layout "
                "changed: each chunk's params, moments and grads are now separate records); the job cannot be "
                "reopened: start it again from a checkpoint (OffloadAdam.state_dict and the model's)"
            )
        clean = bool(d["clean"])
        return cls(
            job_id=str(d["job_id"]),
            owner_uid=int(d["owner_uid"]),
            token=str(d["token"]),
            world_size=int(d["world_size"]),
            ranks=tuple(RankRecord.from_json(r, clean=clean) for r in d["ranks"]),
            clean=clean,
        )


def job_file_path(directory: Path, job_id: str, uid: int) -> Path:
    from tiermemd.nvme import store_name

    return directory / f"{store_name(job_id, 0, uid).rsplit('.r', 1)[0]}.job.json"


def write_job_file(directory: Path, record: JobRecord) -> Path:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    final = job_file_path(directory, record.job_id, record.owner_uid)
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
        job_file_path(directory, job_id, uid).unlink()


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

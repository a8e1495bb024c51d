"""Jobs: who owns what, tokens, and the grace period after a crash.

One ``Job`` record per training job on the node.  Job ids are scoped per uid:
a job is ``(owner uid, job id)``, so two users who pick the same id get two
jobs, and no uid can claim (or block) an id another uid uses.  A job is
created by the first attach of its uid that names a new id; the attach reply
carries a random token (or, with ``create``, the token that attach brought: the
ranks of a distributed job agree on one before any of them attaches, so they
attach in any order).  Every later attach to that job (another rank, or a
restarted process) must present the token: a process of another job cannot
join it by guessing the id, and a process of another uid never reaches it (it
names its own job of that id).  ``max_jobs`` bounds the node's jobs and
``max_jobs_per_uid`` one uid's, so one user cannot fill the node for everyone.

States (``JobState``)::

    ACTIVE --(last session gone)--> ORPHANED --(grace period over)--> RECLAIMED
       ^                               |
       +-------(reattach w/ token)-----+
    ACTIVE --(every rank detached)--> RECLAIMED

The table only decides; the daemon performs the effects (closing windows,
freeing pool blocks, deleting swap) for the jobs ``expire`` returns.  Time
comes from an injected clock so the grace logic is tested without sleeping.
"""

from __future__ import annotations

import enum
import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tiermem.core.errors import AdmissionError, AuthError, InvalidArgument, InvalidState, UnknownJob

__all__ = ["Job", "JobState", "JobTable", "job_key"]

_JOB_ID_MAX = 128


class JobState(enum.Enum):
    ACTIVE = "active"
    ORPHANED = "orphaned"
    RECLAIMED = "reclaimed"


_MOVES = {
    JobState.ACTIVE: {JobState.ORPHANED, JobState.RECLAIMED},
    JobState.ORPHANED: {JobState.ACTIVE, JobState.RECLAIMED},
    JobState.RECLAIMED: set(),
}


@dataclass
class Job:
    job_id: str
    owner_uid: int
    world_size: int
    token: str
    state: JobState = JobState.ACTIVE
    orphaned_at: float | None = None
    ranks: dict[int, Any] = field(default_factory=dict)
    """Per-rank optimizer state, owned by the daemon (``RankOptimizer``)."""
    attached: dict[int, int] = field(default_factory=dict)
    """rank -> id of the session currently driving it."""
    detached: set[int] = field(default_factory=set)
    restored: dict[int, Any] = field(default_factory=dict)
    """rank -> ``RankRecord`` of a job reopened from a previous daemon's job file, until the rank re-registers."""
    durable: dict[int, Any] = field(default_factory=dict)
    """rank -> ``StepCounts`` of the generation its swap store last committed (``tiermemd.durability``)."""
    filed: dict[int, Any] = field(default_factory=dict)
    """rank -> ``RankRecord`` as the job file on disk has it."""
    commit_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    """Serialises the job file writes of the job's ranks."""

    @property
    def key(self) -> str:
        """The job's name on this node (its budget account): the owner uid and the job id."""
        return job_key(self.owner_uid, self.job_id)

    def transition(self, to: JobState, now: float) -> None:
        if to not in _MOVES[self.state]:
            raise InvalidState(f"job {self.job_id!r} cannot go from {self.state.value} to {to.value}")
        self.state = to
        self.orphaned_at = now if to is JobState.ORPHANED else None


def job_key(uid: int, job_id: str) -> str:
    return f"{uid}/{job_id}"


class JobTable:
    """All jobs of the daemon; thread-safe."""

    def __init__(
        self,
        *,
        grace_period_s: float,
        max_jobs: int,
        max_jobs_per_uid: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``max_jobs_per_uid`` 0: half of ``max_jobs``, rounded up."""
        self.grace_period_s = grace_period_s
        self.max_jobs = max_jobs
        self.max_jobs_per_uid = max_jobs_per_uid
        self._clock = clock
        self._jobs: dict[tuple[int, str], Job] = {}
        self._lock = threading.RLock()

    @property
    def per_uid_limit(self) -> int:
        return self.max_jobs_per_uid or -(-self.max_jobs // 2)

    def attach(
        self,
        *,
        job_id: str,
        rank: int,
        world_size: int,
        uid: int,
        token: str | None,
        session: int,
        create: bool = False,
    ) -> tuple[Job, bool]:
        """Bind ``session`` to ``(job_id, rank)``; returns the job and whether it was created.

        ``create`` (with a ``token``): a job that does not exist is created with that token (the
        ranks agreed on it beforehand, so whichever attaches first creates the job).

        Raises ``AuthError`` for a wrong token, ``InvalidArgument`` for a bad
        rank, ``AdmissionError`` when the node holds ``max_jobs`` jobs, the uid
        holds ``max_jobs_per_uid``, or the rank is driven by another live session.
        """
        if not job_id or len(job_id) > _JOB_ID_MAX or not job_id.isprintable():
            raise InvalidArgument(f"job id must be 1..{_JOB_ID_MAX} printable characters, got {job_id!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise InvalidArgument(f"rank {rank} is not in [0, world_size={world_size})")
        with self._lock:
            job = self._jobs.get((uid, job_id))
            if job is None:
                if token and not create:
                    raise UnknownJob(
                        f"uid {uid} has no job {job_id!r}: its grace period may have ended and its state was "
                        "reclaimed, or the daemon restarted after a kill with no commit of it (its state is kept "
                        "over a restart by a clean stop, or by jobs.commit_every); attach without a token to start "
                        "it anew (from a checkpoint)"
                    )
                live = [j for j in self._jobs.values() if j.state is not JobState.RECLAIMED]
                if len(live) >= self.max_jobs:
                    raise AdmissionError(f"the node already holds {len(live)} jobs (jobs.max_jobs = {self.max_jobs})")
                mine = sum(1 for j in live if j.owner_uid == uid)
                if mine >= self.per_uid_limit:
                    raise AdmissionError(
                        f"uid {uid} already holds {mine} jobs (jobs.max_jobs_per_uid = {self.per_uid_limit}); "
                        "close or detach one first"
                    )
                job = Job(job_id, uid, world_size, token if create and token else secrets.token_hex(16))
                self._jobs[(uid, job_id)] = job
                created = True
            else:
                # bytes: compare_digest refuses str with non-ASCII characters (a TypeError, not a wrong token)
                if not token or not hmac.compare_digest(token.encode(), job.token.encode()):
                    raise AuthError(
                        f"job {job_id!r} exists; attaching to it needs its token (returned by the first attach)"
                    )
                if world_size != job.world_size:
                    raise InvalidArgument(f"job {job_id!r} has world_size {job.world_size}, not {world_size}")
                holder = job.attached.get(rank)
                if holder is not None and holder != session:
                    raise AdmissionError(f"rank {rank} of job {job_id!r} is already attached by another live process")
                created = False
            if job.state is JobState.ORPHANED:
                job.transition(JobState.ACTIVE, self._clock())
            job.attached[rank] = session
            job.detached.discard(rank)
            return job, created

    def restore(self, *, job_id: str, owner_uid: int, token: str, world_size: int, ranks: dict[int, Any]) -> Job:
        """Re-create a job from a previous daemon's job file, ORPHANED: it waits for its token (grace period)."""
        with self._lock:
            if (owner_uid, job_id) in self._jobs:
                raise InvalidState(f"job {job_id!r} of uid {owner_uid} exists already")
            job = Job(job_id, owner_uid, world_size, token, restored=dict(ranks))
            job.transition(JobState.ORPHANED, self._clock())
            self._jobs[(owner_uid, job_id)] = job
            return job

    def holder(self, job_id: str, rank: int, uid: int) -> int | None:
        """The session driving ``rank`` of uid ``uid``'s job ``job_id``, if any."""
        with self._lock:
            job = self._jobs.get((uid, job_id))
            return None if job is None else job.attached.get(rank)

    def session_gone(self, session: int) -> list[Job]:
        """Unbind a dead session; jobs left with no session become ORPHANED. Returns the jobs it drove."""
        touched = []
        with self._lock:
            for job in self._jobs.values():
                ranks = [r for r, s in job.attached.items() if s == session]
                for rank in ranks:
                    del job.attached[rank]
                if ranks:
                    touched.append(job)
                    if not job.attached and job.state is JobState.ACTIVE:
                        job.transition(JobState.ORPHANED, self._clock())
        return touched

    def detach(self, job_id: str, rank: int, session: int, uid: int) -> bool:
        """Clean detach of one rank; returns True when the whole job is finished (every rank detached)."""
        with self._lock:
            job = self.get(job_id, uid)
            if job.attached.get(rank) != session:
                raise InvalidState(f"rank {rank} of job {job_id!r} is not attached by this connection")
            del job.attached[rank]
            job.detached.add(rank)
            done = not job.attached and not job.restored and len(job.detached) >= len(job.ranks)
            if done:
                self._reclaim(job)
            elif not job.attached:
                job.transition(JobState.ORPHANED, self._clock())
            return done

    def expire(self) -> list[Job]:
        """Jobs whose grace period is over: marked RECLAIMED, removed, and returned for cleanup."""
        now = self._clock()
        with self._lock:
            due = [
                j
                for j in self._jobs.values()
                if j.state is JobState.ORPHANED
                and j.orphaned_at is not None
                and now - j.orphaned_at >= self.grace_period_s
            ]
            for job in due:
                self._reclaim(job)
            return due

    def discard(self, job_id: str, uid: int) -> list[Job]:
        """Reclaim one job now (a failed first attach); returns it for cleanup, or nothing."""
        with self._lock:
            job = self._jobs.get((uid, job_id))
            if job is None:
                return []
            self._reclaim(job)
            return [job]

    def reclaim_all(self) -> list[Job]:
        with self._lock:
            jobs = list(self._jobs.values())
            for job in jobs:
                self._reclaim(job)
            return jobs

    def get(self, job_id: str, uid: int) -> Job:
        with self._lock:
            job = self._jobs.get((uid, job_id))
            if job is None:
                raise UnknownJob(f"uid {uid} has no job {job_id!r} on this daemon")
            return job

    def jobs(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    def _reclaim(self, job: Job) -> None:
        job.transition(JobState.RECLAIMED, self._clock())
        self._jobs.pop((job.owner_uid, job.job_id), None)

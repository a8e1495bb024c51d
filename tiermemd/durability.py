"""Durability of NVMe-placed state across restarts: commits, job files, and what a restart reports.

Owns the protocol that keeps a rank's swap manifest and its job file in
agreement (see ``persist``), and says, for every rank a client attaches to,
which step its state is at and where it came from:

- ``new``: no state yet;
- ``live``: this daemon held it in memory (the client died, the daemon did not);
- ``shutdown``: reopened from the commit of a daemon that stopped cleanly;
- ``commit``: reopened from the last commit of a daemon that did not stop
  cleanly (killed): the steps it ran after that commit are lost, and the
  reattaching client, which knows how far it got, is told the step it gets.

A commit of a rank (``commit``): wait for its delayed update, write the job
file with the counts of the next manifest generation and of the current one,
then flush the rank's chunks and commit its store.  It runs at shutdown and,
with ``jobs.commit_every = N``, after every N-th step (in the session that ran
it, before the reply).  A commit that fails leaves the store at its previous
generation, which the job file still describes.  Two kinds of failure:

- *deferred* (a periodic commit whose job file could not be written, or
  whose manifest could not (``CommitDeferred``), a full file system most
  often): the data is synced, or not yet written, and the store kept every
  chunk's current version, so the rank trains on; the failure is logged (the
  first of a run, then the 2nd, 4th, 8th, ...) and counted, the next
  periodic commit retries, and the one that lands says how many it caught up;
- anything else (a failed ``fdatasync``): the rank is FAILED (the chunks its
  cache wrote since may no longer be what the store returns).

At shutdown either is logged with the step the next start will serve and ends
the daemon with ``EXIT_DATA_LOST``.

At start (``restore``) every job file is resolved against its manifests: a
rank whose manifest is missing, unreadable or of a generation the file does
not describe, or whose swap files are missing or shorter than its manifest
says, is lost, logged then, and its reattach gets ``DataLostError``
(``lost_error``); a file written by a daemon that did not stop cleanly is
reported with the step each rank comes back at.  A manifest found in another
swap directory than the first means ``swap.dirs`` was reordered: the daemon
refuses to start (``SwapDirsChanged``) rather than lose the state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tiermem.core.errors import CommitDeferred, CorruptionError, DataLostError, TiermemError
from tiermem.core.modes import Placement
from tiermem.engine.swap.manifest import Manifest, read_manifest
from tiermemd.jobs import Job
from tiermemd.nvme import NvmeStateChunks, store_name
from tiermemd.persist import JobRecord, RankRecord, StepCounts, job_file_path, write_job_file
from tiermemd.rank import RankOptimizer
from tiermemd.rank.records import RankPhase

__all__ = ["Durability", "SwapDirsChanged"]

log = logging.getLogger(__name__)


class SwapDirsChanged(TiermemError):
    """``swap.dirs`` no longer lists a restored job's swap directory first (the daemon refuses to start)."""


class Durability:
    def __init__(self, *, jobs_dir: Path, swap_dirs: Sequence[Path], commit_every: int) -> None:
        self.jobs_dir = jobs_dir
        self.swap_dirs = list(swap_dirs)
        self.commit_every = commit_every
        self.failed: list[str] = []
        """One line per rank whose commit at shutdown failed (the daemon then exits ``EXIT_DATA_LOST``)."""
        self.deferred: dict[tuple[int, str, int], int] = {}
        """Periodic commits deferred in a row, by (owner uid, job id, rank), while the rank trains on (each
        key written by its rank's session thread; read by the metrics, cleared when the job ends)."""

    # ----------------------------------------------------------------- start

    def manifest_path(self, job_id: str, uid: int, rank: int) -> Path:
        return self.swap_dirs[0] / f"{store_name(job_id, rank, uid)}.manifest"

    def restore(self, records: Sequence[JobRecord]) -> list[JobRecord]:
        """Each job file with every rank resolved against its manifest and the swap files it names (lost ranks
        marked, all reported).  ``SwapDirsChanged`` when a manifest stands in another swap directory than the
        first: the directories were reordered or one was added in front, and starting would lose the state."""
        out = []
        for record in records:
            ranks = []
            for rank in record.ranks:
                self._check_dirs(record, rank.rank)
                path = self.manifest_path(record.job_id, record.owner_uid, rank.rank)
                try:
                    manifest = read_manifest(path)
                except CorruptionError as exc:
                    resolved = rank.resolve(None, f"its swap manifest {path} is unreadable ({exc})")
                else:
                    if manifest is None:
                        resolved = rank.resolve(None, f"its swap manifest {path} is missing")
                    elif short := self._short_files(manifest):
                        resolved = rank.resolve(None, short)
                    else:
                        resolved = rank.resolve(manifest.generation)
                if resolved.lost:
                    log.error(
                        "job %r (uid %d) rank %d: its state (step %d by its job file) is lost: %s; a reattach "
                        "gets DataLostError",
                        record.job_id,
                        record.owner_uid,
                        rank.rank,
                        rank.last_step,
                        resolved.lost,
                    )
                ranks.append(resolved)
            if not record.clean:
                log.warning(
                    "job %r (uid %d): the daemon that wrote its job file did not stop cleanly; it comes back at its "
                    "last commit, step %s, and any steps run after that are lost (each reattaching client is told "
                    "the step it gets)",
                    record.job_id,
                    record.owner_uid,
                    ", ".join(f"{r.last_step} (rank {r.rank})" for r in ranks if not r.lost) or "none",
                )
            out.append(replace(record, ranks=tuple(ranks)))
        return out

    def _check_dirs(self, record: JobRecord, rank: int) -> None:
        name = f"{store_name(record.job_id, rank, record.owner_uid)}.manifest"
        if (self.swap_dirs[0] / name).exists():
            return
        elsewhere = [d for d in self.swap_dirs[1:] if (d / name).exists()]
        if elsewhere:
            raise SwapDirsChanged(
                f"job {record.job_id!r} (uid {record.owner_uid}) rank {rank}: its swap manifest is in "
                f"{elsewhere[0]}, but the first of swap.dirs is {self.swap_dirs[0]}: the swap directories were "
                "reordered or one was added in front, and starting so would lose the job's state; list them in "
                "their earlier order (a new one at the end)"
            )

    def _short_files(self, manifest: Manifest) -> str:
        """Why the swap files ``manifest`` names cannot hold what it says they do ('' when they can)."""
        if len(manifest.files) != len(self.swap_dirs):
            return (
                f"its manifest names {len(manifest.files)} swap file(s), one per swap directory, and "
                f"swap.dirs lists {len(self.swap_dirs)}"
            )
        for index, (directory, name) in enumerate(zip(self.swap_dirs, manifest.files, strict=True)):
            need = max(
                (e.offset + e.nbytes for r in manifest.records.values() for e in r.extents if e.file == index),
                default=0,
            )
            path = directory / name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                return f"its swap file {path} is missing"
            if size < need:
                return f"its swap file {path} holds {size} bytes, and its manifest needs {need}"
        return ""

    # ----------------------------------------------------------------- attach and register

    @staticmethod
    def attach_state(rank: RankOptimizer) -> tuple[int, str]:
        """The step ``rank``'s state is at and where it comes from (one of
        ``tiermem.core.protocol.session.STATE_FROM``)."""
        if rank.layout is not None:
            return rank.last_step, "live"
        if rank.restored is not None:
            return rank.restored.last_step, "shutdown" if rank.restored.clean else "commit"
        return 0, "new"

    @staticmethod
    def lost_error(job: Job, record: RankRecord) -> DataLostError:
        return DataLostError(
            [store_name(job.job_id, record.rank, job.owner_uid)],
            f"job {job.job_id!r} rank {record.rank}: the state of step {record.last_step} that its job file "
            f"describes cannot be reopened: {record.lost}; the job's files are removed: attach without a token "
            "to start it anew (from a checkpoint)",
        )

    def reopened(self, job: Job, rank: RankOptimizer, record: RankRecord) -> None:
        """A rank of a restored job registered again: its store is at ``record``'s generation.  The job file
        is rewritten as not clean, so that if this daemon is killed the next start says so."""
        with job.commit_lock:
            job.durable[rank.rank] = record.counts
            job.filed[rank.rank] = replace(record, previous=None)
            try:
                self._write(job, clean=False)
            except OSError as exc:
                log.error("job %r: cannot rewrite its job file: %s", job.job_id, exc)

    # ----------------------------------------------------------------- commits

    def set_commit_every(self, steps: int) -> None:
        """``jobs.commit_every`` from a SIGHUP: from each rank's next step on, its periodic commits come
        every ``steps`` steps counted from its last commit (at once where that many ran already); 0 stops
        them, and a deferred commit is then retried only at shutdown (its count goes back to 0)."""
        if steps == self.commit_every:
            return
        log.info("jobs.commit_every: %s", f"a commit every {steps} steps" if steps else "0, commits at shutdown only")
        self.commit_every = steps
        if not steps:
            self.deferred.clear()

    def after_step(self, job: Job, rank: RankOptimizer) -> None:
        """Commit ``rank`` when ``jobs.commit_every`` steps ran since its last commit."""
        if not self.commit_every:
            if self.deferred:  # turned off by a SIGHUP while this rank's commits were deferred: none retries
                self.deferred.pop((job.owner_uid, job.job_id, rank.rank), None)
            return
        if not isinstance(rank.state, NvmeStateChunks) or rank.phase.phase is RankPhase.FAILED:
            return
        durable = job.durable.get(rank.rank)
        if rank.last_step - (durable.last_step if durable is not None else 0) < self.commit_every:
            return
        rank.quiesce()
        self.commit(job, rank, periodic=True)

    def commit(self, job: Job, rank: RankOptimizer, *, periodic: bool = False) -> bool:
        """Make ``rank``'s state durable (see the module docstring); False when it has none to commit.

        Raises the store's ``TiermemError`` (the rank is then FAILED) or, at shutdown, ``DataLostError`` for
        a job file that cannot be written.  A periodic commit whose job file or manifest cannot be written is
        deferred (False): the rank trains on and the next one retries.
        """
        state = rank.state
        if not isinstance(state, NvmeStateChunks) or rank.layout is None:
            return False
        with job.commit_lock:
            generation = state.generation
            durable = job.durable.get(rank.rank)
            if durable is not None and durable.generation != generation:
                durable = None
            record = rank.export(Placement.NVME).pending(generation + 1, durable)
            before = job.filed.get(rank.rank)
            job.filed[rank.rank] = record
            try:
                self._write(job, clean=False)
            except OSError as exc:
                if before is None:
                    job.filed.pop(rank.rank)
                else:
                    job.filed[rank.rank] = before
                path = job_file_path(self.jobs_dir, job.job_id, job.owner_uid)
                if periodic:
                    self._deferred(job, rank, f"cannot write its job file {path}: {exc}", str(path), durable)
                    return False
                log.error("job %r rank %d: cannot write its job file %s: %s", job.job_id, rank.rank, path, exc)
                raise DataLostError([str(path)], f"cannot write the job file {path}: {exc}") from exc
            try:
                state.persist()
            except CommitDeferred as exc:
                if not periodic:
                    raise
                self._deferred(job, rank, str(exc), exc.path, durable)
                return False
            except TiermemError as exc:
                reason = f"the commit of its state failed: {exc}"
                rank.phase.fail(rank.last_step, reason)
                log.error(
                    "job %r rank %d: %s; its state stays at its previous commit (%s)",
                    job.job_id,
                    rank.rank,
                    reason,
                    f"step {durable.last_step}" if durable is not None else "none: its state is lost",
                )
                raise
            job.durable[rank.rank] = record.counts
            deferred = self.deferred.pop((job.owner_uid, job.job_id, rank.rank), 0)
            if deferred:
                log.warning(
                    "job %r rank %d: the commit at step %d landed, after %d deferred: its state is durable again",
                    job.job_id,
                    rank.rank,
                    rank.last_step,
                    deferred,
                )
            return True

    def forget(self, job: Job) -> None:
        """``job`` ended: its ranks' deferred commits are no one's any more."""
        for key in list(self.deferred):  # a copy: session threads add to it meanwhile
            if key[:2] == (job.owner_uid, job.job_id):
                self.deferred.pop(key, None)

    def _deferred(self, job: Job, rank: RankOptimizer, why: str, path: str, durable: StepCounts | None) -> None:
        """Log a deferred periodic commit (``why``: its job file or its manifest, ``path``, could not be
        written): the first of a run in full, then the 2nd, 4th, 8th, ... in a line."""
        key = (job.owner_uid, job.job_id, rank.rank)
        n = self.deferred[key] = self.deferred.get(key, 0) + 1
        back = f"step {durable.last_step}" if durable is not None else "nothing (no commit landed yet)"
        if n == 1:
            log.error(
                "job %r (uid %d) rank %d: the commit at step %d is deferred, training goes on: %s; a restart "
                "now comes back at the last commit that landed: %s",
                job.job_id,
                job.owner_uid,
                rank.rank,
                rank.last_step,
                why,
                back,
            )
        elif n & (n - 1) == 0:
            log.error(
                "job %r rank %d: %d commits deferred in a row (%s); a restart now comes back at %s, not step %d",
                job.job_id,
                rank.rank,
                n,
                path,
                back,
                rank.last_step,
            )

    def persist_job(self, job: Job) -> bool:
        """At shutdown: commit every NVMe rank of ``job`` and mark its job file clean; False when nothing of
        it can outlive the daemon (its files are then removed)."""
        ranks = [r for r in job.ranks.values() if isinstance(r, RankOptimizer) and r.layout is not None]
        cpu_only = [r.rank for r in ranks if not isinstance(r.state, NvmeStateChunks)]
        if cpu_only:
            log.warning(
                "job %r: the state of rank(s) %s lives in memory only and ends with the daemon", job.job_id, cpu_only
            )
            return False
        if not ranks and not job.restored:
            return False
        ok = True
        for rank in ranks:
            rank.close_pipeline()
            try:
                self.commit(job, rank)
            except TiermemError as exc:
                ok = False
                durable = job.durable.get(rank.rank)
                back = f"step {durable.last_step}" if durable is not None else "nothing (its state is lost)"
                line = (
                    f"job {job.job_id!r} (uid {job.owner_uid}) rank {rank.rank}: the commit at shutdown failed "
                    f"({exc}); the next start serves its last commit: {back}, not step {rank.last_step}"
                )
                log.error("%s", line)
                self.failed.append(line)
        if ok:
            with job.commit_lock:
                try:
                    self._write(job, clean=True)
                except OSError as exc:
                    log.error("job %r: cannot mark its job file clean: %s", job.job_id, exc)
        return True

    def _write(self, job: Job, *, clean: bool) -> None:
        ranks = {**job.restored, **job.filed}
        write_job_file(
            self.jobs_dir,
            JobRecord(
                job.job_id,
                job.owner_uid,
                job.token,
                job.world_size,
                tuple(ranks[r] for r in sorted(ranks)),
                clean=clean,
            ),
        )

"""Request handlers: what each message does to jobs, ranks, windows and budgets.

``Handlers.dispatch`` maps a decoded message to the owner of what it touches
(the ``JobTable``, a ``RankOptimizer``, the ``Ledger``) and returns the reply.
Handlers raise ``TiermemError`` for anything a client can get wrong; the
session turns it into an error reply.  Every memory reference a client sends is
bounds-checked by the rank before any byte is touched.

Placement of a rank's state is decided at ``REGISTER``: ``nvme`` if any tensor
asks for it, ``cpu`` if every tensor does, and for ``auto`` the pool when the
node's pool budget has room, else NVMe.  Budgets are reserved before memory or
disk is touched, so a job that does not fit is refused then, not mid-training.

Memory a rank gets: a staging window at ATTACH (``jobs.window_size`` unless
the client asks for a size, capped by ``jobs.max_window``; it never grows
with the model) and, at REGISTER, the shared storage of its params and grads
(charged to the ``storage`` budget: it is the trainer's own tensor memory,
moved into a segment both processes map).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tiermem.core.errors import AdmissionError, AuthError, DaemonStopping, InvalidState, ProtocolError, UnknownJob
from tiermem.core.modes import Placement
from tiermem.core.protocol import (
    Abort,
    Attach,
    AttachOk,
    BucketReady,
    Detach,
    FetchParams,
    GradNorm,
    Message,
    Ok,
    ParamsReady,
    Ping,
    Pong,
    Register,
    RegisterOk,
    StateRead,
    StateReadMany,
    StateReset,
    StateWrite,
    StateWriteMany,
    Stats,
    Step,
)
from tiermem.core.statekeys import StateFormat
from tiermem.core.units import PAGE_SIZE, align_up
from tiermem.engine.pool import Arena
from tiermemd.jobs import Job, JobTable
from tiermemd.ledger import Ledger, Resource
from tiermemd.rank import RankOptimizer, state_keys_for
from tiermemd.server import Reply, Session, SessionState
from tiermemd.stats import node_stats, stats_reply

if TYPE_CHECKING:
    from tiermemd.service import Service

__all__ = ["Handlers"]

log = logging.getLogger(__name__)

_TAKEOVER_WAIT_S = 30.0


class Handlers:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.jobs: JobTable = service.jobs
        self.ledger: Ledger = service.ledger
        self._window_ids = itertools.count(1)
        self._table: dict[type[Message], Callable[[Session, Message], Reply | None]] = {
            Attach: self._attach,  # type: ignore[dict-item]
            Register: self._register,  # type: ignore[dict-item]
            BucketReady: self._bucket_ready,  # type: ignore[dict-item]
            Step: self._step,  # type: ignore[dict-item]
            FetchParams: self._fetch_params,  # type: ignore[dict-item]
            StateRead: self._rank_request(RankOptimizer.read_state),
            StateWrite: self._rank_request(RankOptimizer.write_state),
            StateReadMany: self._rank_request(RankOptimizer.read_many),
            StateWriteMany: self._rank_request(RankOptimizer.write_many),
            StateReset: self._rank_request(lambda rank, msg: rank.reset_state(msg.tensor_ids)),
            Abort: self._rank_request(RankOptimizer.abort),
            GradNorm: self._rank_request(RankOptimizer.grad_norm),
            Stats: self._stats,  # type: ignore[dict-item]
            Detach: self._detach,  # type: ignore[dict-item]
            Ping: lambda _s, _m: Reply(Pong()),
        }

    def dispatch(self, session: Session, msg: Message) -> Reply | None:
        handler = self._table.get(type(msg))
        if handler is None:
            raise ProtocolError(f"{type(msg).__name__} is not a request the daemon accepts")
        return handler(session, msg)

    # ----------------------------------------------------------------- attach / detach

    def _attach(self, session: Session, msg: Attach) -> Reply:
        if session.state is SessionState.ATTACHED:
            raise InvalidState(
                f"this connection is already attached to job {session.job_id!r} rank {session.rank}: one job a "
                "connection; attach on another one (an optimizer made without client= makes its own)"
            )
        if self.service.draining:
            raise DaemonStopping(session.socket_path(), "ATTACH")
        cfg = self.service.config.jobs
        if cfg.max_window and msg.window_nbytes > cfg.max_window:
            raise AdmissionError(
                f"window of {msg.window_nbytes} bytes exceeds jobs.max_window ({cfg.max_window} bytes)"
            )
        window_nbytes = align_up(max(msg.window_nbytes or cfg.window_size, PAGE_SIZE))
        self._wait_for_dead_holder(msg.job_id, msg.rank, session.cred.uid)
        try:
            job, created = self.jobs.attach(
                job_id=msg.job_id,
                rank=msg.rank,
                world_size=msg.world_size,
                uid=session.cred.uid,
                token=msg.token,
                session=session.id,
                create=msg.create,
            )
        except AuthError:
            # a wrong token may be a guess: logged, without a line per guess
            self.service.server.refusals.note("refused an attach: wrong job token", session.cred, f"job {msg.job_id!r}")
            raise
        try:
            if created:
                for resource, quota in ((Resource.POOL, cfg.max_pool), (Resource.SWAP, cfg.max_swap)):
                    if quota:
                        self.ledger.set_quota(job.key, resource, quota)
            rank: RankOptimizer | None = job.ranks.get(msg.rank)
            lost = job.restored.get(msg.rank)
            if rank is None and lost is not None and lost.lost:
                error = self.service.durability.lost_error(job, lost)
                self.service.reclaim(self.jobs.discard(job.job_id, job.owner_uid))
                raise error
            joined = rank is None
            if rank is None:
                self.ledger.reserve(job.key, Resource.WINDOW, window_nbytes)
                try:
                    window = Arena.create(window_nbytes, name=f"tiermem-{job.job_id}-{msg.rank}", mlock=True)
                except BaseException:
                    self.ledger.release(job.key, Resource.WINDOW, window_nbytes)
                    raise
                rank = RankOptimizer(
                    job_id=job.job_id,
                    rank=msg.rank,
                    window=window,
                    window_id=next(self._window_ids),
                    kernel=self.service.kernel,
                    scheduler=self.service.scheduler,
                )
                job.ranks[msg.rank] = rank
                rank.restored = job.restored.pop(msg.rank, None)
        except BaseException:
            self.jobs.session_gone(session.id)
            if created:
                self.service.reclaim(self.jobs.discard(job.job_id, job.owner_uid))
            raise
        session.job_id, session.rank = job.job_id, msg.rank
        session.transition(SessionState.ATTACHED)
        if session.counters is not None:
            session.counters.attached()
        state_step, state_from = self.service.durability.attach_state(rank)
        log.info(
            "%s job %r rank %d/%d for pid %d uid %d (window %d bytes; state at step %d, %s)",
            "created" if created else "joined" if joined else "reattached",
            job.job_id,
            msg.rank,
            msg.world_size,
            session.cred.pid,
            session.cred.uid,
            rank.window.nbytes,
            state_step,
            state_from,
        )
        return Reply(
            AttachOk(
                job_token=job.token,
                window_id=rank.window_id,
                window_nbytes=rank.window.nbytes,
                alignment=PAGE_SIZE,
                max_frame=self.service.config.server.max_frame,
                max_inflight=session.max_oneway,
                reattached=not created and (rank.layout is not None or rank.restored is not None),
                state_step=state_step,
                state_from=state_from,
            ),
            fds=(rank.window.fd,),
        )

    def _detach(self, session: Session, msg: Detach) -> Reply:
        job, rank = self._bound(session)
        if msg.keep_state:
            self.jobs.session_gone(session.id)
        elif self.jobs.detach(job.job_id, rank.rank, session.id, job.owner_uid):
            self.service.reclaim([job])
        session.job_id = session.rank = None
        session.transition(SessionState.OPEN)
        return Reply(Ok())

    def _wait_for_dead_holder(self, job_id: str, rank: int, uid: int) -> None:
        """A restarted process may attach while its dead predecessor's session still finishes the request it
        was in: wait for that session to end (bounded), rather than refuse the rank as taken."""
        server = getattr(self.service, "server", None)
        if server is None:
            return
        deadline = time.monotonic() + _TAKEOVER_WAIT_S
        while time.monotonic() < deadline:
            holder = self.jobs.holder(job_id, rank, uid)
            if holder is None or server.session_alive(holder):
                return
            time.sleep(0.01)

    def session_closed(self, session: Session, why: str) -> None:
        if session.job_id is None or session.rank is None:
            return
        try:
            job = self.jobs.get(session.job_id, session.cred.uid)
        except UnknownJob:  # the job was reclaimed already
            return
        rank = job.ranks.get(session.rank)
        if rank is not None:
            aborted = rank.abort()
            log.info(
                "session %d of job %r rank %d closed (%s); last step %d (%d tensor(s) of an open attempt kept); "
                "state kept for %.0fs",
                session.id,
                job.job_id,
                session.rank,
                why,
                aborted.last_step,
                aborted.tensors_applied,
                self.jobs.grace_period_s,
            )
        self.jobs.session_gone(session.id)

    def abort(self, session: Session) -> None:
        """The client's process exited (seen on the pidfd watcher's thread).  Nothing to cancel here: a
        session thread only ever waits for update pieces, which always run to their end, and the open
        attempt is closed on the session's own thread when it ends (``session_closed``)."""

    # ----------------------------------------------------------------- the rank's work

    def _bound(self, session: Session) -> tuple[Job, RankOptimizer]:
        if session.state is not SessionState.ATTACHED or session.job_id is None or session.rank is None:
            raise InvalidState("attach to a job first")
        job = self.jobs.get(session.job_id, session.cred.uid)
        rank = job.ranks.get(session.rank)
        if rank is None:
            raise InvalidState(f"rank {session.rank} of job {job.job_id!r} has no state")
        return job, rank

    def _register(self, session: Session, msg: Register) -> Reply:
        job, rank = self._bound(session)
        numel = sum(spec.numel for spec in msg.tensors)
        placements = {spec.placement for spec in msg.tensors}
        dtype = msg.tensors[0].dtype if msg.tensors else "float32"
        if rank.restored is not None:
            placement = rank.restored.placement  # its state waits in the swap store
        elif Placement.NVME in placements:
            placement = Placement.NVME
        elif placements == {Placement.CPU}:
            placement = Placement.CPU
        else:
            keys = state_keys_for(dtype, Placement.CPU, msg.grad_buffers, msg.exchange, msg.grads_in_state)
            state_nbytes = self.service.cpu_state_nbytes(numel, StateFormat(keys, dtype, msg.state_dtype))
            fits = state_nbytes <= self.ledger.available(Resource.POOL)
            placement = Placement.CPU if fits else Placement.NVME
        restored = rank.restored
        registration = rank.register(
            msg.tensors,
            msg.groups,
            msg.grad_buffers,
            placement,
            self.service.state_factory(job, rank.rank, placement),
            lambda nbytes: self._make_storage(job, rank, nbytes),
            msg.exchange,
            msg.grads_in_state,
            msg.state_dtype,
        )
        if restored is not None:
            self.service.durability.reopened(job, rank, restored)
        storage = registration.storage
        log.info(
            "job %r rank %d registered %d tensors, %d elements, state %s (moments %s) on %s, storage %d bytes",
            job.job_id,
            rank.rank,
            len(msg.tensors),
            numel,
            "+".join(registration.state_keys),
            msg.state_dtype,
            placement.value,
            storage.nbytes if storage is not None else 0,
        )
        return Reply(
            RegisterOk(
                slots=registration.slots,
                placement=registration.placement,
                state_keys=registration.state_keys,
                storage_nbytes=storage.nbytes if storage is not None else 0,
                state_dtype=msg.state_dtype,
            ),
            fds=(storage.fd,) if storage is not None else (),
        )

    def _make_storage(self, job: Job, rank: RankOptimizer, nbytes: int) -> tuple[Arena, int]:
        """The shared storage of a rank's params and grads, reserved in the storage budget."""
        nbytes = align_up(max(nbytes, PAGE_SIZE))
        self.ledger.reserve(job.key, Resource.STORAGE, nbytes)
        try:
            # not reserved up front: the trainer's params move in one by one, freeing their old memory as they go
            arena = Arena.create(nbytes, name=f"tiermem-{job.job_id}-{rank.rank}-storage", mlock=False, reserve=False)
        except BaseException:
            self.ledger.release(job.key, Resource.STORAGE, nbytes)
            raise
        return arena, next(self._window_ids)

    def _bucket_ready(self, session: Session, msg: BucketReady) -> None:
        _, rank = self._bound(session)
        rank.bucket_ready(msg)

    def _step(self, session: Session, msg: Step) -> Reply:
        job, rank = self._bound(session)
        done = rank.step(msg)
        self.service.durability.after_step(job, rank)
        return Reply(done)

    def _fetch_params(self, session: Session, msg: FetchParams) -> Reply:
        _, rank = self._bound(session)
        rank.write_params(msg.tensor_ids)
        return Reply(ParamsReady(step=rank.last_step, tensor_ids=msg.tensor_ids))

    def _rank_request(self, op: Callable[[RankOptimizer, Any], Message | None]) -> Callable[[Session, Message], Reply]:
        """The handler of a request the session's rank serves alone: ``op``'s reply, or ``Ok`` where it has none."""

        def handle(session: Session, msg: Message) -> Reply:
            _, rank = self._bound(session)
            reply = op(rank, msg)
            return Reply(Ok() if reply is None else reply)

        return handle

    def _stats(self, session: Session, msg: Stats) -> Reply:
        """The node's figures, the jobs of the caller's uid (every job for root and the daemon's uid), and the
        caller's rank when it is attached."""
        rank = None
        if session.job_id is not None and session.rank is not None:
            rank = self._bound(session)[1].stats()
        uid = session.cred.uid
        sees_all = uid in (0, os.getuid())
        return Reply(stats_reply(node_stats(self.service), uid=None if sees_all else uid, rank=rank))

"""The tiermem error hierarchy.

Every error a user, a client, the kernel or a disk can cause is a
``TiermemError``.  Each carries the facts needed to act on it as attributes
(not only in its message), and can be turned into a plain dict and back so that
the daemon can send it over the socket and the client can re-raise it as the
same type (``to_wire`` / ``from_wire``).

Messages say what was expected, what was found and what to change.
"""

from __future__ import annotations

import errno as _errno
import os
from collections.abc import Iterable
from typing import Any, ClassVar

from tiermem.core.units import format_size

__all__ = [
    "AdmissionError",
    "AuthError",
    "BoundsError",
    "CommitDeferred",
    "ConfigError",
    "ConnectionClosed",
    "CorruptionError",
    "DaemonGone",
    "DaemonTimeout",
    "DaemonUnavailable",
    "DataLostError",
    "DTypeError",
    "HostMemoryError",
    "InvalidArgument",
    "InvalidState",
    "InvalidType",
    "StepFailed",
    "PoolExhausted",
    "ProtocolError",
    "RankLost",
    "SwapFullError",
    "StaleStateError",
    "SwapIOError",
    "TiermemError",
    "UnknownJob",
    "UnknownKey",
    "UnsafePathError",
    "error_from_wire",
]


class TiermemError(Exception):
    """Base of every error raised by tiermem on purpose.

    Subclasses list the keyword fields they carry in ``fields``; those travel
    over the wire with the message.
    """

    fields: ClassVar[tuple[str, ...]] = ()
    _registry: ClassVar[dict[str, type[TiermemError]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        TiermemError._registry[cls.__name__] = cls

    def __init__(self, message: str, **facts: Any) -> None:
        super().__init__(message)
        self.message = message
        for name in self.fields:
            setattr(self, name, facts.get(name))

    def to_wire(self) -> dict[str, Any]:
        """A JSON-able description: the type name, message and fields."""
        return {
            "type": type(self).__name__,
            "message": self.message,
            "fields": {name: getattr(self, name, None) for name in self.fields},
        }


TiermemError._registry["TiermemError"] = TiermemError


def error_from_wire(payload: dict[str, Any]) -> TiermemError:
    """Rebuild an error sent by ``to_wire``; unknown types become the base type."""
    name = str(payload.get("type", "TiermemError"))
    cls = TiermemError._registry.get(name, TiermemError)
    message = str(payload.get("message", ""))
    raw_fields = payload.get("fields")
    fields = raw_fields if isinstance(raw_fields, dict) else {}
    err = cls.__new__(cls)
    TiermemError.__init__(err, message)
    for field in cls.fields:
        setattr(err, field, fields.get(field))
    if cls is TiermemError and name != "TiermemError":
        err.message = f"{name}: {message}"
        err.args = (err.message,)
    return err


class ConfigError(TiermemError):
    """A setting is missing, malformed or inconsistent; names the field."""

    fields = ("field",)

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"config {field}: {problem}", field=field)


class PoolExhausted(TiermemError):
    """No block of the requested size could be found even after compaction and eviction."""

    fields = ("requested", "free", "largest_free")

    def __init__(self, requested: int, free: int, largest_free: int, what: str = "pool") -> None:
        super().__init__(
            f"{what} exhausted: requested {format_size(requested)}, "
            f"free {format_size(free)}, largest free block {format_size(largest_free)}",
            requested=requested,
            free=free,
            largest_free=largest_free,
        )


class SwapIOError(TiermemError):
    """An I/O on a swap file failed or transferred fewer bytes than asked."""

    fields = ("path", "offset", "nbytes", "errno")

    def __init__(self, path: str, offset: int, nbytes: int, err: int, detail: str = "") -> None:
        name = _errno.errorcode.get(err, str(err)) if err else "short transfer"
        why = os.strerror(err) if err else detail or "short transfer"
        super().__init__(
            f"swap I/O failed on {path} at offset {offset} ({nbytes} bytes): {name}: {why}",
            path=path,
            offset=offset,
            nbytes=nbytes,
            errno=err,
        )


class SwapFullError(TiermemError):
    """Swap space could not be reserved (disk full or quota exceeded)."""

    fields = ("requested", "available", "path")

    def __init__(self, message: str, requested: int, available: int, path: str = "") -> None:
        super().__init__(message, requested=requested, available=available, path=path)


class CorruptionError(TiermemError):
    """Bytes read back do not match their checksum; the bytes are never returned."""

    fields = ("key", "path", "offset")

    def __init__(self, key: str, path: str, offset: int, detail: str = "checksum mismatch") -> None:
        super().__init__(
            f"corrupt data for {key!r} in {path} at offset {offset}: {detail}",
            key=key,
            path=path,
            offset=offset,
        )


class DataLostError(TiermemError):
    """Data for some keys could not be made durable (EIO, fsync failure) and is lost."""

    fields = ("keys",)

    def __init__(self, keys: list[str], why: str) -> None:
        shown = ", ".join(repr(k) for k in keys[:8]) + (" ..." if len(keys) > 8 else "")
        super().__init__(f"data lost for {len(keys)} key(s) [{shown}]: {why}", keys=list(keys))


class CommitDeferred(TiermemError):
    """A commit synced its data but could not write the manifest that names it (a full or read-only file
    system, most often).  Nothing is lost: the previous manifest stands, the keys written since stay current
    and uncommitted, and the next commit writes them all.  A crash before then comes back at the previous
    commit."""

    fields = ("path", "errno", "keys")
    path: str
    errno: int
    keys: list[str]

    def __init__(self, path: str, err: int, keys: list[str], generation: int) -> None:
        name = _errno.errorcode.get(err, str(err))
        super().__init__(
            f"cannot write the swap manifest {path}: {name}: {os.strerror(err)}; the {len(keys)} key(s) written "
            f"since generation {generation} are synced to the swap files but not committed (a restart now comes "
            f"back at generation {generation}); the next commit retries: free space in {os.path.dirname(path)}",
            path=path,
            errno=err,
            keys=list(keys),
        )


class ProtocolError(TiermemError):
    """A frame or message broke the wire protocol."""


class AuthError(TiermemError):
    """The peer is not allowed to do what it asked."""


class UnsafePathError(AuthError):
    """A socket or state path that someone other than the expected uids owns, listens on, or could replace.

    ``path`` is what was refused, ``owner_uid`` the uid found (the owner, or the uid of the process
    listening on a socket), ``expected_uids`` the uids that would have been accepted.
    """

    fields = ("path", "owner_uid", "expected_uids")

    def __init__(
        self,
        path: str,
        problem: str,
        *,
        owner_uid: int | None = None,
        expected_uids: Iterable[int] = (),
        fix: str = "",
    ) -> None:
        super().__init__(
            f"refusing {path}: {problem}" + (f"; {fix}" if fix else ""),
            path=path,
            owner_uid=owner_uid,
            expected_uids=sorted(expected_uids),
        )


class AdmissionError(TiermemError):
    """A job or request would exceed the node's or the job's budget."""


class UnknownJob(TiermemError):
    """No job with this id (or token) exists on this daemon."""


class UnknownKey(TiermemError):
    """No tensor or stored object with this key exists."""

    fields = ("key",)

    def __init__(self, key: str, where: str = "") -> None:
        super().__init__(f"unknown key {key!r}" + (f" in {where}" if where else ""), key=key)


class BoundsError(TiermemError):
    """A (window, offset, length) reference falls outside its window."""


class InvalidArgument(TiermemError, ValueError):
    """An argument has a bad value (a ``ValueError`` too, as torch raises for bad hyper-parameters)."""


class InvalidType(InvalidArgument, TypeError):
    """An argument is not of a type the operation takes (a string where a number goes): a ``TypeError`` too, as
    torch raises for a string learning rate, and an ``InvalidArgument`` like every refused argument."""


class DTypeError(InvalidArgument):
    """A tensor has a dtype the operation does not support."""


class HostMemoryError(TiermemError):
    """Host memory for a shared-memory arena could not be reserved (the node is short of RAM)."""

    fields = ("nbytes", "errno")

    def __init__(self, nbytes: int, err: int, what: str = "arena") -> None:
        name = _errno.errorcode.get(err, str(err))
        super().__init__(
            f"cannot reserve {format_size(nbytes)} of host memory for the {what}: {name}: {os.strerror(err)}; "
            "lower pool.size or free memory on the node",
            nbytes=nbytes,
            errno=err,
        )


class InvalidState(TiermemError):
    """An object was asked for a transition its current state does not allow."""


class GradsAfterRelease(InvalidState):
    """``step()`` found grads written after ``release_grads`` handed them to tiermemd: DDP's all-reduce writes
    the averaged grads into ``p.grad`` when backward ends, after the hooks released the local ones.  Added to
    what was released they would be the wrong sum, so the step is refused, nothing of it applied, and the next
    backward starts afresh."""


class StepFailed(InvalidState):
    """An update of the rank failed part-way: its state is inconsistent until it is reloaded.

    Every later request of the rank names the failed step; ``load_state_dict`` (which resets and then
    writes every tensor's state) makes the rank usable again.
    """

    fields = ("step", "reason")

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(
            f"the update of step {step} failed part-way ({reason}); the optimizer state is inconsistent: "
            "load a checkpoint with load_state_dict() to continue",
            step=step,
            reason=reason,
        )


class StaleStateError(InvalidState):
    """The daemon holds a rank's state at an older step than the client's (a restart lost steps).

    ``state_step`` is the step the daemon's state is at, ``client_step`` the step the client has reached.
    Continuing from the older state needs an explicit roll-back (``OffloadAdam(rollback=True)``).
    """

    fields = ("state_step", "client_step")

    def __init__(self, job_id: str, rank: int, state_step: int, client_step: int, why: str = "") -> None:
        super().__init__(
            f"tiermemd holds the state of job {job_id!r} rank {rank} at step {state_step}, older than this "
            f"client's step {client_step}" + (f" ({why})" if why else "") + f": steps {state_step + 1}.."
            f"{client_step} are not in it; pass rollback=True to continue from step {state_step}, or load a "
            "checkpoint",
            state_step=state_step,
            client_step=client_step,
        )


class ConnectionClosed(TiermemError):
    """The peer closed the connection (or the connection was closed after a fatal error)."""


class DaemonUnavailable(TiermemError):
    """The client could not reach a daemon; names the socket path and why."""

    fields: ClassVar[tuple[str, ...]] = ("path",)

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"no tiermemd at {path}: {why}", path=path)


class RankLost(TiermemError):
    """A collective of a sharded step failed: another rank of the process group died, timed out, or ran
    collectives this rank did not (a ZeRO-3 forward on rank 0 only, for an evaluation, pairs its all-gathers
    with the other ranks' training collectives: they fail by the limit, and the message says what to look for).

    ``during`` names the phase (``reduce-scatter``, ``statistics``, ``all-gather``, ...), ``rank`` this
    rank.  The daemon's state of this rank is at the last step this rank completed (``last_step``); the
    job's other ranks are at the same step or one behind, and a relaunch of the whole job with the
    same token continues from the checkpoint it loads.
    """

    fields: ClassVar[tuple[str, ...]] = ("during", "rank", "last_step")

    def __init__(self, during: str, rank: int, last_step: int, cause: BaseException) -> None:
        super().__init__(
            f"rank {rank}: the {during} of step {last_step + 1} failed, another rank of the process group is "
            f"gone, timed out, or out of step ({type(cause).__name__}: {str(cause)[:300]}); this rank's state is "
            f"at step {last_step}. Out of step: a forward of a ZeRO-3 model, state_dict() or step() run on some "
            "ranks only (under `if rank == 0:`); every rank must run each",
            during=during,
            rank=rank,
            last_step=last_step,
        )


class DaemonTimeout(DaemonUnavailable):
    """The daemon went silent during a request: neither its reply nor a heartbeat came for ``timeout_s``.

    Names the socket (``path``), the request (``request``, its message type) and how long the client
    waited (``timeout_s``).  The connection is closed; the daemon may be stopped (SIGSTOP), wedged or
    overloaded past its heartbeats.
    """

    fields: ClassVar[tuple[str, ...]] = ("path", "request", "timeout_s")

    def __init__(self, path: str, request: str, timeout_s: float) -> None:
        TiermemError.__init__(
            self,
            f"no tiermemd at {path}: no reply to {request} and no heartbeat within {timeout_s:g}s "
            "(the daemon is stopped, wedged or overloaded; raise the client timeout, timeout_s= or "
            "TIERMEM_CLIENT_TIMEOUT_S, only if it is known to be busy)",
            path=path,
            request=request,
            timeout_s=timeout_s,
        )


class DaemonStopping(DaemonUnavailable):
    """The daemon is stopping (SIGTERM or SIGINT) and refused a request without starting it.

    ``path`` is its socket and ``during`` the request it refused.  Nothing of that request was applied: the
    job's state is at its last completed step.  A ``DaemonUnavailable``, as a daemon that is gone: a program
    that catches that for a daemon's restart catches this too.
    """

    fields: ClassVar[tuple[str, ...]] = ("path", "during")

    def __init__(self, path: str, during: str) -> None:
        TiermemError.__init__(
            self,
            f"the tiermemd at {path} is stopping (SIGTERM or SIGINT: its service was stopped or restarted, or the "
            f"process that started a private one is ending it) and refused {during} without starting it; the "
            "job's state is at its last completed step. A node daemon's NVMe-placed state is committed by the "
            "stop and comes back with the next tiermemd, for a new optimizer with the job's token (opt.token); "
            "CPU-tier state, and a private daemon's, ends with it: load the last checkpoint (state_dict())",
            path=path,
            during=during,
        )


class DaemonGone(DaemonUnavailable):
    """The daemon closed the connection in the middle of a session: it stopped, crashed or was killed, or it
    ended this session.

    ``path`` is its socket and ``during`` the request that found it gone.  For a private daemon (the child
    ``tiermem.client.link.connect`` started when no node daemon answered) ``pid`` is the child and
    ``exit_code`` how it ended (negative: the signal that killed it, as ``subprocess`` reports it; None: still
    running), which ``ended`` says in words; ``private``: a private daemon this process reached by its socket
    (another process started it), so neither is known.  A private daemon's state lives in its memory and its private
    directory only, NVMe-placed state included, so it is gone with the process; a node daemon keeps a job's
    state for a reattach (``docs/operating.md``, Restarts and durability).
    """

    fields: ClassVar[tuple[str, ...]] = ("path", "during", "pid", "exit_code")

    def __init__(
        self,
        path: str,
        during: str,
        *,
        pid: int | None = None,
        exit_code: int | None = None,
        ended: str = "",
        log_path: str = "",
        log_tail: str = "",
        private: bool = False,
    ) -> None:
        if pid is None and private:
            message = (
                f"the private tiermemd at {path} closed the connection during {during}: the process that started "
                "it (this job's first rank on the node, or the program that made it) stopped it or ended, or it "
                "was killed, and the optimizer state it held went with it. Load the last checkpoint "
                "(state_dict()) into a new optimizer, or run a node tiermemd, whose state outlives a trainer "
                "(docs/operating.md)"
            )
        elif pid is None:
            message = (
                f"the node daemon at {path} closed the connection during {during}: it stopped, restarted or ended "
                "this session (its log says which: journalctl -u tiermemd). While it runs, the job's state waits "
                "jobs.grace_period_s for a new OffloadAdam with the job's token (opt.token); after a stop, "
                "CPU-tier state is gone and NVMe-placed state comes back at its last commit (a clean stop, or "
                "every jobs.commit_every steps)"
            )
        elif exit_code is None:
            message = (
                f"the private tiermemd (pid {pid}, still running) closed the connection during {during}; "
                f"its log says why: {log_path}"
            )
        else:
            message = (
                f"the private tiermemd (pid {pid}, {ended or f'exit code {exit_code}'}) is gone, and with it the "
                f"optimizer state it held ({during} found the connection closed). A private daemon keeps the CPU-tier "
                "state in its memory and the NVMe tier's in its private directory, and neither outlives it: load "
                "the last checkpoint (state_dict()) into a new optimizer, which starts a new private daemon, or "
                "run a node tiermemd, whose state outlives a trainer (docs/operating.md)"
            )
            if log_tail.strip():
                message += f". Its log ends: {log_tail.strip()}"
        TiermemError.__init__(self, message, path=path, during=during, pid=pid, exit_code=exit_code)

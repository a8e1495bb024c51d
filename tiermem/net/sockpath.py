"""Socket and state directories that another local user cannot take over.

The threat.  On a shared node any local user can create ``/tmp/tiermem-<uid>``
before its owner does and listen on ``tiermemd.sock`` inside: a client that
trusts the path hands its gradients to that user.  A daemon that binds inside
a directory it does not own (pre-created, or a symlink), or that chmods the
socket by path after bind(2), can be made to expose the socket or to chmod a
file of the attacker's choosing (the path is swapped for a symlink between
bind and chmod).

Trusted paths.  A directory is *trusted for* a set of uids when nobody else
can change what it names: it is a real directory (``lstat``; opened with
``O_DIRECTORY|O_NOFOLLOW`` and checked with ``fstat``), owned by one of those
uids, and writable by nobody else; and every ancestor, both as the path is
written and as it resolves, is owned by one of them (or by the caller) and is
writable by others only when sticky (``/tmp``), where nobody can rename or
remove an entry they do not own.  Once this holds it keeps holding: only the
trusted uids could undo it.  Root is trusted everywhere: it can read any
process's memory, so refusing it would protect nothing, and under systemd
socket activation the listening socket is root's.

The daemon's side (``SecureDir``, used by ``tiermemd.listener.bind_listener``
and for the state and swap directories).  It creates a missing directory
itself, mode 0700, and uses an existing one only if it is trusted for the
daemon's uid; a directory it did not create is never chmod'ed.  The socket
file's permissions are set without any operation by path:

- connect(2) on an ``AF_UNIX`` socket needs write permission on the socket
  file, so the file's mode and group (plus search permission on the
  directories) are the access control.  Linux creates the file at bind(2) with
  the mode of the socket's own inode, masked by the umask.  An ``fchmod`` on
  the socket fd *before* bind therefore sets the file's initial mode; after
  bind, ``fchmod``/``fchown`` on the fd change only the socket inode, never the
  file.  The umask is process-wide (other threads), so it is left alone.
- So: ``fchmod(fd, 0600)`` before bind, and the file is born no more open than
  owner-only whatever the umask; bind; check that the entry appeared in the
  directory verified by fd (if the directory had been swapped between the
  check and bind, the socket landed elsewhere: refuse); open the entry
  relative to that directory fd with ``O_PATH|O_NOFOLLOW`` and ``fstat`` it (a
  socket owned by the daemon, else refuse); set its group and mode through
  that handle (``/proc/self/fd/N``), which names the inode, not a path: there
  is no symlink to follow and no window to race.  Only then is a directory the
  daemon created opened up to what the socket mode needs (search for the
  classes the socket admits, never write), through its fd.

The client's side (``verify_socket``, then ``peer_problem`` after connect in
``tiermem.client.connection.connect_trusted``).  A candidate socket is used only when
its directory is trusted for the daemon the client expects, the entry is a
socket owned by one of those uids (checked before connecting, so an
impostor's listener never sees the connection), and the process listening on
it, as ``SO_PEERCRED`` reports it after connect(2) and before a byte is sent,
runs as one of them.  The last check is decisive: it is what the kernel says
about the other end, not about a path, so no race between the path checks and
connect(2) gets past it.  The expected uids are root and: the node's service
user for ``/run/tiermem/tiermemd.sock``; the user itself for the per-user path
and a private daemon; for a path the caller names, the user itself unless the
caller names the daemon's uid.

Pure parts (``Trust``, ``*_problem``, ``ancestor_paths``, ``socket_dir_mode``,
``socket_candidates``) take modes, uids and strings; the rest binds them to
the file system and raises ``UnsafePathError`` naming the path, its owner and
what to change.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tiermem.core.closing import Closing
from tiermem.core.errors import UnsafePathError

__all__ = [
    "MAX_SOCKET_PATH_BYTES",
    "SecureDir",
    "SocketCandidate",
    "Trust",
    "ancestor_paths",
    "ancestor_problem",
    "check_ancestors",
    "dir_problem",
    "peer_problem",
    "remove_socket",
    "socket_candidates",
    "socket_dir_mode",
    "socket_file_problem",
    "socket_path_problem",
    "uid_label",
    "verify_socket",
]

MAX_SOCKET_PATH_BYTES = 107
"""``sun_path`` holds 108 bytes including the terminating NUL."""

_WRITE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def _plain_label(uid: int) -> str:
    return "root" if uid == 0 else f"uid {uid}"


@dataclass(frozen=True)
class Trust:
    """The uids that may own a socket's directory and file and listen on it; root is always one."""

    uids: frozenset[int]
    what: str
    """Whose socket this should be, for messages ("the node's tiermemd")."""

    @classmethod
    def of(cls, *uids: int, what: str) -> Trust:
        return cls(frozenset({0, *uids}), what)

    def admits(self, uid: int) -> bool:
        return uid in self.uids

    def expected(self, label: Callable[[int], str] = _plain_label) -> str:
        return " or ".join(label(uid) for uid in sorted(self.uids))


# --------------------------------------------------------------------------- pure checks


def _writers(mode: int) -> str:
    return {stat.S_IWGRP: "its group", stat.S_IWOTH: "all users"}.get(mode & _WRITE_BY_OTHERS, "group and others")


@dataclass(frozen=True)
class _Kind:
    """What an entry must be, and how the messages about it read."""

    test: Callable[[int], bool]
    noun: str
    """"is not {noun}"."""
    itself: str
    """"is a symbolic link; expected {itself}"."""
    owned: str
    """"{owned} by uid 1000; expected ..."."""


_DIRECTORY = _Kind(stat.S_ISDIR, "a directory", "a real directory", "is owned")
_SOCKET = _Kind(stat.S_ISSOCK, "a socket", "the socket itself", "is a socket owned")


def _entry_problem(mode: int, uid: int, trust: Trust, label: Callable[[int], str], kind: _Kind) -> str | None:
    """Whether an entry is itself (not a link) of ``kind`` and owned by ``trust``."""
    if stat.S_ISLNK(mode):
        return f"is a symbolic link; expected {kind.itself}"
    if not kind.test(mode):
        return f"is not {kind.noun}"
    if not trust.admits(uid):
        return f"{kind.owned} by {label(uid)}; expected {trust.expected(label)} ({trust.what})"
    return None


def dir_problem(mode: int, uid: int, trust: Trust, label: Callable[[int], str] = _plain_label) -> str | None:
    """What makes a socket's (or state) directory untrusted, from its lstat/fstat ``st_mode`` and ``st_uid``."""
    problem = _entry_problem(mode, uid, trust, label, _DIRECTORY)
    if problem is not None:
        return problem
    if mode & _WRITE_BY_OTHERS:
        return f"is writable by {_writers(mode)} (mode {stat.S_IMODE(mode):04o}); expected only its owner to write"
    return None


def ancestor_problem(mode: int, uid: int, trust: Trust, label: Callable[[int], str] = _plain_label) -> str | None:
    """What lets someone outside ``trust`` rename or replace entries of an ancestor directory."""
    if not trust.admits(uid):
        return f"is owned by {label(uid)}; expected {trust.expected(label)}, so nobody else can replace its entries"
    if stat.S_ISDIR(mode) and mode & _WRITE_BY_OTHERS and not mode & stat.S_ISVTX:
        return f"is writable by {_writers(mode)} without the sticky bit (mode {stat.S_IMODE(mode):04o})"
    if not (stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
        return "is not a directory"
    return None


def socket_file_problem(mode: int, uid: int, trust: Trust, label: Callable[[int], str] = _plain_label) -> str | None:
    """What is wrong with the entry a client is about to connect to (from its lstat)."""
    return _entry_problem(mode, uid, trust, label, _SOCKET)


def peer_problem(uid: int, pid: int, trust: Trust, label: Callable[[int], str] = _plain_label) -> str | None:
    """What is wrong with the listener a client reached (its ``SO_PEERCRED`` uid and pid)."""
    if trust.admits(uid):
        return None
    expected = trust.expected(label)
    return f"the process listening on it (pid {pid}) runs as {label(uid)}; expected {expected} ({trust.what})"


def socket_path_problem(path: str) -> str | None:
    """Why no client could connect to ``path`` by name, or None."""
    nbytes = len(os.fsencode(path))
    if nbytes > MAX_SOCKET_PATH_BYTES:
        return (
            f"{path} is {nbytes} bytes long; AF_UNIX socket paths are limited to {MAX_SOCKET_PATH_BYTES} bytes: "
            "choose a shorter server.socket"
        )
    return None


def socket_dir_mode(socket_mode: int) -> int:
    """The mode of a socket directory the daemon created: search (and list) for the classes the socket admits."""
    mode = 0o700
    if socket_mode & 0o070:
        mode |= 0o050
    if socket_mode & 0o007:
        mode |= 0o005
    return mode


def ancestor_paths(directory: str, resolved: str) -> list[str]:
    """The ancestors of absolute ``directory``, as written and as ``resolved`` (its realpath), outermost first."""

    def prefixes(path: str) -> list[str]:
        parts = [p for p in path.split("/") if p]
        return ["/"] + ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]

    out: list[str] = []
    for path in (*prefixes(directory), *prefixes(resolved)):
        if path not in out:
            out.append(path)
    return out


@dataclass(frozen=True)
class SocketCandidate:
    """A socket a client may try, and whose it must be."""

    path: str
    trust: Trust
    explicit: bool
    """Named by the caller or ``$TIERMEM_SOCKET_PATH``: a refusal is an error, not a reason to try the next."""


def socket_candidates(
    *,
    explicit: str | None,
    node_path: str,
    per_user_path: str,
    uid: int,
    service_uids: Iterable[int],
    daemon_uid: int | None = None,
) -> list[SocketCandidate]:
    """Where a client of ``uid`` looks for a daemon, in order, and what each listener must run as.

    A named path (anyone may have made it) takes a daemon of root, of ``uid``, or of the node service's user
    (``service_uids``: already trusted on the node's own path, and the user a node service runs as on any
    path an operator gives it), unless ``daemon_uid`` names the daemon's user."""
    service = list(service_uids)
    node_uids = set(service) | ({daemon_uid} if daemon_uid is not None else set())
    if explicit:
        if daemon_uid is not None:
            trust = Trust.of(daemon_uid, what=f"the daemon named by daemon_uid={daemon_uid}")
        else:
            trust = Trust.of(
                uid,
                *service,
                what="a daemon of root, of this user or of the node service's user; "
                "a client names another with daemon_uid=",
            )
        return [SocketCandidate(explicit, trust, explicit=True)]
    return [
        SocketCandidate(node_path, Trust.of(*node_uids, what="the node's tiermemd"), explicit=False),
        SocketCandidate(per_user_path, Trust.of(uid, what="this user's own tiermemd"), explicit=False),
    ]


# --------------------------------------------------------------------------- the file system


def uid_label(uid: int) -> str:
    """``uid 65534 (nobody)``; ``root`` for 0."""
    if uid == 0:
        return "root"
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _refuse(path: str, problem: str, st: os.stat_result, trust: Trust, fix: str) -> UnsafePathError:
    return UnsafePathError(path, problem, owner_uid=st.st_uid, expected_uids=trust.uids, fix=fix)


def check_ancestors(directory: str, trust: Trust, *, fix: str = "") -> None:
    """Raise ``UnsafePathError`` for the first ancestor of ``directory`` that others could change.

    The caller's own uid is trusted here too.  A missing ancestor raises ``FileNotFoundError``.
    """
    mine = Trust(trust.uids | {os.geteuid()}, trust.what)
    for path in ancestor_paths(directory, os.path.realpath(directory)):
        st = os.lstat(path)
        problem = ancestor_problem(st.st_mode, st.st_uid, mine, uid_label)
        if problem is not None:
            raise _refuse(path, problem, st, mine, fix)


class SecureDir(Closing):
    """An open directory verified to be trusted; operations on its entries go through its fd.

    ``open`` with ``create`` makes a missing directory (mode 0700; missing
    ancestors 0755 under the umask); ``created`` says whether it did.  Without
    ``create`` the fd is ``O_PATH``: checking a directory and its entries
    needs search permission only, as connect(2) does, not read permission.
    Raises ``UnsafePathError`` for an untrusted directory or ancestor and
    ``OSError`` when the path cannot be a directory at all.
    """

    def __init__(self, path: str, fd: int, created: bool) -> None:
        self.path = path
        self.fd = fd
        self.created = created

    @classmethod
    def open(cls, path: str | os.PathLike[str], trust: Trust, *, create: bool = False, fix: str = "") -> SecureDir:
        where = os.path.abspath(os.fspath(path))
        created = False
        if create:
            os.makedirs(os.path.dirname(where), 0o755, exist_ok=True)
            try:
                os.mkdir(where, 0o700)
                created = True
            except FileExistsError:
                pass
        check_ancestors(where, trust, fix=fix)
        try:
            access = os.O_RDONLY if create else os.O_PATH  # fchmod/fchown (open_up) need a real fd
            fd = os.open(where, access | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except NotADirectoryError:  # a symlink, with O_NOFOLLOW, or a file
            st = os.lstat(where)
            if stat.S_ISLNK(st.st_mode):
                raise _refuse(where, "is a symbolic link; expected a real directory", st, trust, fix) from None
            raise
        try:
            st = os.fstat(fd)
            problem = dir_problem(st.st_mode, st.st_uid, trust, uid_label)
            if problem is not None:
                raise _refuse(where, problem, st, trust, fix)
            if created:
                os.fchmod(fd, 0o700)  # not left to the umask
        except BaseException:
            os.close(fd)
            raise
        return cls(where, fd, created)

    def entry(self, name: str) -> os.stat_result | None:
        """The lstat of ``name`` in this directory, or None when there is none."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def unlink(self, name: str) -> None:
        os.unlink(name, dir_fd=self.fd)

    def set_socket_access(self, name: str, *, mode: int, gid: int | None) -> None:
        """Give the socket file ``name``, bound by this process, its group and mode through an ``O_PATH`` handle."""
        handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            st = os.fstat(handle)
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
                raise UnsafePathError(
                    os.path.join(self.path, name),
                    f"is not the socket this process just bound ({stat.filemode(st.st_mode)}, owner {st.st_uid})",
                    owner_uid=st.st_uid,
                    expected_uids=(os.geteuid(),),
                )
            inode = f"/proc/self/fd/{handle}"  # names the inode just checked, never a path to re-resolve
            if gid is not None:
                os.chown(inode, -1, gid)
            os.chmod(inode, mode)
        finally:
            os.close(handle)

    def open_up(self, mode: int, gid: int | None) -> None:
        """Give a directory this process created ``mode`` (and group ``gid``); one it found is left as it is."""
        if not self.created:
            return
        if gid is not None:
            os.fchown(self.fd, -1, gid)
        os.fchmod(self.fd, mode)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def verify_socket(path: str, trust: Trust) -> None:
    """Check, before connecting, that ``path`` is a socket in a directory trusted for ``trust``.

    Raises ``UnsafePathError`` naming what is wrong, ``FileNotFoundError`` when
    the directory or the socket does not exist, ``OSError`` otherwise.
    """
    directory, name = os.path.split(os.path.abspath(path))
    with SecureDir.open(directory, trust, fix=_directory_fix(directory, trust)) as sdir:
        st = sdir.entry(name)
        if st is None:
            raise FileNotFoundError(2, "no socket file", path)
        problem = socket_file_problem(st.st_mode, st.st_uid, trust, uid_label)
        if problem is not None:
            raise _refuse(path, problem, st, trust, f"point the client at a socket of {trust.what}")


def _directory_fix(directory: str, trust: Trust) -> str:
    """What to do about an untrusted socket directory.  Removing it is advice only for a directory someone
    may have made to catch the client (never a shared one such as /tmp, which others may write by design)."""
    with contextlib.suppress(OSError):
        mode = os.lstat(directory).st_mode
        if mode & stat.S_ISVTX and mode & _WRITE_BY_OTHERS:
            return f"put the daemon's socket in a directory of its own (anyone may add entries to {directory})"
    return f"remove {directory} if you did not create it, or point the client at a socket of {trust.what}"


def remove_socket(path: str | os.PathLike[str]) -> bool:
    """Unlink the socket file at ``path`` through its verified directory; False when there was none.

    Only a socket is removed, and only from a directory trusted for this process.
    """
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    try:
        sdir = SecureDir.open(directory, Trust.of(os.geteuid(), what="this process"))
    except FileNotFoundError:
        return False
    with sdir:
        st = sdir.entry(name)
        if st is None or not stat.S_ISSOCK(st.st_mode):
            return False
        with contextlib.suppress(FileNotFoundError):
            sdir.unlink(name)
            return True
    return False

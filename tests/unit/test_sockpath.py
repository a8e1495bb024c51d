"""The pure checks of ``tiermem.net.sockpath``: what makes a socket path trusted, from modes and uids alone."""

from __future__ import annotations

import stat

import pytest

from tiermem.net.sockpath import (
    MAX_SOCKET_PATH_BYTES,
    Trust,
    ancestor_paths,
    ancestor_problem,
    dir_problem,
    peer_problem,
    socket_candidates,
    socket_dir_mode,
    socket_file_problem,
    socket_path_problem,
)

ALICE = 1000
MALLORY = 1001
SERVICE = 999
MINE = Trust.of(ALICE, what="alice's own tiermemd")

DIR = stat.S_IFDIR
LNK = stat.S_IFLNK
SOCK = stat.S_IFSOCK


def test_trust_always_admits_root_and_lists_the_expected_uids():
    assert MINE.uids == frozenset({0, ALICE})
    assert MINE.admits(0) and MINE.admits(ALICE) and not MINE.admits(MALLORY)
    assert Trust.of(0, what="root's").uids == frozenset({0})
    assert MINE.expected() == f"root or uid {ALICE}"


@pytest.mark.parametrize(
    ("mode", "uid", "expected"),
    [
        (DIR | 0o700, ALICE, None),
        (DIR | 0o755, ALICE, None),
        (DIR | 0o750, 0, None),
        (DIR | 0o777, MALLORY, f"is owned by uid {MALLORY}; expected root or uid {ALICE} (alice's own tiermemd)"),
        (DIR | 0o700, MALLORY, f"is owned by uid {MALLORY}; expected root or uid {ALICE} (alice's own tiermemd)"),
        (DIR | 0o770, ALICE, "is writable by its group (mode 0770); expected only its owner to write"),
        (DIR | 0o1777, ALICE, "is writable by group and others (mode 1777); expected only its owner to write"),
        (DIR | 0o703, ALICE, "is writable by all users (mode 0703); expected only its owner to write"),
        (LNK | 0o777, ALICE, "is a symbolic link; expected a real directory"),
        (stat.S_IFREG | 0o600, ALICE, "is not a directory"),
    ],
)
def test_a_socket_directory_must_be_real_owned_by_the_expected_uid_and_writable_by_it_alone(mode, uid, expected):
    assert dir_problem(mode, uid, MINE) == expected


def test_a_sticky_shared_directory_is_no_place_for_a_socket_but_is_a_fine_ancestor():
    tmp = DIR | 0o1777
    assert dir_problem(tmp, 0, MINE) is not None  # anyone could bind the name first
    assert ancestor_problem(tmp, 0, MINE) is None  # nobody can rename an entry they do not own


@pytest.mark.parametrize(
    ("mode", "uid", "fragment"),
    [
        (DIR | 0o755, 0, None),
        (DIR | 0o700, ALICE, None),
        (LNK | 0o777, 0, None),  # /var/run -> /run: the link's owner matters, not its mode
        (DIR | 0o777, 0, "writable by group and others without the sticky bit (mode 0777)"),
        (DIR | 0o775, ALICE, "writable by its group without the sticky bit (mode 0775)"),
        (DIR | 0o755, MALLORY, f"is owned by uid {MALLORY}"),
        (LNK | 0o777, MALLORY, f"is owned by uid {MALLORY}"),
        (stat.S_IFREG | 0o644, 0, "is not a directory"),
    ],
)
def test_an_ancestor_must_be_one_nobody_else_can_change(mode, uid, fragment):
    problem = ancestor_problem(mode, uid, MINE)
    if fragment is None:
        assert problem is None
    else:
        assert problem is not None and fragment in problem


@pytest.mark.parametrize(
    ("mode", "uid", "expected"),
    [
        (SOCK | 0o660, ALICE, None),
        (SOCK | 0o666, 0, None),
        (
            SOCK | 0o777,
            MALLORY,
            f"is a socket owned by uid {MALLORY}; expected root or uid {ALICE} (alice's own tiermemd)",
        ),
        (LNK | 0o777, ALICE, "is a symbolic link; expected the socket itself"),
        (stat.S_IFREG | 0o600, ALICE, "is not a socket"),
    ],
)
def test_the_entry_must_be_a_socket_owned_by_the_expected_uid(mode, uid, expected):
    assert socket_file_problem(mode, uid, MINE) == expected


def test_the_listener_must_run_as_the_expected_uid():
    assert peer_problem(ALICE, 42, MINE) is None
    assert peer_problem(0, 1, MINE) is None  # systemd's socket activation: the listener is pid 1's
    assert peer_problem(MALLORY, 4242, MINE) == (
        f"the process listening on it (pid 4242) runs as uid {MALLORY}; expected root or uid {ALICE} "
        "(alice's own tiermemd)"
    )


def test_problems_name_users_through_the_given_label():
    names = {0: "root", MALLORY: "uid 1001 (mallory)", ALICE: "uid 1000 (alice)"}
    problem = dir_problem(DIR | 0o777, MALLORY, MINE, names.__getitem__)
    assert problem == "is owned by uid 1001 (mallory); expected root or uid 1000 (alice) (alice's own tiermemd)"


@pytest.mark.parametrize(
    ("socket_mode", "dir_mode"),
    [(0o600, 0o700), (0o660, 0o750), (0o640, 0o750), (0o666, 0o755), (0o606, 0o705), (0o000, 0o700)],
)
def test_a_created_socket_directory_gives_search_to_the_classes_the_socket_admits_and_write_to_none(
    socket_mode, dir_mode
):
    assert socket_dir_mode(socket_mode) == dir_mode
    assert not socket_dir_mode(socket_mode) & 0o022


def test_a_socket_path_longer_than_sun_path_is_named_with_its_length():
    fits = "/" + "a" * (MAX_SOCKET_PATH_BYTES - 1)
    assert socket_path_problem(fits) is None
    long = fits + "b"
    problem = socket_path_problem(long)
    assert problem is not None
    assert f"is {MAX_SOCKET_PATH_BYTES + 1} bytes long" in problem and "server.socket" in problem
    assert socket_path_problem("/" + "é" * 54) is not None  # bytes, not characters


def test_ancestors_cover_the_path_as_written_and_as_resolved_outermost_first():
    assert ancestor_paths("/run/tiermem", "/run/tiermem") == ["/", "/run"]
    assert ancestor_paths("/var/run/tiermem", "/run/tiermem") == ["/", "/var", "/var/run", "/run"]
    assert ancestor_paths("/home/a/link/sub", "/tmp/x/sub") == [
        "/",
        "/home",
        "/home/a",
        "/home/a/link",
        "/tmp",
        "/tmp/x",
    ]
    assert ancestor_paths("/", "/") == ["/"]


def test_a_named_socket_trusts_root_and_the_user_unless_the_caller_names_the_daemon_uid():
    (own,) = socket_candidates(
        explicit="/srv/t.sock", node_path="/run/n.sock", per_user_path="/p", uid=ALICE, service_uids=[SERVICE]
    )
    assert (own.path, own.trust.uids, own.explicit) == ("/srv/t.sock", frozenset({0, ALICE, SERVICE}), True)
    (named,) = socket_candidates(
        explicit="/srv/t.sock",
        node_path="/run/n.sock",
        per_user_path="/p",
        uid=ALICE,
        service_uids=[SERVICE],
        daemon_uid=SERVICE,
    )
    assert named.trust.uids == frozenset({0, SERVICE})  # not the user: the caller said whose it is


def test_a_named_path_takes_the_node_service_user_too():
    """``TIERMEM_SOCKET_PATH=/run/tiermem/tiermemd.sock`` (or ``--socket`` with it, or the path an operator
    gave the node service) refused the node service, which runs as its own user, and said to pass
    daemon_uid=, which the CLI cannot."""
    for named in ("/run/n.sock", "/srv/other.sock"):
        (node,) = socket_candidates(
            explicit=named, node_path="/run/n.sock", per_user_path="/p", uid=ALICE, service_uids=iter([SERVICE])
        )
        assert (node.path, node.trust.uids) == (named, frozenset({0, ALICE, SERVICE}))
        assert not node.trust.admits(MALLORY)


def test_discovery_expects_the_service_user_on_the_node_path_and_the_user_on_its_own():
    node, own = socket_candidates(
        explicit=None, node_path="/run/n.sock", per_user_path="/tmp/tiermem-1000/s", uid=ALICE, service_uids=[SERVICE]
    )
    assert (node.path, node.trust.uids, node.explicit) == ("/run/n.sock", frozenset({0, SERVICE}), False)
    assert (own.path, own.trust.uids, own.explicit) == ("/tmp/tiermem-1000/s", frozenset({0, ALICE}), False)
    (bare_node, _) = socket_candidates(
        explicit=None, node_path="/run/n.sock", per_user_path="/p", uid=ALICE, service_uids=[]
    )
    assert bare_node.trust.uids == frozenset({0})  # no service user on this node: only root's daemon

"""A rank's connection to its node's tiermemd, and one private daemon per node when the node runs none.

Every rank first looks for the node's daemon as a single process would
(``$TIERMEM_SOCKET_PATH``, the node path; no private start).  The ranks then
tell each other (one ``all_gather_object``) which node they are on (host name
and ``$TIERMEM_SOCKET_PATH``: two simulated nodes on one host differ by it)
and whether they found one.  On a node without one, its first rank starts a
private daemon sized for the shards of all the node's ranks (the sum of the
pools each would have started alone, ``private_pool_plan``) and the others
connect to its socket, so a node's ranks always share one daemon.  A rank
that fails to start it makes every rank of its node raise, so none waits.
The rank that started it stops it when it closes, once the node's other
ranks have disconnected (at most ``PEERS_LINGER_S``): ranks end in any order.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from tiermem.client.link import Client, connect
from tiermem.client.offload.options import OffloadOptions
from tiermem.core.errors import DaemonUnavailable, TiermemError

__all__ = ["PEERS_LINGER_S", "node_client"]

PEERS_LINGER_S = 60.0
"""How long the rank that started a node's private daemon waits, at ``close``, for the node's other ranks to
disconnect before it stops the daemon (ranks end in any order; one that is hung does not keep it forever)."""


def node_client(
    collective: Callable[..., Any],
    rank: int,
    world_size: int,
    numels: Sequence[int],
    options: OffloadOptions,
    *,
    dtype: str,
) -> Client:
    """This rank's client of its node's daemon; ``collective(what, fn, *args)`` runs a collective.

    Where the node has no daemon, one rank starts a private one with a pool sized for what every rank of
    the node will ask: each rank's plan for its inner ``OffloadAdam`` of tensors of ``numels`` elements of
    ``dtype``, made with ``options`` (the record the inner optimizer is built from: its placement, exchange,
    step mode, released grads, window and moments' format, so a paged or staged optimizer gets its 16 bytes
    per element, and compressed moments their own size).  ``options.exchange`` is the one the inner
    optimizer will use (not ``auto``)."""
    plan = options.pool_plan(numels, dtype=dtype)
    found: Client | None = None
    try:
        found = connect(embed=False)
    except DaemonUnavailable:
        found = None
    node = (socket.gethostname(), os.environ.get("TIERMEM_SOCKET_PATH", ""))
    seen: list[Any] = [None] * world_size
    collective("search for the node's daemon", dist.all_gather_object, seen, (node, found is not None, plan))
    missing = [r for r, (n, ok, _) in enumerate(seen) if n == node and not ok]
    path: str | None = None
    error: str | None = None
    if missing and missing[0] == rank:
        plans = [p for n, ok, p in seen if n == node and not ok]
        try:
            found = connect(
                pool_size=sum(p.nbytes for p in plans),
                settings={"pool.arena_size": max(p.arena_size for p in plans)},
            )
            path = found.socket_path
            if len(plans) > 1:  # the node's other ranks use it too: closing first must not pull it from under them
                found.peers_linger_s = PEERS_LINGER_S
        except TiermemError as exc:
            error = f"{type(exc).__name__}: {exc}"
    paths: list[Any] = [None] * world_size
    collective("start of the node's daemon", dist.all_gather_object, paths, (node, path, error))
    failed = [(r, e) for r, (n, _, e) in enumerate(paths) if e and n == node]
    if failed:
        if found is not None:
            found.close()
        raise DaemonUnavailable(node[1] or "(private)", f"rank {failed[0][0]} could not start one: {failed[0][1]}")
    if found is None:
        started = next(p for n, p, _ in paths if n == node and p)
        found = connect(socket_path=started, embed=False)
    return found

"""Eviction and prefetch policy of the tier manager.  Pure: no pool, no I/O, no clock.

``AccessOrder`` is the cyclic order in which tensors are used in one pass
(an optimizer step touches every tensor once, in the same order each step;
the order is given, or recorded on the first pass as PatrickStar and Gemini
do).  ``distance(key, position)`` is how many uses away the key's next use is
from ``position`` (the index of the last use), wrapping into the next pass;
a key outside the order is infinitely far.

``choose_victims`` picks the CPU-resident tensors to move to NVMe so that
``nbytes_needed`` bytes become free: furthest next use first (Belady's rule)
when an order is known, else least recently used; among equals, clean tensors
(whose NVMe copy is current, so eviction needs no write) first.  With
``sooner_than``, a tensor whose next use comes before that distance is never
chosen: prefetching must not evict what is needed before what it fetches.

``choose_node_victims`` is the same rule across the tier managers of a node
(the pool's last resort, see ``shares``): each tenant offers its idle tensors
with an estimate of the seconds until their next use (distances of different
jobs are not comparable, times are), and a tenant gives up at most what it
holds above its guaranteed floor.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tiermem.core.errors import InvalidArgument

__all__ = ["AccessOrder", "Candidate", "NodeCandidate", "choose_node_victims", "choose_victims"]


class AccessOrder:
    """A cyclic sequence of keys; see the module docstring."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise InvalidArgument("an access order needs at least one key")
        self._keys = list(keys)
        self._positions: dict[str, list[int]] = {}
        for i, key in enumerate(self._keys):
            self._positions.setdefault(key, []).append(i)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._positions

    @property
    def keys(self) -> list[str]:
        return list(self._keys)

    def position_after(self, key: str, position: int) -> int | None:
        """Index of ``key``'s first use after ``position`` (wrapping), or None if it is not in the order."""
        found = self._positions.get(key)
        if not found:
            return None
        i = bisect.bisect_right(found, position)
        return found[i] if i < len(found) else found[0]

    def distance(self, key: str, position: int) -> float:
        """Uses from ``position`` to ``key``'s next use (1 = the very next), or inf when not in the order."""
        nxt = self.position_after(key, position)
        if nxt is None:
            return math.inf
        d = (nxt - position) % len(self._keys)
        return d if d > 0 else len(self._keys)

    def window(self, position: int, depth: int, *, wrap: bool = True) -> list[str]:
        """The distinct keys of the next ``depth`` uses after ``position``, soonest first; without ``wrap``,
        none of the next pass (the window ends with the order)."""
        out: list[str] = []
        n = len(self._keys)
        last = min(depth, n) if wrap else min(depth, n - 1 - position)
        for step in range(1, last + 1):
            key = self._keys[(position + step) % n]
            if key not in out:
                out.append(key)
        return out


@dataclass(frozen=True, slots=True)
class Candidate:
    """A tensor that could be evicted: resident, idle, not being paged."""

    key: str
    nbytes: int
    last_use: int
    """A counter value: larger is more recent."""
    clean: bool
    """Its NVMe copy is current: evicting it needs no write."""


def choose_victims(
    candidates: Iterable[Candidate],
    nbytes_needed: int,
    order: AccessOrder | None = None,
    position: int = -1,
    *,
    sooner_than: float | None = None,
) -> list[Candidate]:
    """Victims, best first, whose sizes add up to at least ``nbytes_needed`` (fewer if not enough qualify)."""
    pool = list(candidates)
    if order is not None:
        scored = [(order.distance(c.key, position), c) for c in pool]
        if sooner_than is not None:
            scored = [(d, c) for d, c in scored if d > sooner_than]
        scored.sort(key=lambda dc: (-dc[0], not dc[1].clean, dc[1].last_use))
        ranked = [c for _, c in scored]
    else:
        ranked = sorted(pool, key=lambda c: (c.last_use, not c.clean))
    victims: list[Candidate] = []
    total = 0
    for c in ranked:
        if total >= nbytes_needed:
            break
        victims.append(c)
        total += c.nbytes
    return victims


@dataclass(frozen=True, slots=True)
class NodeCandidate:
    """An idle tensor one tenant (a tier manager of the node) offers for eviction."""

    tenant: str
    key: str
    nbytes: int
    next_use_s: float
    """Estimated seconds until its next use (inf: not expected again)."""
    clean: bool


def choose_node_victims(
    candidates: Iterable[NodeCandidate], nbytes_needed: int, spare: dict[str, int]
) -> list[NodeCandidate]:
    """Victims across tenants, furthest next use first (clean first among equals), adding up to at least
    ``nbytes_needed`` (fewer if not enough qualify); a tenant never gives more than ``spare[tenant]`` bytes
    (what it holds above its guaranteed floor; missing: nothing)."""
    left = dict(spare)
    ranked = sorted(candidates, key=lambda c: (-c.next_use_s, not c.clean, c.tenant, c.key))
    victims: list[NodeCandidate] = []
    total = 0
    for c in ranked:
        if total >= nbytes_needed:
            break
        if c.nbytes > left.get(c.tenant, 0):
            continue
        left[c.tenant] -= c.nbytes
        victims.append(c)
        total += c.nbytes
    return victims

"""The server's refusal bookkeeping: token buckets per uid, and the rate-limited refusal log."""

from __future__ import annotations

import logging

import pytest

from tiermem.net.frames import PeerCred
from tiermemd.admission import RefusalLog, TokenBuckets


def test_a_bucket_allows_its_rate_then_refills_with_time_and_keys_are_apart() -> None:
    buckets = TokenBuckets(rate=5)
    assert [buckets.take(7, 100.0) for _ in range(7)] == [True] * 5 + [False] * 2
    assert buckets.take(8, 100.0)  # another uid has its own bucket
    assert not buckets.take(7, 100.1)  # 0.5 token refilled: still empty
    assert buckets.take(7, 100.3)  # 1.5 tokens
    assert [buckets.take(7, 200.0) for _ in range(6)] == [True] * 5 + [False]  # capped at the rate


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_refusals_are_logged_once_per_uid_and_reason_then_counted(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    refusals = RefusalLog(every_s=10, clock=clock)
    with caplog.at_level(logging.WARNING, logger="tiermemd.admission"):
        for _ in range(1000):
            refusals.note("refused a connection: uid not allowed", PeerCred(pid=5, uid=1001, gid=1001))
        refusals.note("refused a connection: uid not allowed", PeerCred(pid=6, uid=1002, gid=1002))
        assert refusals.flush() == {}  # not yet: the period has not passed
        clock.now = 11
        counts = refusals.flush()
    assert counts == {("refused a connection: uid not allowed", 1001): 999}
    assert refusals.total == 1001
    assert len(caplog.records) == 3  # the first of each uid, and one summary

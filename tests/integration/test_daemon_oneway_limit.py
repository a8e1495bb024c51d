"""A client that floods one-way messages without ever asking for a reply is disconnected."""

from __future__ import annotations

from typing import Any

from conftest import RawConn, error_of

from tiermem.core.protocol import FLAG_ONEWAY, BucketReady, ParamGroup, Ping, encode_message


def test_a_flood_of_one_way_messages_closes_only_that_connection(daemon_factory: Any) -> None:
    daemon = daemon_factory({"server": {"max_inflight": 20}})
    bucket = encode_message(
        BucketReady(step=1, attempt=1, bucket=0, tensor_ids=(0,), groups=(ParamGroup(lr=0.1),)), 1, FLAG_ONEWAY
    )
    with RawConn(daemon.socket_path) as ok:
        for _ in range(20):  # up to the limit, then a request: fine (they fail the request: no job attached)
            assert ok.send(bucket)
        assert error_of(ok.request(encode_message(Ping(), 2)))[1] == "InvalidState"
    with RawConn(daemon.socket_path) as flood:
        for _ in range(21):
            flood.send(bucket)
        code, kind, message = error_of(flood.recv())
        assert (code, kind) == (0, "AdmissionError") and "server.max_inflight" in message
        assert flood.recv() is None  # the daemon hung up
    with daemon.connection() as conn:  # everybody else is served
        assert type(conn.request(Ping())).__name__ == "Pong"

"""The staging window as a ring of slots: pipelined state transfer against a real tiermemd.

``StateTransfer`` cuts the window into slots, packs the tensors of a transfer
into them (one STATE_READ_MANY / STATE_WRITE_MANY per slot filled) and keeps
up to one request per slot outstanding (``Connection.pipeline``).  These tests hold it to exact
round trips for every slot count and piece size (tensors smaller than, equal
to and many times a slot, empty ones), and show that an error in the middle
of a pipeline is raised once and leaves the connection usable.  Moments (what
these write) are cut on quantization blocks of 256 elements
(``test_pack_spans``), so a slot's room short of a block stays empty.
"""

from __future__ import annotations

import pytest
import torch
from offload_helpers import OffloadDaemon

from tiermem.client.offload.transfer import pack_spans
from tiermem.core.errors import InvalidArgument
from tiermem.core.lowbit import BLOCK
from tiermem.core.protocol import MemRef, Ping, StateRead

WINDOW = 4096
SIZES = [0, 1, 511, 512, 513, 1024, 3000, 7]
"""Elements: with two 2 KiB slots a slot holds 512 fp32, so these are empty, sub-slot, exact and multi-slot."""


def optimizer(offload: OffloadDaemon) -> tuple[list[torch.nn.Parameter], object]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    opt = offload.make(params, lr=1e-3, window_nbytes=WINDOW)
    return params, opt


@pytest.mark.parametrize("slots", [1, 2, 3, 8])
def test_push_many_then_pull_many_round_trips_exactly(offload: OffloadDaemon, slots: int) -> None:
    _, opt = optimizer(offload)
    transfer = opt.transfer  # type: ignore[attr-defined]
    transfer.slots = slots
    values = [torch.randn(n) for n in SIZES]
    sent = transfer.push_many([(i, "exp_avg", v, 7, False) for i, v in enumerate(values)])
    count = 1 if slots * BLOCK * 4 > WINDOW else slots  # a slot holds a block at least
    per = WINDOW // count // 64 * 64 // 4
    # packed: the tensors share slots, one request per slot filled
    assert sent == len(list(pack_spans(SIZES, per, aligns=[BLOCK] * len(SIZES))))
    out = [torch.full((n,), float("nan")) for n in SIZES]
    steps = transfer.pull_many_into([(i, "exp_avg", o) for i, o in enumerate(out)])
    assert steps == [7] * len(SIZES)
    for v, o in zip(values, out, strict=True):
        torch.testing.assert_close(o, v, rtol=0, atol=0)
    # accumulate adds piece by piece, into the right offsets
    transfer.push_many([(i, "exp_avg", v, 7, True) for i, v in enumerate(values)])
    for i, v in enumerate(values):
        got, _ = transfer.pull(i, "exp_avg", v.numel())
        torch.testing.assert_close(got, 2 * v, rtol=0, atol=0)
    opt.close()  # type: ignore[attr-defined]


def test_a_bad_request_mid_pipeline_is_raised_and_the_connection_stays_in_step(offload: OffloadDaemon) -> None:
    _, opt = optimizer(offload)
    transfer = opt.transfer  # type: ignore[attr-defined]
    good = torch.arange(1, 1025, dtype=torch.float32)  # tensor 5: two full slots, so the bad span opens the third
    bad = torch.ones(1)
    items = [(5, "exp_avg", good, 1, False), (99, "exp_avg", bad, 1, False), (5, "exp_avg_sq", good, 1, False)]
    with pytest.raises(InvalidArgument, match="99"):
        transfer.push_many(items)
    conn = transfer.client.conn
    assert not conn.closed
    conn.request(Ping())  # the replies of the requests after the bad one were read: the stream is in step
    # what came before the bad request was written; the bad request (the bad span and the block of 256
    # elements that shared its slot, the 511 left cut on a block) wrote nothing; of what came after, only
    # the request already out (depth - 1 = one slot of 512 elements) was carried out, nothing was drawn
    # after the error reply
    got, _ = transfer.pull(5, "exp_avg", 1024)
    torch.testing.assert_close(got, good, rtol=0, atol=0)
    after, _ = transfer.pull(5, "exp_avg_sq", 1024)
    assert int((after[:256] != 0).sum()) == 0 and int((after[768:] != 0).sum()) == 0
    assert int((after[256:768] != 0).sum()) in (0, 512)


def test_an_error_in_the_callers_copy_drains_the_pipeline(offload: OffloadDaemon) -> None:
    _, opt = optimizer(offload)
    transfer = opt.transfer  # type: ignore[attr-defined]
    conn = transfer.client.conn
    info = transfer.client.info
    seen: list[int] = []

    def on_reply(i: int, _reply: object) -> None:
        seen.append(i)
        if i == 1:
            raise RuntimeError("copy failed")

    reads = (StateRead(tensor_id=6, key="exp_avg", offset=0, dest=MemRef(info.window_id, 0, 64)) for _ in range(6))
    with pytest.raises(RuntimeError, match="copy failed"):
        conn.pipeline(reads, depth=2, on_reply=on_reply)
    assert seen == [0, 1]  # no callback after the error; the request already out was read, not handed over
    conn.request(Ping())
    with pytest.raises(InvalidArgument, match="depth"):
        conn.pipeline([], depth=0)


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_bf16_and_fp32_items_share_slots_and_round_trip_exactly(offload: OffloadDaemon, slots: int) -> None:
    """A transfer mixing bf16 items (staged as 2 bytes an element, odd lengths included) and fp32 ones: the
    daemon widens the bf16 masters exactly and narrows them back to the same bits, the fp32 moments land
    where they belong, and the copy layer counts 2 bytes an element for the one and 4 for the other."""
    _, opt = optimizer(offload)
    transfer = opt.transfer  # type: ignore[attr-defined]
    transfer.slots = slots
    low = [torch.randn(n).to(torch.bfloat16) for n in SIZES]
    moments = [torch.randn(n) for n in SIZES]
    items = [(i, "master", v, 0, False) for i, v in enumerate(low)]
    items += [(i, "exp_avg", m, 3, False) for i, m in enumerate(moments)]
    transfer.push_many(items)
    back = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    wide = [torch.empty(n) for n in SIZES]
    got_moments = [torch.empty(n) for n in SIZES]
    reads = [(i, "master", b) for i, b in enumerate(back)] + [(i, "master", w) for i, w in enumerate(wide)]
    transfer.pull_many_into(reads + [(i, "exp_avg", m) for i, m in enumerate(got_moments)])
    for i in range(len(SIZES)):
        assert torch.equal(back[i], low[i]) and torch.equal(wide[i], low[i].float()), i
        assert torch.equal(got_moments[i], moments[i]), i
    crossed = transfer.crossed.nbytes
    total = sum(SIZES)
    assert crossed["to_host.master"] == 2 * total and crossed["to_host.exp_avg"] == 4 * total
    assert crossed["to_device.master"] == 2 * total + 4 * total

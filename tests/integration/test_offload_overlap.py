"""The overlapped update (``overlap_update=True``): buckets are updated as they land, with torch's result.

One private daemon for the module (eager Adam, as in the other OffloadAdam tests).
"""

from __future__ import annotations

import pytest
import torch
from offload_helpers import OffloadDaemon
from torch import nn

from tiermem.core.errors import InvalidArgument, InvalidState


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 8))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 24, generator=g), torch.randn(16, 8, generator=g)) for _ in range(n)]


def test_overlapped_updates_equal_torch_adamw_with_an_lr_schedule(offload: OffloadDaemon) -> None:
    model, ref = mlp(), mlp()
    groups = [
        {"params": list(model[0].parameters()), "lr": 3e-3},
        {"params": list(model[2].parameters()) + list(model[4].parameters()), "weight_decay": 0.1},
    ]
    ref_groups = [
        {"params": list(ref[0].parameters()), "lr": 3e-3},
        {"params": list(ref[2].parameters()) + list(ref[4].parameters()), "weight_decay": 0.1},
    ]
    opt = offload.make(groups, lr=1e-3, weight_decay=0.0, overlap_update=True, bucket_nbytes=4096)
    ref_opt = torch.optim.AdamW(ref_groups, lr=1e-3, weight_decay=0.0)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5) for o in (opt, ref_opt)]
    for x, y in batches(30):
        for m, o in ((model, opt), (ref, ref_opt)):
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
        for s in schedules:
            s.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    stats = opt.stats()
    # every step after the first updated all six tensors as their buckets landed
    assert stats.rank.overlapped_tensors == 29 * 6


def test_a_loop_that_clips_after_backward_is_refused_before_anything_is_applied(offload: OffloadDaemon) -> None:
    """The first step of an overlap run is synchronous: it shows the loop clips, and is refused before its update."""
    model = mlp()
    opt = offload.make(model.parameters(), lr=1e-3, overlap_update=True, bucket_nbytes=4096)
    before = [p.detach().clone() for p in model.parameters()]
    (x, y), _ = batches(2)
    nn.functional.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(InvalidState, match="grads changed after backward"):
        opt.step()
    for p, q in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert opt.state_dict()["state"] == {}
    assert opt.stats().rank.overlapped_tensors == 0


def test_more_buckets_than_the_daemon_takes_in_a_row_are_paced_with_a_ping(daemon_factory) -> None:
    """A model of more buckets (ZeRO-3 by layer: more units) than ``server.max_inflight`` one-way messages
    between two requests: the daemon used to close the connection; the client now sends a PING first."""
    from tiermem import OffloadAdam
    from tiermem.client.link import connect

    daemon = daemon_factory({"server": {"max_inflight": 2}})
    model, ref = mlp(), mlp()
    opt = OffloadAdam(
        model.parameters(), lr=1e-3, overlap_update=True, bucket_nbytes=256, client=connect(daemon.socket_path)
    )
    assert opt.client.conn.peer_max_inflight == 2
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    try:
        for x, y in batches(4):
            for m, o in ((model, opt), (ref, ref_opt)):
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b)
        assert opt.stats().rank.overlapped_tensors == 3 * 6  # six buckets a step, two at a time
    finally:
        opt.close()


def test_a_clip_set_later_is_refused_as_at_construction(offload: OffloadDaemon) -> None:
    """``set_max_grad_norm`` (HF Trainer's callback hands its clip this way) refuses what the constructor
    refuses: an overlapped update runs before any global norm exists.  The optimizer is left as it was."""
    opt = offload.make(mlp().parameters(), lr=1e-3, overlap_update=True)
    with pytest.raises(InvalidArgument, match=r"overlap_update=True cannot clip"):
        opt.set_max_grad_norm(1.0)
    assert opt.max_grad_norm is None and opt.options.max_grad_norm is None
    opt.set_max_grad_norm(None)

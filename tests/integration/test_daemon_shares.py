"""A node's jobs share its pool elastically: two NVMe jobs borrow all of it, a third is still admitted.

One private tiermemd with a pool that holds the whole state of two tiny GPTs
and little more.  Their chunk caches borrow free pool memory above their
guaranteed floors until each holds all of its state; a third job then
registers, its chunk cache takes memory back from the first two (the pool's
eviction callback, ``PoolShares``), and all three train exactly like the
same engine in-process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from offload_helpers import CHUNK_NUMEL, OffloadDaemon, assert_params_equal, cpu_adam, train
from small_models import gpt_batches, gpt_loss, replicas, tiny_gpt

STATE_NBYTES = 21472 * 12  # the tiny GPT's fp32 master and moments on the NVMe tier
CHUNK_NBYTES = CHUNK_NUMEL * 12
POOL_NBYTES = 2 * STATE_NBYTES + 2 * CHUNK_NBYTES  # two jobs' whole state, and room for two chunks


OFFLOAD_DAEMON: dict[str, Any] = {
    "settings": {"jobs.window_budget": "64MiB", "swap.borrow": True},
    "pool_size": POOL_NBYTES,
}


@pytest.mark.timeout(300)
def test_a_third_job_is_admitted_into_a_pool_two_jobs_filled(offload: OffloadDaemon) -> None:
    batches = gpt_batches(8)
    jobs = []
    for seed in range(3):
        model, reference = replicas(tiny_gpt(seed), 2)
        jobs.append((model, reference, cpu_adam(reference.parameters(), lr=3e-3, weight_decay=0.01)))
    optimizers = [offload.make(jobs[i][0].parameters(), lr=3e-3, weight_decay=0.01, offload="nvme") for i in range(2)]

    def step(i: int, batch_no: int) -> None:
        model, reference, ref_opt = jobs[i]
        train(model, optimizers[i], batches[batch_no : batch_no + 1], gpt_loss)
        train(reference, ref_opt, batches[batch_no : batch_no + 1], gpt_loss)

    for n in range(2):
        step(0, n)
        step(1, n)
    held = [opt.stats().rank.cpu_state_nbytes for opt in optimizers]
    # each cache borrowed above its guaranteed six chunks: together they hold almost all of the pool
    assert all(h >= STATE_NBYTES for h in held), held
    assert sum(held) > POOL_NBYTES - 2 * CHUNK_NBYTES - 4096 * 24

    optimizers.append(offload.make(jobs[2][0].parameters(), lr=3e-3, weight_decay=0.01, offload="nvme"))  # admitted
    for n in range(2, 8):
        for i in range(3):
            step(i, n)
    stats = [opt.stats().rank for opt in optimizers]
    assert stats[0].cpu_state_nbytes + stats[1].cpu_state_nbytes < sum(held)  # they gave memory back
    assert all(s.nvme is not None for s in stats)
    assert stats[2].nvme is not None and stats[2].nvme.page_outs > 0  # the third is paged within what it got
    for model, reference, _ in jobs:
        assert_params_equal(model, reference)
    assert all(torch.isfinite(p).all() for model, _, _ in jobs for p in model.parameters())

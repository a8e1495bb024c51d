"""A finished job gives its shared storage back: no fd, no mapping of it stays in the daemon.

The storage holds the trainer's params and grads, so a mapping kept alive after the job ends leaks the
model's size per job.  A view of it held anywhere in the daemon (the CPU scheduler once kept its last
task, a closure over the step's storage views, while idle) keeps the mmap, and the memfd with it.
"""

from __future__ import annotations

import os
import time

import torch

from tiermem import OffloadAdam
from tiermem.client.link import connect


def _storage_refs(pid: int, job_id: str) -> list[str]:
    name = f"tiermem-{job_id}-0-storage"
    refs = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if name in target:
            refs.append(f"fd {fd}")
    with open(f"/proc/{pid}/maps") as maps:
        refs += [f"mapping {line.split()[0]}" for line in maps if name in line]
    return refs


def test_a_job_that_stepped_leaves_no_fd_or_mapping_of_its_storage() -> None:
    owner = connect(pool_size=64 << 20)
    try:
        assert owner.daemon is not None
        pid = owner.daemon.process.pid
        for mode in ({}, {"delayed_update": True, "warmup_steps": 1}, {"overlap_update": True}):
            job_id = "storage-" + "-".join(mode) if mode else "storage-sync"
            model = torch.nn.Linear(64, 64)
            client = connect(owner.socket_path, embed=False)
            opt = OffloadAdam(model.parameters(), client=client, job_id=job_id, **mode)
            for _ in range(3):
                model(torch.randn(4, 64)).square().sum().backward()
                opt.step()
                opt.zero_grad()
            assert _storage_refs(pid, job_id), "the test must see the storage while the job lives"
            opt.close()
            client.close()
            deadline = time.monotonic() + 10
            while _storage_refs(pid, job_id) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _storage_refs(pid, job_id) == [], f"{job_id}: the daemon still holds its storage"
    finally:
        owner.close()

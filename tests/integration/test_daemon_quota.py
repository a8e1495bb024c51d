"""Per-job quotas refuse a job's state at admission, naming the quota; other jobs are unaffected."""

from __future__ import annotations

from typing import Any

import pytest

from tiermem.core.errors import AdmissionError
from tiermem.core.modes import Placement
from tiermem.core.protocol import ParamGroup, TensorSpec


def test_a_job_over_its_pool_quota_is_refused_at_register(daemon_factory: Any) -> None:
    daemon = daemon_factory({"jobs": {"max_pool": "64KiB"}})
    # fp32 params on the CPU tier are their own master: 8 bytes of state (the two moments) per element
    small = [TensorSpec("w", (1024,), "float32", Placement.CPU, 0)]  # 8 KiB of state: fits
    big = [TensorSpec("w", (12288,), "float32", Placement.CPU, 0)]  # 96 KiB of state: over 64 KiB
    with daemon.client() as client:
        client.attach("big", window_nbytes=1 << 16)
        with pytest.raises(AdmissionError, match="quota of 64KiB"):
            client.register(big, [ParamGroup(lr=1e-3)])
    with daemon.client() as client:
        client.attach("small", window_nbytes=1 << 16)
        assert len(client.register(small, [ParamGroup(lr=1e-3)]).slots) == 1
        client.detach()

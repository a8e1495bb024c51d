"""Which code an update runs, as the engine reports it (``AdamEngine.path``) and the daemon's binding returns it."""

from __future__ import annotations

import torch

from tiermem.core.protocol import KERNEL_PATHS, ParamGroup
from tiermem.engine.optim import AdamEngine


def test_an_fp32_update_without_output_runs_torchs_fused_kernel_natively() -> None:
    engine = AdamEngine(threads=1, compile=False, warmup=())
    assert engine.path(torch.float32, None) == "native"


def test_compiling_off_leaves_the_low_precision_update_on_the_fallback() -> None:
    engine = AdamEngine(threads=1, compile=False, warmup=())
    assert engine.path(torch.float16, torch.float16) == "fallback"
    assert engine.path(torch.bfloat16, torch.bfloat16) == "fallback"


def test_without_the_native_path_an_fp32_update_falls_back() -> None:
    engine = AdamEngine(threads=1, compile=False, warmup=(), native=False)
    assert engine.path(torch.float32, None) == "fallback"


def test_the_path_an_update_reports_is_the_one_it_ran() -> None:
    engine = AdamEngine(threads=1, compile=False, warmup=())
    p, g = torch.zeros(64), torch.ones(64)
    m, v = torch.zeros(64), torch.zeros(64)
    engine.update(p, m, v, g, None, group=ParamGroup(lr=0.1), step=1, grad_scale=1.0)
    assert engine.path(torch.float32, None) in KERNEL_PATHS
    assert not torch.equal(p, torch.zeros(64))

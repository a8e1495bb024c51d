"""How long the demo's trainer lets its idle OpenMP workers spin.  Pure, but must run before torch loads.

The demo trains on the CPU, where trainer and daemon share the cores.  torch's
CPU ops run on libgomp, which by default keeps a worker spinning for about
300,000 polls (a few milliseconds) after each parallel region, so the core it
holds is busy when the daemon's update starts just after backward.  Measured
on the demo GPT (1.8M params, 2 cores, 300 steps; ``benchmarks/bench_demo_openmp.py``
has the figures), ``GOMP_SPINCOUNT=20000`` leaves AdamW's own step as it is
and takes the CPU tier from 1.05-1.06x of it to 1.04x; 2,000 slows AdamW
itself (70 ms a step against 62), as does ``OMP_WAIT_POLICY=PASSIVE``.  So the
demo, which is a training script like a user's, runs its trainer with 20,000
unless the environment chose a policy; libgomp reads it once, when torch
loads, so ``choose`` is called before anything imports torch.  The private
daemon does not inherit the trainer's setting (``tiermem.client.link``): it
keeps its own, passive one.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["SPINCOUNT", "choose"]

SPINCOUNT = "20000"
"""The demo trainer's ``GOMP_SPINCOUNT``, where the environment sets no OpenMP wait policy."""
_POLICY_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def choose(environ: Mapping[str, str], *, torch_loaded: bool) -> tuple[dict[str, str], str]:
    """The variables to set before torch loads, and a line saying how the trainer's workers wait."""
    chosen = {name: environ[name] for name in _POLICY_VARS if name in environ}
    if chosen:
        setting = " ".join(f"{k}={v}" for k, v in chosen.items())
        return {}, f"trainer OpenMP: {setting} (from the environment)"
    if torch_loaded:
        return {}, "trainer OpenMP: libgomp's default spin (torch was loaded before the demo could set it)"
    return (
        {"GOMP_SPINCOUNT": SPINCOUNT},
        f"trainer OpenMP: GOMP_SPINCOUNT={SPINCOUNT} (idle workers spin for {int(SPINCOUNT):,} polls, not libgomp's "
        "300,000, leaving the cores to the daemon's update sooner; GOMP_SPINCOUNT or OMP_WAIT_POLICY in the "
        "environment choose otherwise)",
    )

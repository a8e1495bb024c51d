"""``OffloadAdam`` under PyTorch Lightning's ``Trainer.fit``, with the real package: gradient clipping, a
``ModelCheckpoint``, ``fit(ckpt_path=...)`` and teardown raise nothing and end where the same Lightning run
with ``torch.optim.AdamW`` ends; single process and DDP at 2 ranks on gloo.

Lightning wraps the optimizer (``LightningOptimizer``, an instance of a dynamic subclass that forwards to the
real one and is dropped while the real one trains) and moves its state at the start and end of ``fit``
(``optimizer.state[p][key] = value.to(device)``): the seams ``tiermem.client.offload.handle`` and
``state_view`` serve.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from lightning_case import CLIP, STEPS, RequeueSignals, fit, fit_resumed, flat_params

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

HERE = Path(__file__).parent
TOLERANCE = 1e-5


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_fit_ends_where_adamw_ends(tmp_path: Path, state_dtype: str) -> None:
    ours = flat_params(fit(tmp_path / "ours", "offload", state_dtype))
    ref = flat_params(fit(tmp_path / "ref", "adamw"))
    gap = float((ours - ref).abs().max())
    # compressed moments follow AdamW within their rounding (int8: 5e-3 to 6e-3 here), over 8 steps of lr 1e-2
    assert gap <= (TOLERANCE if state_dtype == "fp32" else 1e-2), gap


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_fit_resumed_from_a_checkpoint_ends_where_the_uninterrupted_fit_ends(tmp_path: Path, state_dtype: str) -> None:
    resumed = flat_params(fit_resumed(tmp_path / "resumed", "offload", state_dtype, stop=4))
    whole = flat_params(fit(tmp_path / "whole", "offload", state_dtype))
    assert torch.equal(resumed, whole), float((resumed - whole).abs().max())
    if state_dtype == "fp32":
        ref = flat_params(fit_resumed(tmp_path / "ref", "adamw", stop=4))
        assert float((resumed - ref).abs().max()) <= TOLERANCE
    assert (tmp_path / "resumed" / "last.ckpt").exists()


SLURM_JOB = {
    "SLURM_NTASKS": "1",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}


@pytest.mark.parametrize("optimizer", ["offload", "offload-overlap"])
def test_slurm_requeue_checkpoints_saved_mid_step_are_whole_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, optimizer: str
) -> None:
    """Lightning's SLURM auto-requeue saves ``hpc_ckpt_*.ckpt`` from inside its SIGUSR1 handler, wherever the
    signal lands: it hung there when that was ``OffloadAdam.step()``, and with the overlapped update a save
    during backward failed the backward.  Now every save holds one step (with the overlapped update, a save
    in backward holds the buckets updated so far at the next one), and the signals change nothing in the
    training."""
    from pytorch_lightning.plugins.environments import SLURMEnvironment

    for name, value in SLURM_JOB.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no scontrol here: Lightning logs that the requeue failed
    steps = 25 * STEPS
    signals = RequeueSignals(seed=0)
    out = tmp_path / "signalled"
    loop: dict[str, Any] = {"max_epochs": -1}
    if optimizer == "offload-overlap":
        loop["gradient_clip_val"] = None  # the overlapped update's contract: no clipping
    kwargs = {"plugins": [SLURMEnvironment(auto_requeue=True)], **loop}
    signalled = flat_params(fit(out, optimizer, steps=steps, extra_callbacks=(signals,), **kwargs))
    quiet = flat_params(fit(tmp_path / "quiet", optimizer, steps=steps, **loop))
    assert torch.equal(signalled, quiet), float((signalled - quiet).abs().max())
    in_step = signals.interrupted.count("step()")
    assert in_step >= 5, f"{in_step} of {len(signals.interrupted)} signals landed in OffloadAdam.step()"
    saved = sorted(out.glob("hpc_ckpt_*.ckpt"))
    assert len(saved) == len(signals.interrupted)
    for path in saved:
        state = torch.load(path, weights_only=False)["optimizer_states"][0]["state"]
        steps_saved = sorted({int(entry["step"]) for entry in state.values()})
        assert len(steps_saved) <= 1 or (optimizer == "offload-overlap" and steps_saved[1] == steps_saved[0] + 1)


def _ddp(out: Path, runs: tuple[str, ...]) -> dict[str, list[torch.Tensor]]:
    """One torchrun launch of 2 ranks: each run's fit (``optimizer-state_dtype``), resumed from its checkpoint;
    params per rank."""
    out.mkdir()
    path = str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "TMPDIR": str(out)}  # torchrun's own temp dirs
    env["TIERMEM_SECRET_FILE"] = str(out / "job-secret")  # a sharded optimizer's job secret, out of the home directory
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(HERE / "lightning_case.py"),
        str(out),
        ",".join(run.replace("-", ":") for run in runs),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, _per_rank(done.stderr)
    return {run: [torch.load(out / f"params-{run}-{rank}.pt") for rank in range(2)] for run in runs}


def _per_rank(stderr: str, keep: int = 2500) -> str:
    """The end of each rank's own lines (torchrun prefixes them ``[rankN]:``), then the end of the launcher's:
    the rank that failed first is not the one whose traceback ends the output."""
    lines = stderr.splitlines()
    parts = []
    for rank in range(2):
        mine = "\n".join(line for line in lines if line.startswith(f"[rank{rank}]:"))
        parts.append(f"--- rank {rank}:\n{mine[-keep:]}")
    rest = "\n".join(line for line in lines if not line.startswith("[rank"))
    return "\n".join([*parts, f"--- torchrun:\n{rest[-keep:]}"])


def test_ddp_fit_and_resume_at_two_ranks(tmp_path: Path) -> None:
    """OffloadAdam per rank, and ShardedOffloadAdam: Lightning's DDP checkpoints call ``consolidate_state_dict``
    on every rank, then save rank 0's ``state_dict()``, which is the whole state (before, rank 0's share alone,
    and rank 1's resume was refused).  The ZeRO-3 optimizers under Lightning's DDP, made before them: their
    forwards turn DDP's all-reduce off (before, ``LayerShardedAdam``'s second step failed inside DDP's
    reducer, "grad.numel() == bucket_view.numel()"), and they clip in place of Lightning: ``layer`` at its
    own ``max_grad_norm``, ``paged`` at Lightning's ``gradient_clip_val``, which ``HandOverClip`` gave it
    (before, that clip found no grads and nothing clipped)."""
    runs = ("offload-fp32", "offload-bf16", "offload-int8", "zero2-fp32", "layer-fp32", "paged-fp32", "adamw-fp32")
    ours = _ddp(tmp_path / "ddp", runs)
    ref = ours.pop("adamw-fp32")
    for run in ("layer-fp32", "paged-fp32"):
        assert [(tmp_path / "ddp" / f"clip-{run}-{rank}.txt").read_text() for rank in range(2)] == [repr(CLIP)] * 2
    for run, ranks in ours.items():
        # DDP keeps the replicas equal: each rank's optimizer saw the same grads
        assert torch.equal(ranks[0], ranks[1]), run
        gap = float((ranks[0] - ref[0]).abs().max())
        assert gap <= (TOLERANCE if run.endswith("fp32") else 1e-2), (run, gap)


def test_hand_over_clip_gives_gradient_clip_val_to_a_paged_offload_adam_and_refuses_value_clipping() -> None:
    """Under ``offload_params`` the grads go to the daemon during backward, so Lightning's clip finds none:
    ``HandOverClip`` gives ``gradient_clip_val`` to that ``OffloadAdam`` as a fit starts; an ``OffloadAdam``
    whose grads Lightning sees is left alone; clipping by value, which the daemon cannot do, is refused."""
    import pytorch_lightning as pl

    import tiermem
    from tiermem.client.distributed.lightning import HandOverClip
    from tiermem.core.errors import InvalidArgument

    def lightning(**clip: Any) -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, **clip)

    paged_model, plain_model = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    paged = tiermem.OffloadAdam(paged_model.parameters(), offload="cpu", exchange="staged")
    plain = tiermem.OffloadAdam(plain_model.parameters(), offload="cpu")
    try:
        tiermem.offload_params(paged_model, paged, device_budget="1MiB")
        for opt, handed in ((paged, CLIP), (plain, None)):
            trainer = lightning(gradient_clip_val=CLIP)
            trainer.strategy.optimizers = [opt]
            HandOverClip().on_fit_start(trainer, None)  # type: ignore[arg-type]
            assert opt.max_grad_norm == handed
        paged.set_max_grad_norm(None)
        trainer = lightning(gradient_clip_val=CLIP, gradient_clip_algorithm="value")
        trainer.strategy.optimizers = [paged]
        with pytest.raises(
            InvalidArgument, match=r"gradient_clip_algorithm='value'.*use gradient_clip_algorithm='norm'"
        ):
            HandOverClip().on_fit_start(trainer, None)  # type: ignore[arg-type]
        assert paged.max_grad_norm is None
    finally:
        paged.close()
        plain.close()

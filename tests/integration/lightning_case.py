"""One PyTorch Lightning training case, the same for every optimizer: a small regression model, fixed data,
``Trainer.fit`` with gradient clipping and a ``ModelCheckpoint``; run in-process by the single-process tests
and as ``python lightning_case.py OUT_DIR OPTIMIZER:STATE_DTYPE,...`` on each rank of a DDP launch.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from signal_helpers import interrupted_method
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tiermem
import tiermem.distributed
from tiermem.client.distributed.lightning import HandOverClip

HYPER = {"lr": 1e-2, "weight_decay": 0.1}
CLIP = 0.5
ZERO3 = ("layer", "paged")
"""The ZeRO-3 optimizers, whose grads Lightning's clip cannot see: ``layer`` clips at ``CLIP`` itself
(``gradient_clip_val`` off), ``paged`` gets ``gradient_clip_val`` from ``HandOverClip``."""
STEPS = 8
BATCH = 16


class Regressor(pl.LightningModule):
    def __init__(self, optimizer: str, state_dtype: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
        self.optimizer_name = optimizer
        self.state_dtype = state_dtype

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.made = self._make_optimizer()
        return self.made

    def _make_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), **HYPER)
        if self.optimizer_name == "zero2":  # DDP's process group is up: Lightning's checkpoints consolidate it
            return tiermem.distributed.ShardedOffloadAdam(self.parameters(), state_dtype=self.state_dtype, **HYPER)
        # ZeRO-3 holds no grads in the trainer, so Lightning's gradient_clip_val would find none: it clips itself
        # (layer), or HandOverClip gives it gradient_clip_val (paged)
        if self.optimizer_name == "layer":  # paged: it clips
            return tiermem.distributed.LayerShardedAdam(
                self, paged=True, state_dtype=self.state_dtype, max_grad_norm=CLIP, **HYPER
            )
        if self.optimizer_name == "paged":
            return tiermem.distributed.ShardedPagedAdam(
                self, offload="cpu", device_budget="64KiB", state_dtype=self.state_dtype, **HYPER
            )
        overlap = {"overlap_update": True, "bucket_nbytes": 1024} if self.optimizer_name == "offload-overlap" else {}
        return tiermem.OffloadAdam(self.parameters(), state_dtype=self.state_dtype, **HYPER, **overlap)


def data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    n = STEPS // 2 * BATCH  # two epochs: a resume at step 4 starts the second (Lightning replays no epoch part)
    x, y = torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def trainer(
    out: Path, max_steps: int, *, extra_callbacks: tuple[pl.Callback, ...] = (), hand_over: bool = False, **kwargs: Any
) -> pl.Trainer:
    """``extra_callbacks`` replace the ``ModelCheckpoint`` (and checkpointing is off) when given: a save of
    Lightning's interrupted by another from its signal handler ends the first one's fsspec transaction under
    it (``'NoneType' object has no attribute '_intrans'``), whatever the optimizer.  ``hand_over``: with
    ``HandOverClip``."""
    saves = [ModelCheckpoint(dirpath=out, save_last=True, every_n_train_steps=2)] if not extra_callbacks else []
    return pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        gradient_clip_val=kwargs.pop("gradient_clip_val", CLIP),
        callbacks=[*saves, *extra_callbacks, *([HandOverClip()] if hand_over else [])],
        enable_checkpointing=bool(saves),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        **kwargs,
    )


def fit(out: Path, optimizer: str, state_dtype: str = "fp32", *, steps: int = STEPS, **kwargs: Any) -> Regressor:
    """Train ``steps`` steps and tear down; returns the module (its params are the trained ones)."""
    module = Regressor(optimizer, state_dtype)
    trainer(out, steps, **kwargs).fit(module, data())
    return module


def fit_resumed(out: Path, optimizer: str, state_dtype: str = "fp32", *, stop: int, **kwargs: Any) -> Regressor:
    """Train to ``stop``, then a new Trainer and module resume from the last checkpoint to ``STEPS``."""
    fit(out, optimizer, state_dtype, steps=stop, **kwargs)
    module = Regressor(optimizer, state_dtype)
    trainer(out, STEPS, **kwargs).fit(module, data(), ckpt_path=str(out / "last.ckpt"))
    return module


class RequeueSignals(pl.Callback):
    """While training: SIGUSR1 to the main thread at random moments 1-6 ms apart (each once the last one was
    handled), as SLURM sends it before a job's time limit, to Lightning's own auto-requeue handler, which
    saves a checkpoint from inside the handler.  ``interrupted`` notes the outermost optimizer method each
    signal landed in ("" for none)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.interrupted: list[str] = []
        self._handled = threading.Event()
        self._stop = threading.Event()
        self._sender: threading.Thread | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        lightning = signal.getsignal(signal.SIGUSR1)
        assert callable(lightning), "Lightning set no SIGUSR1 handler: is the SLURM environment seen?"
        main = threading.get_ident()

        def noted(signum: int, frame: Any) -> None:
            try:
                self.interrupted.append(interrupted_method(frame))
                lightning(signum, frame)
            finally:
                self._handled.set()

        def send() -> None:
            while not self._stop.is_set():
                self._handled.wait()
                if self._stop.wait(self.rng.uniform(0.001, 0.006)):
                    return
                if signal.getsignal(signal.SIGUSR1) is not noted:
                    return  # Lightning's teardown came first (an error ended the fit)
                self._handled.clear()
                signal.pthread_kill(main, signal.SIGUSR1)

        signal.signal(signal.SIGUSR1, noted)
        self._handled.set()
        self._sender = threading.Thread(target=send, daemon=True)
        self._sender.start()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop.set()
        if self._sender is not None:
            self._sender.join()
        self._handled.wait(10.0)  # before Lightning puts the default action (terminate) back


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])


def main() -> None:
    """One DDP launch trains every ``optimizer:state_dtype`` named (comma-separated) in turn, each fit resumed
    from its own checkpoint, and saves each rank's params per run (``params-<optimizer>-<dtype>-<rank>.pt``)."""
    out, runs = Path(sys.argv[1]), [run.split(":") for run in sys.argv[2].split(",")]
    rank = int(os.environ["RANK"])
    for optimizer, state_dtype in runs:
        name = f"{optimizer}-{state_dtype}"
        clip = {"gradient_clip_val": None} if optimizer == "layer" else {"hand_over": optimizer == "paged"}
        module = fit_resumed(out / name, optimizer, state_dtype, stop=4, devices=2, strategy="ddp", **clip)
        # a ZeRO-3 model holds placeholders between forwards: its state dict gathers the values (every rank)
        values = torch.cat([v.reshape(-1).float() for v in module.state_dict().values()])
        torch.save(values, out / f"params-{name}-{rank}.pt")
        if optimizer in ZERO3:  # the clip the optimizer ended with: its own, or the one HandOverClip gave it
            (out / f"clip-{name}-{rank}.txt").write_text(repr(module.made.max_grad_norm))
    # torch's teardown at interpreter exit, with a gloo process group, now and then aborts a rank ("terminate
    # called without an active exception", SIGABRT) after everything is saved: 2 of 25 launches of this test
    # beside a busy core, one of them the torch.optim.AdamW reference, which runs no tiermem at all (and 3 of
    # 90 torch-only launches in benchmarks/soak_torchrun.py).  The results are written: leave without it.
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

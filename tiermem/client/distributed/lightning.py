"""PyTorch Lightning's ``gradient_clip_val`` handed to an optimizer whose grads it cannot see: ``HandOverClip``.

Lightning clips after backward with ``clip_grad_norm_`` over the
optimizer's params (``Trainer(gradient_clip_val=...)``).  A ZeRO-3 model
(``LayerShardedAdam``, ``ShardedPagedAdam``) holds no grads in the trainer,
nor does a model under ``offload_params`` (or ``OffloadAdam(release_grads=
True)``): that clip finds none and clips nothing, silently
(``tiermem.client.distributed.frameworks``).

``HandOverClip`` is a ``Callback``: in ``on_fit_start``, once the strategy
has made the optimizers, it hands ``gradient_clip_val`` to each such
optimizer that does not clip itself (``set_max_grad_norm``), as Lightning's
DeepSpeed strategy passes it to DeepSpeed.  Lightning's own clip still runs
and finds nothing.  Clipping by value (``gradient_clip_algorithm="value"``)
has no global rule for the daemons to apply: refused, naming the fix.
Other optimizers are left alone.

Importing this module imports ``pytorch_lightning``.
"""

from __future__ import annotations

import pytorch_lightning as pl

from tiermem.client.distributed.frameworks import grads_elsewhere, hand_over_clip
from tiermem.core.errors import InvalidArgument

__all__ = ["HandOverClip"]


class HandOverClip(pl.Callback):
    """``pl.Trainer(gradient_clip_val=..., callbacks=[HandOverClip()])``: the clip reaches an optimizer whose
    grads Lightning's clip cannot see (see the module docstring)."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        clip = trainer.gradient_clip_val
        elsewhere = [opt for opt in (grads_elsewhere(o) for o in trainer.optimizers) if opt is not None]
        if not clip or not elsewhere:
            return
        algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm))
        if trainer.gradient_clip_algorithm is not None and algorithm != "norm":
            raise InvalidArgument(
                f"gradient_clip_algorithm={algorithm!r}: {type(elsewhere[0]).__name__} holds no grads in the "
                "trainer, and its daemons clip by the global norm only; use gradient_clip_algorithm='norm'"
            )
        for opt in elsewhere:
            hand_over_clip(
                opt,
                float(clip),
                framework="Lightning",
                knob="gradient_clip_val",
                off="gradient_clip_val=None",
            )

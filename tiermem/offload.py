"""``OffloadAdam``: a ``torch.optim.Optimizer`` whose Adam state lives in tiermemd.

The model keeps only its working-precision params (fp32, fp16 or bf16, on any
device) and grads; the fp32 master weights, ``exp_avg`` and ``exp_avg_sq`` live
in the daemon, in its pool (``offload="cpu"``) or on NVMe (``"nvme"``).

Data path of one step (see docs in ``tiermem.layout`` for the window):

1. backward: a post-accumulate-grad hook per parameter copies its grad into the
   window (on CUDA: a non-blocking copy on a side stream into the pinned,
   CUDA-registered window); when every tensor of a bucket has landed the
   daemon is told (``BUCKET_READY``, one-way) and starts on its statistics.
2. ``step()``: grads changed in place after their hook ran (``clip_grad_norm_``,
   ``GradScaler.unscale_``) are detected by tensor version counters and copied
   again; one ``STEP`` request carries the hyper-parameters, loss scale and
   clipping; the reply comes once the update is done.
3. the updated params are copied from the window into the model's tensors.

With ``delayed_update=True`` (ZeRO-Offload's DPU), after ``warmup_steps``
synchronous steps, ``step()`` first installs the params of the previous update,
then hands this step's grads to the daemon and returns at once: the update runs
during the next forward and backward.  The model is then one update behind
(``staleness`` in ``stats()``).  ``flush()`` (called by ``state_dict``) waits for
the last update and installs its params.

With ``overlap_update=True`` the daemon updates each bucket as soon as it lands
(ZeRO-Offload's overlap), while backward computes the next ones.  An early
update cannot be unscaled, clipped or redone, so it is used only in steps whose
predecessor needed none of that (no GradScaler, no ``max_grad_norm``, no grads
changed after their hook, no gradient accumulation), never with the delayed
update, and never on the first step; if a step then turns out to need it
anyway, ``step()`` raises ``InvalidState`` instead of applying a wrong update.
Hyper-parameters are read when the first bucket lands: set them before
backward.

``torch.amp.GradScaler`` works unchanged: the optimizer declares
``_step_supports_amp_scaling``, so the scaler gives it ``grad_scale`` and
``found_inf``; an overflow skips the step without contacting the daemon, and the
grads are unscaled inside the daemon's update pass.

``state_dict()`` is ``torch.optim.AdamW``'s format (``step``, ``exp_avg``,
``exp_avg_sq`` per parameter, torch's param-group keys), plus ``master`` (the
fp32 weights) for low-precision params, so checkpoints move between the two
optimizers both ways.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tiermem.client import Client, connect
from tiermem.errors import DTypeError, InvalidArgument, InvalidState
from tiermem.layout import Layout, plan_layout
from tiermem.layout import TensorSpec as LayoutSpec
from tiermem.protocol import MemRef, ParamGroup, Step, TensorSlot, TensorSpec
from tiermem.units import MiB, align_up

__all__ = ["OffloadAdam"]

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


class OffloadAdam(torch.optim.Optimizer):
    """Adam/AdamW with its state in tiermemd; see the module docstring."""

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adamw: bool = True,
        maximize: bool = False,
        client: Client | None = None,
        offload: str = "auto",
        delayed_update: bool = False,
        overlap_update: bool = False,
        warmup_steps: int = 10,
        max_grad_norm: float | None = None,
        bucket_nbytes: int = 32 * MiB,
        job_id: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        token: str | None = None,
    ) -> None:
        if offload not in ("cpu", "nvme", "auto"):
            raise InvalidArgument(f'offload must be "cpu", "nvme" or "auto", got {offload!r}')
        if warmup_steps < 0:
            raise InvalidArgument(f"warmup_steps must be >= 0, got {warmup_steps}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InvalidArgument(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "adamw": adamw,
            "maximize": maximize,
        }
        self._registered = False
        super().__init__(params, defaults)
        self.offload = offload
        self.delayed_update = delayed_update
        self.overlap_update = overlap_update
        self.warmup_steps = warmup_steps
        self.max_grad_norm = max_grad_norm
        self.bucket_nbytes = bucket_nbytes
        self.job_id = job_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.rank = 0 if rank is None else rank
        self.world_size = 1 if world_size is None else world_size
        self._token = token
        self._client = client
        self._params: list[torch.nn.Parameter] = []
        self._layout: Layout | None = None
        self._slots: tuple[TensorSlot, ...] = ()
        self._landed: dict[int, tuple[int, int]] = {}
        """tensor id -> (id of the grad tensor, its version) when it was last copied into the window."""
        self._eager: set[int] = set()
        """Tensors the daemon already updated in this step, as their bucket landed."""
        self._eager_groups: tuple[ParamGroup, ...] = ()
        self._accumulated = False
        """A grad landed twice in this step (gradient accumulation)."""
        self._overlap_safe = False
        """The last step needed no loss scaling, clipping, recopies or accumulation: buckets may update early."""
        self._reported: dict[int, tuple[int, int]] = {}
        """tensor id -> the landed key the daemon computed its gradient statistics on this step."""
        self._bucket_left: list[int] = []
        self._steps_sent = 0
        self._inflight = False
        self._inflight_ids: list[int] = []
        self._skipped = 0
        self._copy_stream: Any = None
        self._hooks: list[Any] = []
        for group in self.param_groups:
            self._hook(group["params"])

    # ----------------------------------------------------------------- torch.optim API

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_registered", False):
            raise InvalidState(
                "OffloadAdam registers its tensors with tiermemd on the first backward or step; "
                "add every param group before training starts"
            )
        super().add_param_group(param_group)
        if hasattr(self, "_hooks"):
            self._hook(param_group["params"])

    def _hook(self, params: Iterable[torch.nn.Parameter]) -> None:
        for p in params:
            if not isinstance(p, torch.Tensor) or p.dtype not in _DTYPE_NAMES:
                raise DTypeError(f"OffloadAdam takes float32/float16/bfloat16 params, got {getattr(p, 'dtype', p)}")
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    @property
    def client(self) -> Client:
        self._ensure_registered()
        if self._client is None:  # pragma: no cover - set by _ensure_registered
            raise InvalidState("not connected")
        return self._client

    @property
    def token(self) -> str | None:
        """The job token (give it to ``OffloadAdam(token=...)`` to reattach after a crash)."""
        return self._token

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_registered()
        grad_scale = getattr(self, "grad_scale", False)
        found_inf = getattr(self, "found_inf", None)
        if self._eager and grad_scale is not False:
            self._reset_step()
            self._overlap_safe = False
            raise InvalidState(
                "a GradScaler drives this step, but its buckets were already updated as they landed "
                "(overlap_update=True) with the scaled grads; use overlap_update=False with loss scaling"
            )
        if found_inf is not None and float(found_inf) > 0:
            self._skipped += 1  # GradScaler found an overflow: skip, as torch's fused Adam does
            self._reset_step()
            return loss
        loss_scale = 1.0 if grad_scale is None or grad_scale is False else float(grad_scale)
        ids, recopied = self._present_grads(recopy_all=grad_scale is None)
        safe = grad_scale is False and not recopied and not self._accumulated and self.max_grad_norm is None
        if self._eager and not safe:
            self._reset_step()
            self._overlap_safe = False
            raise InvalidState(
                "this step's buckets were already updated as they landed (overlap_update=True), but the grads "
                "changed afterwards (GradScaler, clip_grad_norm_, another backward): the step cannot be applied "
                "as asked; use overlap_update=False for such training loops"
            )
        self._overlap_safe = safe
        delayed = self.delayed_update and self._steps_sent >= self.warmup_steps
        if self._inflight:
            self._install_params()
        if not ids:
            self._reset_step()
            return loss
        self._sync_copies()
        step_no = self._steps_sent + 1
        buffer = self._grad_buffer()
        if self.max_grad_norm is not None:
            # statistics taken on grads that changed since (accumulation, in-place edits) are taken again
            stale = [tid for tid in ids if self._reported.get(tid) != self._landed.get(tid)]
            if stale:
                self.client.bucket_ready(step_no, len(self._layout.buckets), stale, buffer)  # type: ignore[union-attr]
        groups = tuple(self._wire_group(g) for g in self.param_groups)
        if self._eager and groups != self._eager_groups:
            self._reset_step()
            raise InvalidState(
                "hyper-parameters changed between backward and step() while buckets were updated as they "
                "landed (overlap_update=True); set lr and the other group values before backward"
            )
        self.client.step(
            Step(
                step=step_no,
                groups=groups,
                loss_scale=loss_scale,
                max_grad_norm=self.max_grad_norm,
                skip_nonfinite=False,
                tensor_ids=tuple(ids),
                buckets=0,
                delayed=delayed,
                grad_buffer=buffer,
            )
        )
        self._steps_sent = step_no
        self._reset_step()
        if delayed:
            self._inflight = True
            self._inflight_ids = ids
        else:
            self._copy_params(ids)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)

    def flush(self) -> None:
        """Wait for a delayed update and install its params in the model."""
        if self._inflight:
            self._install_params()

    def close(self, *, keep_state: bool = False) -> None:
        """Detach from the daemon (the job's state is freed unless ``keep_state``) and close the connection."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._client is not None:
            if self._registered:
                try:
                    self.flush()
                    self._client.detach(keep_state=keep_state)
                except Exception as exc:  # closing must not mask the caller's own error
                    log.warning("detaching from tiermemd failed: %s", exc)
            self._client.close()
            self._client = None

    def stats(self) -> dict[str, float]:
        """The daemon's figures for this rank, plus the client's: skipped steps and the DPU staleness."""
        values = self.client.stats()
        values["client_skipped_steps"] = float(self._skipped)
        values["staleness_steps"] = 1.0 if self._inflight else 0.0
        values["steps"] = float(self._steps_sent)
        return values

    # ----------------------------------------------------------------- registration

    def _ensure_registered(self) -> None:
        if self._registered:
            return
        params = [p for g in self.param_groups for p in g["params"]]
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise DTypeError(
                f"OffloadAdam needs one working dtype for all params, got {sorted(str(d) for d in dtypes)}; "
                "use one OffloadAdam per dtype"
            )
        (dtype,) = dtypes
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        specs = [
            TensorSpec(f"{i}", tuple(p.shape), _DTYPE_NAMES[dtype], self.offload, group_of[id(p)])
            for i, p in enumerate(params)
        ]
        buffers = 2 if self.delayed_update else 1
        layout = plan_layout(
            [LayoutSpec(s.name, s.shape, s.dtype, s.group) for s in specs],
            bucket_nbytes=self.bucket_nbytes,
            grad_buffers=buffers,
        )
        if self._client is None:
            numel = layout.numel
            pool = align_up(int(numel * 12 * 1.05) + 64 * MiB) if self.offload != "nvme" else 256 * MiB
            self._client = connect(pool_size=max(pool, align_up(layout.nbytes) + 64 * MiB))
        info = self._client.attach(
            self.job_id, rank=self.rank, world_size=self.world_size, window_nbytes=layout.nbytes, token=self._token
        )
        self._token = info.token
        self._slots = self._client.register(
            specs, [self._wire_group(g) for g in self.param_groups], grad_buffers=buffers
        )
        self._params = params
        self._layout = layout
        self._bucket_left = [len(b.tensors) for b in layout.buckets]
        self._registered = True
        self._maybe_pin_window(params)
        if info.reattached:
            self._steps_sent = int(self._client.stats().get("rank_last_step", 0))
            self._client.fetch_params()
            self._copy_params(list(range(len(params))))
        else:
            for tid, p in enumerate(params):
                self._push_state(tid, "master", p.detach().reshape(-1), step=0)

    def _maybe_pin_window(self, params: list[torch.nn.Parameter]) -> None:
        if not any(p.is_cuda for p in params):
            return
        from tiermem.pool.pinning import default_pinner

        window = self._client.window  # type: ignore[union-attr]
        result = default_pinner().register(window.data_ptr(), window.numel())
        if not result.registered:
            log.warning("the window could not be registered with CUDA (%s); copies will be staged", result)
        self._copy_stream = torch.cuda.Stream()

    @staticmethod
    def _wire_group(group: dict[str, Any]) -> ParamGroup:
        lr = group["lr"]
        return ParamGroup(
            lr=float(lr),
            betas=(float(group["betas"][0]), float(group["betas"][1])),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            adamw=bool(group.get("adamw", True)),
            maximize=bool(group.get("maximize", False)),
        )

    # ----------------------------------------------------------------- the window

    def _view(self, ref: MemRef, dtype: torch.dtype) -> torch.Tensor:
        return self.client.window[ref.offset : ref.offset + ref.length].view(dtype)

    def _grad_buffer(self) -> int:
        return self._steps_sent % 2 if self.delayed_update else 0

    def _grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: copy this grad into the window, report full buckets."""
        if not self._registered:
            self._ensure_registered()
        tid = self._tid(p)
        if tid is None or p.grad is None:
            return
        self._accumulated = self._accumulated or tid in self._landed
        self._copy_grad(tid, p.grad)
        layout = self._layout
        bucket = layout.slots[tid].bucket  # type: ignore[union-attr]
        self._bucket_left[bucket] -= 1
        if self._bucket_left[bucket] == 0 and not p.grad.is_cuda:
            members = [t for t in layout.buckets[bucket].tensors if t in self._landed]  # type: ignore[union-attr]
            if self._may_overlap():
                groups = self._eager_groups or tuple(self._wire_group(g) for g in self.param_groups)
                self.client.bucket_ready(self._steps_sent + 1, bucket, members, self._grad_buffer(), update_with=groups)
                self._eager.update(members)
                self._eager_groups = groups
            else:
                self.client.bucket_ready(self._steps_sent + 1, bucket, members, self._grad_buffer())
            self._reported.update((t, self._landed[t]) for t in members)

    def _may_overlap(self) -> bool:
        """Update buckets as they land only when the previous step showed nothing an early update would miss."""
        return (
            self.overlap_update
            and self._overlap_safe
            and not self.delayed_update
            and self.max_grad_norm is None
            and not self._accumulated
        )

    def _tid(self, p: torch.Tensor) -> int | None:
        index = getattr(self, "_index", None)
        if index is None or len(index) != len(self._params):
            index = self._index = {id(q): i for i, q in enumerate(self._params)}
        return index.get(id(p))

    def _copy_grad(self, tid: int, grad: torch.Tensor) -> None:
        slot = self._slots[tid]
        dest = self._view(slot.grads[self._grad_buffer()], grad.dtype).view(grad.shape)
        if grad.is_cuda and self._copy_stream is not None:
            self._copy_stream.wait_stream(torch.cuda.current_stream(grad.device))
            with torch.cuda.stream(self._copy_stream):
                dest.copy_(grad, non_blocking=True)
                grad.record_stream(self._copy_stream)
        else:
            dest.copy_(grad)
        self._landed[tid] = (id(grad), grad._version)

    def _sync_copies(self) -> None:
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    def _present_grads(self, *, recopy_all: bool) -> tuple[list[int], bool]:
        """Ids of params with a grad, and whether any grad had changed since its hook copied it (or was
        never copied by one): those are copied now."""
        ids = []
        recopied = False
        for tid, p in enumerate(self._params):
            grad = p.grad
            if grad is None:
                continue
            if grad.dtype != p.dtype:
                raise DTypeError(f"param {tid} is {p.dtype} but its grad is {grad.dtype}")
            ids.append(tid)
            if recopy_all or self._landed.get(tid) != (id(grad), grad._version):
                recopied = True
                self._copy_grad(tid, grad)
        return ids, recopied

    def _reset_step(self) -> None:
        self._landed.clear()
        self._reported.clear()
        self._eager.clear()
        self._eager_groups = ()
        self._accumulated = False
        if self._layout is not None:
            self._bucket_left = [len(b.tensors) for b in self._layout.buckets]

    def _copy_params(self, ids: list[int]) -> None:
        for tid in ids:
            p = self._params[tid]
            src = self._view(self._slots[tid].param, p.dtype).view(p.shape)
            p.data.copy_(src, non_blocking=p.is_cuda)

    def _install_params(self) -> None:
        self.client.fetch_params(self._inflight_ids)
        self._copy_params(self._inflight_ids)
        self._inflight = False

    # ----------------------------------------------------------------- state transfer

    def _staging(self) -> MemRef:
        layout = self._layout
        if layout is None:  # pragma: no cover
            raise InvalidState("not registered")
        start = layout.grad_offsets[0]
        length = (layout.nbytes - start) // 4 * 4
        return MemRef(self._slots[0].param.window, start, length)

    def _push_state(self, tid: int, key: str, values: torch.Tensor, *, step: int) -> None:
        stage = self._staging()
        self._landed.clear()  # staging overwrites the grad region: grads are copied again at step()
        flat = values.detach().reshape(-1).to("cpu", torch.float32)
        per = stage.length // 4
        buf = self.client.window[stage.offset : stage.offset + stage.length].view(torch.float32)
        for start in range(0, flat.numel(), per):
            piece = flat[start : start + per]
            buf[: piece.numel()].copy_(piece)
            ref = MemRef(stage.window, stage.offset, piece.numel() * 4)
            self.client.write_state(tid, key, start * 4, ref, step)

    def _pull_state(self, tid: int, key: str) -> tuple[torch.Tensor, int]:
        stage = self._staging()
        self._landed.clear()  # staging overwrites the grad region: grads are copied again at step()
        numel = self._params[tid].numel()
        out = torch.empty(numel, dtype=torch.float32)
        per = stage.length // 4
        buf = self.client.window[stage.offset : stage.offset + stage.length].view(torch.float32)
        step = 0
        for start in range(0, numel, per):
            n = min(per, numel - start)
            chunk = self.client.read_state(tid, key, start * 4, MemRef(stage.window, stage.offset, n * 4))
            out[start : start + n].copy_(buf[:n])
            step = chunk.step
        if numel == 0:
            step = self.client.read_state(tid, key, 0, MemRef(stage.window, stage.offset, 0)).step
        return out, step

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s format (plus ``master`` for low-precision params)."""
        self._ensure_registered()
        self.flush()
        state: dict[int, dict[str, Any]] = {}
        for tid, p in enumerate(self._params):
            exp_avg, step = self._pull_state(tid, "exp_avg")
            if step == 0:
                continue  # torch has no state for a param that never stepped
            exp_avg_sq, _ = self._pull_state(tid, "exp_avg_sq")
            entry: dict[str, Any] = {
                "step": torch.tensor(float(step)),
                "exp_avg": exp_avg.view(p.shape).to(p.device),
                "exp_avg_sq": exp_avg_sq.view(p.shape).to(p.device),
            }
            if p.dtype != torch.float32:
                entry["master"] = self._pull_state(tid, "master")[0].view(p.shape).to(p.device)
            state[tid] = entry
        groups = []
        index = 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            packed.setdefault("amsgrad", False)
            packed.setdefault("foreach", None)
            packed.setdefault("capturable", False)
            packed.setdefault("differentiable", False)
            packed.setdefault("fused", None)
            packed["decoupled_weight_decay"] = bool(group.get("adamw", True))
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by ``OffloadAdam`` or ``torch.optim.Adam``/``AdamW``."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise InvalidArgument(
                f"state dict has {len(groups) if isinstance(groups, list) else 'no'} param groups, "
                f"this optimizer has {len(self.param_groups)}"
            )
        mapping: dict[Any, int] = {}
        tid = 0
        for mine, saved in zip(self.param_groups, groups, strict=True):
            if len(mine["params"]) != len(saved["params"]):
                raise InvalidArgument(
                    f"a saved param group has {len(saved['params'])} params, the matching group here has "
                    f"{len(mine['params'])}"
                )
            for key in saved["params"]:
                mapping[key] = tid
                tid += 1
            for name in ("lr", "betas", "eps", "weight_decay", "maximize"):
                if name in saved:
                    mine[name] = saved[name]
            if "adamw" in saved:
                mine["adamw"] = saved["adamw"]
            elif "decoupled_weight_decay" in saved:
                mine["adamw"] = bool(saved["decoupled_weight_decay"])
        self._ensure_registered()
        self.flush()
        for key, entry in state_dict.get("state", {}).items():
            if key not in mapping:
                raise InvalidArgument(f"state for param {key!r}, which no param group lists")
            t = mapping[key]
            p = self._params[t]
            step = int(float(entry["step"]))
            for name in ("exp_avg", "exp_avg_sq"):
                value = entry[name]
                if value.numel() != p.numel():
                    raise InvalidArgument(
                        f"state {name} of param {key!r} has {value.numel()} elements, not {p.numel()}"
                    )
                self._push_state(t, name, value, step=step)
            master = entry.get("master", p.detach())
            self._push_state(t, "master", master, step=step)
        self.client.fetch_params()
        self._copy_params(list(range(len(self._params))))

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            if self._client is not None and self._client.daemon is not None:
                self._client.close()
        except Exception:  # noqa: S110 - never raise from a finalizer
            pass

"""One row of ``gpu_peers.py`` in its own process: the model, the data, the systems and the timed loop.

    python benchmarks/gpu_peers_worker.py SPEC.json

``SPEC.json`` (written by ``gpu_peers.py``) names the system, the model config, device, batch, steps,
seed and hyper-parameters, and two paths: ``progress`` gets one JSON line per step as it ends (so a row
killed at its time limit still has its steps), ``row`` gets the finished row.

The model: a Llama-style decoder in plain torch (token embedding; ``n_layers`` blocks of RMSNorm,
causal attention with rotary embeddings through ``scaled_dot_product_attention``, RMSNorm, SwiGLU; a
final RMSNorm and an untied output projection; no biases).  ``LlamaConfig()`` is 1,467,066,368 params;
``LlamaConfig.tiny()`` runs on a CPU in seconds.  The data: each sequence's first half is drawn from a
Zipf-like distribution, its second half repeats the first, so the loss falls within a few steps; batch
``i`` depends only on ``(seed, i)``.

The systems (``SYSTEMS``, one class each, its settings in its docstring and constructor): AdamW with the
same hyper-parameters over the same bf16 model, whose fp32 master weights start from the bf16 values.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 32000
    dim: int = 2048
    n_layers: int = 26
    n_heads: int = 16
    ffn_dim: int = 5632
    """SwiGLU hidden width (Llama's 8/3 * dim rounded up to a multiple of 256)."""
    seq_len: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def full(cls) -> LlamaConfig:
        return cls()

    @classmethod
    def tiny(cls) -> LlamaConfig:
        return cls(vocab_size=512, dim=64, n_layers=2, n_heads=4, ffn_dim=176, seq_len=64)

    def num_params(self) -> int:
        """Params of ``Llama(self)``: per block 4 dim^2 (attention) + 3 dim ffn (SwiGLU) + 2 dim (norms);
        embedding and output vocab * dim each; the final norm dim."""
        block = 4 * self.dim * self.dim + 3 * self.dim * self.ffn_dim + 2 * self.dim
        return self.n_layers * block + 2 * self.vocab_size * self.dim + self.dim

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def rotary(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim / 2), fp32, made on ``device`` each forward (no buffers:
    nothing for a sharding or paging wrapper to move)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (even, odd) of the last dim of x (batch, heads, seq, head_dim), in x's dtype."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        cos, sin = rotary(t, self.head_dim, self.theta, x.device)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy (fp32) of ``tokens`` against ``targets``."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


@torch.no_grad()
def init_weights(model: Llama) -> None:
    """Normal(0, 0.02) for every matrix, the residual projections (wo, w2) scaled by 1/sqrt(2 n_layers);
    norms at one.  Run after ``torch.manual_seed``: the same seed on the same device gives the same
    weights."""
    residual_std = 0.02 / math.sqrt(2 * model.cfg.n_layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(("wo.weight", "w2.weight")):
            p.normal_(0.0, residual_std)
        else:
            p.normal_(0.0, 0.02)


def build_model(cfg: LlamaConfig, *, device: str | torch.device, dtype: torch.dtype, seed: int) -> Llama:
    """The model made directly on ``device`` in ``dtype`` (never an fp32 CPU copy first: 1.5B params
    initialise in about a second on a GPU), its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    with torch.device(device):
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = Llama(cfg)
        finally:
            torch.set_default_dtype(default)
    init_weights(model)
    return model


def batch(cfg: LlamaConfig, batch_size: int, index: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index`` of the stream: (tokens, targets), int64 on the CPU, each (batch_size, seq_len)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    half = (cfg.seq_len + 2) // 2
    weights = 1.0 / (torch.arange(cfg.vocab_size, dtype=torch.float64) + 10.0)
    first = torch.multinomial(weights.float(), batch_size * half, replacement=True, generator=g)
    first = first.view(batch_size, half)
    seq = torch.cat((first, first), dim=1)[:, : cfg.seq_len + 1]
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


# --------------------------------------------------------------------------------------------- systems


@dataclass
class Hyper:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1

    def kwargs(self) -> dict[str, Any]:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Trainer:
    """A system: ``step`` trains on one batch and returns the loss; ``counters`` are the system's own
    cumulative figures (read outside the timed steps); ``pcie_computed`` the bytes a step must move
    between host and device in this system's design (``None``: no offload)."""

    pcie_basis = "nothing offloaded"
    pcie_bytes_per_param = 0.0
    opt: Any
    """The optimizer the plain ``step`` drives (a system with a loop of its own overrides ``step``)."""

    def __init__(self, model: nn.Module, hyper: Hyper, spec: dict[str, Any]) -> None:
        self.model, self.hyper, self.spec = model, hyper, spec

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The plain loop over the subclass's ``self.opt``: forward, backward, step, grads dropped."""
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    @torch.no_grad()
    def loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return float(self.model(x, y))

    def counters(self) -> dict[str, float]:
        return {}

    def extra(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class GpuAdamW(Trainer):
    """The ceiling, all on the device: fp32 masters, ``torch.optim.AdamW(fused=True)`` over them, bf16 grads
    widened into their ``.grad``, the params narrowed back after each step."""

    def __init__(self, model: nn.Module, hyper: Hyper, spec: dict[str, Any]) -> None:
        super().__init__(model, hyper, spec)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone() for p in self.params]
        for m in self.master:
            m.grad = torch.zeros_like(m)
        self.opt = torch.optim.AdamW(self.master, fused=True, **hyper.kwargs())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.model(x, y)
        loss.backward()
        with torch.no_grad():
            for m, p in zip(self.master, self.params, strict=True):
                m.grad.copy_(p.grad)
                p.grad = None
            self.opt.step()
            for m, p in zip(self.master, self.params, strict=True):
                p.copy_(m)
        return loss.detach()


WINDOW_NBYTES = 64 << 20
"""The staging window of the unpaged tiermem rows: each slot filled is a request of about a millisecond, so
the daemon's 2 MiB default would cost ~1,400 requests a step for a 1.5B bf16 model's grads; 64 MiB is what
``offload_params`` grows a window to at most, and fits the daemon's default window budget."""


class Tiermem(Trainer):
    """``OffloadAdam`` through a private daemon: ``cpu``, ``delayed`` (the one-step delayed update after one
    synchronous step), ``nvme``, ``paged`` (``offload_params``, a device budget of a quarter of the params),
    ``int8`` (``state_dtype="int8"``)."""

    pcie_basis = "bf16 grads to the host and bf16 params back: 2 + 2 B/param"
    pcie_bytes_per_param = 4.0

    def __init__(self, model: nn.Module, hyper: Hyper, spec: dict[str, Any]) -> None:
        super().__init__(model, hyper, spec)
        from tiermem.client.link import connect
        from tiermem.client.offload import OffloadAdam, offload_params

        variant = spec["system"].removeprefix("tiermem-")
        numel = sum(p.numel() for p in model.parameters())
        # fp32 master, m, v (12 B/param) and the working copies the daemon keeps (bf16 param + grad), plus room
        pool = int(numel * 16 * 1.1) + (1 << 30)
        swap_dir = spec["workdir"] + "/swap" if variant == "nvme" else None
        if swap_dir:
            os.makedirs(swap_dir, exist_ok=True)
            pool = int(numel * 4 * 1.1) + (2 << 30)  # the chunk cache and the working copies, not the state
        self.client = connect(pool_size=pool, swap_dir=swap_dir, settings={"swap.fsync": False})
        options: dict[str, Any] = {"offload": "nvme" if variant == "nvme" else "cpu"}
        if variant != "paged":  # offload_params sizes a paged job's window itself (up to the same 64 MiB)
            options["window_nbytes"] = WINDOW_NBYTES
        if variant == "delayed":
            options.update(delayed_update=True, warmup_steps=1)
        if variant == "int8":
            options["state_dtype"] = "int8"
        if variant == "paged":
            options["exchange"] = "staged"
        self.opt = OffloadAdam(model.parameters(), client=self.client, **options, **hyper.kwargs())
        self.pager = None
        if variant == "paged":
            budget = sum(p.numel() * p.element_size() for p in model.parameters()) // 4
            self.pager = offload_params(model, self.opt, device_budget=budget)
            self.pcie_basis = "params to the device for forward and again for backward, grads back: 2 + 2 + 2 B/param"
            self.pcie_bytes_per_param = 6.0

    @torch.no_grad()
    def loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.opt.flush()  # the delayed update's last step lands first
        return float(self.model(x, y))

    def counters(self) -> dict[str, float]:
        """``OffloadAdam.stats().crossed_nbytes`` (bytes its copies moved across the host/device boundary,
        by direction and state key) where this tiermem has it; the daemon's update time."""
        stats = self.opt.stats()
        out = {f"crossed_nbytes.{k}": float(v) for k, v in (getattr(stats, "crossed_nbytes", None) or {}).items()}
        out["update_s"] = float(stats.rank.update_s)
        return out

    def extra(self) -> dict[str, Any]:
        rank = self.opt.stats().rank
        out: dict[str, Any] = {"exchange": self.opt.exchange.value, "state_dtype": rank.state_dtype}
        for name in ("window_nbytes", "storage_nbytes", "cpu_state_nbytes", "nvme_state_nbytes", "update_s", "wait_s"):
            out[name] = getattr(rank, name)
        if self.pager is not None:
            out["pager"] = self.pager.stats()
        return out

    def close(self) -> None:
        self.opt.close()
        self.client.close()


def one_rank_group(backend: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend, rank=0, world_size=1)


class DeepSpeed(Trainer):
    """ZeRO-2 with ``offload_optimizer`` cpu, pinned, ``overlap_comm``, ``contiguous_gradients``
    (DeepSpeedCPUAdam, JIT-built on first use); ZeRO-3 with ``offload_param`` too."""

    pcie_basis = "bf16 grads to the host and bf16 params back: 2 + 2 B/param"
    pcie_bytes_per_param = 4.0

    def __init__(self, model: nn.Module, hyper: Hyper, spec: dict[str, Any]) -> None:
        super().__init__(model, hyper, spec)
        import deepspeed

        stage = 3 if spec["system"].endswith("zero3") else 2
        pinned = {"device": "cpu", "pin_memory": True}
        zero: dict[str, Any] = {
            "stage": stage,
            "offload_optimizer": dict(pinned),
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
        }
        if stage == 3:
            zero["offload_param"] = dict(pinned)
            self.pcie_basis = "params to the device for forward and again for backward, grads back: 2 + 2 + 2 B/param"
            self.pcie_bytes_per_param = 6.0
        else:
            zero["allgather_bucket_size"] = 5e8
        config = {
            "train_micro_batch_size_per_gpu": spec["batch"],
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": hyper.kwargs()},
            "gradient_clipping": 0.0,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        deepspeed.init_distributed(dist_backend="nccl" if spec["device"] == "cuda" else "gloo")
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.config = config
        self.version = deepspeed.__version__

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    @torch.no_grad()
    def loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return float(self.engine(x, y))

    def extra(self) -> dict[str, Any]:
        return {"deepspeed": self.version, "config": self.config}


class Fsdp2(Trainer):
    """``fully_shard`` per block and at the root, world size 1, ``CPUOffloadPolicy``, bf16 params / fp32
    reduce over fp32 masters, ``torch.optim.AdamW`` (fused, on the CPU)."""

    pcie_basis = (
        "fp32 sharded params to the device for forward and again for backward, fp32 grads back: 4 + 4 + 4 B/param"
    )
    pcie_bytes_per_param = 12.0

    def __init__(self, model: nn.Module, hyper: Hyper, spec: dict[str, Any]) -> None:
        super().__init__(model, hyper, spec)
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        one_rank_group("nccl" if spec["device"] == "cuda" else "gloo")
        model.float()  # the fp32 master weights, from the bf16 values every row starts from
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=spec["device"] == "cuda")
        for block in model.layers:
            fully_shard(block, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mp_policy=mp, offload_policy=offload)
        kwargs = hyper.kwargs()
        try:
            self.opt = torch.optim.AdamW(model.parameters(), fused=True, **kwargs)
            self.fused = True
        except (RuntimeError, TypeError):  # a torch whose fused AdamW takes no CPU DTensors
            self.opt = torch.optim.AdamW(model.parameters(), foreach=True, **kwargs)
            self.fused = False

    def extra(self) -> dict[str, Any]:
        return {"fused_adamw": self.fused}


class TorchAO(Trainer):
    """``torchao.optim.CPUOffloadOptimizer(..., torch.optim.AdamW, fused=True)``: its CPU copy and state in the
    params' dtype (bf16; no fp32 master)."""

    pcie_basis = "bf16 grads to the host and bf16 params back: 2 + 2 B/param"
    pcie_bytes_per_param = 4.0

    def __init__(self, model: nn.Module, hyper: Hyper, spec: dict[str, Any]) -> None:
        super().__init__(model, hyper, spec)
        import torchao

        try:
            from torchao.optim import CPUOffloadOptimizer
        except ImportError:  # torchao before 0.11
            from torchao.prototype.low_bit_optim import CPUOffloadOptimizer  # type: ignore[no-redef]
        self.opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True, **hyper.kwargs())
        self.version = torchao.__version__

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()

    def extra(self) -> dict[str, Any]:
        return {"torchao": self.version}


SYSTEMS: dict[str, Callable[[nn.Module, Hyper, dict[str, Any]], Trainer]] = {
    "adamw": GpuAdamW,
    "tiermem-cpu": Tiermem,
    "deepspeed-zero2": DeepSpeed,
    "fsdp2": Fsdp2,
    "torchao": TorchAO,
    "tiermem-delayed": Tiermem,
    "tiermem-paged": Tiermem,
    "tiermem-nvme": Tiermem,
    "tiermem-int8": Tiermem,
    "deepspeed-zero3": DeepSpeed,
}


# --------------------------------------------------------------------------------------------- measuring


class PcieSampler:
    """Bytes across PCIe from NVML's throughput counters (TX + RX, each a 20 ms sample in KB/s), integrated
    over the time between samples on a thread; ``None`` where NVML or the counter is missing."""

    def __init__(self) -> None:
        self.total = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0") or 0))
            self._read()
        except Exception:  # no NVML, no GPU, or the counter is not supported (a VM)
            self._nvml = None

    def _read(self) -> float:
        nv = self._nvml
        tx = nv.nvmlDeviceGetPcieThroughput(self._handle, nv.NVML_PCIE_UTIL_TX_BYTES)
        rx = nv.nvmlDeviceGetPcieThroughput(self._handle, nv.NVML_PCIE_UTIL_RX_BYTES)
        return (tx + rx) * 1024.0

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            rate = self._read()
            now = time.perf_counter()
            self.total += rate * (now - last)
            self.samples += 1
            last = now

    def start(self) -> None:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def stop(self) -> float | None:
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        return self.total


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(spec["device"])
    cfg = LlamaConfig(**spec["model"])
    hyper = Hyper(**spec.get("hyper", {}))
    progress = open(spec["progress"], "a", buffering=1)  # noqa: SIM115 - one line per step, kept open
    t0 = time.perf_counter()
    model = build_model(cfg, device=device, dtype=torch.bfloat16, seed=spec["seed"])
    numel = sum(p.numel() for p in model.parameters())
    trainer = SYSTEMS[spec["system"]](model, hyper, spec)
    setup_s = time.perf_counter() - t0
    progress.write(json.dumps({"event": "ready", "setup_s": setup_s, "numel": numel}) + "\n")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warmup, timed = spec["warmup"], spec["steps"]
    tokens = spec["batch"] * cfg.seq_len
    step_s: list[float] = []
    losses: list[float] = []
    sampler = PcieSampler() if device.type == "cuda" else None
    before: dict[str, float] = {}
    for i in range(warmup + timed):
        if i == warmup:
            before = trainer.counters()
            if sampler is not None:
                sampler.start()
        x, y = (t.to(device, non_blocking=True) for t in batch(cfg, spec["batch"], i, spec["seed"]))
        sync(device)
        start = time.perf_counter()
        loss = trainer.step(x, y)
        sync(device)
        seconds = time.perf_counter() - start
        losses.append(float(loss))
        if i >= warmup:
            step_s.append(seconds)
        line = {"event": "step", "step": i, "timed": i >= warmup, "step_s": seconds, "loss": losses[-1]}
        if device.type == "cuda":
            line["gpu_peak_allocated_nbytes"] = torch.cuda.max_memory_allocated()
        progress.write(json.dumps(line) + "\n")
    nvml = sampler.stop() if sampler is not None else None
    counters = counter_delta(before, trainer.counters())
    x, y = (t.to(device) for t in batch(cfg, spec["batch"], warmup + timed, spec["seed"]))
    loss_after = trainer.loss(x, y)
    row: dict[str, Any] = {
        "status": "ok",
        "numel": numel,
        "tokens_per_step": tokens,
        "warmup_steps": warmup,
        "timed_steps": timed,
        "setup_s": setup_s,
        "step_s": step_s,
        "losses": losses,
        "loss_after": loss_after,
        "counters": counters,
        "pcie": pcie_figures(trainer, numel, timed, counters, nvml),
        "extra": trainer.extra(),
    }
    if device.type == "cuda":
        row["gpu_peak_allocated_nbytes"] = torch.cuda.max_memory_allocated()
        row["gpu_peak_reserved_nbytes"] = torch.cuda.max_memory_reserved()
    trainer.close()
    return row


def pcie_figures(
    trainer: Trainer, numel: int, steps: int, counters: dict[str, float], nvml_nbytes: float | None
) -> dict[str, Any]:
    """Bytes per step across the host/device boundary: the system's own counter where it has one, NVML's
    sampled throughput where the GPU reports it, and the design's minimum computed from the dtypes."""
    crossed = sum(v for k, v in counters.items() if k.startswith("crossed_nbytes."))
    has_counter = any(k.startswith("crossed_nbytes.") for k in counters)
    return {
        "counter_nbytes_per_step": crossed / steps if has_counter and steps else None,
        "nvml_nbytes_per_step": nvml_nbytes / steps if nvml_nbytes is not None and steps else None,
        "computed_nbytes_per_step": trainer.pcie_bytes_per_param * numel,
        "computed_basis": trainer.pcie_basis,
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the campaign's signal before it kills a late row
    row = run(spec)
    tmp = spec["row"] + ".tmp"
    Path(tmp).write_text(json.dumps(row, indent=1) + "\n")
    os.replace(tmp, spec["row"])


if __name__ == "__main__":
    main()

"""Param paging (``tiermem.offload_params``): params live in a real private tiermemd and visit the trainer a
submodule at a time.

The device here is the trainer's memory with a budget.  The seed network (the
first seed's four scalar layers) checks the gradients against its analytic
formulas and the fetch / prefetch / release order against its pipeline; the
demo GPT, 4x the budget, trains bitwise like the same optimizer without paging
(the same engine), also with its state on NVMe past the pool budget; tied
weights, a shared block, a root's own param, activation checkpointing, eval
under ``no_grad``, ``state_dict`` through ``torch.save`` and a model made on
the meta device come after.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from offload_helpers import CHUNK_NUMEL, OffloadDaemon, offload_daemon
from small_models import BATCH, corpus
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import tiermem
from tiermem.client.demo.model import GPT, GPTConfig
from tiermem.client.offload import ParamPager
from tiermem.core.errors import InvalidArgument, InvalidState

HYPER: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
WINDOW = 4096
"""Smaller than most of the GPT's params: every fetch takes several pieces."""
PAGING_GPT = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16)
"""About 59k params (236 KiB): the largest submodule (the token embedding, 32 KiB) is a seventh of it."""


OFFLOAD_DAEMON: dict[str, Any] = {"settings": {"jobs.max_jobs": 256}}
"""The module's optimizers stay attached until it ends: up to 128 for this uid (half of ``max_jobs``), where 64
was one test short on the pytest worker that ran most of them."""


def make_opt(offload: OffloadDaemon, model: nn.Module, tier: str = "cpu", **kwargs: Any) -> Any:
    return offload.make(
        model.parameters(), offload=tier, exchange="staged", window_nbytes=WINDOW, **{**HYPER, **kwargs}
    )


def param_nbytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ----------------------------------------------------------------------------- the seed network


def seed_net(
    weights: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8), biases: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4)
) -> nn.Sequential:
    """Three Linear(1, 1) + ReLU layers and a last Linear(1, 1), with the given weights and biases."""
    net = nn.Sequential(
        nn.Linear(1, 1), nn.ReLU(), nn.Linear(1, 1), nn.ReLU(), nn.Linear(1, 1), nn.ReLU(), nn.Linear(1, 1)
    )
    with torch.no_grad():
        for layer, w, b in zip(net[::2], weights, biases, strict=True):
            layer.weight.fill_(w)
            layer.bias.fill_(b)
    return net


def seed_loss(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (net(x) - x).pow(2).sum()


def seed_gradients(x: float, w: list[float], b: list[float]) -> dict[str, float]:
    """The first seed's formulas: forward h_m = ReLU(w_m h_{m-1} + b_m), y = w_4 h_3 + b_4, L = (y - x)^2 / 2,
    and its backward, layer by layer (I is the indicator of a positive activation)."""
    h1 = max(0.0, w[0] * x + b[0])
    h2 = max(0.0, w[1] * h1 + b[1])
    h3 = max(0.0, w[2] * h2 + b[2])
    y = w[3] * h3 + b[3]
    dy = y - x
    dh3 = dy * w[3]
    i3, i2, i1 = float(h3 > 0), float(h2 > 0), float(h1 > 0)
    dh2 = dh3 * w[2] * i3
    dh1 = dh2 * w[1] * i2
    return {
        "6.weight": dy * h3,
        "6.bias": dy,
        "4.weight": dh3 * h2 * i3,
        "4.bias": dh3 * i3,
        "2.weight": dh2 * h1 * i2,
        "2.bias": dh2 * i2,
        "0.weight": dh1 * x * i1,
        "0.bias": dh1 * i1,
    }


def daemon_grads(pager: ParamPager) -> dict[str, float]:
    """The grads as the daemon holds them (its ``grad`` state key), read back through the window."""
    pager.drain()
    out = {}
    for e in pager.entries:
        values, _ = pager.transfer.pull(e.index, "grad", e.shape.numel())
        out[e.name] = float(values[0])
    return out


@pytest.mark.parametrize(
    ("x", "weights", "biases"),
    [
        (1.5, (0.5, 0.6, 0.7, 0.8), (0.1, 0.2, 0.3, 0.4)),  # every ReLU active
        (2.0, (0.9, -1.2, 0.7, -0.6), (0.3, 0.1, 0.5, 0.2)),  # the second ReLU is dead: I(h2 > 0) = 0
    ],
)
def test_seed_network_gradients_equal_the_seeds_formulas(
    offload: OffloadDaemon, x: float, weights: tuple[float, ...], biases: tuple[float, ...]
) -> None:
    net = seed_net(weights, biases)
    opt = make_opt(offload, net)
    pager = tiermem.offload_params(net, opt, device_budget=16, prefetch=1)
    seed_loss(net, torch.tensor([[x]])).backward()
    expected = seed_gradients(x, list(weights), list(biases))
    got = daemon_grads(pager)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    assert all(p.grad is None for p in net.parameters())  # the grads went to the daemon as they landed


def _seed_pipeline() -> list[tuple[str, str]]:
    """The first seed's ZeRO-3 pipeline for one step after the first, one layer fetched ahead (layer k is
    module ``2k - 2``): forward fetches layer 1 and, while each layer computes, the next, releasing each after
    use; layer 4 is kept for backward ("if forward did not release it, the fetch is skipped").  Backward
    computes layer m with layer m's weight (the grad of its input), so it fetches layers 4, 3, 2 in that order,
    each while the one after it computes, and releases each once its grads are out; layer 1, whose input
    needs no grad, is not fetched again."""
    w, b = "weight", "bias"
    events = [("fetch", f"0.{w}"), ("fetch", f"0.{b}")]
    for layer in (1, 2, 3):
        nxt = f"{2 * layer}"
        events += [("prefetch", f"{nxt}.{w}"), ("prefetch", f"{nxt}.{b}")]
        prev = f"{2 * layer - 2}"
        events += [("release", f"{prev}.{w}"), ("release", f"{prev}.{b}")]
    events += [("release", f"6.{b}")]  # end of forward: layer 4's weight is kept for its backward
    for layer, prev in ((4, 3), (3, 2), (2, None)):
        mod = f"{2 * layer - 2}"
        if prev is not None:
            events += [("prefetch", f"{2 * prev - 2}.{w}")]
        events += [("grad", f"{mod}.{b}"), ("grad", f"{mod}.{w}"), ("release", f"{mod}.{w}")]
    events += [("grad", f"0.{b}"), ("grad", f"0.{w}")]
    return events


def test_seed_network_fetch_and_release_follow_the_seeds_pipeline(offload: OffloadDaemon) -> None:
    net = seed_net()
    opt = make_opt(offload, net)
    pager = tiermem.offload_params(net, opt, device_budget=16, prefetch=1)  # two layers' params
    x = torch.tensor([[1.5]])
    logs = []
    for _ in range(3):
        pager.events.clear()
        seed_loss(net, x).backward()
        logs.append(list(pager.events))
        opt.step()
        opt.zero_grad()
    first = logs[0]
    assert not [e for e in first if e[0] == "prefetch"]  # nothing recorded yet: every fetch waits
    backward = first[first.index(("release", "6.bias")) + 1 :]
    assert [n for ev, n in backward if ev == "fetch"] == ["6.weight", "4.weight", "2.weight"]
    assert logs[1] == _seed_pipeline()
    assert logs[2] == _seed_pipeline()
    assert pager.peak_nbytes <= 16
    assert pager.trace.missed == 0


def test_seed_network_trains_like_torch(offload: OffloadDaemon) -> None:
    net, ref = seed_net(), seed_net()
    opt = make_opt(offload, net)
    tiermem.offload_params(net, opt, device_budget=16, prefetch=1)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    x = torch.tensor([[1.5]])
    for _ in range(20):
        for model, o in ((net, opt), (ref, ref_opt)):
            seed_loss(model, x).backward()
            o.step()
            o.zero_grad()
    for (name, got), want in zip(net.state_dict().items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")


# ----------------------------------------------------------------------------- a transformer 4x the budget


def paging_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(PAGING_GPT)


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [corpus().batch(BATCH, PAGING_GPT.block_size, g) for _ in range(steps)]


def run(model: nn.Module, opt: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def assert_state_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("prefetch", [0, 2])
def test_gpt_four_times_the_budget_trains_bitwise_like_unpaged(offload: OffloadDaemon, prefetch: int) -> None:
    paged, plain = paging_gpt(), paging_gpt()
    budget = param_nbytes(paged) // 4
    opt = make_opt(offload, paged)
    pager = tiermem.offload_params(paged, opt, device_budget=budget, prefetch=prefetch)
    data = batches(4)
    assert run(paged, opt, data) == run(plain, make_opt(offload, plain), data)
    assert_state_equal(paged, plain)
    assert 0 < pager.peak_nbytes <= budget
    assert pager.peak_grad_nbytes <= budget
    if prefetch:
        assert pager.counters["prefetches"] > 0 and pager.trace.missed == 0


class Interrupted(BaseException):
    """What a Ctrl-C is to torch and the pager: a ``BaseException`` that is not an ``Exception`` (not
    ``KeyboardInterrupt`` itself, which would end the test session if it escaped)."""


class InterruptAtFetch:
    """A ``Probe`` that raises ``Interrupted`` at the ``nth`` fetch the trainer's thread submits once armed: a
    Ctrl-C landing in a forward, where torch's always-called post-hooks do not run (they run for an
    ``Exception``)."""

    def __init__(self, nth: int) -> None:
        self.left = nth
        self.armed = False

    def at(self, point: str, what: str) -> None:
        if point == "fetch" and self.armed:
            self.left -= 1
            if self.left == 0:
                raise Interrupted


@pytest.mark.parametrize("nth", [1, 3, 5])
def test_a_ctrl_c_in_a_forward_leaves_the_pager_to_save_and_train_on(offload: OffloadDaemon, nth: int) -> None:
    """Before: the interrupted forward's leases, the pager's torch-function mode and its saved-tensor hooks
    stayed in place, so the handler's ``model.state_dict()`` or the next forward failed ("device_budget ...
    cannot hold ... in use by")."""
    paged, plain = paging_gpt(), paging_gpt()
    budget = param_nbytes(paged) // 4
    opt = make_opt(offload, paged)
    probe = InterruptAtFetch(nth)
    pager = ParamPager(paged, opt, device_budget=budget, prefetch=0, probe=probe)
    plain_opt = make_opt(offload, plain)
    data = batches(3)
    run(paged, opt, data[:1])
    x, y = data[1]
    probe.armed = True
    with pytest.raises(Interrupted):
        paged(x, y).backward()  # interrupted: no step
    opt.zero_grad()
    saved = paged.state_dict()  # what a handler saves
    run(plain, plain_opt, data[:1])
    for name, value in plain.state_dict().items():
        assert torch.equal(saved[name], value), name
    assert run(paged, opt, data[1:]) == run(plain, plain_opt, data[1:])
    assert_state_equal(paged, plain)
    assert pager.nbytes <= budget


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvme_state_past_the_pool_budget_with_paged_params_equals_the_in_memory_run(dtype: torch.dtype) -> None:
    """bf16 on the NVMe tier keeps its params in bf16 apart from the fp32 master (what a fetch reads): the
    same values as the cpu tier's master cast, to the bit."""
    data = batches(3)
    results = []
    for tier, settings in (("nvme", {"jobs.max_pool": "320KiB"}), ("cpu", {})):
        with offload_daemon(settings={"jobs.max_jobs": 8, **settings}) as daemon:
            model = paging_gpt().to(dtype)
            state_nbytes = 16 * sum(p.numel() for p in model.parameters())  # master, moments, grad in fp32
            opt = make_opt(daemon, model, tier)
            if tier == "nvme":
                assert opt.placement_used.value == "nvme"
                assert state_nbytes >= 4 * 320 * 1024 * 0.7
                assert ("param" in opt.state_keys) == (dtype != torch.float32)
            pager = tiermem.offload_params(model, opt, device_budget=param_nbytes(model) // 4)
            results.append((run(model, opt, data), model.state_dict()))
            assert pager.peak_nbytes <= param_nbytes(model) // 4
    (nvme_losses, nvme_state), (cpu_losses, cpu_state) = results
    assert nvme_losses == cpu_losses
    for name, value in cpu_state.items():
        assert torch.equal(nvme_state[name], value), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_paged_nvme_step_moves_each_byte_of_the_layout_once(offload: OffloadDaemon, dtype: torch.dtype) -> None:
    """With a cache of 6 of the state's ~30 chunks: a fetch reads the params' working bytes only (2 a bf16
    param, not the 16 of master, moments and grad together), and a step reads the grads and the fp32 state
    once and writes them and the params once (consumed grads are not written back)."""
    model = paging_gpt().to(dtype)
    numel = sum(p.numel() for p in model.parameters())
    opt = make_opt(offload, model, "nvme")
    assert opt.placement_used.value == "nvme"
    tiermem.offload_params(model, opt, device_budget=param_nbytes(model) // 4)
    data = batches(3)
    run(model, opt, data[:2])  # the first step writes everything once; from the second on, steps are steady

    def disk() -> tuple[int, int]:
        nvme = opt.stats().rank.nvme
        assert nvme is not None
        return nvme.read_nbytes, nvme.written_nbytes

    working = numel * dtype.itemsize
    grads, state = 4 * numel, 12 * numel  # fp32 grads; fp32 master and moments
    pad = -(-numel // CHUNK_NUMEL) * 4096  # page rounding: at most a page per chunk and part
    read0, written0 = disk()
    with torch.no_grad():
        model(*data[2])  # fetches only
    read1, _ = disk()
    assert 0 < read1 - read0 <= working + pad
    run(model, opt, data[2:])
    read2, written2 = disk()
    assert state <= read2 - read1 <= 2 * working + grads + state + 3 * pad  # the state did not fit the cache
    params_out = working if dtype != torch.float32 else 0  # an fp32 model's params are its master
    # what the last update left dirty in the cache is written when evicted: in this window, the update
    # before it; at its end, some of its own chunks are still unwritten
    cached = 6 * CHUNK_NUMEL * (4 + 12 + 4)
    assert written2 - written0 <= grads + state + params_out + 3 * pad + cached


# ----------------------------------------------------------------------------- reuse, checkpointing, eval


class SharedBlockNet(nn.Module):
    """A block applied twice, an embedding tied to the output projection, and a param of the root itself."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.block = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU())
        self.scale = nn.Parameter(torch.full((16,), 0.5))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.block(x)
        x = x + self.block(x) * self.scale
        logits = F.linear(x, self.emb.weight)
        return F.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))


def shared_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)) for _ in range(steps)
    ]


def test_tied_weights_shared_block_and_root_param_train_like_unpaged(offload: OffloadDaemon) -> None:
    torch.manual_seed(0)
    paged = SharedBlockNet()
    plain = copy.deepcopy(paged)
    opt = make_opt(offload, paged)
    budget = param_nbytes(paged) - 128  # all but the LayerNorm: the embedding is held through backward
    pager = tiermem.offload_params(paged, opt, device_budget=budget, prefetch=1)
    data = shared_batches(4)
    assert run(paged, opt, data) == run(plain, make_opt(offload, plain), data)
    assert_state_equal(paged, plain)
    assert pager.peak_nbytes <= budget < param_nbytes(plain)


class CheckpointedGPT(GPT):
    """The demo GPT with each block under ``torch.utils.checkpoint``."""

    reentrant = False

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        _, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        assert targets is not None
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class _LaggingLinear(nn.Linear):
    """A Linear whose kernels run late: the compute stream spins first, so the forward hook that releases its
    params returns while the matmul that reads them is still queued."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(20_000_000)  # about 10 ms of GPU cycles
        return super().forward(x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_reused_buffer_is_not_overwritten_while_queued_kernels_read_it(offload: OffloadDaemon) -> None:
    """On a GPU the pager releases a layer's params when its forward hook returns, while the layer's kernels
    may still be queued; a prefetch then reuses the buffer on the copy stream.  It must wait for the compute
    stream (``ParamCopies.mark``), or a lagging matmul reads the next layer's weights: the paged run must
    equal the unpaged one bitwise."""
    torch.manual_seed(0)
    layers = [_LaggingLinear(1024, 1024) for _ in range(6)]
    paged = nn.Sequential(*layers).cuda()
    plain = copy.deepcopy(paged)
    opt = offload.make(paged.parameters(), offload="cpu", exchange="staged", **HYPER)
    plain_opt = offload.make(plain.parameters(), offload="cpu", exchange="staged", **HYPER)
    tiermem.offload_params(paged, opt, device_budget=3 * param_nbytes(layers[0]), prefetch=2)
    x = torch.randn(4096, 1024, device="cuda")
    for _ in range(3):
        for model, o in ((paged, opt), (plain, plain_opt)):
            model(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    with torch.no_grad():
        assert torch.equal(paged(x), plain(x))


def test_a_backward_through_frozen_layers_stays_within_the_budget_and_trains_bitwise_unpaged(
    offload: OffloadDaemon,
) -> None:
    """Bias-only fine-tuning (frozen weights in every layer, as LoRA's frozen base): backward runs through every
    frozen weight.  Each was held until backward ended, as a trained param is until its grad lands, but no
    grad ever came: a budget of a quarter of the model failed (``device_budget 58.2KiB cannot hold
    blocks.3.fc.weight``).  Freezing part of the model between steps failed the same way.  Both now train
    bitwise like the unpaged model within the budget."""
    paged, plain = paging_gpt(0), paging_gpt(0)
    for m in (paged, plain):
        for name, p in m.named_parameters():
            p.requires_grad_(not name.endswith("weight"))
    opt, plain_opt = make_opt(offload, paged), make_opt(offload, plain)
    budget = param_nbytes(paged) // 4
    pager = tiermem.offload_params(paged, opt, device_budget=budget)
    data = batches(6)
    for i, batch in enumerate(data):
        if i == 3:  # the other way round, between steps: train the weights of the first blocks, freeze the rest
            for m in (paged, plain):
                m.requires_grad_(False)
                m.blocks[0].requires_grad_(True)
                m.blocks[1].requires_grad_(True)
        run(paged, opt, [batch])
        run(plain, plain_opt, [batch])
    for name, value in plain.state_dict().items():
        assert torch.equal(paged.state_dict()[name], value), name
    assert pager.peak_nbytes <= budget


def test_one_loss_over_two_forwards_trains_bitwise_unpaged_within_a_third_of_the_model(offload: OffloadDaemon) -> None:
    """``(model(a) + model(b)).backward()`` (a contrastive or consistency loss, two views of a batch): a trained
    param's grad lands once, after both forwards' nodes used it, and a param was held from its first use in
    backward until then, so every shared param stayed (``device_budget 77.6KiB cannot hold
    blocks.3.qkv.weight``).  A hold whose node is done is given up when room is needed (the param is fetched
    again for the other forward's node); a buffer a running node still views is never reused."""
    paged, plain = paging_gpt(0), paging_gpt(0)
    opt, plain_opt = make_opt(offload, paged), make_opt(offload, plain)
    budget = param_nbytes(paged) // 3
    pager = tiermem.offload_params(paged, opt, device_budget=budget)
    for x, y in batches(3):
        for model, o in ((paged, opt), (plain, plain_opt)):
            (model(x, y) + model(x.flip(0), y.flip(0))).backward()
            o.step()
            o.zero_grad()
    for name, value in plain.state_dict().items():
        assert torch.equal(paged.state_dict()[name], value), name
    assert pager.peak_nbytes <= budget


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_refetches_during_recomputation(offload: OffloadDaemon, reentrant: bool) -> None:
    torch.manual_seed(0)
    paged = CheckpointedGPT(PAGING_GPT)
    paged.reentrant = reentrant
    plain = copy.deepcopy(paged)
    # a recomputed block keeps all its params until their grads land (the checkpoint holds its recomputed
    # tensors), next to the tied embedding, held through backward: half the model here
    budget = param_nbytes(paged) // 2
    opt = make_opt(offload, paged)
    pager = tiermem.offload_params(paged, opt, device_budget=budget, prefetch=2)
    data = batches(3)
    pager.events.clear()
    plain_opt = make_opt(offload, plain)
    assert run(paged, opt, data[:1]) == run(plain, plain_opt, data[:1])
    fetched = [n for ev, n in pager.events if ev in ("fetch", "prefetch")]
    # forward, then the recomputation in backward: every block's qkv weight comes twice
    assert all(fetched.count(f"blocks.{i}.qkv.weight") >= 2 for i in range(PAGING_GPT.n_layer))
    assert run(paged, opt, data[1:]) == run(plain, plain_opt, data[1:])
    assert_state_equal(paged, plain)
    assert pager.peak_nbytes <= budget


def test_a_compiled_paged_model_trains_like_the_eager_unpaged_one(offload: OffloadDaemon) -> None:
    """``torch.compile`` of a paged model: dynamo traced into the pager's hooks, compiled a graph around a
    placeholder param (``expected size 16==16, stride 0==8``) and left the pager broken (``param is fetching
    without a fetch`` at close).  The hooks now run as Python, between the compiled pieces of each submodule,
    and the tied embedding's use outside its module is still caught.  Inductor's kernels round differently
    from eager ones: close, not bitwise."""
    paged, plain = paging_gpt(), paging_gpt()
    budget = param_nbytes(paged) // 2
    opt = make_opt(offload, paged)
    pager = tiermem.offload_params(paged, opt, device_budget=budget, prefetch=1)
    data = batches(3)
    compiled = torch.compile(paged)
    losses = run(compiled, opt, data)
    reference = run(plain, make_opt(offload, plain), data)
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(paged.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert pager.peak_nbytes <= budget
    opt.close()  # the pager is whole: every param back in the daemon


def test_evaluation_under_inference_mode_between_steps_leaves_training_bitwise_unpaged(offload: OffloadDaemon) -> None:
    """An evaluation under ``torch.inference_mode()`` (HF's and Lightning's validation loops) before each step,
    the first included: its fetches made inference tensors, which the I/O thread then could not write
    (``Inplace update to inference tensor outside InferenceMode``), leaving the pager broken."""
    paged, plain = paging_gpt(), paging_gpt()
    opt = make_opt(offload, paged)
    tiermem.offload_params(paged, opt, device_budget=param_nbytes(paged) // 4, prefetch=2)
    plain_opt = make_opt(offload, plain)
    for x, y in batches(3):
        for model, o in ((paged, opt), (plain, plain_opt)):
            model.eval()
            with torch.inference_mode():
                evaluated = model(x, y)
            model.train()
            loss = model(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
            assert evaluated == loss
    assert_state_equal(paged, plain)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_function_over_submodules_called_without_their_parent_trains_like_unpaged(
    offload: OffloadDaemon, reentrant: bool
) -> None:
    """A loss computed from submodules directly (a LightningModule's ``training_step`` calling ``self.net``
    parts; the paged root's own forward never runs), with a checkpointed function over two of them: the first
    submodule's forward opened the pager's saved-tensor hooks over the checkpoint's, which then saw fewer saved
    tensors in the forward than in its recompute and refused (``Recomputed values for the following tensors
    have different metadata``)."""
    torch.manual_seed(0)
    paged = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4))
    plain = copy.deepcopy(paged)

    def loss_of(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: torch.tanh(m[1](torch.tanh(m[0](t)))), x, use_reentrant=reentrant)
        return m[2](h).square().mean()

    opt = make_opt(offload, paged)
    tiermem.offload_params(paged, opt, device_budget=param_nbytes(paged), prefetch=1)  # a segment held whole
    plain_opt = make_opt(offload, plain)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step), requires_grad=reentrant)
        for m, o in ((paged, opt), (plain, plain_opt)):
            loss_of(m, x).backward()
            o.step()
            o.zero_grad()
    assert_state_equal(paged, plain)


def test_eval_under_no_grad_pages_and_matches_unpaged(offload: OffloadDaemon) -> None:
    paged, plain = paging_gpt(), paging_gpt()
    budget = param_nbytes(paged) // 4
    opt = make_opt(offload, paged)
    pager = tiermem.offload_params(paged, opt, device_budget=budget)
    paged.eval()
    plain.eval()
    x, _ = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(paged(x), plain(x))
        assert torch.equal(paged(x), plain(x))
    assert pager.peak_nbytes <= budget
    assert pager.nbytes <= budget
    assert all(p.grad is None for p in paged.parameters())


# ----------------------------------------------------------------------------- state dicts, meta init


def test_state_dict_round_trip_through_torch_save(offload: OffloadDaemon) -> None:
    trained, plain = paging_gpt(0), paging_gpt(0)
    opt = make_opt(offload, trained)
    tiermem.offload_params(trained, opt, device_budget=param_nbytes(trained) // 4)
    run(trained, opt, batches(2))
    saved = trained.state_dict()
    assert list(saved) == list(plain.state_dict())  # torch's keys
    assert all(saved[k].shape == v.shape for k, v in plain.state_dict().items())
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    restored = torch.load(buf)
    other = paging_gpt(5)
    other_opt = make_opt(offload, other)
    pager = tiermem.offload_params(other, other_opt, device_budget=param_nbytes(other) // 4)
    other.load_state_dict(restored)
    for name, value in other.state_dict().items():
        assert torch.equal(value, saved[name]), name
    plain.load_state_dict(restored)
    x, _ = batches(1, seed=7)[0]
    with torch.no_grad():
        assert torch.equal(other(x), plain(x))
    assert pager.peak_nbytes <= param_nbytes(other) // 4
    with pytest.raises(RuntimeError, match="size mismatch"):
        other.load_state_dict({**restored, "ln_f.weight": torch.ones(3)})


def test_a_bf16_models_own_state_dict_loaded_back_changes_nothing(offload: OffloadDaemon) -> None:
    """The pager wrote each loaded param whole as its master, dropping its fp32 bits below bf16; a master element
    that rounds to the loaded value is kept now, so a reload of what the model holds changes nothing."""
    runs = []
    for reload in (False, True):
        model = paging_gpt(0).to(torch.bfloat16)
        opt = make_opt(offload, model)
        tiermem.offload_params(model, opt, device_budget=param_nbytes(model) // 4)
        run(model, opt, batches(2))
        if reload:
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
        run(model, opt, batches(2, seed=3))
        runs.append(model.state_dict())
    for name, value in runs[0].items():
        assert torch.equal(runs[1][name], value), name


def test_copying_or_pickling_a_paged_model_is_refused_naming_what_to_copy_and_training_goes_on(
    offload: OffloadDaemon,
) -> None:
    """``copy.deepcopy(model)`` (an EMA copy) and ``torch.save(model)`` failed on a paged model with errors that
    blamed the optimizer or pickle's internals; the copy would hold placeholders and the original's forward.
    Refused, they leave training bitwise the unpaged run's."""
    paged, plain = paging_gpt(0), paging_gpt(0)
    opt = make_opt(offload, paged)
    tiermem.offload_params(paged, opt, device_budget=param_nbytes(paged) // 4)
    plain_opt = make_opt(offload, plain)
    run(paged, opt, batches(1))
    run(plain, plain_opt, batches(1))
    wanted = r"params are paged by offload_params.*placeholders.*model\.state_dict\(\) gathers them"
    with pytest.raises(TypeError, match=wanted):
        copy.deepcopy(paged)
    with pytest.raises(TypeError, match=wanted):
        torch.save(paged, io.BytesIO())
    run(paged, opt, batches(2, seed=3))
    run(plain, plain_opt, batches(2, seed=3))
    for name, value in plain.state_dict().items():
        assert torch.equal(paged.state_dict()[name], value), name


EDITS = {
    "init-in-place": (lambda m: nn.init.zeros_(m.get_parameter("blocks.1.ln_1.bias")), "written in place"),
    "new-data": (lambda m: setattr(m.get_parameter("blocks.2.fc.weight"), "data", torch.zeros(128, 32)), "given new"),
    "half": (lambda m: m.half(), "converted to torch.float16"),
}


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("then", ["forward", "state_dict"])
def test_a_paged_out_param_edited_outside_a_forward_is_refused_at_its_next_use_and_nothing_is_lost(
    offload: OffloadDaemon, edit: str, then: str
) -> None:
    """``nn.init.zeros_`` on a paged-out param wrote its placeholder, so the edit was silently dropped and the
    param no longer read NaN; ``p.data = t`` and ``model.half()`` failed later with torch's errors.  The
    next use (a forward's fetch, or ``state_dict()``) now refuses it, naming the param, what happened and
    the way that works; the placeholders are put back, so training goes on bitwise the unpaged run's."""
    paged, plain = paging_gpt(0), paging_gpt(0)
    opt, plain_opt = make_opt(offload, paged), make_opt(offload, plain)
    tiermem.offload_params(paged, opt, device_budget=param_nbytes(paged) // 4)
    run(paged, opt, batches(1))
    run(plain, plain_opt, batches(1))
    change, what = EDITS[edit]
    change(paged)
    x, y = batches(1, seed=3)[0]
    with pytest.raises(InvalidState, match=rf"param '.*' \(.*\) was {what} .*while paged out.*load_state_dict\(\)"):
        paged(x, y) if then == "forward" else paged.state_dict()
    assert all(p.dtype == torch.float32 for p in paged.parameters())
    run(paged, opt, batches(2, seed=5))
    run(plain, plain_opt, batches(2, seed=5))
    for name, value in plain.state_dict().items():
        assert torch.equal(paged.state_dict()[name], value), name
    with torch.no_grad():
        assert all(torch.isnan(p).all() for p in paged.parameters())  # placeholders again, between forwards


def test_a_move_to_the_device_named_otherwise_copies_the_placeholders_and_changes_nothing(
    offload: OffloadDaemon,
) -> None:
    """``model.to(torch.device("cpu:0"))`` (HF Trainer's and accelerate's move at several CPU ranks) copies
    every CPU tensor, placeholders included, into new data of the same shape, dtype and device.  The next use
    refused that as an edit (``p.data = t``); now a copy that is all NaN, as the placeholder is, is taken as
    no change: the placeholder is put back (the copy's memory freed) and training goes on bitwise."""
    paged, plain = paging_gpt(0), paging_gpt(0)
    opt, plain_opt = make_opt(offload, paged), make_opt(offload, plain)
    tiermem.offload_params(paged, opt, device_budget=param_nbytes(paged) // 4)
    run(paged, opt, batches(1))
    run(plain, plain_opt, batches(1))
    paged.to(torch.device("cpu:0"))
    assert all(p.stride() != (0,) * p.dim() for p in paged.parameters())  # whole copies now
    run(paged, opt, batches(2, seed=5))
    run(plain, plain_opt, batches(2, seed=5))
    for name, value in plain.state_dict().items():
        assert torch.equal(paged.state_dict()[name], value), name
    assert all(p.stride() == (0,) * p.dim() for p in paged.parameters())  # placeholders again
    opt.close()
    plain_opt.close()


def test_a_model_made_on_the_meta_device_is_initialized_into_the_daemon(offload: OffloadDaemon) -> None:
    with torch.device("meta"):
        model = GPT(PAGING_GPT)
    opt = make_opt(offload, model)
    budget = param_nbytes(model) // 4
    torch.manual_seed(0)
    pager = tiermem.offload_params(model, opt, device_budget=budget, init=GPT._init)
    assert all(p.device.type == "cpu" for p in model.parameters())
    state = model.state_dict()
    assert torch.equal(state["ln_f.weight"], torch.ones(PAGING_GPT.n_embd))
    assert torch.equal(state["blocks.0.qkv.bias"], torch.zeros(3 * PAGING_GPT.n_embd))
    assert 0.015 < float(state["blocks.0.fc.weight"].std()) < 0.025  # GPT._init: normal(0, 0.02)
    losses = run(model, opt, batches(3))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert pager.peak_nbytes <= budget


def test_meta_params_without_an_initializer_are_refused(offload: OffloadDaemon) -> None:
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(4))

    with torch.device("meta"):
        model = Bare()
    opt = make_opt(offload, model)
    with pytest.raises(InvalidArgument, match="no reset_parameters"):
        tiermem.offload_params(model, opt, device_budget="1KiB")


def test_a_meta_model_with_meta_buffers_is_refused_naming_them(offload: OffloadDaemon) -> None:
    """Only params are initialized: a buffer left on the meta device failed the first forward."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = make_opt(offload, model)
    with pytest.raises(InvalidArgument, match=r"buffer\(s\) \['1\.running_mean', .*offload_params initializes only"):
        tiermem.offload_params(model, opt, device_budget="1KiB")


def test_meta_params_without_the_staged_exchange_are_refused_at_construction(offload: OffloadDaemon) -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(InvalidArgument, match=r"2 of 2 params .* meta device.*offload_params"):
        offload.make(model.parameters(), offload="cpu", **HYPER)


def test_meta_params_never_paged_are_refused_at_step_by_name(offload: OffloadDaemon) -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    opt = make_opt(offload, model)
    with pytest.raises(InvalidState, match=r"param 0 .* meta device at step\(\).*offload_params"):
        opt.step()


# ----------------------------------------------------------------------------- bad input


def test_bad_arguments_are_refused_by_name(offload: OffloadDaemon) -> None:
    net = seed_net()
    with pytest.raises(InvalidArgument, match="exchange='staged'"):
        tiermem.offload_params(net, offload.make(net.parameters(), exchange="shared"), device_budget=16)
    net = seed_net()
    opt = make_opt(offload, net)
    with pytest.raises(InvalidArgument, match="smaller than the params of one submodule"):
        tiermem.offload_params(net, opt, device_budget=4)
    with pytest.raises(InvalidArgument, match="device_budget"):
        tiermem.offload_params(net, opt, device_budget="lots")
    with pytest.raises(InvalidArgument, match="prefetch"):
        tiermem.offload_params(net, opt, device_budget=16, prefetch=-1)
    bigger = nn.Sequential(net, nn.Linear(1, 1))
    with pytest.raises(InvalidArgument, match="not in the optimizer"):
        tiermem.offload_params(bigger, opt, device_budget=16)
    tiermem.offload_params(net, opt, device_budget=16)
    with pytest.raises(InvalidState, match="already paged"):
        tiermem.offload_params(net, opt, device_budget=16)


def test_a_use_past_the_budget_is_refused_naming_what_is_held(offload: OffloadDaemon) -> None:
    class Outer(nn.Module):
        """Owns ``w`` and, while it runs, also uses another module's weight."""

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(8, 8))
            self.inner = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(F.linear(x, self.w), self.inner.weight)

    model = Outer()
    opt = make_opt(offload, model)
    pager = tiermem.offload_params(model, opt, device_budget=300)  # one unit (at most 288 bytes), not two
    with (
        torch.no_grad(),
        pytest.raises(
            InvalidState,
            match=r"device_budget 300B cannot hold inner.weight \(256B\) as well: 256B are in use by 1 params \(w\)",
        ),
    ):
        model(torch.ones(2, 8))
    assert pager.peak_nbytes <= 300


# ----------------------------------------------------------------------------- the trainer's memory

_RSS_CHILD = """
import json, sys
import torch
from torch import nn
from offload_helpers import offload_daemon
import tiermem

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

layers, width, budget = 24, 1024, 8 << 20
with offload_daemon(settings={"adam.chunk_numel": 1 << 20}, pool_size=500 << 20) as daemon:
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(0))
    warm = nn.Linear(width, width)  # torch's own first-use allocations are not the model's
    warm(x).square().mean().backward()
    del warm
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    opt = daemon.make(model.parameters(), offload="cpu", exchange="staged", window_nbytes=1 << 20, lr=1e-2)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set (VmHWM) to the current one
    before = rss("VmRSS")
    pager = tiermem.offload_params(model, opt, device_budget=budget, prefetch=1)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    print(json.dumps({
        "growth": rss("VmHWM") - before,
        "model_nbytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "budget": budget,
        "peak_nbytes": pager.peak_nbytes,
        "peak_grad_nbytes": pager.peak_grad_nbytes,
    }))
"""


@pytest.mark.alone
def test_the_trainers_memory_grows_by_the_budget_not_by_the_model() -> None:
    """24 layers of 4 MiB (96 MiB of params) made on the meta device and paged through an 8 MiB budget, in a
    fresh process (its allocator not shaped by earlier tests): from the optimizer's construction on, the
    peak resident memory grows by a few times the budget (params, grads waiting for the I/O thread, what
    the C allocator keeps of freed grads), far less than the model."""
    done = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["peak_nbytes"] <= figures["budget"] and figures["peak_grad_nbytes"] <= figures["budget"]
    assert figures["growth"] < figures["model_nbytes"] // 2, figures


def test_a_window_too_small_for_a_submodule_is_named_with_the_knob(
    offload: OffloadDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    """A fetch costs a request per window slot: a window smaller than two slots of the largest submodule's
    params (as staged) is said at ``offload_params``, with the size to pass."""
    model = paging_gpt()
    with caplog.at_level(logging.WARNING, logger="tiermem.client.offload.paging"):
        tiermem.offload_params(model, make_opt(offload, model), device_budget=param_nbytes(model))
    assert "the staging window (4KiB) is smaller" in caplog.text and "window_nbytes=1048576" in caplog.text
    caplog.clear()
    roomy = paging_gpt()
    opt = offload.make(roomy.parameters(), offload="cpu", exchange="staged", window_nbytes=1 << 20, **HYPER)
    with caplog.at_level(logging.WARNING, logger="tiermem.client.offload.paging"):
        tiermem.offload_params(roomy, opt, device_budget=param_nbytes(roomy))
    assert "staging window" not in caplog.text


def wide_mlp(seed: int = 0) -> nn.Sequential:
    """Two Linear(512, 512) without bias: 1 MiB of fp32 params each, so two slots of one want a 2 MiB window."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(512, 512, bias=False), nn.Tanh(), nn.Linear(512, 512, bias=False))


def train_wide(model: nn.Module, opt: Any, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        model(torch.randn(4, 512, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_window_left_to_the_daemon_grows_for_the_largest_submodule(caplog: pytest.LogCaptureFixture) -> None:
    """``offload_params`` re-registers an optimizer that has not stepped with a window of two slots of the
    largest submodule's fp32 params; the training is bitwise that of a window chosen so by hand, and a
    fetch of that submodule is one request."""
    with offload_daemon(settings={"jobs.window_size": 64 << 10}) as daemon:
        grown_model, chosen_model = wide_mlp(), wide_mlp()
        grown = daemon.make(grown_model.parameters(), offload="cpu", exchange="staged", **HYPER)
        assert grown.client.window.numel() == 64 << 10
        with caplog.at_level(logging.INFO, logger="tiermem.client.offload.paging"):
            pager = tiermem.offload_params(grown_model, grown, device_budget="2MiB")
        assert grown.client.window.numel() == 2 << 20
        assert "staging window grown from 64KiB to 2MiB" in caplog.text
        assert "smaller than two slots" not in caplog.text
        chosen = daemon.make(
            chosen_model.parameters(), offload="cpu", exchange="staged", window_nbytes=2 << 20, **HYPER
        )
        tiermem.offload_params(chosen_model, chosen, device_budget="2MiB")
        train_wide(grown_model, grown)
        train_wide(chosen_model, chosen)
        for a, b in zip(grown.state_dict()["state"].values(), chosen.state_dict()["state"].values(), strict=True):
            assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
        before = pager.transfer.requests
        grown_model(torch.zeros(1, 512))  # each Linear fetched, in one request each
        assert pager.transfer.requests - before == 2


def test_a_window_the_daemon_refuses_to_grow_stays_and_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """Where the daemon refuses the larger window (here ``jobs.max_window``), the old one comes back (the job
    trains as before) and the warning names the size to pass."""
    settings = {"jobs.window_size": 64 << 10, "jobs.max_window": 1 << 20}
    with offload_daemon(settings=settings) as daemon:
        model, ref = wide_mlp(), wide_mlp()
        opt = daemon.make(model.parameters(), offload="cpu", exchange="staged", **HYPER)
        with caplog.at_level(logging.WARNING):
            tiermem.offload_params(model, opt, device_budget="2MiB")
        assert opt.client.window.numel() == 64 << 10
        assert "staging window was refused" in caplog.text and "window_nbytes=2097152" in caplog.text
        ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
        train_wide(model, opt)
        train_wide(ref, ref_opt)
        state = opt.state_dict()["state"]
        ref_state = ref_opt.state_dict()["state"]
        for i in ref_state:
            assert torch.equal(state[i]["exp_avg"], ref_state[i]["exp_avg"])


def test_paged_jobs_take_at_most_half_of_the_free_window_budget(caplog: pytest.LogCaptureFixture) -> None:
    """So that jobs attaching later still find a window: with a 5 MiB budget the first paged job grows to
    2 MiB (half of what is free, its own window counted), the second to 1 MiB, and says the budget held it."""
    settings = {"jobs.window_size": 64 << 10, "jobs.window_budget": 5 << 20}
    with offload_daemon(settings=settings) as daemon:
        first, second = wide_mlp(), wide_mlp()
        opt1 = daemon.make(first.parameters(), offload="cpu", exchange="staged", **HYPER)
        opt2 = daemon.make(second.parameters(), offload="cpu", exchange="staged", **HYPER)
        tiermem.offload_params(first, opt1, device_budget="2MiB")
        assert opt1.client.window.numel() == 2 << 20
        with caplog.at_level(logging.WARNING):
            tiermem.offload_params(second, opt2, device_budget="2MiB")
        assert opt2.client.window.numel() == 1 << 20
        assert "a paged job takes at most half of the daemon's free window budget" in caplog.text
        third = daemon.make(wide_mlp().parameters(), offload="cpu", exchange="staged", **HYPER)
        assert third.client.window.numel() == 64 << 10  # a later job still attaches


def test_a_window_grows_only_before_the_first_step_and_where_left_to_the_daemon(offload: OffloadDaemon) -> None:
    model = wide_mlp()
    opt = offload.make(model.parameters(), offload="cpu", exchange="staged", window_nbytes=64 << 10, **HYPER)
    assert opt.grow_window(2 << 20) is False and opt.client.window.numel() == 64 << 10
    other = wide_mlp()
    stepped = offload.make(other.parameters(), offload="cpu", exchange="staged", **HYPER)
    train_wide(other, stepped, steps=1)
    window = stepped.client.window.numel()
    assert stepped.grow_window(window * 4) is False and stepped.client.window.numel() == window
    # a resumed optimizer (state loaded, no step of its own yet) keeps its registration and its state
    resumed_model = wide_mlp()
    resumed = offload.make(resumed_model.parameters(), offload="cpu", exchange="staged", **HYPER)
    resumed.load_state_dict(stepped.state_dict())
    assert resumed.grow_window(window * 4) is False and resumed.client.window.numel() == window
    for a, b in zip(resumed.state_dict()["state"].values(), stepped.state_dict()["state"].values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"])


def test_a_model_made_on_the_meta_device_trains_the_same_in_a_grown_window() -> None:
    """The growth re-registers params that have no values yet; ``init`` then gives them theirs."""
    finals = []
    for window in (None, 2 << 20):
        with offload_daemon(settings={"jobs.window_size": 64 << 10}) as daemon:
            with torch.device("meta"):
                model = wide_mlp()
            extra = {} if window is None else {"window_nbytes": window}
            opt = daemon.make(model.parameters(), offload="cpu", exchange="staged", **extra, **HYPER)

            def init(m: nn.Module) -> None:
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02, generator=torch.Generator().manual_seed(7))

            tiermem.offload_params(model, opt, device_budget="2MiB", init=init)
            assert opt.client.window.numel() == 2 << 20
            train_wide(model, opt)
            finals.append([v["exp_avg_sq"] for v in opt.state_dict()["state"].values()])
    for a, b in zip(*finals, strict=True):
        assert torch.equal(a, b)

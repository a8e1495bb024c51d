"""Training step time of the demo GPT: in-process torch AdamW against ``OffloadAdam`` over tiermemd.

Modes, each on its own copy of the model (same initial values, same
batches), in one process, interleaved in turns of ``--block-steps`` steps so
that all see the same machine (``--sequential``: one after another, one model
in memory at a time, for the largest sizes):

- ``torch``: ``torch.optim.AdamW(fused=True)`` in process (the baseline);
- ``cpu``: ``OffloadAdam(offload="cpu")``, state in the daemon's pool;
- ``nvme``: ``OffloadAdam(offload="nvme")``, state paged through the daemon's
  6-chunk cache (it pages only when the state is larger than the cache:
  6 x ``adam.chunk_numel`` x 12 bytes, 288 MiB with the default chunk);
- ``overlap``: ``OffloadAdam(offload="cpu", overlap_update=True)``, each
  bucket updated as soon as backward produces it;
- ``dpu``: ``OffloadAdam(offload="cpu", delayed_update=True)``, the update of
  step t running during the forward and backward of step t+1;
- ``none``: forward and backward only, no update (``zero_grad``): the
  trainer's own compute, the floor every other mode stands on.

The daemon is a private ``tiermemd`` child (what ``tiermem.client.link.connect``
starts), one per run, with a pool sized for the largest model (per mode and
param: 8 bytes of state for fp32 params on the CPU tier, which are their own
master, 12 with the delayed update; the model's params and grads live in the
shared storage, outside the pool); each mode detaches (frees its state) when
its size is done.

Per step, medians over the steps after ``--warmup``:

- ``step``: forward + backward + ``optimizer.step()`` + ``zero_grad``;
- ``fwd+bwd``: forward and backward (for OffloadAdam this includes the
  post-accumulate-grad hooks that move fresh grads into the shared storage);
- ``opt.step``: the ``step()`` call;
- ``grad copy``: time inside ``OffloadAdam``'s one copy (``SharedFeed._copy_in``:
  a fresh grad into the shared grad buffer), measured by wrapping it on the
  optimizer's feed from here; ``param copy`` is always empty now: the daemon
  updates the params in the shared storage in place;
- ``wait``: time blocked on the daemon: the STEP round trip (sync modes; it
  includes the update) plus FETCH_PARAMS (DPU: waiting for the in-flight update);
- ``d.update`` / ``d.stats`` / ``d.wait``: the daemon's own figures per step
  (``rank_update_s``, ``rank_stats_s``, ``rank_wait_s`` deltas); ``pg out``:
  NVMe chunk page-outs per step, ``nvme wait``: ``rank_nvme_wait_s`` per step.

Goals: ``cpu`` step <= 1.05x ``torch``; ``dpu`` step approaching
max(fwd+bwd, update), shown as ``dpu/bound`` (bound = max(torch fwd+bwd,
the ``cpu`` mode's daemon update per step: the daemon's ``rank_update_s``
counts synchronous updates only, so the ``dpu`` row shows none)).  Without a
GPU, forward and backward run on the same cores as the daemon's Adam, so DPU
overlaps two CPU loads and cannot reach the bound on a 2-core machine.

    .venv/bin/python benchmarks/bench_train_step.py [--sizes 10M,50M] [--steps 8] [--warmup 3] [--json out.json]

Larger models: ``--sizes 100M,200M`` interleaved; ``--sizes 500M --sequential``
keeps one model in memory at a time (per param: 8 bytes of model and grads, 8
more of AdamW state in the ``torch`` mode, 24 in the daemon's pool: about
20 GiB at 500M with one mode at a time, so on a 24 GiB machine leave out ``torch`` or ``dpu`` with
``--modes``).  ``--threads 1`` leaves a core to the daemon, as a GPU would.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tiermem.client.connection import Connection
from tiermem.client.demo.model import GPT, GPTConfig
from tiermem.client.link import Client, EmbeddedDaemon, connect
from tiermem.client.offload import OffloadAdam
from tiermem.client.offload.stats import OptimizerStats
from tiermem.core.config import AdamConfig
from tiermem.core.units import GiB, MiB, align_up, format_size, parse_size

MODES = ("torch", "cpu", "overlap", "nvme", "dpu", "none")


def daemon_figures(stats: OptimizerStats) -> dict[str, float]:
    """The daemon's counters of the rank that the step breakdown reports (their deltas per step)."""
    r, nvme = stats.rank, stats.rank.nvme
    return {
        "rank_update_s": r.update_s,
        "rank_stats_s": r.grad_stats_s,
        "rank_wait_s": r.wait_s,
        "rank_nvme_wait_s": nvme.stall_s if nvme is not None else 0.0,
        "rank_nvme_page_outs": float(nvme.page_outs) if nvme is not None else 0.0,
    }


class PhaseTimer:
    """Wraps methods of one object to add their wall time to named phases."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def wrap(self, obj: Any, method: str, phase: str) -> None:
        inner = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - t0

        setattr(obj, method, timed)

    def take(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


@contextlib.contextmanager
def private_daemon(pool_size: int, compile_adam: bool) -> Iterator[Client]:
    daemon = EmbeddedDaemon(pool_size=pool_size, settings={"adam.compile": compile_adam, "swap.fsync": False})
    try:
        client = Client(Connection.open(daemon.socket), socket_path=daemon.socket, daemon=daemon)
    except BaseException:
        daemon.stop()
        raise
    with client:
        yield client


class NoUpdate:
    """Mode ``none``: ``step()`` does nothing, ``zero_grad`` drops the grads."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)


def make_optimizer(mode: str, model: torch.nn.Module, socket_path: str, lr: float) -> Any:
    if mode == "none":
        return NoUpdate(model)
    if mode == "torch":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=True)
    return OffloadAdam(
        model.parameters(),
        lr=lr,
        weight_decay=0.1,
        client=connect(socket_path),
        offload="nvme" if mode == "nvme" else "cpu",
        delayed_update=mode == "dpu",
        overlap_update=mode == "overlap",
        warmup_steps=1,
    )


class Runner:
    """One mode: its own copy of the model, its optimizer, and the per-step figures it recorded."""

    def __init__(
        self,
        mode: str,
        cfg: GPTConfig,
        init: dict[str, torch.Tensor],
        socket_path: str,
        make_model: Callable[[], torch.nn.Module] | None = None,
    ) -> None:
        self.mode = mode
        self.model = make_model() if make_model is not None else GPT(cfg)
        self.model.load_state_dict(init)
        self.opt = make_optimizer(mode, self.model, socket_path, lr=1e-4)
        self.timer = PhaseTimer()
        self.rows: list[dict[str, float]] = []
        self.offload = isinstance(self.opt, OffloadAdam)
        self.before: dict[str, float] = {}
        if isinstance(self.opt, OffloadAdam):
            self.before = daemon_figures(
                self.opt.stats()
            )  # connects and registers: the client exists and can be wrapped
            self.timer.wrap(self.opt.feed, "_copy_in", "grad_copy")
            self.timer.wrap(self.opt.client, "step", "wait")
            self.timer.wrap(self.opt.client, "fetch_params", "wait")

    def run(self, batches: list[Any], *, record_from: int) -> None:
        """Train on ``batches``; keep the figures of steps ``record_from`` on.  A delayed update still in
        flight at the end is waited for (outside the figures), so it never runs during another mode's steps."""
        opt = self.opt
        for i, (x, y) in enumerate(batches):
            t0 = time.perf_counter()
            loss = self.model(x, y)
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            row = {"step_s": t3 - t0, "fwd_bwd_s": t1 - t0, "opt_step_s": t2 - t1, "loss": float(loss.detach())}
            row.update({f"{k}_s": v for k, v in self.timer.take().items()})
            if isinstance(opt, OffloadAdam):
                after = daemon_figures(opt.stats())
                row.update({f"d_{k}": v - self.before.get(k, 0.0) for k, v in after.items()})
                self.before = after
            if i >= record_from:
                self.rows.append(row)
        if isinstance(opt, OffloadAdam):
            opt.flush()
            self.timer.take()
            self.before = daemon_figures(opt.stats())

    def median(self) -> dict[str, float]:
        """Medians of the recorded steps' figures, and ``mean_step_s`` / ``mean_fwd_bwd_s``: the means (a
        step time with two modes, as beside another OpenMP job, has a median that follows whichever mode
        most steps fell in; the mean is the throughput)."""
        keys = sorted({k for r in self.rows for k in r})
        out = {k: statistics.median(r.get(k, 0.0) for r in self.rows) for k in keys}
        for k in ("step_s", "fwd_bwd_s"):
            out[f"mean_{k}"] = statistics.fmean(r[k] for r in self.rows)
        return out

    def close(self) -> None:
        if isinstance(self.opt, OffloadAdam):
            self.opt.close()
        del self.opt, self.model
        gc.collect()


def measure(
    cfg: GPTConfig,
    modes: list[str],
    socket_path: str,
    *,
    steps: int,
    warmup: int,
    block: int,
    sequential: bool,
    batch: int,
    make_model: Callable[[], torch.nn.Module] | None = None,
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, dict[str, float]]:
    """Medians per mode.

    Interleaved (default): every mode runs blocks of ``block`` steps in turn (in the given order, then the
    reverse, alternately), the first step of each block not counted, so all modes see the same machine
    (a DPU update still running at the end of a turn is waited for outside the figures).  ``sequential``:
    one mode, then the next, one model in memory at a time (for the largest sizes).  ``make_model`` and
    ``make_batch`` replace the demo GPT and its random token batches (``bench_busy``'s MLP)."""
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in (make_model() if make_model else GPT(cfg)).state_dict().items()}
    g = torch.Generator().manual_seed(1)
    per_block = max(1, block - 1)
    rounds = 1 if sequential else -(-steps // per_block)
    total = warmup + (steps if sequential else rounds * block)
    shape = (batch, cfg.block_size)

    def tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, cfg.vocab_size, shape, generator=g)
        return x, torch.randint(0, cfg.vocab_size, shape, generator=g)

    batches = [(make_batch or tokens)(g) for _ in range(total)]
    out: dict[str, dict[str, float]] = {}
    if sequential:
        for mode in modes:
            runner = Runner(mode, cfg, init, socket_path, make_model)
            runner.run(batches, record_from=warmup)
            out[mode] = runner.median()
            runner.close()
        return out
    runners = [Runner(mode, cfg, init, socket_path, make_model) for mode in modes]
    for runner in runners:
        runner.run(batches[:warmup], record_from=warmup)
    for r in range(rounds):
        chunk = batches[warmup + r * block : warmup + (r + 1) * block]
        # the modes' order flips every round: a mode that always ran right after another measured 4-5%
        # slower than in the other order (20M, torch then cpu: 1.05x; cpu then torch: 1.00x)
        for runner in runners if r % 2 == 0 else runners[::-1]:
            runner.run(chunk, record_from=1)
    for runner in runners:
        out[runner.mode] = runner.median()
        runner.close()
    return out


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def print_table(results: list[dict[str, Any]]) -> None:
    header = (
        f"{'size':>6} {'mode':<6} {'step ms':>9} {'x torch':>8} {'fwd+bwd':>8} {'opt.step':>9} {'grad cp':>8} "
        f"{'wait':>8} {'param cp':>9} {'d.update':>9} {'d.stats':>8} {'d.wait':>7} {'pg out':>7} {'nvme wait':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        m = r["median"]
        offload = r["mode"] != "torch"
        pages = f"{m.get('d_rank_nvme_page_outs', 0.0):.0f}" if offload else "-"
        daemon = [m.get(k) if offload else None for k in ("d_rank_update_s", "d_rank_stats_s", "d_rank_wait_s")]
        print(
            f"{r['size']:>6} {r['mode']:<6} {ms(m['step_s']):>9} {r['ratio']:>7.2f}x {ms(m['fwd_bwd_s']):>8} "
            f"{ms(m['opt_step_s']):>9} {ms(m.get('grad_copy_s') if offload else None):>8} "
            f"{ms(m.get('wait_s') if offload else None):>8} {ms(m.get('param_copy_s') if offload else None):>9} "
            f"{ms(daemon[0]):>9} {ms(daemon[1]):>8} {ms(daemon[2]):>7} "
            f"{pages:>7} "
            f"{ms(m.get('d_rank_nvme_wait_s') if offload else None):>10}"
        )
    for r in results:
        if r["mode"] == "dpu":
            print(
                f"{r['size']}: dpu step {ms(r['median']['step_s'])} ms, bound max(fwd+bwd, update) "
                f"{ms(r['dpu_bound_s'])} ms, dpu/bound {r['dpu_over_bound']:.2f}x"
            )


def pool_bytes(configs: list[tuple[str, GPTConfig]], modes: list[str], *, sequential: bool) -> int:
    """Pool for the largest size: per mode, its fp32 state (8 B/param on the CPU tier, 12 with a master)
    or NVMe chunk cache, and a 2 MiB staging window."""
    n = max(cfg.num_params() for _, cfg in configs)
    cache = min(12 * n, 6 * AdamConfig().chunk_numel * 12)
    need = {"torch": 0, "none": 0, "cpu": 8 * n, "overlap": 8 * n, "nvme": cache, "dpu": 12 * n}
    per_mode = [need[m] for m in modes]
    total = max(per_mode) if sequential else sum(per_mode)
    return align_up(int(total * 1.1) + 256 * MiB, GiB)


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10M,50M", help="target parameter counts, comma separated (500M works)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=8, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring (kernel compiles, paging)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--block-steps", type=int, default=4, help="steps per mode per turn when interleaving")
    parser.add_argument("--sequential", action="store_true", help="one mode after another, one model in memory")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the trainer (0: torch's default)")
    parser.add_argument("--pool", default="", help="daemon pool size (default: sized for the largest model)")
    parser.add_argument("--no-compile", action="store_true", help="run the daemon's Adam eagerly")
    parser.add_argument("--json", default="", help="write the figures here")
    args = parser.parse_args()
    if args.block_steps < 2 and not args.sequential:
        parser.error("--block-steps must be >= 2 (the first step of each block is not counted)")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            parser.error(f"unknown mode {m!r} (modes: {', '.join(MODES)})")
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = [(s, GPTConfig.for_params(parse_count(s), block_size=args.block)) for s in args.sizes.split(",")]
    pool = parse_size(args.pool) if args.pool else pool_bytes(configs, modes, sequential=args.sequential)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; daemon pool {format_size(pool)}, "
        f"Adam {'eager' if args.no_compile else 'compiled'}; batch {args.batch}x{args.block}; "
        f"medians over {args.steps} steps after {args.warmup}"
    )
    results: list[dict[str, Any]] = []
    with private_daemon(pool, not args.no_compile) as owner:
        for label, cfg in configs:
            t0 = time.perf_counter()
            medians = measure(
                cfg,
                modes,
                owner.socket_path,
                steps=args.steps,
                warmup=args.warmup,
                block=args.block_steps,
                sequential=args.sequential,
                batch=args.batch,
            )
            print(f"  {label} ({cfg.num_params() / 1e6:.1f}M params): {time.perf_counter() - t0:.0f} s")
            base = medians.get("torch")
            for mode, median in medians.items():
                row: dict[str, Any] = {"size": label, "params": cfg.num_params(), "mode": mode, "median": median}
                row["ratio"] = median["step_s"] / base["step_s"] if base else float("nan")
                if mode == "dpu":
                    # the daemon counts update time of synchronous steps only: take the cpu mode's update figure
                    update = medians.get("cpu", median).get("d_rank_update_s", 0.0)
                    fwd_bwd = base["fwd_bwd_s"] if base else median["fwd_bwd_s"]
                    row["dpu_bound_s"] = max(fwd_bwd, update)
                    row["dpu_over_bound"] = median["step_s"] / row["dpu_bound_s"]
                results.append(row)
    print()
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()

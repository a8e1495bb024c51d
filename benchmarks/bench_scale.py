"""The largest demo GPT each way of training fits in a fixed memory limit, and what its step costs.

Modes, each trial a fresh worker process in a fresh child memory cgroup with
``--limit`` (trainer and the private tiermemd it starts are charged together,
as in ``bench_memory.py``, whose cgroup probe this reuses):

- ``adamw``: ``torch.optim.AdamW`` in process (the model, grads and state in
  the trainer);
- ``offload-cpu`` / ``offload-nvme``: ``tiermem.OffloadAdam(offload=...)``,
  the default user path (the params in the trainer, shared with the daemon);
- ``offload-nvme-paged``: ``OffloadAdam(offload="nvme", exchange="staged")``
  and ``tiermem.offload_params(model, opt, device_budget=--device-budget,
  prefetch=2, init=GPT._init)`` on a model made on the meta device: the
  params live in the daemon's NVMe state and come to the trainer a submodule
  at a time.

Each mode is searched for each model dtype of ``--dtypes`` (``fp32``,
``bf16``: the demo GPT made in that dtype; ``adamw`` in bf16 is torch's AdamW
on the bf16 model), and each ``offload-*`` mode for each state dtype of
``--state-dtypes`` (``fp32``, ``bf16``, ``int8``; default ``fp32``), passed as
``OffloadAdam(state_dtype=...)``: how the daemon stores the Adam moments
(4 + 4 bytes a param, 2 + 2, or 1 + 1 and one fp32 scale a block of 256
elements).  The tables and the JSON rows carry the state dtype (``state``,
``state_dtype``; none for ``adamw``, which keeps torch's state).

Search by size: from ``--start-params`` the size doubles while trials train
``--steps`` steps (batch ``--batch`` x ``--seq`` tokens) without being killed
(an OOM kill in the cgroup, an error, or ``--timeout-s``), then ``--bisect``
geometric bisections between the last size that trained and the first that
did not.  ``--max-params`` caps the search (a mode that trains the cap is
reported as ``>=``); the NVMe modes are also capped by the free space of the
swap directory: 45% of it over the swap bytes a param of the rank's keys in
its state dtype (``swap_nbytes_per_param``; the paged mode on a bf16 model
18, 14, 12.03 for fp32, bf16, int8 moments; 16, 12, 10.03 on fp32).

The private daemon's pool is ``--pool-size`` (1 GiB, its default); the NVMe
tier's chunk cache borrows free pool memory up to all of the state, so a
model whose state (16 B/param for the paged mode with fp32 moments, less with
compressed ones) fits in the pool does not touch the disk after its first
step.  A smaller pool makes a small model page like a large one
(the cache plan counts each chunk's parts in whole pages and leaves one
part's room to the allocator).  ``--window-size`` sets the private daemon's
staging window: its two slots bound what one request moves, so the pager's
requests per step are about the bytes it moves over half the window.

Per mode, at its largest size: the step time (the last step), the bytes the
daemon moved to and from the disk in that step (``/proc/<pid>/io`` of the
daemon: ``read_bytes`` + ``write_bytes``, so O_DIRECT I/O is counted and the
page cache is not), the achieved NVMe GB/s (those bytes over the step time),
and the disk bound: the step's read bytes over fio's read bandwidth plus its
written bytes over fio's write bandwidth, fio (libaio, O_DIRECT, 1 MiB, QD32,
``bench_swap.fio``) measured in the same run on the same directory.  The
paged mode also reports what the pager moved (params fetched, grads pushed)
and how long the trainer waited for fetches.

The NVMe modes' disk traffic against the least a layout could move
(``layout_min``, the paged mode's figure for its dtype and state dtype), from
the same last step.  A paged step reads the param for forward and for
backward, the grad back, and the state part, and writes the grad, the state
part and the new param; an fp32 model's param part is the master itself, read
once more for the update.  The param and the grad count in the model dtype
(what the trainer holds: the daemon's fp32 grad part moves more); the state
part as ``tiermem.core.statekeys.StateFormat`` lays it out (``part_element_nbytes``
of the rank's keys): the fp32 master where the model is below fp32, and the
moments in the state dtype.  Per param, read + written:

============  ===================  ===================  =====================
model dtype   fp32 moments         bf16 moments         int8 moments
============  ===================  ===================  =====================
bf16          18 + 16 = 34         14 + 12 = 26         12.03 + 10.03 = 22.06
fp32          24 + 16 = 40         20 + 12 = 32         18.03 + 10.03 = 28.06
============  ===================  ===================  =====================

The JSON's ``layout_min_per_param`` names these ``"<mode> <dtype>"`` for fp32
moments (as before) and ``"<mode> <dtype> <state dtype>"`` for the others.

- bytes per param read and written (the ``/proc`` figures over the model's
  params), their sum over the minimum (``x min``);
- requests per step: the pager's requests to the daemon
  (``ParamPager.stats()["requests"]``: each state read or write through the
  staging window, one per window slot) and the disk I/O requests the daemon
  issued (``swap.reads`` + ``swap.writes`` of its STATS reply, through
  ``OffloadAdam.stats()``; the daemon is private, so the node's figures are
  this trainer's), with the rank's NVMe page-ins and page-outs.  The swap
  store counts one read or write per chunk (``adam.chunk_numel`` elements
  with all their state keys), which its I/O engine submits as block-sized
  AIO requests; the STATS reply does not count those;
- the step time over the minimal-bytes disk bound (the minimum's read bytes
  over fio's read bandwidth plus its written bytes over fio's write
  bandwidth), beside the step time over the bound of the measured bytes;
- the daemon's state bytes per param after the last step (``state B/param``,
  cpu + nvme; the JSON's ``cpu_state_per_param`` and ``nvme_state_per_param``,
  from ``OffloadAdam.stats().rank``): ``cpu_state_nbytes`` is the chunk cache,
  ``nvme_state_nbytes`` the swap's chunks written back so far (with older
  versions not yet freed); a chunk in both counts in both, and a part held
  only within a step (the paged mode's grads) may be in neither, so the two
  need not add up to the state's size.

    ./run.sh bench scale [--limit 4GiB] [--modes adamw,offload-cpu,offload-nvme,offload-nvme-paged]
        [--dtypes fp32,bf16] [--state-dtypes fp32,bf16,int8] [--max-params 4e9] [--device-budget 512MiB]
        [--pool-size 1GiB] [--json out.json]

One size, no search: ``--start-params N --max-params N`` (a trial at ``N``
only; ``--bisect`` is then unused).

The goal (issue 11): the paged mode trains a model >= 10x the largest
``adamw`` trains in the same limit, at a step time <= 1.25x its disk bound.
The figures next to the layout's minimum are those the redesign of param
paging on NVMe ("params paged in their working precision") is judged on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_memory import CgroupProbe, own_memory_cgroup
from bench_swap import ensure_fio, fio

GiB = 1 << 30
MiB = 1 << 20
MODES = ("adamw", "offload-cpu", "offload-nvme", "offload-nvme-paged")
NVME_MODES = ("offload-nvme", "offload-nvme-paged")
DTYPES = ("fp32", "bf16")
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
PAGED = "offload-nvme-paged"


def _rank_keys(mode: str, dtype: str) -> tuple[str, ...]:
    """The state keys the daemon keeps for an NVMe mode's rank (``tiermem.core.statekeys.state_keys_for``)."""
    from tiermem.core.statekeys import state_keys_for

    return state_keys_for(TORCH_DTYPES[dtype], "nvme", 1, "staged" if mode == PAGED else "shared")


def swap_nbytes_per_param(mode: str, dtype: str, state_dtype: str) -> float:
    """Swap bytes per param of an NVMe mode (master, moments; the paged mode keeps its grads there too, and a
    bf16 model's params)."""
    from tiermem.core.statekeys import part_element_nbytes

    return sum(part_element_nbytes(_rank_keys(mode, dtype), TORCH_DTYPES[dtype], state_dtype).values())


def layout_min(mode: str, dtype: str, state_dtype: str) -> tuple[float, float] | None:
    """The least disk bytes per param a paged step can move, ``(read, written)``, each byte once (None for the
    other modes): the param for forward and backward, the grad back and the state part read; the grad, the
    state part and the new param written; an fp32 model's param part is its master, read again for the update.
    Param and grad in the model dtype; the state part as the daemon lays it out (``StateFormat``'s parts of the
    rank's keys: the master where the model is below fp32, and the moments in ``state_dtype``).  bf16 with fp32
    moments: 2 + 2 + 2 + 12 read, 2 + 12 + 2 written (34); fp32: 4 + 4 + 4 + 8 + 4 and 4 + 8 + 4 (40)."""
    if mode != PAGED:
        return None
    from tiermem.core import dtypes
    from tiermem.core.statekeys import part_element_nbytes

    keys = _rank_keys(mode, dtype)
    parts = part_element_nbytes(keys, TORCH_DTYPES[dtype], state_dtype)
    working = float(dtypes.by_name(TORCH_DTYPES[dtype]).torch.itemsize)
    param, state = parts["param"], parts["state"]
    master_again = 0.0 if "param" in keys else param  # no separate param: the update reads the master
    return 2 * param + working + state + master_again, working + state + param


def layout_min_key(mode: str, dtype: str, state_dtype: str) -> str:
    """The JSON's name of a minimum: ``"<mode> <dtype>"`` for fp32 moments, the state dtype added otherwise."""
    return f"{mode} {dtype}" if state_dtype == "fp32" else f"{mode} {dtype} {state_dtype}"


def layout_min_json(mode: str, dtype: str, state_dtype: str) -> dict[str, float]:
    read, written = layout_min(mode, dtype, state_dtype) or (0.0, 0.0)
    return {"read": read, "written": written}


def fmt_nbytes(value: float) -> str:
    """Bytes per param, without trailing zeros (34, 6.03)."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def parse_size(text: str) -> int:
    from tiermem.core.units import parse_size as parse

    return parse(text)


def parse_count(text: str) -> int:
    value = float(text)
    if value <= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a positive count such as 2e9, got {text!r}")
    return int(value)


# ----------------------------------------------------------------------------- one trial (parent side)


@dataclass
class Trial:
    mode: str
    dtype: str
    params: int
    state_dtype: str | None = None
    """``OffloadAdam(state_dtype=...)`` of an offload mode; None for ``adamw``."""
    status: str = "ok"
    """ok, oom, failed, timeout."""
    reason: str = ""
    peak_nbytes: int = 0
    wall_s: float = 0.0
    worker: dict[str, Any] = field(default_factory=dict)


def run_trial(
    args: argparse.Namespace, mode: str, dtype: str, state_dtype: str | None, params: int, parent: Path, log_dir: Path
) -> Trial:
    trial = Trial(mode, dtype, params, state_dtype)
    spec = {
        "mode": mode,
        "dtype": dtype,
        "state_dtype": state_dtype,
        "params": params,
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "device_budget": args.device_budget,
        "pool_size": args.pool_size,
        "window_size": args.window_size,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    env["TIERMEM_SOCKET_PATH"] = str(log_dir / "no-such-daemon.sock")  # a private daemon, inside the cgroup
    env["TMPDIR"] = str(args.swap_dir)  # where the private daemon puts its swap files
    env["PYTHONUNBUFFERED"] = "1"
    name = f"{mode}-{dtype}-{state_dtype or 'torch'}-{params}"
    log_path = log_dir / f"{name}.log"
    probe = CgroupProbe(parent, f"tiermem-scale-{os.getpid()}-{name}", args.limit)
    t0 = time.monotonic()
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
            )
        probe.add(proc.pid)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"g")  # in the cgroup now: the worker may import torch
        proc.stdin.flush()
        try:
            out, _ = proc.communicate(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            trial.status, trial.reason = "timeout", f"no result after {args.timeout_s:.0f} s"
            for pid in probe.pids():
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
            out, _ = proc.communicate()
        deadline = time.monotonic() + 30
        while probe.pids() and time.monotonic() < deadline:  # the daemon exits with its parent
            time.sleep(0.2)
        for pid in probe.pids():
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        trial.peak_nbytes = probe.peak()
        events = probe.events()
        for line in out.decode(errors="replace").splitlines():
            if line.startswith("RESULT "):
                trial.worker = json.loads(line[len("RESULT ") :])
        if trial.status == "ok":
            if events.get("oom_kill", 0) or proc.returncode == -9:
                trial.status, trial.reason = "oom", f"OOM-killed in the {args.limit / GiB:.2f} GiB cgroup"
            elif proc.returncode != 0 or "error" in trial.worker or "steps" not in trial.worker:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-2:]
                trial.status = "failed"
                trial.reason = trial.worker.get("error") or f"exit {proc.returncode}: {' | '.join(tail)}"[:300]
    finally:
        probe.remove()
    trial.wall_s = time.monotonic() - t0
    return trial


def search(
    args: argparse.Namespace, mode: str, dtype: str, state_dtype: str | None, parent: Path, log_dir: Path
) -> tuple[Trial | None, list[Trial]]:
    """The largest size that trained, and every trial."""
    cap = args.max_params
    if mode in NVME_MODES:
        free = shutil.disk_usage(args.swap_dir).free
        per_param = swap_nbytes_per_param(mode, dtype, state_dtype or "fp32")
        cap = min(cap, int(free * 0.45 / per_param))  # the store reserves the state and a cache again
    trials: list[Trial] = []

    def attempt(n: int) -> Trial:
        t = run_trial(args, mode, dtype, state_dtype, n, parent, log_dir)
        trials.append(t)
        ok = f"{t.worker['steps'][-1]['step_s']:.2f} s/step" if t.status == "ok" else t.reason
        print(
            f"  {mode:<20} {dtype} {state_dtype or '-':<4} {n / 1e6:>9.1f}M params: {t.status:<7} "
            f"peak {t.peak_nbytes / GiB:5.2f} GiB  {ok}",
            flush=True,
        )
        return t

    best: Trial | None = None
    n = min(args.start_params, cap)
    failed_at = None
    while True:
        t = attempt(n)
        if t.status != "ok":
            failed_at = n
            break
        best = t
        if n >= cap:
            break
        n = min(cap, n * 2)
    if best is not None and failed_at is not None:
        lo, hi = best.params, failed_at
        for _ in range(args.bisect):
            mid = int(math.sqrt(lo * hi))
            if mid <= lo * 1.05:
                break
            t = attempt(mid)
            if t.status == "ok":
                best, lo = t, mid
            else:
                hi = mid
    return best, trials


# ----------------------------------------------------------------------------- the worker (inside the cgroup)


def _io(pid: int) -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _memory(pid: int) -> dict[str, int]:
    """A process's peak resident set and, of the resident set now, what is shared memory (the pool's
    memfd arenas for the daemon), in bytes (``/proc/<pid>/status``)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    kib = {k: int(v.split()[0]) * 1024 for k, v in fields.items() if v.strip().endswith("kB")}
    return {"peak_rss": kib.get("VmHWM", 0), "rss_shmem": kib.get("RssShmem", 0)}


def worker(spec: dict[str, Any]) -> int:
    sys.stdin.buffer.read(1)  # wait until the parent has moved this process into its cgroup
    result: dict[str, Any] = {}
    try:
        result = _train(spec)
    except Exception as exc:  # the parent reports it as the trial's reason
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


def _daemon_figures(opt: Any) -> dict[str, int]:
    """The daemon's running totals of disk I/O (its STATS reply); empty for an in-process optimizer."""
    import tiermem

    if not isinstance(opt, tiermem.OffloadAdam):
        return {}
    stats = opt.stats()
    swap = stats.node.swap
    out = {
        "swap_reads": swap.reads,
        "swap_writes": swap.writes,
        "swap_read_nbytes": swap.read_nbytes,
        "swap_written_nbytes": swap.written_nbytes,
    }
    nvme = stats.rank.nvme
    if nvme is not None:
        out.update(page_ins=nvme.page_ins, page_outs=nvme.page_outs)
    return out


def _train(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import tiermem
    from tiermem.client.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    mode = spec["mode"]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    cfg = GPTConfig.for_params(spec["params"], block_size=spec["seq"])
    opt: Any
    pager = None
    client = None
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the model is made in its dtype, never as an fp32 copy first
    try:
        if mode == "offload-nvme-paged":
            with torch.device("meta"):
                model = GPT(cfg)
        else:
            model = GPT(cfg)
    finally:
        torch.set_default_dtype(default)
    if mode == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        ws = spec["window_size"]
        window = {"jobs.window_size": ws, "jobs.window_budget": ws} if ws else {}  # one job, one window
        # the private daemon (no other is reachable)
        client = tiermem.connect(pool_size=spec["pool_size"], settings=window)
        hyper: dict[str, Any] = {"lr": 1e-4, "state_dtype": spec.get("state_dtype") or "fp32", "client": client}
        if mode == "offload-nvme-paged":
            opt = tiermem.OffloadAdam(model.parameters(), offload="nvme", exchange="staged", **hyper)
            pager = tiermem.offload_params(model, opt, device_budget=spec["device_budget"], prefetch=2, init=GPT._init)
        else:
            opt = tiermem.OffloadAdam(model.parameters(), offload=mode.removeprefix("offload-"), **hyper)
    numel = cfg.num_params()
    # the private daemon is the caller's client's (the optimizer may hold a connection of its own to it)
    daemon = getattr(client, "daemon", None) if mode != "adamw" else None
    daemon_pid = daemon.process.pid if daemon is not None else None
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(spec["steps"]):
        x = torch.randint(0, cfg.vocab_size, (spec["batch"], cfg.block_size), generator=g)
        y = torch.randint(0, cfg.vocab_size, (spec["batch"], cfg.block_size), generator=g)
        figures0 = _daemon_figures(opt)  # outside the timed step: a STATS round trip
        io0 = _io(daemon_pid) if daemon_pid else (0, 0)
        if pager is not None:
            pager.reset_stats()
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_s = time.perf_counter() - t0
        io1 = _io(daemon_pid) if daemon_pid else (0, 0)
        figures1 = _daemon_figures(opt)
        row: dict[str, Any] = {
            "step_s": step_s,
            "loss": float(loss.detach()),
            "read_nbytes": io1[0] - io0[0],
            "write_nbytes": io1[1] - io0[1],
        }
        if figures1:
            row["daemon"] = {k: v - figures0[k] for k, v in figures1.items()}
        if pager is not None:
            stats = pager.stats()
            row["pager"] = {
                k: stats.get(k, 0.0)
                for k in (
                    "fetched_nbytes",
                    "pushed_nbytes",
                    "fetch_wait_us",
                    "push_wait_us",
                    "peak_nbytes",
                    "fetches",
                    "prefetches",
                    "requests",
                )
            }
        steps.append(row)
    out = {"numel": numel, "dtype": spec["dtype"], "config": asdict(cfg), "steps": steps}
    if isinstance(opt, tiermem.OffloadAdam):
        rank = opt.stats().rank
        out["state"] = {
            "state_dtype": rank.state_dtype,  # as the daemon reports it
            "cpu_state_nbytes": rank.cpu_state_nbytes,
            "nvme_state_nbytes": rank.nvme_state_nbytes,
        }
    out["memory"] = {"trainer": _memory(os.getpid())}
    if daemon_pid:
        out["memory"]["daemon"] = _memory(daemon_pid)
    if hasattr(opt, "close"):
        opt.close()
    return out


# ----------------------------------------------------------------------------- report


def summarize(
    mode: str, dtype: str, state_dtype: str | None, best: Trial | None, fio_bw: dict[str, float], capped: bool
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "mode": mode,
        "dtype": dtype,
        "state_dtype": state_dtype,
        "largest_params": best.worker["numel"] if best else 0,
        "capped": capped,
    }
    if best is None:
        return row
    last = best.worker["steps"][-1]
    numel = best.worker["numel"]
    moved = last["read_nbytes"] + last["write_nbytes"]
    row.update(
        step_s=last["step_s"],
        peak_nbytes=best.peak_nbytes,
        paged_nbytes=moved,
        read_nbytes=last["read_nbytes"],
        write_nbytes=last["write_nbytes"],
        nvme_gbps=moved / last["step_s"] / 1e9 if moved else 0.0,
    )
    if moved and fio_bw:
        bound = last["read_nbytes"] / (fio_bw["read"] * 1e9) + last["write_nbytes"] / (fio_bw["write"] * 1e9)
        row.update(disk_bound_s=bound, step_over_bound=last["step_s"] / bound)
    if mode in NVME_MODES:
        row.update(
            read_per_param=last["read_nbytes"] / numel,
            write_per_param=last["write_nbytes"] / numel,
            moved_per_param=moved / numel,
        )
    least = layout_min(mode, dtype, state_dtype or "fp32")
    if least is not None:
        row.update(min_read_per_param=least[0], min_write_per_param=least[1], min_per_param=sum(least))
        row["over_min"] = moved / numel / sum(least)
        if fio_bw:
            bound = numel * least[0] / (fio_bw["read"] * 1e9) + numel * least[1] / (fio_bw["write"] * 1e9)
            row.update(min_bound_s=bound, step_over_min_bound=last["step_s"] / bound)
    if "daemon" in last:
        row["daemon"] = last["daemon"]
        row["disk_requests"] = last["daemon"]["swap_reads"] + last["daemon"]["swap_writes"]
    if "pager" in last:
        row["pager"] = last["pager"]
        row["pager_requests"] = int(last["pager"]["requests"])
    if "state" in best.worker:
        state = best.worker["state"]
        row["state"] = state
        row["cpu_state_per_param"] = state["cpu_state_nbytes"] / numel
        row["nvme_state_per_param"] = state["nvme_state_nbytes"] / numel
    if "memory" in best.worker:
        row["memory"] = best.worker["memory"]
    return row


def row_name(r: dict[str, Any]) -> str:
    """``mode dtype`` and the state dtype where there is one, for the lines under the tables."""
    return f"{r['mode']} {r['dtype']}" + (f" {r['state_dtype']}" if r.get("state_dtype") else "")


def _cells(head: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")


def print_table(rows: list[dict[str, Any]], limit: int) -> None:
    adamw = {r["dtype"]: r["largest_params"] for r in rows if r["mode"] == "adamw" and r["largest_params"]}
    print(f"\nlargest demo GPT trained for the steps in a {limit / GiB:.2f} GiB cgroup (trainer + daemon)")
    head = ["mode", "dtype", "state", "largest", "x adamw", "peak", "step s", "on disk/step", "NVMe GB/s"]
    head += ["disk bound s", "x bound"]
    body = []
    for r in rows:
        n = r["largest_params"]
        base = adamw.get(r["dtype"])
        body.append(
            [
                r["mode"],
                r["dtype"],
                r.get("state_dtype") or "",
                (">=" if r.get("capped") else "") + f"{n / 1e6:.0f}M" if n else "none",
                f"{n / base:.1f}x" if base and n else "",
                f"{r['peak_nbytes'] / GiB:.2f} GiB" if "peak_nbytes" in r else "",
                f"{r['step_s']:.2f}" if "step_s" in r else "",
                f"{r['paged_nbytes'] / GiB:.2f} GiB" if r.get("paged_nbytes") else "0",
                f"{r['nvme_gbps']:.2f}" if r.get("nvme_gbps") else "",
                f"{r['disk_bound_s']:.2f}" if "disk_bound_s" in r else "",
                f"{r['step_over_bound']:.2f}x" if "step_over_bound" in r else "",
            ]
        )
    _cells(head, body)
    disk = [r for r in rows if "moved_per_param" in r]
    if disk:
        print("\nper step at that size: disk bytes per param (read + written) against the layout's minimum")
        head = ["mode", "dtype", "state", "params", "B/param read + written", "minimum", "x min", "state B/param"]
        head += ["pager requests", "disk requests", "step s", "x bound (measured bytes)", "min bound s", "x min bound"]
        body = []
        for r in disk:
            moved = f"{r['read_per_param']:.1f} + {r['write_per_param']:.1f} = {r['moved_per_param']:.1f}"
            least = ""
            if "min_per_param" in r:
                least = " + ".join(fmt_nbytes(r[k]) for k in ("min_read_per_param", "min_write_per_param"))
                least += f" = {fmt_nbytes(r['min_per_param'])}"
            state = ""
            if "cpu_state_per_param" in r:
                state = f"{r['cpu_state_per_param']:.2f} + {r['nvme_state_per_param']:.2f}"
            body.append(
                [
                    r["mode"],
                    r["dtype"],
                    r.get("state_dtype") or "",
                    f"{r['largest_params'] / 1e6:.0f}M",
                    moved,
                    least,
                    f"{r['over_min']:.2f}x" if "over_min" in r else "",
                    state,
                    str(r["pager_requests"]) if "pager_requests" in r else "",
                    str(r["disk_requests"]) if "disk_requests" in r else "",
                    f"{r['step_s']:.2f}",
                    f"{r['step_over_bound']:.2f}x" if "step_over_bound" in r else "",
                    f"{r['min_bound_s']:.2f}" if "min_bound_s" in r else "",
                    f"{r['step_over_min_bound']:.2f}x" if "step_over_min_bound" in r else "",
                ]
            )
        _cells(head, body)
        idle = [row_name(r) for r in disk if not r["moved_per_param"]]
        if idle:
            print(
                f"{', '.join(idle)}: no disk I/O in the step (the state fit in the daemon's chunk cache, which "
                "borrows the free pool); measure a larger model or a smaller --pool-size"
            )
    for r in rows:
        if "pager" in r:
            p = r["pager"]
            print(
                f"{row_name(r)}: pager fetched {p['fetched_nbytes'] / GiB:.2f} GiB "
                f"({p['fetches']:.0f} fetches, {p['prefetches']:.0f} prefetches) and pushed "
                f"{p['pushed_nbytes'] / GiB:.2f} GiB of grads per step; the trainer waited "
                f"{p['fetch_wait_us'] / 1e6:.2f} s for fetches, {p['push_wait_us'] / 1e6:.2f} s for pushes; "
                f"peak materialized params {p['peak_nbytes'] / MiB:.0f} MiB"
            )
        if "memory" in r:
            parts = [
                f"{who} {m['peak_rss'] / GiB:.2f} GiB (shared memory {m['rss_shmem'] / GiB:.2f} GiB at the end)"
                for who, m in r["memory"].items()
            ]
            print(f"{row_name(r)}: peak resident set: {', '.join(parts)}")
        if "daemon" in r and r["disk_requests"]:
            d = r["daemon"]
            print(
                f"{row_name(r)}: the daemon issued {d['swap_reads']} disk reads and "
                f"{d['swap_writes']} writes ({r['paged_nbytes'] / r['disk_requests'] / MiB:.2f} MiB each on "
                f"average), {d.get('page_ins', 0)} page-ins and {d.get('page_outs', 0)} page-outs"
            )


def main(argv: list[str] | None = None) -> int:
    from tiermem.core.modes import STATE_DTYPES  # no torch: the parent stays small until it needs the layout

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=parse_size, default=4 * GiB, help="memory cgroup limit (default 4GiB)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help=f"model dtypes, comma-separated, of {', '.join(DTYPES)}")
    ap.add_argument(
        "--state-dtypes",
        default="fp32",
        help=f"OffloadAdam(state_dtype=) of the offload modes, comma-separated, of {', '.join(STATE_DTYPES)} (fp32)",
    )
    ap.add_argument("--start-params", type=parse_count, default=16_000_000, help="first size tried (16e6)")
    ap.add_argument("--max-params", type=parse_count, default=4_000_000_000, help="largest size tried (4e9)")
    ap.add_argument("--bisect", type=int, default=2, help="bisections after the doubling search (2)")
    ap.add_argument("--steps", type=int, default=2, help="training steps per trial (2)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence (64)")
    ap.add_argument("--device-budget", type=parse_size, default=512 * MiB, help="paged mode's budget (512MiB)")
    ap.add_argument(
        "--pool-size",
        type=parse_size,
        default=1 * GiB,
        help="the private daemon's pool (1GiB, its default); below the NVMe state, a small model pages as a large one",
    )
    ap.add_argument(
        "--window-size",
        type=parse_size,
        default=0,
        help="the private daemon's staging window per rank (default: its own, 2MiB); the window's two slots "
        "bound the bytes one request moves",
    )
    ap.add_argument("--swap-dir", type=Path, default=None, help="NVMe directory (default: a fresh one in $TMPDIR)")
    ap.add_argument("--fio-size", type=parse_size, default=1 * GiB, help="bytes fio writes and reads (1GiB)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per trial (1800)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)}; the modes are {', '.join(MODES)}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown or not dtypes:
        ap.error(f"unknown dtype(s) {', '.join(unknown) or '(none given)'}; the dtypes are {', '.join(DTYPES)}")
    state_dtypes = [d.strip() for d in args.state_dtypes.split(",") if d.strip()]
    unknown = sorted(set(state_dtypes) - set(STATE_DTYPES))
    if unknown or not state_dtypes:
        ap.error(f"unknown state dtype(s) {', '.join(unknown) or '(none given)'}; they are {', '.join(STATE_DTYPES)}")
    parent = own_memory_cgroup()
    if parent is None:
        ap.error("needs a writable cgroup v1 memory controller at /sys/fs/cgroup/memory (run as root)")
    made_swap = args.swap_dir is None
    args.swap_dir = Path(tempfile.mkdtemp(prefix="tiermem-scale-")) if made_swap else args.swap_dir
    log_dir = Path(tempfile.mkdtemp(prefix="tiermem-scale-logs-"))
    try:
        fio_bw: dict[str, float] = {}
        missing = ensure_fio()
        if missing is None:
            fio_bw = {
                "write": fio(args.swap_dir, "write", args.fio_size, MiB, 32),
                "read": fio(args.swap_dir, "read", args.fio_size, MiB, 32),
            }
            (args.swap_dir / "fio.dat").unlink(missing_ok=True)
            print(f"fio in {args.swap_dir}: write {fio_bw['write']:.2f} GB/s, read {fio_bw['read']:.2f} GB/s")
        else:
            print(f"no disk bound: {missing}")
        rows, every = [], []
        for mode in modes:
            for dtype in dtypes:
                variants: list[str | None] = [None] if mode == "adamw" else list(state_dtypes)
                for state_dtype in variants:
                    best, trials = search(args, mode, dtype, state_dtype, parent, log_dir)
                    every += [asdict(t) for t in trials]
                    capped = best is not None and all(t.status == "ok" for t in trials)
                    rows.append(summarize(mode, dtype, state_dtype, best, fio_bw, capped))
        print_table(rows, args.limit)
        if args.json:
            report = {
                "limit_nbytes": args.limit,
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
                "args": {k: str(v) for k, v in vars(args).items() if k != "worker"},
                "fio_gbps": fio_bw,
                "layout_min_per_param": {
                    layout_min_key(PAGED, d, sd): layout_min_json(PAGED, d, sd)
                    for d in DTYPES
                    for sd in dict.fromkeys(("fp32", *state_dtypes))
                },
                "results": rows,
                "trials": every,
            }
            args.json.write_text(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
        if made_swap:
            shutil.rmtree(args.swap_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

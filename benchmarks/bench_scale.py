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

Search by size: from ``--start-params`` the size doubles while trials train
``--steps`` steps (batch ``--batch`` x ``--seq`` tokens) without being killed
(an OOM kill in the cgroup, an error, or ``--timeout-s``), then ``--bisect``
geometric bisections between the last size that trained and the first that
did not.  ``--max-params`` caps the search (a mode that trains the cap is
reported as ``>=``); the NVMe modes are also capped by the free space of the
swap directory.

Per mode, at its largest size: the step time (the last step), the bytes the
daemon moved to and from the disk in that step (``/proc/<pid>/io`` of the
daemon: ``read_bytes`` + ``write_bytes``, so O_DIRECT I/O is counted and the
page cache is not), the achieved NVMe GB/s (those bytes over the step time),
and the disk bound: the step's read bytes over fio's read bandwidth plus its
written bytes over fio's write bandwidth, fio (libaio, O_DIRECT, 1 MiB, QD32,
``bench_swap.fio``) measured in the same run on the same directory.  The
paged mode also reports what the pager moved (params fetched, grads pushed)
and how long the trainer waited for fetches.

    ./run.sh bench scale [--limit 4GiB] [--modes adamw,offload-cpu,offload-nvme,offload-nvme-paged]
        [--max-params 4e9] [--device-budget 512MiB] [--json out.json]

The goal (issue 11): the paged mode trains a model >= 10x the largest
``adamw`` trains in the same limit, at a step time <= 1.25x its disk bound.
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
STATE_BYTES = {"offload-nvme": 12, "offload-nvme-paged": 16}
"""Swap bytes per param of the NVMe modes (master, moments; the paged mode keeps its grads there too)."""


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
    params: int
    status: str = "ok"
    """ok, oom, failed, timeout."""
    reason: str = ""
    peak_nbytes: int = 0
    wall_s: float = 0.0
    worker: dict[str, Any] = field(default_factory=dict)


def run_trial(args: argparse.Namespace, mode: str, params: int, parent: Path, log_dir: Path) -> Trial:
    trial = Trial(mode, params)
    spec = {
        "mode": mode,
        "params": params,
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "device_budget": args.device_budget,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    env["TIERMEM_SOCKET_PATH"] = str(log_dir / "no-such-daemon.sock")  # a private daemon, inside the cgroup
    env["TMPDIR"] = str(args.swap_dir)  # where the private daemon puts its swap files
    env["PYTHONUNBUFFERED"] = "1"
    log_path = log_dir / f"{mode}-{params}.log"
    probe = CgroupProbe(parent, f"tiermem-scale-{os.getpid()}-{mode}-{params}", args.limit)
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


def search(args: argparse.Namespace, mode: str, parent: Path, log_dir: Path) -> tuple[Trial | None, list[Trial]]:
    """The largest size that trained, and every trial."""
    cap = args.max_params
    if mode in NVME_MODES:
        free = shutil.disk_usage(args.swap_dir).free
        cap = min(cap, int(free * 0.45 / STATE_BYTES[mode]))  # the store reserves the state and a cache again
    trials: list[Trial] = []

    def attempt(n: int) -> Trial:
        t = run_trial(args, mode, n, parent, log_dir)
        trials.append(t)
        ok = f"{t.worker['steps'][-1]['step_s']:.2f} s/step" if t.status == "ok" else t.reason
        print(f"  {mode:<20} {n / 1e6:>9.1f}M params: {t.status:<7} peak {t.peak_nbytes / GiB:5.2f} GiB  {ok}")
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


def _train(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import tiermem
    from tiermem.client.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    mode = spec["mode"]
    cfg = GPTConfig.for_params(spec["params"], block_size=spec["seq"])
    opt: Any
    pager = None
    if mode == "offload-nvme-paged":
        with torch.device("meta"):
            model = GPT(cfg)
        opt = tiermem.OffloadAdam(model.parameters(), lr=1e-4, offload="nvme", exchange="staged")
        pager = tiermem.offload_params(model, opt, device_budget=spec["device_budget"], prefetch=2, init=GPT._init)
    else:
        model = GPT(cfg)
        if mode == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            opt = tiermem.OffloadAdam(model.parameters(), lr=1e-4, offload=mode.removeprefix("offload-"))
    numel = cfg.num_params()
    daemon = getattr(getattr(opt, "client", None), "daemon", None)
    daemon_pid = daemon.process.pid if daemon is not None else None
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(spec["steps"]):
        x = torch.randint(0, cfg.vocab_size, (spec["batch"], cfg.block_size), generator=g)
        y = torch.randint(0, cfg.vocab_size, (spec["batch"], cfg.block_size), generator=g)
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
        row: dict[str, Any] = {
            "step_s": step_s,
            "loss": float(loss.detach()),
            "read_nbytes": io1[0] - io0[0],
            "write_nbytes": io1[1] - io0[1],
        }
        if pager is not None:
            stats = pager.stats()
            row["pager"] = {
                k: stats.get(k, 0.0)
                for k in ("fetched_nbytes", "pushed_nbytes", "fetch_wait_us", "push_wait_us", "peak_nbytes")
            }
        steps.append(row)
    out = {"numel": numel, "config": asdict(cfg), "steps": steps}
    if hasattr(opt, "close"):
        opt.close()
    return out


# ----------------------------------------------------------------------------- report


def summarize(mode: str, best: Trial | None, fio_bw: dict[str, float], capped: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"mode": mode, "largest_params": best.worker["numel"] if best else 0, "capped": capped}
    if best is None:
        return row
    last = best.worker["steps"][-1]
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
    if "pager" in last:
        row["pager"] = last["pager"]
    return row


def print_table(rows: list[dict[str, Any]], limit: int) -> None:
    adamw = next((r["largest_params"] for r in rows if r["mode"] == "adamw" and r["largest_params"]), None)
    print(f"\nlargest demo GPT trained for the steps in a {limit / GiB:.2f} GiB cgroup (trainer + daemon)")
    head = ["mode", "largest", "x adamw", "peak", "step s", "paged/step", "NVMe GB/s", "disk bound s", "x bound"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        n = r["largest_params"]
        cells = [
            r["mode"],
            (">=" if r.get("capped") else "") + f"{n / 1e6:.0f}M" if n else "none",
            f"{n / adamw:.1f}x" if adamw and n else "",
            f"{r['peak_nbytes'] / GiB:.2f} GiB" if "peak_nbytes" in r else "",
            f"{r['step_s']:.2f}" if "step_s" in r else "",
            f"{r['paged_nbytes'] / GiB:.2f} GiB" if r.get("paged_nbytes") else "0",
            f"{r['nvme_gbps']:.2f}" if r.get("nvme_gbps") else "",
            f"{r['disk_bound_s']:.2f}" if "disk_bound_s" in r else "",
            f"{r['step_over_bound']:.2f}x" if "step_over_bound" in r else "",
        ]
        print("| " + " | ".join(cells) + " |")
    for r in rows:
        if "pager" in r:
            p = r["pager"]
            print(
                f"{r['mode']}: pager fetched {p['fetched_nbytes'] / GiB:.2f} GiB and pushed "
                f"{p['pushed_nbytes'] / GiB:.2f} GiB of grads per step; the trainer waited "
                f"{p['fetch_wait_us'] / 1e6:.2f} s for fetches, {p['push_wait_us'] / 1e6:.2f} s for pushes; "
                f"peak materialized params {p['peak_nbytes'] / MiB:.0f} MiB"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=parse_size, default=4 * GiB, help="memory cgroup limit (default 4GiB)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--start-params", type=parse_count, default=16_000_000, help="first size tried (16e6)")
    ap.add_argument("--max-params", type=parse_count, default=4_000_000_000, help="largest size tried (4e9)")
    ap.add_argument("--bisect", type=int, default=2, help="bisections after the doubling search (2)")
    ap.add_argument("--steps", type=int, default=2, help="training steps per trial (2)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence (64)")
    ap.add_argument("--device-budget", type=parse_size, default=512 * MiB, help="paged mode's budget (512MiB)")
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
            best, trials = search(args, mode, parent, log_dir)
            every += [asdict(t) for t in trials]
            capped = best is not None and all(t.status == "ok" for t in trials)
            rows.append(summarize(mode, best, fio_bw, capped))
        print_table(rows, args.limit)
        if args.json:
            report = {
                "limit_nbytes": args.limit,
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
                "args": {k: str(v) for k, v in vars(args).items() if k != "worker"},
                "fio_gbps": fio_bw,
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

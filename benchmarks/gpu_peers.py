"""tiermem against what a GPU user would pick instead, on one GPU, same model, data and seed.

    python benchmarks/gpu_peers.py [--out-dir DIR] [--time-limit 450] [--systems a,b] [--resume]
    python benchmarks/gpu_peers.py --dry-run      # the whole pipeline on the CPU, a tiny model

Rows, most important first (``CAMPAIGN``): fused AdamW all on the GPU (the ceiling), ``OffloadAdam`` on
the CPU tier, DeepSpeed ZeRO-2 offload, FSDP2 ``CPUOffloadPolicy``, torchao ``CPUOffloadOptimizer``,
``OffloadAdam`` with the delayed update, paged params (``offload_params``, a quarter of the params on the
device), the NVMe tier, int8 moments, DeepSpeed ZeRO-3 offload.  The model, data and each system's
settings are in ``gpu_peers_worker.py``.

Each row runs in its own process (``gpu_peers_worker.py``) under its own time limit, the smaller of its
budget and what is left of ``--time-limit``; a row that runs over is killed with its process group,
keeping the steps it finished (one JSON line each).  After each row the whole result is rewritten to
``DIR/gpu-peers-<gpu>.json`` (``h100``, ``h200``, ``cpu-tiny``): a timeout of the whole command keeps every
row before it, and ``--resume`` runs only the rows not yet ``ok``; every row's output is appended to
``DIR/gpu-peers-<gpu>.log`` (DIR: ``benchmarks/results``; a fresh temporary directory with ``--tiny``).  A
peer whose package is missing is recorded as ``not installed``; a system that needs CUDA, on a CPU-only run,
as ``needs CUDA``.

Per row: step time (median of the timed steps after the warm-up), tokens/s, model TFLOP/s (6 * params *
tokens / step time), peak GPU memory (``max_memory_allocated``), peak host memory (the node's
MemTotal - MemAvailable over the row, above its value before the row), bytes across PCIe per step (the
system's own counter where it has one: ``OffloadAdam.stats().crossed_nbytes``; NVML's sampled
throughput; and the design's minimum from the dtypes, all three kept), and the loss on the next batch
after the timed steps against the AdamW row's (rows cut short: the last training loss against AdamW's at
the same step).  DeepSpeed's CPU Adam is built (JIT, ninja) in the background while the AdamW row runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "gpu_peers_worker.py"
GiB = 1 << 30


@dataclass(frozen=True)
class System:
    name: str
    budget_s: float
    """Longest this row may run (its process start, set-up, warm-up and timed steps)."""
    needs: tuple[str, ...] = ()
    """Packages it imports; a missing one makes the row ``not installed``."""
    needs_cuda: bool = False
    warmup: int | None = None
    steps: int | None = None
    """Warm-up and timed steps where they differ from the campaign's (``None``: the campaign's)."""


CAMPAIGN = (
    System("adamw", 60),
    System("tiermem-cpu", 90),
    System("deepspeed-zero2", 100, needs=("deepspeed",)),
    System("fsdp2", 75),
    System("torchao", 60, needs=("torchao",), needs_cuda=True),
    System("tiermem-delayed", 60),
    System("tiermem-paged", 75),
    System("tiermem-nvme", 60, warmup=1, steps=3),  # ~35 GB of state read and written a step
    System("tiermem-int8", 60),
    System("deepspeed-zero3", 90, needs=("deepspeed",)),
)

MIN_ROW_S = 15.0
"""A row is not started with less than this left of the campaign."""
BUILD_WAIT_S = 150.0
"""Longest the rows after the first wait for DeepSpeed's CPU Adam build (a failed build fails its rows)."""


# --------------------------------------------------------------------------------------------- figures


def model_tflops(numel: int, tokens: int, step_s: float) -> float:
    """Model TFLOP/s: 6 FLOPs per param per token (forward 2, backward 4), attention not counted."""
    return 6.0 * numel * tokens / step_s / 1e12


def gpu_slug(device_name: str | None) -> str:
    """``h100``, ``h200``, ``a100``... from the CUDA device name; ``cpu-tiny`` without one."""
    if not device_name:
        return "cpu-tiny"
    found = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", device_name.upper())
    return found.group(1).lower() if found else re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def relative(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0:
        return None
    return (value - reference) / reference


def summarize(row: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    """The figures the table shows, from a row's steps (finished or cut short) and the AdamW row."""
    step_s = row.get("step_s") or []
    out: dict[str, Any] = {"steps_timed": len(step_s)}
    if step_s:
        median = statistics.median(step_s)
        out.update(
            step_s_median=median,
            tokens_per_s=row["tokens_per_step"] / median,
            model_tflops=model_tflops(row["numel"], row["tokens_per_step"], median),
        )
        ref_s = (reference or {}).get("summary", {}).get("step_s_median")
        out["step_over_adamw"] = median / ref_s if ref_s else None
    ref_losses = (reference or {}).get("losses") or []
    losses = row.get("losses") or []
    if row.get("loss_after") is not None and reference and len(losses) == len(ref_losses):
        out["loss_vs_adamw"] = relative(row["loss_after"], reference.get("loss_after"))
        out["loss_compared"] = "after the timed steps"
    elif losses and len(ref_losses) >= len(losses):
        out["loss_vs_adamw"] = relative(losses[-1], ref_losses[len(losses) - 1])
        out["loss_compared"] = f"training loss at step {len(losses) - 1}"
    pcie = row.get("pcie") or {}
    for source in ("counter", "nvml", "computed"):
        value = pcie.get(f"{source}_nbytes_per_step")
        if value is not None:
            out["pcie_nbytes_per_step"], out["pcie_source"] = value, source
            out["pcie_bytes_per_param"] = value / row["numel"] if row.get("numel") else None
            break
    return out


def row_from_progress(lines: list[str]) -> dict[str, Any]:
    """What a row killed before it finished leaves: its set-up and the steps it completed."""
    row: dict[str, Any] = {"step_s": [], "losses": []}
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the line being written when the row was killed
        if event.get("event") == "ready":
            row.update(setup_s=event["setup_s"], numel=event["numel"])
        elif event.get("event") == "step":
            row["losses"].append(event["loss"])
            if event["timed"]:
                row["step_s"].append(event["step_s"])
            if "gpu_peak_allocated_nbytes" in event:
                row["gpu_peak_allocated_nbytes"] = event["gpu_peak_allocated_nbytes"]
    return row


def refresh_summaries(result: dict[str, Any]) -> None:
    """Every row's ``summary``, the AdamW row's first (the others compare with it)."""
    reference = result["rows"].get("adamw")
    if reference is not None and "step_s" in reference:
        reference["summary"] = summarize(reference, reference)
    for row in result["rows"].values():
        if "step_s" in row:
            row["summary"] = summarize(row, reference)


# --------------------------------------------------------------------------------------------- results file


def load_result(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"campaign": {}, "rows": {}}
    data = json.loads(path.read_text())
    data.setdefault("rows", {})
    return data


def done_rows(result: dict[str, Any]) -> set[str]:
    """Rows ``--resume`` keeps: those that finished."""
    return {name for name, row in result["rows"].items() if row.get("status") == "ok"}


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Rewrite the whole result, atomically: a kill mid-write leaves the previous file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)


def _fmt(value: Any, spec: str) -> str:
    """``value`` in ``spec``; a dash as wide where there is none."""
    if value is None:
        width = re.match(r"\D*(\d*)", spec).group(1)  # type: ignore[union-attr]
        return "-".rjust(int(width or 0))
    return format(value, spec)


def format_table(result: dict[str, Any]) -> str:
    header = (
        f"{'system':<16} {'status':<14} {'step s':>7} {'xAdamW':>6} {'tok/s':>8} {'TFLOP/s':>7} "
        f"{'GPU GiB':>7} {'host GiB':>8} {'PCIe B/param':>12} {'loss':>7} {'dloss':>8}"
    )
    lines = [header, "-" * len(header)]
    for name, row in result["rows"].items():
        s = row.get("summary", {})
        pcie = s.get("pcie_bytes_per_param")
        pcie_cell = "-" if pcie is None else f"{pcie:.2f} {s['pcie_source'][:4]}"
        gpu = row.get("gpu_peak_allocated_nbytes")
        host = row.get("host_peak_nbytes")
        loss = row.get("loss_after") if row.get("status") == "ok" else (row.get("losses") or [None])[-1]
        lines.append(
            f"{name:<16} {row.get('status', '?')[:14]:<14} {_fmt(s.get('step_s_median'), '7.3f')} "
            f"{_fmt(s.get('step_over_adamw'), '6.2f')} {_fmt(s.get('tokens_per_s'), '8.0f')} "
            f"{_fmt(s.get('model_tflops'), '7.1f')} {_fmt(gpu and gpu / GiB, '7.1f')} "
            f"{_fmt(host and host / GiB, '8.1f')} {pcie_cell:>12} {_fmt(loss, '7.4f')} "
            f"{_fmt(s.get('loss_vs_adamw'), '+8.1e')}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- processes


class HostMemory:
    """The node's used memory (MemTotal - MemAvailable) sampled every 0.1 s on a thread; ``peak`` above the
    value when it started."""

    def __init__(self) -> None:
        self.base = self.read()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def read() -> int:
        fields = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024
        return fields["MemTotal"] - fields["MemAvailable"]

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self.read() - self.base)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(workdir: Path, cuda: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))  # ninja for JIT builds
    env.setdefault("TORCH_EXTENSIONS_DIR", str(workdir / "torch_extensions"))  # DeepSpeed's ops, built once
    env["DS_ACCELERATOR"] = "cuda" if cuda else "cpu"
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    return env


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the row's process group (its daemon and compilers too), SIGKILL after 5 s."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
            return


def append_log(log: Any, title: str, path: Path) -> str:
    """Copy a process's output file into the campaign's log under a title; its last 3,000 characters."""
    text = path.read_text(errors="replace") if path.is_file() else ""
    log.write(f"\n===== {title} =====\n{text}")
    log.flush()
    return text[-3000:]


def run_row(
    system: System, spec: dict[str, Any], limit_s: float, workdir: Path, log: Any, *, clear_locks: bool = True
) -> dict[str, Any]:
    """One row in its own process group, killed at ``limit_s``; its directory (the NVMe row's swap files)
    removed after; ``clear_locks``: a failed row's JIT build locks removed (not while another build runs)."""
    rowdir = workdir / system.name
    shutil.rmtree(rowdir, ignore_errors=True)
    rowdir.mkdir(parents=True)
    spec = dict(spec, system=system.name, time_limit_s=limit_s, workdir=str(rowdir))
    spec.update(progress=str(rowdir / "progress.jsonl"), row=str(rowdir / "row.json"))
    for key in ("warmup", "steps"):
        if getattr(system, key) is not None:
            spec[key] = getattr(system, key)
    spec_path = rowdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    memory = HostMemory()
    started = time.perf_counter()
    env = child_env(workdir, spec["device"] == "cuda")
    with open(rowdir / "output.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(spec_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            rc = None
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)  # every thread's stack into its output first
            time.sleep(1.0)
        finally:
            stop_group(proc)
    if rc != 0 and clear_locks:
        remove_build_locks(env["TORCH_EXTENSIONS_DIR"])
    wall_s = time.perf_counter() - started
    host_peak = memory.stop()
    tail = append_log(log, f"{system.name} (limit {limit_s:.0f} s, rc {rc})", rowdir / "output.log")
    row_file = Path(spec["row"])
    if rc == 0 and row_file.is_file():
        row = json.loads(row_file.read_text())
    else:
        progress = Path(spec["progress"])
        row = row_from_progress(progress.read_text().splitlines() if progress.is_file() else [])
        row["status"] = f"timeout {limit_s:.0f}s" if rc is None else f"error rc={rc}"
        row.setdefault("tokens_per_step", spec["batch"] * spec["model"]["seq_len"])
        row["output_tail"] = tail
    row.update(wall_s=wall_s, limit_s=limit_s, host_peak_nbytes=host_peak)
    shutil.rmtree(rowdir, ignore_errors=True)
    return row


def remove_build_locks(extensions: str) -> None:
    """A JIT build killed midway leaves torch's lock file, on which every later load of that op would wait
    until its row's time limit."""
    for lock in Path(extensions).rglob("lock"):
        lock.unlink(missing_ok=True)


class DeepSpeedBuild:
    """DeepSpeed's CPU Adam, JIT-built (ninja, the host compiler) into the shared extensions directory in
    the background while the first row runs; ``finish`` waits for it, at most ``limit_s``."""

    def __init__(self, workdir: Path, cuda: bool) -> None:
        self.output = workdir / "deepspeed-build.log"
        self.started = time.perf_counter()
        env = child_env(workdir, cuda)
        self.extensions = env["TORCH_EXTENSIONS_DIR"]
        code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
        with open(self.output, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def finish(self, limit_s: float, log: Any) -> dict[str, Any]:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(max(0.0, limit_s))
        stop_group(self.proc)
        rc = self.proc.returncode
        if rc != 0:
            remove_build_locks(self.extensions)
        tail = append_log(log, f"deepspeed cpu_adam build (rc {rc})", self.output)
        out: dict[str, Any] = {"rc": rc, "seconds": time.perf_counter() - self.started}
        if rc != 0:
            out["output_tail"] = tail
        return out


# --------------------------------------------------------------------------------------------- main


def device_info(cuda: bool) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cpus": os.cpu_count()}
    info["host_nbytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if cuda:  # from nvidia-smi: a CUDA context in this process would hold GPU memory through every row
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"]
        with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
            name, mib, driver = (
                subprocess.run(query, check=False, capture_output=True, text=True, timeout=30)
                .stdout.split("\n")[0]
                .split(", ")
            )
            info.update(device=name, device_nbytes=int(mib) << 20, driver=driver)
    for package in ("deepspeed", "torchao"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            info[package] = version(package)
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda where available")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (seconds on a CPU)")
    parser.add_argument("--dry-run", action="store_true", help="--device cpu --tiny: the pipeline, here")
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="default: benchmarks/results; a fresh temporary one for --tiny"
    )
    parser.add_argument("--systems", default="", help="comma-separated rows to run (default: all, in order)")
    parser.add_argument("--resume", action="store_true", help="keep the file's finished rows, run the others")
    parser.add_argument("--time-limit", type=float, default=450.0, help="seconds for the whole campaign")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply each row's budget (a slow machine)")
    parser.add_argument("--batch", type=int, default=None, help="sequences a step (default 8; tiny 2)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps after the warm-up")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device, args.tiny = "cpu", True
    if args.out_dir is None:
        args.out_dir = Path(tempfile.mkdtemp(prefix="gpu-peers-tiny-")) if args.tiny else HERE / "results"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    campaign_start = time.perf_counter()
    import torch
    from gpu_peers_worker import LlamaConfig

    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if cuda and not torch.cuda.is_available():
        print("--device cuda: no CUDA device", file=sys.stderr)
        return 2
    chosen = [s for s in CAMPAIGN if not args.systems or s.name in args.systems.split(",")]
    unknown = set(filter(None, args.systems.split(","))) - {s.name for s in CAMPAIGN}
    if unknown:
        print(f"unknown systems {sorted(unknown)}; choose from {[s.name for s in CAMPAIGN]}", file=sys.stderr)
        return 2
    info = device_info(cuda)
    slug = gpu_slug(info.get("device")) if cuda else "cpu-tiny" if args.tiny else "cpu"
    path = args.out_dir / f"gpu-peers-{slug}.json"
    result = load_result(path) if args.resume else {"campaign": {}, "rows": {}}
    keep = done_rows(result)
    cfg = LlamaConfig.tiny() if args.tiny else LlamaConfig()
    spec = {
        "device": "cuda" if cuda else "cpu",
        "model": cfg.as_dict(),
        "batch": args.batch or (2 if args.tiny else 8),
        "warmup": args.warmup,
        "steps": args.steps,
        "seed": args.seed,
    }
    result["campaign"] = {**info, **spec, "numel": cfg.num_params(), "time_limit_s": args.time_limit}
    print(f"{cfg.num_params():,} params, batch {spec['batch']} x {cfg.seq_len}, {info.get('device', 'cpu')}")
    print(f"results: {path}")
    deadline = campaign_start + args.time_limit
    workdir = Path(tempfile.mkdtemp(prefix="gpu-peers-"))
    log_path = args.out_dir / f"gpu-peers-{slug}.log"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with open(log_path, "a") as log:
            build = None
            if find_spec("deepspeed") and any(s.name.startswith("deepspeed") and s.name not in keep for s in chosen):
                build = DeepSpeedBuild(workdir, cuda)
            for system in chosen:
                if system.name in keep:
                    print(f"{system.name}: kept from {path.name}")
                    continue
                if build is not None and system.name != "adamw":  # the build must not share the CPU with a row
                    wait_s = min(BUILD_WAIT_S * args.budget_scale, deadline - time.perf_counter() - MIN_ROW_S)
                    result["campaign"]["deepspeed_build"] = build.finish(wait_s, log)
                    build = None
                left = deadline - time.perf_counter()
                missing = [p for p in system.needs if find_spec(p) is None]
                if missing:
                    row: dict[str, Any] = {"status": "not installed", "missing": missing}
                elif system.needs_cuda and not cuda:
                    row = {"status": "needs CUDA"}
                elif left < MIN_ROW_S:
                    row = {"status": "not run", "reason": f"{left:.0f} s left of --time-limit {args.time_limit:.0f}"}
                else:
                    row = run_row(
                        system,
                        spec,
                        min(system.budget_s * args.budget_scale, left),
                        workdir,
                        log,
                        clear_locks=build is None,
                    )
                result["rows"][system.name] = row
                refresh_summaries(result)
                result["campaign"]["seconds"] = time.perf_counter() - campaign_start
                write_result(path, result)
                median = row.get("summary", {}).get("step_s_median")
                print(
                    f"{system.name}: {row['status']}"
                    + (f", {median:.3f} s/step" if median else "")
                    + f" ({row.get('wall_s', 0):.0f} s; {time.perf_counter() - campaign_start:.0f} s in)",
                    flush=True,
                )
            if build is not None:
                result["campaign"]["deepspeed_build"] = build.finish(0.0, log)
                write_result(path, result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # the NVMe row's swap files among them
    print()
    print(format_table(result))
    print(f"\n{time.perf_counter() - campaign_start:.0f} s; rows' output in {log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak host memory of trainer + daemon together, per parameter, for each way of running Adam.

Modes, each run alone in a fresh worker process (one model in memory at a time):

- ``model``: forward and backward only, no optimizer: the floor (params, grads,
  activations, the torch runtime) that every other mode adds to;
- ``adamw``: ``torch.optim.AdamW`` in process, its default implementation (on
  CPU params ``foreach=None`` resolves to the per-tensor loop, not ``foreach``
  and not ``fused``; the JSON records what it resolved to);
- ``cpuadam``: ``tiermem.CPUAdam`` in process (the engine tiermemd runs);
- ``offload-cpu`` / ``offload-nvme``: ``tiermem.OffloadAdam(offload=...)`` with
  the private ``tiermemd`` child it starts itself (the default user path);
- ``offload-cpu-release`` / ``offload-nvme-release`` (``--release-grads``): the
  same with ``release_grads=True`` when ``OffloadAdam`` accepts that keyword,
  else reported as ``n/a``.

Every ``offload-*`` mode is run once per state dtype of ``--state-dtypes``
(comma-separated, of ``fp32``, ``bf16``, ``int8``; default ``fp32``), passed
as ``OffloadAdam(state_dtype=...)``: how the daemon stores the Adam moments
(fp32: 4 + 4 bytes a param; bf16: 2 + 2; int8: 1 + 1 and one fp32 scale a
block of 256 elements).  Such a row is labelled with its state dtype
(``offload-cpu int8``); the other modes have none and run once.  The private
daemon's pool is sized for the compressed bytes, so the peak shows what a
state dtype saves.

The model is the demo GPT (``tiermem.client.demo.model``, ``GPTConfig.for_params``)
built directly in the measured dtype (no transient fp32 copy of a bf16 model),
trained for ``--steps`` steps on random tokens, batch ``--batch`` x
``--seq`` tokens: small, so that activations stay small next to the optimizer
state; the bytes autograd saves for backward are measured on the first step and
printed.  A stack of Linear layers would put the same bytes in the same places;
the GPT keeps the real tensor mix (embeddings, LayerNorms, many tensors per
bucket) that the window layout and buckets are planned for.

How memory is measured.  With the cgroup v1 memory controller writable (it is
on these machines) every run gets a fresh child cgroup of the one this script
runs in (``tiermem-bench-<pid>-<n>``).  The worker is started, moved into it
(its pid written to ``cgroup.procs``) and only then told to import torch; the
daemon that ``OffloadAdam`` starts, and any compile workers, are its children
and inherit the cgroup, so trainer and daemon are charged together, shared
memory included (a memfd window's pages are charged to the cgroup that first
touches them, and both sides are in it).  The figure is
``memory.max_usage_in_bytes``: the kernel's own high-water mark of the run.
It is read and reset at every phase mark (import, model, optimizer, step1..N,
stats, close), so the JSON keeps each phase's own peak; the table names the
first phase that came within 1% of the run's peak.  ``memory.usage_in_bytes``
is sampled every 50 ms, and ``memory.stat`` (rss = anonymous memory, shmem,
cache = page cache including shmem) is kept at the highest sample.  The cgroup
is removed when its processes have exited.  A limit (``--mem-limit-gib``,
default: memory available at the start of the run less 1 GiB) turns a runaway
run into an OOM kill inside its cgroup, reported in its row, instead of a
machine-wide one.

Without a writable controller (or with ``--method pss``) the fallback sums
``Pss`` from ``/proc/<pid>/smaps_rollup`` over the worker and all its
descendants every 50 ms (PSS splits shared pages among their mappers, so the
sum counts the window once); a sampled peak can miss spikes shorter than the
period, PSS also counts the mapped pages of shared libraries (about 0.1 GiB for
torch per process tree; a cgroup charges them only to whoever read them
first), and the output says which method was used.

Against what: the ratio column is each row's peak over ``adamw``'s peak at the
same size and dtype.  Note that ``adamw`` on a bf16 model keeps bf16 state
(8 B/param of params, grads and moments), not fp32 master weights, so it is the
floor of what torch does in process, not a mixed-precision peer.  Window bytes
come from ``OffloadAdam.stats()`` (``rank_window_bytes``), pool bytes from the
daemon's ``pool_capacity_bytes``: a window or pool that grows with the model
shows here.  The daemon's state bytes per param, after the last step, are the
columns ``cpu st B/p`` (``stats().rank.cpu_state_nbytes``: all of the state on
the CPU tier, the chunk cache on the NVMe tier) and ``nvme st B/p``
(``nvme_state_nbytes``: the swap bytes, with any older versions not yet
freed), each over the model's params.  With the fp32 master the state is
12 (fp32 moments), 8 (bf16) and 6.03 (int8) bytes a param; an fp32 model on
the CPU tier keeps no master apart from its params (the pool-backed params
are the master), so there it is 8, 4 and 2.03.  int8 lays each tensor out
from a block's start, so a model of many small tensors takes a little more.
On the NVMe tier the chunk cache holds what fits (all of a small model's
state, which ``cpu st B/p`` then shows whole) and the swap the chunks written
back so far; a chunk in both counts in both, so there the two columns need
not add up to the state.
A run that fails (an exception, an OOM kill, ``--timeout-s``) is a row with
its reason, not the end of the benchmark.

    ./run.sh bench memory --params 100e6,300e6 --dtypes float32,bfloat16 \\
        [--modes model,adamw,cpuadam,offload-cpu,offload-nvme] [--state-dtypes fp32,bf16,int8] \\
        [--steps 3] [--release-grads] [--json out.json]

Defaults are a quick run (``--params 20e6 --dtypes float32 --state-dtypes fp32``);
the documented run is 100M and 300M in fp32 and bf16.  The JSON keeps a run's
``mode`` as above and adds its ``state_dtype`` (null for the modes without
one), its ``label`` (the table's row name) and ``cpu_state_per_param`` /
``nvme_state_per_param``; the worker's ``state_dtype``, ``cpu_state_nbytes``
and ``nvme_state_nbytes`` are the daemon's own figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
SAMPLE_S = 0.05
BASE_MODES = ("model", "adamw", "cpuadam", "offload-cpu", "offload-nvme")
RELEASE_MODES = ("offload-cpu-release", "offload-nvme-release")
ALL_MODES = BASE_MODES + RELEASE_MODES
STAT_KEYS = ("rss", "cache", "shmem", "mapped_file")


# ----------------------------------------------------------------------------- memory probes (parent side)


def own_memory_cgroup() -> Path | None:
    """The cgroup v1 memory directory this process is in, when a child can be made there; else None."""
    root = Path("/sys/fs/cgroup/memory")
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = root / path.lstrip("/")
            probe = base / f"tiermem-bench-probe-{os.getpid()}"
            try:
                probe.mkdir()
                probe.rmdir()
            except OSError:
                return None
            return base
    return None


class CgroupProbe:
    """One fresh child memory cgroup around one run."""

    method = "cgroup-v1"

    def __init__(self, parent: Path, name: str, limit_nbytes: int | None) -> None:
        self.dir = parent / name
        self.dir.mkdir()
        # charges made before the move (the interpreter's start-up) follow the task where the kernel allows it
        with contextlib.suppress(OSError):
            self._write("memory.move_charge_at_immigrate", "3")
        if limit_nbytes:
            self._write("memory.limit_in_bytes", str(limit_nbytes))
        self.limit_nbytes = limit_nbytes

    def _write(self, name: str, value: str) -> None:
        (self.dir / name).write_text(value)

    def _read(self, name: str) -> str:
        return (self.dir / name).read_text()

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))
        self.reset_peak()

    def usage(self) -> int:
        return int(self._read("memory.usage_in_bytes"))

    def peak(self) -> int:
        return int(self._read("memory.max_usage_in_bytes"))

    def reset_peak(self) -> None:
        self._write("memory.max_usage_in_bytes", "0")

    def stat(self) -> dict[str, int]:
        out = {}
        for line in self._read("memory.stat").splitlines():
            key, _, value = line.partition(" ")
            if key in STAT_KEYS:
                out[key] = int(value)
        return out

    def pids(self) -> list[int]:
        return [int(p) for p in self._read("cgroup.procs").split()]

    def events(self) -> dict[str, int]:
        out = {"failcnt": int(self._read("memory.failcnt"))}
        for line in self._read("memory.oom_control").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                out["oom_kill"] = int(value)
        return out

    def remove(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                self.dir.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    todo.extend(int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split())
    return out


class PssProbe:
    """Summed PSS of the worker and its descendants, sampled (the fallback)."""

    method = "pss-sampled"
    limit_nbytes = None

    def __init__(self) -> None:
        self.root = 0
        self._peak = 0
        self._last: dict[str, int] = {}

    def add(self, pid: int) -> None:
        self.root = pid

    def _rollup(self) -> dict[str, int]:
        fields = {"Pss:": "pss", "Pss_Anon:": "rss", "Pss_Shmem:": "shmem", "Pss_File:": "cache"}
        total = dict.fromkeys(fields.values(), 0)
        for pid in _descendants(self.root):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    parts = line.split()
                    if parts and parts[0] in fields:
                        total[fields[parts[0]]] += int(parts[1]) * 1024
        return total

    def usage(self) -> int:
        self._last = self._rollup()
        self._peak = max(self._peak, self._last["pss"])
        return self._last["pss"]

    def peak(self) -> int:
        self.usage()
        return self._peak

    def reset_peak(self) -> None:
        self._peak = 0

    def stat(self) -> dict[str, int]:
        return {k: v for k, v in self._last.items() if k != "pss"}

    def pids(self) -> list[int]:
        return _descendants(self.root) if self.root else []

    def events(self) -> dict[str, int]:
        return {}

    def remove(self) -> None:
        pass


# ----------------------------------------------------------------------------- one run (parent side)


@dataclass
class RunSpec:
    mode: str
    dtype: str
    params: int
    steps: int
    batch: int
    seq: int
    msg_fd: int = -1
    state_dtype: str | None = None
    """``OffloadAdam(state_dtype=...)`` of an ``offload-*`` mode; None for the others."""


@dataclass
class RunResult:
    mode: str
    dtype: str
    params_target: int
    state_dtype: str | None = None
    """The offload modes' ``state_dtype``; None for the others."""
    status: str = "ok"
    """ok, n/a (the mode is not supported by this code), failed, timeout."""
    reason: str = ""
    peak_nbytes: int | None = None
    peak_phase: str = ""
    """The first phase whose high-water mark came within 1% of the peak."""
    at_peak_sample: dict[str, int] = field(default_factory=dict)
    """memory.stat (or PSS parts) at the highest usage sample."""
    phases: list[dict[str, Any]] = field(default_factory=list)
    processes: dict[str, str] = field(default_factory=dict)
    """pid -> command line of every process seen in the run."""
    events: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    worker: dict[str, Any] = field(default_factory=dict)
    """What the worker reported: param count, activation bytes, optimizer details, daemon stats."""

    @property
    def numel(self) -> int:
        return int(self.worker.get("numel", self.params_target))

    @property
    def label(self) -> str:
        """The row's name: the mode, and its state dtype where it has one (``offload-cpu int8``)."""
        return f"{self.mode} {self.state_dtype}" if self.state_dtype else self.mode

    def state_per_param(self, tier: str) -> float | None:
        """The daemon's state bytes on ``tier`` (cpu, nvme) after the last step, over the model's params."""
        nbytes = self.worker.get(f"{tier}_state_nbytes")
        return nbytes / self.numel if nbytes is not None and self.numel else None


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    return ""


def run_one(spec: RunSpec, probe: CgroupProbe | PssProbe, *, timeout_s: float, log_dir: Path) -> RunResult:
    result = RunResult(spec.mode, spec.dtype, spec.params, spec.state_dtype)
    read_fd, write_fd = os.pipe()
    spec.msg_fd = write_fd
    log_path = log_dir / f"{spec.mode}-{spec.state_dtype or 'none'}-{spec.dtype}-{spec.params}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    # never reach a shared daemon: its memory would not be in the cgroup; OffloadAdam starts a private one
    env["TIERMEM_SOCKET_PATH"] = str(log_dir / "no-such-daemon.sock")
    env["PYTHONUNBUFFERED"] = "1"
    t0 = time.monotonic()
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(asdict(spec))],
            stdin=subprocess.PIPE,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            env=env,
        )
    os.close(write_fd)
    messages: list[dict[str, Any]] = []
    lock = threading.Lock()

    def on_phase(name: str) -> None:
        """The worker finished phase ``name``: its peak is the high-water mark since the last phase ended."""
        with lock:
            peak = probe.peak()
            result.phases.append({"phase": name, "peak_nbytes": peak, "end_usage_nbytes": probe.usage()})
            probe.reset_peak()

    def reader() -> None:
        with os.fdopen(read_fd, "rb") as stream:
            for line in stream:
                msg = json.loads(line)
                messages.append(msg)
                if "phase" in msg:
                    on_phase(msg["phase"])

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    best = -1
    try:
        probe.add(proc.pid)
        assert proc.stdin is not None
        proc.stdin.write(b"g")  # moved: now the worker may import torch
        proc.stdin.close()
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                result.status, result.reason = "timeout", f"no result after {timeout_s:.0f} s"
                _kill(probe.pids())
                break
            with lock:
                usage = probe.usage()
                if usage > best:
                    best = usage
                    result.at_peak_sample = probe.stat()
            for pid in probe.pids():
                if str(pid) not in result.processes:
                    result.processes[str(pid)] = _cmdline(pid)[:160]
            time.sleep(SAMPLE_S)
        proc.wait()
        thread.join(timeout=10)
        finished = any(m.get("info", {}).get("done") for m in messages)
        on_phase("close" if finished else "unfinished")  # from the last phase mark to the exit
    finally:
        if proc.poll() is None:
            _kill([proc.pid])
            proc.wait()
        deadline = time.monotonic() + 30
        while probe.pids() and time.monotonic() < deadline:  # the daemon exits with its parent
            time.sleep(0.2)
        _kill(probe.pids())
        result.events = probe.events()
    result.wall_s = time.monotonic() - t0
    result.peak_nbytes = max(p["peak_nbytes"] for p in result.phases)
    # memory often plateaus from the first step on: name the first phase that reached (within 1%) the peak
    result.peak_phase = next(p["phase"] for p in result.phases if p["peak_nbytes"] >= 0.99 * result.peak_nbytes)
    for msg in messages:
        result.worker.update(msg.get("info", {}))
    if result.status == "ok":
        if "unsupported" in result.worker:
            result.status, result.reason = "n/a", result.worker["unsupported"]
        elif "error" in result.worker:
            result.status, result.reason = "failed", result.worker["error"]
        elif proc.returncode != 0:
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
            oom = result.events.get("oom_kill", 0)
            result.status = "failed"
            ended = len(result.phases) - 1  # the last record is the exit, after the last finished phase
            after = result.phases[ended - 1]["phase"] if ended > 0 else "start-up"
            result.reason = f"worker ended by {how} after phase {after}" + (
                f" (cgroup oom_kill={oom}, limit {probe.limit_nbytes / GiB:.1f} GiB)" if oom else ""
            )
        elif not result.worker.get("done"):
            result.status, result.reason = "failed", "worker exited without a result"
    if result.status in ("failed", "timeout"):
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        result.worker["log_tail"] = tail
    return result


# ----------------------------------------------------------------------------- the worker (inside the cgroup)


def worker_main(spec: RunSpec) -> int:
    sys.stdin.buffer.read(1)  # wait until the parent has moved this process into its cgroup
    out = os.fdopen(spec.msg_fd, "w", buffering=1)

    def send(**msg: Any) -> None:
        out.write(json.dumps(msg) + "\n")

    def phase(name: str) -> None:
        send(phase=name)
        time.sleep(0.1)  # the parent closes the previous phase around here

    try:
        return _train(spec, send, phase)
    except Exception as exc:
        send(info={"error": f"{type(exc).__name__}: {exc}"[:500]})
        import traceback

        traceback.print_exc()
        return 1


def _train(spec: RunSpec, send: Any, phase: Any) -> int:
    import importlib.util
    import inspect

    import torch

    import tiermem
    from tiermem.client.demo.model import GPT, GPTConfig

    cfg = GPTConfig.for_params(spec.params, block_size=spec.seq)
    daemon_spec = importlib.util.find_spec("tiermemd")
    send(
        info={
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "tiermem_path": tiermem.__file__,
            "tiermemd_path": daemon_spec.origin if daemon_spec else None,
            "numel": cfg.num_params(),
            "config": str(cfg),
        }
    )
    offload = spec.mode.startswith("offload-")
    release = spec.mode.endswith("-release")
    if release:
        from tiermem.client.offload import OffloadAdam

        if "release_grads" not in inspect.signature(OffloadAdam.__init__).parameters:
            send(info={"unsupported": "OffloadAdam has no release_grads keyword in this version"})
            return 0
    phase("import")

    dtype = getattr(torch, spec.dtype)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the measured dtype: no transient fp32 copy
    try:
        model = GPT(cfg)
    finally:
        torch.set_default_dtype(previous)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    send(info={"numel": numel, "param_dtypes": sorted({str(p.dtype) for p in params})})
    phase("model")

    opt: Any = None
    info: dict[str, Any] = {}
    hyper = {"lr": 1e-4, "weight_decay": 0.01}
    if spec.mode == "adamw":
        opt = torch.optim.AdamW(params, **hyper)
        info["adamw"] = {"foreach": opt.defaults["foreach"], "fused": opt.defaults["fused"]}
        with contextlib.suppress(Exception):
            from torch.optim.optimizer import _default_to_fused_or_foreach

            fused, foreach = _default_to_fused_or_foreach(params, False, False)
            info["adamw"]["resolved"] = "fused" if fused else "foreach" if foreach else "for-loop"
    elif spec.mode == "cpuadam":
        opt = tiermem.CPUAdam(params, **hyper)
    elif offload:
        from tiermem.client.offload import OffloadAdam

        kwargs: dict[str, Any] = {"offload": "nvme" if "nvme" in spec.mode else "cpu"}
        if spec.state_dtype is not None:
            kwargs["state_dtype"] = spec.state_dtype
        if release:
            kwargs["release_grads"] = True
        opt = OffloadAdam(params, **hyper, **kwargs)
    elif spec.mode != "model":
        raise ValueError(f"unknown mode {spec.mode}")
    send(info=info)
    phase("optimizer")

    g = torch.Generator().manual_seed(1)
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    step_s = []
    losses = []
    for step in range(spec.steps):
        x = torch.randint(0, cfg.vocab_size, (spec.batch, spec.seq), generator=g)
        y = torch.randint(0, cfg.vocab_size, (spec.batch, spec.seq), generator=g)
        t0 = time.perf_counter()
        if step == 0:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(x, y)
        else:
            loss = model(x, y)
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        del loss
        phase(f"step{step + 1}")

    done: dict[str, Any] = {"step_s": step_s, "losses": losses, "activation_nbytes": sum(saved.values())}
    if offload:
        stats = opt.stats()
        done["daemon_stats"] = {"pool_capacity_bytes": stats.node.pool.capacity_nbytes}
        done["window_nbytes"] = stats.rank.window_nbytes
        done["state_dtype"] = stats.rank.state_dtype  # as the daemon reports it
        done["cpu_state_nbytes"] = stats.rank.cpu_state_nbytes
        done["nvme_state_nbytes"] = stats.rank.nvme_state_nbytes
    send(info=done)
    phase("stats")
    if offload:
        opt.close()
    send(info={"done": True})
    return 0


# ----------------------------------------------------------------------------- report


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                info[key.lower() + "_nbytes"] = int(value.split()[0]) * 1024
    return info


def source_info(results: list[RunResult]) -> dict[str, Any]:
    """The checkout the workers imported tiermem from (else this file's), its commit and uncommitted files."""
    paths = [r.worker["tiermem_path"] for r in results if r.worker.get("tiermem_path")]
    repo = Path(paths[0]).resolve().parent.parent if paths else Path(__file__).resolve().parent.parent
    out: dict[str, Any] = {
        "root": str(repo),
        "tiermemd_path": next((r.worker["tiermemd_path"] for r in results if r.worker.get("tiermemd_path")), None),
    }
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out["commit"] = subprocess.check_output(["git", "-C", str(repo), "rev-parse", "HEAD"], text=True).strip()
        dirty = subprocess.check_output(
            ["git", "-C", str(repo), "status", "--porcelain", "--", "tiermem", "daemon"], text=True
        )
        out["dirty_files"] = [line[3:] for line in dirty.splitlines()]
    return out


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def fmt_params(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n >= GiB:
        return f"{n / GiB:.2f}GiB"
    return f"{n / MiB:.0f}MiB"


def print_table(results: list[RunResult]) -> None:
    base = {(r.dtype, r.params_target): r.peak_nbytes for r in results if r.mode == "adamw" and r.status == "ok"}
    header = (
        f"{'mode':<25} {'dtype':<9} {'params':>7} {'peak GiB':>9} {'B/param':>8} {'x adamw':>8} "
        f"{'anon GiB':>9} {'shmem GiB':>10} {'window':>9} {'pool':>9} {'cpu st B/p':>10} {'nvme st B/p':>11} "
        f"{'peak in':>9}  note"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        head = f"{r.label:<25} {r.dtype:<9} {fmt_params(r.numel):>7}"
        if r.status != "ok":
            blank = f"{'':>9} {'':>10} {'':>9} {'':>9} {'':>10} {'':>11} {'':>9}"
            print(f"{head} {'n/a':>9} {'n/a':>8} {'n/a':>8} {blank}  {r.status}: {r.reason}")
            continue
        peak = r.peak_nbytes or 0
        ref = base.get((r.dtype, r.params_target))
        ratio = f"{peak / ref:.2f}x" if ref else "-"
        sample = r.at_peak_sample
        anon = f"{sample['rss'] / GiB:.2f}" if "rss" in sample else "-"
        shmem = f"{sample['shmem'] / GiB:.2f}" if "shmem" in sample else "-"
        window = pool = cpu_state = nvme_state = ""
        if r.mode.startswith("offload"):
            window = fmt_bytes(r.worker.get("window_nbytes"))
            pool_nbytes = r.worker.get("daemon_stats", {}).get("pool_capacity_bytes")
            pool = fmt_bytes(int(pool_nbytes)) if pool_nbytes is not None else "-"
            cpu_state, nvme_state = (fmt_per_param(r.state_per_param(tier)) for tier in ("cpu", "nvme"))
        note = ""
        if r.mode.startswith("offload") and not any("tiermemd" in c for c in r.processes.values()):
            note = "no tiermemd seen in the cgroup"
        if r.events.get("failcnt"):
            note += f" hit the cgroup limit {r.events['failcnt']} times"
        reported = r.worker.get("state_dtype")
        if r.state_dtype and reported and reported != r.state_dtype:
            note += f" the daemon reports state_dtype {reported}"
        print(
            f"{head} {peak / GiB:>9.2f} {peak / r.numel:>8.1f} {ratio:>8} {anon:>9} {shmem:>10} "
            f"{window:>9} {pool:>9} {cpu_state:>10} {nvme_state:>11} {r.peak_phase:>9}  {note}"
        )


def fmt_per_param(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def parse_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return worker_main(RunSpec(**json.loads(sys.argv[2])))
    from tiermem.core.modes import STATE_DTYPES  # no torch: the parent stays small

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="20e6", help="comma-separated target parameter counts (e.g. 100e6,300e6)")
    ap.add_argument("--dtypes", default="float32", help="comma-separated model dtypes (float32,bfloat16)")
    ap.add_argument("--modes", default=",".join(BASE_MODES), help=f"comma-separated, from {', '.join(ALL_MODES)}")
    ap.add_argument("--release-grads", action="store_true", help="add the OffloadAdam(release_grads=True) rows")
    ap.add_argument(
        "--state-dtypes",
        default="fp32",
        help=f"comma-separated, of {', '.join(STATE_DTYPES)}: each offload mode once per OffloadAdam(state_dtype=)",
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence (the model's block size)")
    ap.add_argument("--method", choices=("auto", "cgroup", "pss"), default="auto")
    ap.add_argument(
        "--mem-limit-gib", type=float, default=None, help="cgroup limit per run (default: available memory - 1 GiB)"
    )
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    sizes = [int(float(p)) for p in parse_list(args.params)]
    dtypes = parse_list(args.dtypes)
    modes = parse_list(args.modes)
    if args.release_grads:
        modes += [m for m in RELEASE_MODES if m not in modes]
    for m in modes:
        if m not in ALL_MODES:
            ap.error(f"unknown mode {m!r}; choose from {', '.join(ALL_MODES)}")
    for d in dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            ap.error(f"unknown dtype {d!r}")
    state_dtypes = parse_list(args.state_dtypes)
    for sd in state_dtypes:
        if sd not in STATE_DTYPES:
            ap.error(f"unknown state dtype {sd!r}; choose from {', '.join(STATE_DTYPES)}")
    if not state_dtypes:
        ap.error("--state-dtypes names none")
    runs = [(m, sd if m.startswith("offload-") else None) for m in modes for sd in state_dtypes]
    runs = list(dict.fromkeys(runs))  # the modes without a state dtype once

    cgroup_parent = None if args.method == "pss" else own_memory_cgroup()
    if args.method == "cgroup" and cgroup_parent is None:
        ap.error("the cgroup v1 memory controller is not writable here")
    method = "cgroup-v1" if cgroup_parent is not None else "pss-sampled"
    where = f"child cgroups of {cgroup_parent}" if cgroup_parent else "summed PSS of worker + daemon, 50 ms samples"
    print(f"memory measured with {method}: {where}")
    print(f"steps {args.steps}, batch {args.batch} x {args.seq} tokens, one fresh worker per run\n", flush=True)

    machine = machine_info()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    results: list[RunResult] = []
    counter = 0
    started = time.monotonic()
    try:
        for params in sizes:
            for dtype in dtypes:
                for mode, state_dtype in runs:
                    counter += 1
                    spec = RunSpec(mode, dtype, params, args.steps, args.batch, args.seq, state_dtype=state_dtype)
                    limit = int(args.mem_limit_gib * GiB) if args.mem_limit_gib else max(mem_available() - GiB, GiB)
                    probe: CgroupProbe | PssProbe
                    if cgroup_parent is not None:
                        probe = CgroupProbe(cgroup_parent, f"tiermem-bench-{os.getpid()}-{counter}", limit)
                    else:
                        probe = PssProbe()
                    try:
                        r = run_one(spec, probe, timeout_s=args.timeout_s, log_dir=log_dir)
                    finally:
                        probe.remove()
                    results.append(r)
                    act = r.worker.get("activation_nbytes")
                    print(
                        f"  {r.label:<25} {dtype:<9} {fmt_params(r.numel):>6}: {r.status:<6} peak "
                        f"{fmt_bytes(r.peak_nbytes):>9} in {r.peak_phase or '-'}, saved activations "
                        f"{fmt_bytes(act)}, {r.wall_s:.0f} s {r.reason}",
                        flush=True,
                    )
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    print()
    print_table(results)
    acts: dict[tuple[str, str], int] = {}
    for r in results:
        if r.worker.get("activation_nbytes"):
            acts.setdefault((r.dtype, fmt_params(r.numel)), r.worker["activation_nbytes"])
    for (dtype, size), act in acts.items():
        print(f"activations saved for backward ({dtype}, {size}, batch {args.batch}x{args.seq}): {fmt_bytes(act)}")
    print(f"total {time.monotonic() - started:.0f} s")
    if args.json:
        machine["loadavg_end"] = os.getloadavg()
        payload = {
            "benchmark": "bench_memory",
            "method": method,
            "cgroup_parent": str(cgroup_parent) if cgroup_parent else None,
            "sample_period_s": SAMPLE_S,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": machine,
            "source": source_info(results),
            "runs": [
                {
                    **asdict(r),
                    "numel": r.numel,
                    "label": r.label,
                    "cpu_state_per_param": r.state_per_param("cpu"),
                    "nvme_state_per_param": r.state_per_param("nvme"),
                }
                for r in results
            ],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark report: the benchmarks' JSON turned into one markdown page and its PNG plots.

Reads what the scripts of this directory write with ``--json`` into ``--results``
(default ``benchmarks/results``) and writes, beside it (``--out``):

- ``report.md``: the headline table, a section per figure with its table and
  plot, and the list of inputs that were missing;
- ``cpu_adam.png`` (``cpu_adam.json``, bench_cpu_adam.py): Adam Gparam/s by
  size, tiermem against the memory probe and its peers;
- ``swap.png`` (``swap.json``, bench_swap.py): swap store GB/s against fio
  (and the raw engine, DeepSpeed's aio_handle when measured) by block size
  and queue depth, writes and reads;
- ``bytes_per_param.png`` (``memory*.json``, bench_memory.py): peak host
  bytes per parameter of trainer + daemon by mode (the newest run of each
  mode, dtype and size across the files);
- ``largest_model.png`` (``scale*.json``, bench_scale.py): the largest model
  each mode trains in the memory limit;
- ``step_breakdown.png`` (``train_step.json``, bench_train_step.py): where a
  training step's time goes, per mode and size.

A figure whose JSON is absent is listed as missing (with the command that
makes it) and gets no plot.  Needs matplotlib (``pip install 'tiermem[plot]'``).

    .venv/bin/python benchmarks/report.py [--results benchmarks/results] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20
KIB = 1 << 10


@dataclass
class Section:
    """One figure of the report: its markdown, its plot (if drawn), its headline rows."""

    title: str
    source: str
    body: list[str] = field(default_factory=list)
    plot: str = ""
    headlines: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Missing:
    figure: str
    wanted: str
    command: str


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SystemExit(f"report: {path} is not valid JSON: {exc}") from None


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.0f}{unit}" if n % scale == 0 or n / scale >= 10 else f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def elements(n: int) -> str:
    """bench_cpu_adam's sizes are binary (16M = 2**24), as it prints them."""
    return f"{n // MIB}M" if n % MIB == 0 else count(n)


def binary(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


# --------------------------------------------------------------------------- CPU Adam


CPU_ROWS = [
    ("tiermem", "tiermem", "C0", "-"),
    ("bound: same-bytes probe", "same-bytes probe (memory bound)", "C7", "--"),
    ("torch fused", "torch AdamW fused", "C1", "-"),
    ("torch foreach", "torch AdamW foreach", "C2", "-"),
    ("deepspeed", "DeepSpeedCPUAdam", "C3", "-"),
]


def cpu_adam(data: dict[str, Any], plt: Any, out: Path) -> Section:
    sizes = sorted(data["sizes"], key=int)
    sec = Section("CPU Adam against its peers, by size", "cpu_adam.json (bench_cpu_adam.py)")
    header = ["params", *[label for key, label, *_ in CPU_ROWS if key in data["sizes"][sizes[0]]]]
    rows = []
    for n in sizes:
        figures = data["sizes"][n]
        cells = [elements(int(n))]
        for key, *_ in CPU_ROWS:
            if key in figures:
                r = figures[key]
                ratio = "" if key == "tiermem" else f" ({r['tiermem_ratio']:.2f}x)"
                cells.append(f"{r['params_per_s'] / 1e9:.3f}{ratio}")
        rows.append(cells)
    sec.body += [
        f"Gparam/s of one AdamW step, fp16 grads in and fp16 params out, {data['threads']} threads, torch "
        f"{data['torch']}; in brackets tiermem's speed over that row's. DeepSpeed: {data['deepspeed']}.",
        "",
        *table(header, rows),
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [int(n) for n in sizes]
    for key, label, color, style in CPU_ROWS:
        if key in data["sizes"][sizes[0]]:
            ax.plot(
                x,
                [data["sizes"][n][key]["params_per_s"] / 1e9 for n in sizes],
                style,
                marker="o",
                color=color,
                label=label,
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [elements(v) for v in x])
    ax.set_xlabel("parameters per step")
    ax.set_ylabel("Gparam/s (log)")
    ax.set_title(f"AdamW step on the CPU, fp16 grads in / fp16 params out, {data['threads']} threads")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    sec.plot = save(fig, plt, out / "cpu_adam.png")
    top = data["sizes"][sizes[-1]]
    peers = [
        f"{top[k]['tiermem_ratio']:.2f}x {label}"
        for k, label in (("torch fused", "torch fused"), ("deepspeed", "DeepSpeedCPUAdam"))
        if k in top
    ]
    sec.headlines.append(
        (
            f"CPU Adam, {elements(int(sizes[-1]))} params",
            f"{top['tiermem']['params_per_s'] / 1e9:.2f} Gparam/s, "
            f"{top['bound: same-bytes probe']['tiermem_ratio']:.2f}x the memory probe; " + ", ".join(peers),
        )
    )
    return sec


# --------------------------------------------------------------------------- swap


SWAP_SYSTEMS = [
    ("fio", "fio", "C7"),
    ("engine", "tiermem engine", "C2"),
    ("store", "tiermem store", "C0"),
    ("deepspeed", "DeepSpeed aio_handle", "C3"),
]


def swap(data: dict[str, Any], plt: Any, out: Path) -> Section:
    rows = data["rows"]
    systems = [s for s in SWAP_SYSTEMS if s[0] in rows[0]]
    sec = Section("Swap I/O against fio, by block size and queue depth", "swap.json (bench_swap.py)")
    header = ["block", "QD", *[label for _, label, _ in systems]]
    if "fio" in rows[0]:
        header.append("store / fio")
    body = []
    for r in rows:
        cells = [binary(r["block"]), str(r["qd"])] + [f"{r[k][0]:.2f} / {r[k][1]:.2f}" for k, _, _ in systems]
        if "fio" in r:
            cells.append(f"{r['store'][0] / r['fio'][0]:.2f} / {r['store'][1] / r['fio'][1]:.2f}")
        body.append(cells)
    sec.body += [
        f"Sequential O_DIRECT GB/s, write / read, {binary(data['size'])} per run, median of {data['repeats']}.",
        *(f"Note: {n}" for n in data.get("notes", [])),
        "",
        *table(header, body),
    ]
    tier = data.get("tier") or {}
    if tier.get("page_out_s") is not None and tier.get("fio_s"):
        sec.body += [
            "",
            f"Tier manager page-out + page-in {tier['page_out_s'] + tier['page_in_s']:.2f} s against "
            f"{tier['fio_s']:.2f} s for fio moving the same bytes.",
        ]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    labels = [f"{binary(r['block'])}\nQD{r['qd']}" for r in rows]
    width = 0.8 / len(systems)
    for side, ax in enumerate(axes):
        for i, (key, label, color) in enumerate(systems):
            xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(rows))]
            ax.bar(xs, [r[key][side] for r in rows], width, label=label, color=color)
        ax.set_xticks(range(len(rows)), labels)
        ax.set_title("write" if side == 0 else "read")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("GB/s")
    axes[1].legend()
    fig.suptitle(f"Sequential O_DIRECT I/O, {binary(data['size'])} per run")
    sec.plot = save(fig, plt, out / "swap.png")
    best = [r for r in rows if r["block"] == MIB and r["qd"] == 32]
    if best and "fio" in best[0]:
        r = best[0]
        sec.headlines.append(
            (
                "swap store, 1 MiB requests at QD32",
                f"{r['store'][0]:.2f} / {r['store'][1]:.2f} GB/s write / read, "
                f"{r['store'][0] / r['fio'][0]:.2f}x / {r['store'][1] / r['fio'][1]:.2f}x fio",
            )
        )
    return sec


# --------------------------------------------------------------------------- memory


MEMORY_ORDER = [
    "model",
    "adamw",
    "cpuadam",
    "offload-cpu",
    "offload-cpu-release",
    "offload-nvme",
    "offload-nvme-release",
]


def with_state(mode: str, state_dtype: str | None) -> str:
    """A mode's label with its state dtype where the moments were compressed (``offload-cpu int8``)."""
    return mode if state_dtype in (None, "fp32") else f"{mode} {state_dtype}"


def memory_order(label: str) -> tuple[int, int]:
    """Where a mode's label sorts: ``MEMORY_ORDER``'s place of its mode, then fp32, bf16, int8 moments."""
    mode, _, state = label.partition(" ")
    place = MEMORY_ORDER.index(mode) if mode in MEMORY_ORDER else len(MEMORY_ORDER)
    return place, ("", "bf16", "int8").index(state) if state in ("", "bf16", "int8") else 3


def newest_memory_runs(files: list[tuple[str, dict[str, Any]]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """The newest ``ok`` run of each (mode, dtype, size) across bench_memory's files (by their start date); the
    mode is labelled with its state dtype where that is not fp32."""
    best: dict[tuple[str, str, int], tuple[str, dict[str, Any]]] = {}
    for name, data in files:
        date = data.get("machine", {}).get("date", "")
        for run in data.get("runs", []):
            if run.get("status") != "ok":
                continue
            key = (with_state(run["mode"], run.get("state_dtype")), run["dtype"], int(run["params_target"]))
            if key not in best or date >= best[key][0]:
                best[key] = (date, {**run, "file": name, "date": date})
    return {k: v for k, (_, v) in best.items()}


def memory(files: list[tuple[str, dict[str, Any]]], plt: Any, out: Path) -> Section:
    runs = newest_memory_runs(files)
    sec = Section("Host memory per parameter, by mode", ", ".join(n for n, _ in files) + " (bench_memory.py)")
    shapes = sorted({(dtype, size) for _, dtype, size in runs}, key=lambda s: (s[1], s[0]))
    modes = sorted({k[0] for k in runs}, key=memory_order)
    header = ["mode", *[f"{count(size)} {'fp32' if dt == 'float32' else 'bf16'}" for dt, size in shapes]]
    rows = []
    for mode in modes:
        cells = [mode]
        for dt, size in shapes:
            run = runs.get((mode, dt, size))
            if run is None:
                cells.append("")
                continue
            adamw = runs.get(("adamw", dt, size))
            ratio = f" ({run['peak_nbytes'] / adamw['peak_nbytes']:.2f}x)" if adamw else ""
            cells.append(f"{run['peak_nbytes'] / run['numel']:.1f}{ratio}")
        rows.append(cells)
    sec.body += [
        "Peak host bytes per parameter of trainer + daemon together (a memory cgroup's max usage), 3 steps of "
        "the demo GPT; in brackets the ratio to in-process AdamW's peak at the same size and dtype. "
        "`-release`: `release_grads=True`. The newest run of each cell across the files.",
        "",
        *table(header, rows),
    ]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(shapes))
    for i, (dt, size) in enumerate(shapes):
        xs, ys = [], []
        for j, mode in enumerate(modes):
            run = runs.get((mode, dt, size))
            if run is not None:
                xs.append(j + (i - (len(shapes) - 1) / 2) * width)
                ys.append(run["peak_nbytes"] / run["numel"])
        ax.bar(xs, ys, width, label=f"{count(size)} params, {'fp32' if dt == 'float32' else 'bf16'}", color=f"C{i}")
    ax.set_xticks(range(len(modes)), [m.replace("-release", "\n+release") for m in modes])
    ax.set_ylabel("peak host bytes / parameter")
    ax.set_title("Trainer + daemon peak host memory per parameter")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    sec.plot = save(fig, plt, out / "bytes_per_param.png")
    biggest = max((size for _, size in shapes), default=0)
    for mode in ("offload-nvme-release", "offload-nvme", "offload-cpu"):
        run, adamw = runs.get((mode, "float32", biggest)), runs.get(("adamw", "float32", biggest))
        if run and adamw:
            sec.headlines.append(
                (
                    f"host memory, {count(biggest)} fp32 params, {mode}",
                    f"{run['peak_nbytes'] / run['numel']:.1f} B/param, "
                    f"{run['peak_nbytes'] / adamw['peak_nbytes']:.2f}x in-process AdamW "
                    f"({adamw['peak_nbytes'] / adamw['numel']:.1f} B/param)",
                )
            )
            break
    return sec


# --------------------------------------------------------------------------- largest model


def scale_rows(data: Any) -> list[dict[str, Any]]:
    """bench_scale.py's rows: a mode and the largest parameter count it trained (``largest_params``)."""
    rows = data.get("results", data.get("modes", data.get("rows", []))) if isinstance(data, dict) else data
    if isinstance(rows, dict):
        rows = [{"mode": k, **v} for k, v in rows.items()]
    good = [r for r in rows if isinstance(r, dict) and "mode" in r and "largest_params" in r]
    if not good:
        raise ValueError("expected rows with 'mode' and 'largest_params'")
    return good


def scale(name: str, data: Any, plt: Any, out: Path) -> Section:
    rows = scale_rows(data)
    sec = Section("Largest model by mode, in a fixed memory limit", f"{name} (bench_scale.py)")
    limit = data.get("limit_nbytes") if isinstance(data, dict) else None
    # each model dtype against AdamW's of the same dtype (results before dtypes were measured are fp32)
    adamw_of = {
        r.get("dtype", "fp32"): r["largest_params"] for r in rows if r["mode"] == "adamw" and r["largest_params"]
    }
    adamw = adamw_of.get("fp32") or next(iter(adamw_of.values()), None)

    def largest(r: dict[str, Any]) -> str:
        # capped: every size tried trained, so the largest is at least this
        return (">= " if r.get("capped") else "") + count(r["largest_params"])

    def versus_adamw(r: dict[str, Any]) -> str:
        base = adamw_of.get(r.get("dtype", "fp32"))
        return f"{r['largest_params'] / base:.1f}x" if base else ""

    by_dtype = any("dtype" in r for r in rows)  # results made before dtypes were measured have one (fp32)
    body = [
        [
            with_state(r["mode"], r.get("state_dtype")),
            *([r.get("dtype", "fp32")] if by_dtype else []),
            largest(r),
            versus_adamw(r),
            f"{r['step_s']:.1f}" if r.get("step_s") else "",
            f"{r['step_over_bound']:.2f}x" if r.get("step_over_bound") else "",
        ]
        for r in rows
    ]
    sec.body += [
        "The largest demo GPT each mode trains without an OOM kill"
        + (f", trainer + daemon in a {limit / 2**30:.0f} GiB memory cgroup" if limit else "")
        + "; `>=`: every size tried trained. Step time of that size, and its ratio to the disk bound "
        "(bytes paged per step over fio's bandwidth measured in the same run).",
        "",
        *table(["mode", *(["dtype"] if by_dtype else []), "largest model", "x adamw", "step s", "x disk bound"], body),
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [
        with_state(r["mode"], r.get("state_dtype")) + (f" {r.get('dtype', 'fp32')}" if by_dtype else "") for r in rows
    ]
    bars = ax.bar(labels, [r["largest_params"] / 1e6 for r in rows], color="C0")
    ax.bar_label(bars, [largest(r) for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("largest model (M params, log)")
    title = "Largest model trained"
    ax.set_title(title + (f" in a {limit / 2**30:.0f} GiB memory cgroup" if limit else ""))
    ax.grid(alpha=0.3, axis="y")
    sec.plot = save(fig, plt, out / "largest_model.png")
    best = max(rows, key=lambda r: r["largest_params"])
    figure = f"{largest(best)} params with {best['mode']}"
    if adamw:
        figure += f", {best['largest_params'] / adamw:.1f}x in-process AdamW"
    if best.get("step_over_bound"):
        figure += f"; step {best['step_over_bound']:.2f}x the disk bound"
    sec.headlines.append(("largest model in the memory limit", figure))
    return sec


# --------------------------------------------------------------------------- step time


def step_parts(mode: str, m: dict[str, float]) -> dict[str, float]:
    """A step split into parts that add up to it (seconds).

    bench_train_step.py's ``grad copy`` runs in the post-accumulate-grad hooks, inside forward + backward;
    ``wait`` (the STEP round trip, the update included) and ``param copy`` inside ``optimizer.step()``.
    """
    offload = mode != "torch"
    grad = m.get("grad_copy_s", 0.0) if offload else 0.0
    wait = m.get("wait_s", 0.0) if offload else 0.0
    param = m.get("param_copy_s", 0.0) if offload else 0.0
    return {
        "forward + backward": max(0.0, m["fwd_bwd_s"] - grad),
        "grad copy (backward hooks)": grad,
        "waiting on the daemon (update)": wait,
        "param copy": param,
        "rest of optimizer.step": max(0.0, m["opt_step_s"] - wait - param),
        "zero_grad, other": max(0.0, m["step_s"] - m["fwd_bwd_s"] - m["opt_step_s"]),
    }


def step_time(data: dict[str, Any], plt: Any, out: Path) -> Section:
    results = data["results"]
    sec = Section(
        "Training step breakdown, in-process AdamW against OffloadAdam", "train_step.json (bench_train_step.py)"
    )
    rows = []
    for r in results:
        m = r["median"]
        parts = step_parts(r["mode"], m)
        rows.append(
            [
                r["size"],
                r["mode"],
                f"{m['step_s'] * 1e3:.1f}",
                f"{r['ratio']:.2f}x",
                *(f"{v * 1e3:.1f}" for v in parts.values()),
            ]
        )
    args = data.get("args", {})
    sec.body += [
        f"Medians per step (ms) of the demo GPT, batch {args.get('batch', '?')}x{args.get('block', '?')}, "
        f"{args.get('steps', '?')} steps after {args.get('warmup', '?')} per mode, modes interleaved.",
        "",
        *table(["size", "mode", "step", "x torch", *step_parts("cpu", results[0]["median"]).keys()], rows),
    ]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(results)), 4.5))
    labels = [f"{r['size']}\n{r['mode']}" for r in results]
    bottoms = [0.0] * len(results)
    for i, part in enumerate(step_parts("cpu", results[0]["median"])):
        heights = [step_parts(r["mode"], r["median"])[part] * 1e3 for r in results]
        ax.bar(labels, heights, bottom=bottoms, label=part, color=f"C{i}")
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_ylabel("ms per step (median)")
    ax.set_title("Where a training step's time goes (demo GPT on the CPU)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")
    sec.plot = save(fig, plt, out / "step_breakdown.png")
    largest = max(results, key=lambda r: r["params"])
    cpu = next((r for r in results if r["params"] == largest["params"] and r["mode"] == "cpu"), None)
    if cpu is not None:
        sec.headlines.append(
            (
                f"training step, {largest['size']} GPT, state on the CPU tier",
                f"{cpu['ratio']:.2f}x in-process fused AdamW",
            )
        )
    return sec


# --------------------------------------------------------------------------- assembly


def save(fig: Any, plt: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path.name


FIGURES: list[tuple[str, str, str]] = [
    (
        "cpu_adam",
        "cpu_adam.json",
        "./run.sh bench cpu_adam --sizes 1M,4M,16M,64M --json benchmarks/results/cpu_adam.json",
    ),
    ("swap", "swap.json", "./run.sh bench swap --size 1GiB --json benchmarks/results/swap.json"),
    (
        "memory",
        "memory*.json",
        "./run.sh bench memory --params 100e6,300e6 --release-grads --json benchmarks/results/memory.json",
    ),
    ("scale", "scale*.json", "./run.sh bench scale --json benchmarks/results/scale.json"),
    ("train_step", "train_step.json", "./run.sh bench train_step --json benchmarks/results/train_step.json"),
]


LABELS = {
    "cpu_adam": "CPU Adam",
    "swap": "swap I/O",
    "memory": "host memory per parameter",
    "scale": "largest model by mode",
    "train_step": "training step",
}


def build(results: Path, out: Path, plt: Any) -> tuple[list[Section], list[Missing]]:
    sections: list[Section] = []
    missing: list[Missing] = []
    for figure, pattern, command in FIGURES:
        paths = sorted(results.glob(pattern))
        if not paths:
            missing.append(Missing(figure, pattern, command))
            continue
        draw: Callable[[], Section]
        if figure == "cpu_adam":
            draw = lambda p=paths[0]: cpu_adam(load(p), plt, out)  # noqa: E731
        elif figure == "swap":
            draw = lambda p=paths[0]: swap(load(p), plt, out)  # noqa: E731
        elif figure == "memory":
            draw = lambda ps=paths: memory([(p.name, load(p)) for p in ps], plt, out)  # noqa: E731
        elif figure == "scale":
            draw = lambda p=paths[-1]: scale(p.name, load(p), plt, out)  # noqa: E731
        else:
            draw = lambda p=paths[0]: step_time(load(p), plt, out)  # noqa: E731
        try:
            sections.append(draw())
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            missing.append(
                Missing(figure, f"{pattern} (present but not understood: {type(exc).__name__} {exc})", command)
            )
    return sections, missing


def markdown(sections: list[Section], missing: list[Missing], *, image_prefix: str = "") -> str:
    lines = [
        "# Benchmark report",
        "",
        "Made by `benchmarks/report.py` from the JSON in `benchmarks/results/`; "
        "`benchmarks/README.md` says what each benchmark measures, against what bound, and on what machine. "
        "Figures are those of the recorded runs, under whatever load the machine had then; compare the ratios "
        "of one run, not absolute figures across runs (`cpu_adam.json` was recorded on a loaded machine: its "
        "torch fused row, 0.16 Gparam/s at 64M, reaches about 1.0 on a quiet one).",
        "",
        "## Headlines",
        "",
    ]
    heads = [[what, figure] for s in sections for what, figure in s.headlines]
    heads += [[LABELS[m.figure], "not measured yet"] for m in missing]
    lines += table(["what", "figure"], heads)
    for s in sections:
        files, _, script = s.source.partition(" (")
        lines += ["", f"## {s.title}", "", f"From `{files}` ({script}.", "", *s.body]
        if s.plot:
            lines += ["", f"![{s.title}]({image_prefix}{s.plot})"]
    if missing:
        lines += ["", "## Missing", ""]
        lines += [f"- {LABELS[m.figure]}: no `{m.wanted}`; make it with `{m.command}`" for m in missing]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="directory of the benchmarks' JSON")
    ap.add_argument("--out", type=Path, help="where report.md and the PNGs go (default: --results)")
    args = ap.parse_args(argv)
    out = args.out or args.results
    if not args.results.is_dir():
        ap.error(f"--results {args.results} is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError as exc:
        print(f"report: the plots need matplotlib ({exc}); pip install 'tiermem[plot]'", file=sys.stderr)
        return 2
    sections, missing = build(args.results, out, plt)
    text = markdown(sections, missing)
    (out / "report.md").write_text(text)
    print(text)
    print(f"wrote {out / 'report.md'} and {len([s for s in sections if s.plot])} plots", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

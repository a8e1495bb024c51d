"""NVMe tier: tiermem's swap store and I/O engine against fio, DeepSpeed's aio_handle and aiofiles.

On one directory (default /var/tmp, this machine's disk), sequential write then
read of --size bytes, block sizes 1 MiB and 128 KiB, queue depths 1, 8, 32:

- ``fio``: ioengine=libaio, direct=1 (installed with apt-get if missing);
- ``engine``: tiermem's LibaioEngine alone (O_DIRECT, one pre-touched buffer);
- ``store``: tiermem's SwapStore over that engine, objects of 64 MiB (the
  shape of Adam state tensors): CRC32C per extent, out-of-place writes,
  verification on read, a commit (fdatasync + manifest) at the end of writes;
- ``deepspeed``: ``AsyncIOBuilder().load().aio_handle`` when deepspeed with its
  aio op is importable (said when absent);
- ``aiofiles``: buffered asyncio file I/O (fsync after writing, page cache
  dropped with fadvise before reading), for reference.

Figures are GB/s (1e9 bytes/s), medians over --repeats; ratios are against fio
and DeepSpeed measured in the same run.  Goals: store >= 0.9x fio and >= 1.0x
DeepSpeed for read and write.  A last table times a full page-out (flush) and
page-in (a prefetched pass) of --size bytes of fp32 Adam state through the
TierManager, against fio and the store alone moving the same bytes (1 MiB,
QD 32), the three interleaved in each of --repeats rounds; the ratio is fio's
time over the tier manager's (goal >= 0.9).  ``--tier-only`` runs just that
table.

The disk is shared and noisy: run this once, on an otherwise idle machine.

    .venv/bin/python benchmarks/bench_swap.py [--dir /var/tmp] [--size 4GiB] [--quick] [--tier-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiermem.core.units import KiB, MiB, format_size, parse_size
from tiermem.engine.swap.engine import IOOp, make_request
from tiermem.engine.swap.engine_libaio import LibaioEngine
from tiermem.engine.swap.store import SwapStore

BLOCKS = [1 * MiB, 128 * KiB]
DEPTHS = [1, 8, 32]
OBJECT = 64 * MiB


def arena(nbytes: int) -> mmap.mmap:
    m = mmap.mmap(-1, nbytes)
    chunk = os.urandom(MiB)
    for off in range(0, nbytes, MiB):
        m[off : off + MiB] = chunk[: min(MiB, nbytes - off)]
    return m


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# --------------------------------------------------------------------------- fio


def ensure_fio() -> str | None:
    if shutil.which("fio"):
        return None
    done = subprocess.run(["apt-get", "install", "-y", "-q", "fio"], capture_output=True, text=True, check=False)
    return None if shutil.which("fio") else f"fio missing and apt-get install failed: {done.stderr.strip()[-200:]}"


def fio(d: Path, rw: str, size: int, bs: int, qd: int) -> float:
    out = subprocess.run(
        ["fio", "--name=b", f"--filename={d / 'fio.dat'}", f"--size={size}", f"--bs={bs}", f"--iodepth={qd}",
         "--ioengine=libaio", "--direct=1", f"--rw={rw}", "--output-format=json", "--end_fsync=1"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    job = json.loads(out.stdout)["jobs"][0]
    part = job["write" if rw == "write" else "read"]
    return part["io_bytes"] / (part["runtime"] / 1000) / 1e9


# --------------------------------------------------------------------------- tiermem


def engine_run(d: Path, buf: mmap.mmap, size: int, bs: int, qd: int) -> tuple[float, float]:
    engine = LibaioEngine(block_size=bs, queue_depth=qd)
    path = d / "engine.dat"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        view = memoryview(buf)[:size]
        t = time.perf_counter()
        engine.submit([make_request(IOOp.WRITE, fd, 0, view)])[0].result()
        os.fdatasync(fd)
        w = gbps(size, time.perf_counter() - t)
        t = time.perf_counter()
        engine.submit([make_request(IOOp.READ, fd, 0, view)])[0].result()
        r = gbps(size, time.perf_counter() - t)
        return w, r
    finally:
        engine.close()
        os.close(fd)
        path.unlink()


def store_run(d: Path, buf: mmap.mmap, size: int, bs: int, qd: int) -> tuple[float, float]:
    engine = LibaioEngine(block_size=bs, queue_depth=qd)
    store = SwapStore.open([d / "store"], "bench", engine, size + OBJECT)
    try:
        view = memoryview(buf)
        keys = [(f"k{i}", off) for i, off in enumerate(range(0, size, OBJECT))]
        t = time.perf_counter()
        futures = [store.write(k, view[off : off + min(OBJECT, size - off)]) for k, off in keys]
        for f in futures:
            f.result()
        store.commit()
        w = gbps(size, time.perf_counter() - t)
        t = time.perf_counter()
        futures = [store.read(k, view[off : off + min(OBJECT, size - off)]) for k, off in keys]
        for f in futures:
            f.result()
        r = gbps(size, time.perf_counter() - t)
        return w, r
    finally:
        store.close(remove=True)
        engine.close()


def deepspeed_handle(bs: int, qd: int) -> tuple[Any, str | None]:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder  # type: ignore[import-not-found]

        builder = AsyncIOBuilder()
        if not builder.is_compatible():
            return None, "deepspeed's async_io op is not compatible here"
        return builder.load(verbose=False).aio_handle(bs, qd, False, True, 1), None
    except Exception as exc:  # optional peer: any failure just means "absent"
        return None, f"deepspeed aio_handle unavailable ({type(exc).__name__}: {exc})"


def deepspeed_run(d: Path, size: int, bs: int, qd: int) -> tuple[float, float] | None:
    handle, _ = deepspeed_handle(bs, qd)
    if handle is None:
        return None
    import torch

    tensor = torch.empty(size, dtype=torch.uint8)
    tensor.fill_(7)
    path = str(d / "ds.dat")
    t = time.perf_counter()
    handle.sync_pwrite(tensor, path)
    w = gbps(size, time.perf_counter() - t)
    t = time.perf_counter()
    handle.sync_pread(tensor, path)
    r = gbps(size, time.perf_counter() - t)
    os.unlink(path)
    return w, r


def aiofiles_run(d: Path, buf: mmap.mmap, size: int, bs: int) -> tuple[float, float]:
    import aiofiles

    path = d / "aiofiles.dat"
    view = memoryview(buf)

    async def write() -> None:
        async with aiofiles.open(path, "wb") as f:
            for off in range(0, size, bs):
                await f.write(view[off : off + bs])
            await f.flush()
            os.fsync(f.fileno())

    async def read() -> None:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        async with aiofiles.open(path, "rb") as f:
            while await f.read(bs):
                pass

    t = time.perf_counter()
    asyncio.run(write())
    w = gbps(size, time.perf_counter() - t)
    t = time.perf_counter()
    asyncio.run(read())
    r = gbps(size, time.perf_counter() - t)
    path.unlink()
    return w, r


def tier_run(d: Path, size: int, qd: int = 32, prefetch: int = 8) -> tuple[float, float]:
    """Seconds for a full page-out (flush) and page-in (prefetched pass) of ``size`` bytes of fp32 state."""
    import torch

    from tiermem.engine.pool import BufferPool
    from tiermem.engine.tiers import TierManager

    engine = LibaioEngine(block_size=MiB, queue_depth=qd)
    holder: list[TierManager] = []
    pool = BufferPool.create(size + 64 * MiB, arena_size=size + 64 * MiB, evict=lambda n: holder[0].evict(n))  # noqa: PLW0108
    store = SwapStore.open([d / "tier"], "bench", engine, 2 * size + OBJECT)
    manager = TierManager(pool, store, size + OBJECT)
    holder.append(manager)
    keys = [f"adam{i}" for i in range(size // OBJECT)]
    try:
        for k in keys:
            manager.register(k, torch.float32, (OBJECT // 4,))
            manager.acquire(k).fill_(1.5)
            manager.release(k)
        t = time.perf_counter()
        manager.flush()
        out_s = time.perf_counter() - t
        manager.evict(size + OBJECT)  # clean now: dropped without I/O
        manager.prefetch(keys, depth=prefetch)
        t = time.perf_counter()
        for k in keys:
            manager.acquire(k)
            manager.release(k, dirty=False)
        in_s = time.perf_counter() - t
        return out_s, in_s
    finally:
        manager.close()
        store.close(remove=True)
        pool.close()
        engine.close()


# --------------------------------------------------------------------------- driver


def measure(
    d: Path, buf: mmap.mmap, size: int, bs: int, qd: int, repeats: int, *, fio_ok: bool, ds_ok: bool
) -> dict[str, Any]:
    row: dict[str, Any] = {"block": bs, "qd": qd}
    if fio_ok:
        row["fio"] = median_of(repeats, lambda: (fio(d, "write", size, bs, qd), fio(d, "read", size, bs, qd)))
    row["engine"] = median_of(repeats, lambda: engine_run(d, buf, size, bs, qd))
    row["store"] = median_of(repeats, lambda: store_run(d, buf, size, bs, qd))
    if ds_ok:
        row["deepspeed"] = median_of(repeats, lambda: deepspeed_run(d, size, bs, qd) or (0.0, 0.0))
    return row


def median_of(repeats: int, fn: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    runs = [fn() for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def tier_table(d: Path, buf: mmap.mmap, size: int, repeats: int, *, fio_ok: bool) -> dict[str, Any]:
    """The tier manager's page-out + page-in against fio and the store moving the same bytes, interleaved.

    Each repeat runs fio (1 MiB, QD32: write, read), the store alone (write, read) and the tier manager
    (flush, prefetched pass) back to back, so the ratios compare runs that saw the same disk.
    """
    runs: dict[str, list[float]] = {"fio_s": [], "store_s": [], "page_out_s": [], "page_in_s": []}
    for _ in range(repeats):
        if fio_ok:
            w, r = fio(d, "write", size, MiB, 32), fio(d, "read", size, MiB, 32)
            (d / "fio.dat").unlink()
            runs["fio_s"].append(size / (w * 1e9) + size / (r * 1e9))
        w, r = store_run(d, buf, size, MiB, 32)
        runs["store_s"].append(size / (w * 1e9) + size / (r * 1e9))
        out_s, in_s = tier_run(d, size)
        runs["page_out_s"].append(out_s)
        runs["page_in_s"].append(in_s)
    med = {k: statistics.median(v) if v else float("nan") for k, v in runs.items()}
    tier_s = med["page_out_s"] + med["page_in_s"]
    ratios = [f / (o + i) for f, o, i in zip(runs["fio_s"], runs["page_out_s"], runs["page_in_s"], strict=False)]
    return {
        **med,
        "tier_s": tier_s,
        "fio_same_bytes_s": med["fio_s"],
        "tier_vs_fio": statistics.median(ratios) if ratios else float("nan"),
        "tier_vs_fio_runs": ratios,
        "tier_vs_store": med["store_s"] / tier_s,
        "runs": runs,
    }


def print_tier(size: int, repeats: int, tier: dict[str, Any]) -> None:
    print(
        f"tier manager, {format_size(size)} of Adam state, median of {repeats}: page-out {tier['page_out_s']:.2f} s "
        f"+ page-in {tier['page_in_s']:.2f} s = {tier['tier_s']:.2f} s; same bytes: fio 1MiB QD32 "
        f"{tier['fio_s']:.2f} s, store alone {tier['store_s']:.2f} s; fio time / tier time "
        f"{tier['tier_vs_fio']:.2f}x (runs: {', '.join(f'{x:.2f}' for x in tier['tier_vs_fio_runs'])}), "
        f"store / tier {tier['tier_vs_store']:.2f}x"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="a directory on the disk to measure (not tmpfs)")
    ap.add_argument("--size", default="4GiB", help="bytes moved per run (default 4GiB)")
    ap.add_argument("--quick", action="store_true", help="512MiB per run, 1 repeat, QD 32 only at 128KiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tier-only", action="store_true", help="only the tier manager's table (with fio and the store)")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()
    size = parse_size("512MiB" if args.quick else args.size)
    repeats = 1 if args.quick else args.repeats
    notes: list[str] = []
    fio_missing = ensure_fio()
    if fio_missing:
        notes.append(fio_missing)
    _, ds_missing = deepspeed_handle(MiB, 8)
    if ds_missing:
        notes.append(ds_missing)
    rows: list[dict[str, Any]] = []
    ref: tuple[float, float] | None = None
    buf = arena(size)
    with tempfile.TemporaryDirectory(prefix="tiermem-bench-", dir=args.dir) as tmp:
        d = Path(tmp)
        if not args.tier_only:
            for bs in BLOCKS:
                for qd in DEPTHS:
                    rows.append(measure(d, buf, size, bs, qd, repeats, fio_ok=not fio_missing, ds_ok=not ds_missing))
                    print(f"  measured {format_size(bs)} QD{qd}", file=sys.stderr, flush=True)
            try:
                import aiofiles  # noqa: F401  (a peer to compare with: the bench extra)
            except ImportError:
                print("aiofiles is not installed (pip install -e '.[bench]'); its row is left out", file=sys.stderr)
            else:
                ref = median_of(repeats, lambda: aiofiles_run(d, buf, size, MiB))
        tier = tier_table(d, buf, size, repeats, fio_ok=not fio_missing)
    if rows:
        print(f"\nsequential I/O, {format_size(size)} per run, GB/s (write / read), median of {repeats}")
        systems = [s for s in ("fio", "engine", "store", "deepspeed") if s in rows[0]]
        print(f"{'block':>7} {'QD':>3} " + " ".join(f"{s:>13}" for s in systems) + "   store/fio     store/ds")
        for row in rows:
            cells = " ".join(f"{row[s][0]:6.2f}/{row[s][1]:<6.2f}" for s in systems)
            ratio = "".join(
                f"  {row['store'][0] / row[s][0]:4.2f}/{row['store'][1] / row[s][1]:<4.2f}  "
                if s in row
                else "      -      "
                for s in ("fio", "deepspeed")
            )
            print(f"{format_size(row['block']):>7} {row['qd']:>3} {cells} {ratio}")
        if ref is not None:
            print(f"aiofiles (buffered, 1MiB): {ref[0]:.2f} / {ref[1]:.2f}")
    print_tier(size, repeats, tier)
    for note in notes:
        print(f"note: {note}")
    if args.json:
        figures = {"size": size, "repeats": repeats, "rows": rows, "notes": notes, "tier": tier}
        if ref is not None:
            figures["aiofiles"] = ref
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A store's owner killed with SIGKILL mid-write: every key committed before the kill reads back exactly."""

from __future__ import annotations

import mmap
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tiermem.core.units import MiB
from tiermem.engine.swap.engine_libaio import LibaioEngine
from tiermem.engine.swap.store import SwapStore

P = 4096
NKEYS = 12

# The child rewrites every key each round (key i of round r holds pattern(i, r)),
# deleting key 0 on odd rounds, commits, then prints "committed <r>".
CHILD = r"""
import mmap, sys
from tiermem.engine.swap.engine_libaio import LibaioEngine
from tiermem.engine.swap.store import SwapStore

def pattern(i, r, nbytes):
    head = (i * 1000003 + r).to_bytes(8, "little")
    return (head + bytes([(i * 7 + r) % 256]) * (4096 - 8)) * (nbytes // 4096)

def size(i):
    return 4096 * (1 + (i * 37) % 64)

engine = LibaioEngine(block_size=64 * 1024, queue_depth=16)
store = SwapStore.open([sys.argv[1]], "crash", engine, 64 << 20)
buf = mmap.mmap(-1, 1 << 20)
r = 0
while True:
    r += 1
    for i in range(12):
        if i == 0 and r % 2:
            if "k0" in store:
                store.delete("k0")
            continue
        n = size(i)
        buf[:n] = pattern(i, r, n)
        store.write(f"k{i}", memoryview(buf)[:n]).result()
    store.commit()
    print("committed", r, flush=True)
"""


def pattern(i: int, r: int, nbytes: int) -> bytes:
    head = (i * 1000003 + r).to_bytes(8, "little")
    return (head + bytes([(i * 7 + r) % 256]) * (P - 8)) * (nbytes // P)


def size(i: int) -> int:
    return P * (1 + (i * 37) % 64)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_keys_committed_before_sigkill_read_back_exactly(seed: int) -> None:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="tiermem-crash-", dir="/var/tmp") as d:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, d],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert child.stdout is not None
        seen = 0
        try:
            target = rng.randint(2, 6)
            while seen < target:
                line = child.stdout.readline()
                assert line.startswith("committed"), f"child said {line!r}"
                seen = int(line.split()[1])
            time.sleep(rng.uniform(0.0, 0.05))  # land somewhere inside the next round's writes
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            rest = child.stdout.read().split()
        if rest:  # commits the child finished between our last read and the kill
            seen = max(seen, *(int(x) for x in rest if x.isdigit()))

        engine = LibaioEngine(block_size=64 * 1024, queue_depth=16)
        store = SwapStore.open([d], "crash", engine, 64 * MiB)
        buf = mmap.mmap(-1, MiB)
        try:
            keys = store.keys()
            # the reopened state is exactly one committed round: the last one reported, or one more whose
            # report the kill cut off; every key must be from that same round
            first = memoryview(buf)[: size(1)]
            store.read("k1", first).result(timeout=30)
            committed = int.from_bytes(bytes(first[:8]), "little") - 1000003
            assert committed in (seen, seen + 1)
            seen = committed
            assert ("k0" in keys) == (seen % 2 == 0)
            assert [k for k in keys if k != "k0"] == sorted(f"k{i}" for i in range(1, NKEYS))
            for key in keys:
                i = int(key[1:])
                n = size(i)
                view = memoryview(buf)[:n]
                store.read(key, view).result(timeout=30)
                assert bytes(view) == pattern(i, seen, n), f"{key} is not round {seen}"
        finally:
            store.close(remove=True)
            engine.close()

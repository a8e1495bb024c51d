"""Helpers for the pool tests: a layout checker, and child-process entry points.

Run as a script, this is the *other* process of the arena tests:
  helpers_pool.py map FD NBYTES        map a passed fd, check the parent's pattern, write ours
  helpers_pool.py probe PID FD         as user nobody, try to reach another process's memfd
  helpers_pool.py mlock LIMIT NBYTES   as user nobody under RLIMIT_MEMLOCK=LIMIT, build a pool
Each prints one JSON object on stdout.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys

from tiermem.engine.pool import Allocator, BlockState

NOBODY = 65534


def parent_pattern(nbytes: int) -> bytes:
    return bytes(i % 251 for i in range(nbytes))


def child_pattern(nbytes: int) -> bytes:
    return bytes((7 * i + 3) % 253 for i in range(nbytes))


def check_layout(allocator: Allocator) -> None:
    """Live and free extents tile [0, capacity) exactly; aligned; no two free extents touch; stats agree."""
    live = allocator.live_blocks()
    free = allocator.free_extents()
    extents = sorted([(b.offset, b.nbytes, "live") for b in live] + [(o, n, "free") for o, n in free])
    cursor, previous = 0, ""
    for offset, nbytes, kind in extents:
        assert offset == cursor, f"gap or overlap at {offset} (expected {cursor})"
        assert nbytes > 0 and offset % allocator.alignment == 0 and nbytes % allocator.alignment == 0
        assert not (kind == previous == "free"), f"adjacent free extents at {offset}"
        cursor, previous = offset + nbytes, kind
    assert cursor == allocator.capacity
    assert all(b.state is BlockState.LIVE for b in live)
    used = sum(b.nbytes for b in live)
    assert allocator.used == used
    assert allocator.free_bytes == sum(n for _, n in free)
    assert allocator.used + allocator.free_bytes == allocator.capacity
    assert allocator.largest_free == max((n for _, n in free), default=0)
    assert allocator.blocks == len(live)


def _drop_to_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _map(fd: int, nbytes: int) -> dict[str, object]:
    from tiermem.engine.pool import Arena

    with Arena.from_fd(fd) as arena:
        seen = bytes(arena.view(0, nbytes)) == parent_pattern(nbytes)
        arena.view(0, nbytes)[:] = child_pattern(nbytes)
        return {"saw_parent_bytes": seen, "nbytes": arena.nbytes, "sealed": arena.sealed}


def _probe(pid: int, fd: int) -> dict[str, object]:
    _drop_to_nobody()
    result: dict[str, object] = {"uid": os.getuid()}
    for label, path in (("proc_fd", f"/proc/{pid}/fd/{fd}"), ("proc_map_files", f"/proc/{pid}/map_files")):
        try:
            with open(path, "rb") as f:
                f.read(1)
            result[label] = "opened"
        except OSError as exc:
            result[label] = type(exc).__name__
    result["dev_shm"] = sorted(os.listdir("/dev/shm"))
    return result


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _mlock(limit: int, nbytes: int) -> dict[str, object]:
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
    _drop_to_nobody()
    records = _Records()
    logging.getLogger("tiermem").addHandler(records)
    logging.getLogger("tiermem").setLevel(logging.DEBUG)
    from tiermem.engine.pool import BufferPool

    with BufferPool.create(nbytes, arena_size=nbytes // 2, mlock=True) as pool:
        blocks = [pool.alloc(arena.nbytes) for arena in pool.arenas]  # fill every arena, all of it
        pattern = child_pattern(blocks[0].nbytes)
        for block in blocks:
            pool.view(block)[:] = pattern
        intact = all(bytes(pool.view(block)) == pattern for block in blocks)
        warnings = [r.getMessage() for r in records.records if r.levelno == logging.WARNING]
        return {
            "uid": os.getuid(),
            "locked": pool.locked,
            "arenas_locked": [a.locked for a in pool.arenas],
            "refusal_errnos": [r.errno for r in pool.mlock_refusals],
            "refusal_limits": [r.limit_soft for r in pool.mlock_refusals],
            "warnings": warnings,
            "capacity": pool.capacity,
            "intact": intact,
        }


def main(argv: list[str]) -> int:
    mode, *args = argv
    if mode == "map":
        out = _map(int(args[0]), int(args[1]))
    elif mode == "probe":
        out = _probe(int(args[0]), int(args[1]))
    elif mode == "mlock":
        out = _mlock(int(args[0]), int(args[1]))
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

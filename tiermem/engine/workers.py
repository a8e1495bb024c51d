"""Thread pools whose workers all exist from the start.

``ThreadPoolExecutor`` starts a worker only when a task finds none idle, and
never ends one, so the number of threads of a long-running process grows with
the concurrency it happened to meet (a second swap read verified while the
first still is, hours into a run) and a thread count taken at one moment says
nothing about the next.  The daemon's ledger (threads before and after a fault)
and its operators need a fixed number: these pools start every worker at
construction, so the count is known up front and never changes.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["started_pool"]


def started_pool(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` of ``workers`` threads named ``prefix``, every one started before this returns."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix)
    gate = threading.Barrier(workers + 1)
    # each task holds its worker until all are running, so the pool must start a new worker for every one
    waits = [pool.submit(gate.wait) for _ in range(workers)]
    gate.wait()
    for w in waits:
        w.result()
    return pool

"""Signals at random moments to the main thread, as a cluster's scheduler sends them (SLURM's SIGUSR1 before
a job's time limit), for the tests of handlers that save checkpoints wherever they land."""

from __future__ import annotations

import random
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def signals_to_main(handler: Callable[[str], None], seed: int) -> Iterator[None]:
    """SIGUSR1 to this (main) thread at random moments 0.5-4 ms apart, each once the last one's handler has
    returned (a handler is never interrupted by the next signal); ``handler(where)`` runs for each, ``where``
    being the optimizer method the signal interrupted (``interrupted_method``)."""
    handled = threading.Event()
    handled.set()
    stop = threading.Event()
    main = threading.get_ident()
    rng = random.Random(seed)

    def on_signal(signum: int, frame: Any) -> None:
        try:
            handler(interrupted_method(frame))
        finally:
            handled.set()

    def send() -> None:
        while not stop.is_set():
            handled.wait()
            if stop.wait(rng.uniform(0.0005, 0.004)):
                return
            handled.clear()
            signal.pthread_kill(main, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, on_signal)
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        yield
    finally:
        stop.set()
        sender.join()
        handled.wait(5.0)  # a signal sent just before the stop is handled before the handler goes
        signal.signal(signal.SIGUSR1, previous)


def interrupted_method(frame: Any) -> str:
    """The outermost optimizer method (``step()``, ``zero_grad()``) on the interrupted stack, or ""."""
    found = ""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(OPTIMIZER_FILES) and not code.co_name.startswith("_"):
            found = f"{code.co_name}()"
        frame = frame.f_back
    return found


OPTIMIZER_FILES = (
    "tiermem/client/offload/optimizer.py",
    "tiermem/client/offload/checkpoint.py",
    "tiermem/client/distributed/sharded.py",
)
"""Where the optimizers' public methods are (``OffloadAdam``'s, and the sharded optimizers' facade)."""

"""A one-line progress display for the command line (stdlib only).

On a terminal the line is redrawn in place; otherwise (CI logs, pipes) a full
line is written every ``every`` updates and at the end, so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, label: str, *, stream: TextIO | None = None, every: int = 50) -> None:
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.every = every
        self.done = 0
        self.start = time.perf_counter()
        self._tty = self.stream.isatty()

    def update(self, fields: dict[str, str] | None = None, n: int = 1) -> None:
        fields = fields or {}
        self.done += n
        if not self._tty and self.done % self.every and self.done != self.total:
            return
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.perf_counter() - self.start
        extra = "  ".join(f"{k} {v}" for k, v in fields.items())
        line = f"{self.label:<22} [{bar}] {self.done:>5}/{self.total}  {elapsed:6.1f}s  {extra}"
        if self._tty:
            self.stream.write("\r" + line + "\x1b[K")
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

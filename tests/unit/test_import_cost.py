"""Importing the client library loads neither the compiler stack nor the daemon.

Every trainer imports ``tiermem``; ``torch._dynamo`` (with sympy) costs about 75 MB of memory and a
second of start-up, so the library must not pull it in unless the user compiles something.
"""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "tiermemd")


def test_importing_the_optimizers_loads_no_compiler() -> None:
    code = (
        "import sys; from tiermem import OffloadAdam, CPUAdam; "
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "", f"importing tiermem loaded {done.stdout.strip()}"

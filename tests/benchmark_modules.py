"""A script of ``benchmarks/`` loaded as a module for tests of its pure parts (the scripts are files, not a
package)."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def benchmark_module(stem: str, *, name: str | None = None) -> Iterator[ModuleType]:
    """``benchmarks/<stem>.py`` as the module ``name`` (``stem`` unless given) for the block: in
    ``sys.modules`` (dataclasses look their module up while the class is made), with ``benchmarks/`` on
    ``sys.path`` (a script imports its sibling scripts by name)."""
    name = name or stem
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{stem}.py")
    assert spec is not None and spec.loader is not None, stem
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]
        sys.path.remove(str(BENCHMARKS))

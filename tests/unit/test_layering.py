"""Imports flow one way: pure cores -> engines -> service, and pure cores -> net -> trainer side.

Every import in ``tiermem/`` and ``tiermemd/`` (function-level ones too) is read from the source and held
to the layering the package docstrings state.  A failure names the module, the import and the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

EFFECTFUL = {"socket", "mmap", "fcntl", "ctypes", "threading", "subprocess", "select", "selectors", "signal"}
EFFECTFUL |= {"asyncio", "multiprocessing", "libaio", "concurrent"}
"""What a pure core may not import (``os`` is allowed: the config loader reads the environment once)."""

TRAINER_MAY_USE = {
    "tiermem.engine.pool.pinning",  # registering the window with CUDA
    "tiermem.engine.pool.pool",  # the pool's sizing rule, to size a private daemon
    "tiermem.engine.optim",  # the demo compares with CPUAdam, the in-process engine; doctor finds its kernels
    "tiermem.engine.swap.engine_select",  # tiermem doctor probes libaio and O_DIRECT as the daemon would
    "tiermem.engine.swap.engine_libaio",  # and opens a kernel AIO context of the daemon's depth
}
"""The engines the trainer side must reach, and why."""


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("tiermem", "tiermemd"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append(module)
            found += [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in MODULES]
    return found


def _layer(module: str) -> str:
    for prefix in ("tiermem.core", "tiermem.engine", "tiermem.net", "tiermem.client"):
        if module == prefix or module.startswith(prefix + "."):
            return prefix.rpartition(".")[2]
    if module == "tiermemd" or module.startswith("tiermemd."):
        return "service"
    if module.startswith("tiermem"):
        return "facade"
    return "outside"


ALLOWED = {
    "core": {"core"},
    "engine": {"core", "engine"},
    "net": {"core", "net"},
    "client": {"core", "net", "client"},
    "facade": {"core", "engine", "net", "client", "facade"},
    "service": {"core", "engine", "net", "service", "facade"},
}


def _violations(name: str) -> list[str]:
    layer = _layer(name)
    out = []
    for target in _imports(name, MODULES[name]):
        kind = _layer(target)
        if target == "tiermem":
            continue  # the package root: ``__version__``, and the lazy public names
        if kind == "outside":
            if layer == "core" and target.split(".")[0] in EFFECTFUL:
                out.append(f"{name} imports {target}: a pure core does no I/O, threads or syscalls")
            continue
        if kind in ALLOWED[layer]:
            continue
        if layer == "client" and kind == "engine" and any(target.startswith(t) for t in TRAINER_MAY_USE):
            continue
        out.append(f"{name} ({layer}) imports {target} ({kind}); {layer} may import {sorted(ALLOWED[layer])}")
    return out


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_imports_follow_the_layering(name: str) -> None:
    assert _violations(name) == []


def test_the_walk_sees_a_violation_when_there_is_one(tmp_path: Path) -> None:
    """The check itself: a core importing a socket or the trainer side is caught."""
    MODULES["tiermem.core._probe"] = probe = tmp_path / "probe.py"
    probe.write_text("import socket\n\ndef f():\n    from tiermem.client.link import Client\n")
    try:
        found = _violations("tiermem.core._probe")
    finally:
        del MODULES["tiermem.core._probe"]
    assert len(found) == 2 and "socket" in found[0] and "tiermem.client.link" in found[1]


def test_every_layer_is_populated() -> None:
    layers = {_layer(name) for name in MODULES}
    assert {"core", "engine", "net", "client", "service"} <= layers

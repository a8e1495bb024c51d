"""The trainer's side stays readable: no function in ``tiermem/client/`` (the offload and distributed packages
included) runs over 80 lines, and param paging's modules stay under STYLE.md's ~600 (an AST walk; no import
of the code)."""

from __future__ import annotations

import ast
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[2] / "tiermem" / "client"
OFFLOAD = CLIENT / "offload"
MAX_FUNCTION_LINES = 80
MAX_PAGING_MODULE_LINES = 600


def long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(CLIENT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_client_function_is_longer_than_80_lines() -> None:
    paths = sorted(CLIENT.rglob("*.py"))
    assert {p.parent.name for p in paths} >= {"client", "offload", "distributed", "demo"}
    assert [f for path in paths for f in long_functions(path)] == []


def test_param_pagings_modules_stay_under_600_lines() -> None:
    paging = sorted(OFFLOAD.glob("pag*.py"))
    assert {p.name for p in paging} >= {"paging.py", "pageio.py", "pageuses.py", "pagestate.py"}
    sizes = {p.name: len(p.read_text().splitlines()) for p in paging}
    assert {name: n for name, n in sizes.items() if n > MAX_PAGING_MODULE_LINES} == {}

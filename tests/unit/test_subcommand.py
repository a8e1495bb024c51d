"""``tiermem``'s subcommands lay out their help alike: a one-line paragraph wraps, a paragraph of several
lines keeps them (``tiermem doctor --help`` printed its description as one 600-character line)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tiermem.client.cli import build_parser
from tiermem.client.subcommand import add_command


def _help(description: str, epilog: str | None = None, width: int = 60) -> str:
    parser = argparse.ArgumentParser(prog="t")
    sub = parser.add_subparsers()
    cmd = add_command(sub, "x", help="h", run=lambda _a: 0, description=description, epilog=epilog)
    return cmd.format_help().replace(cmd.format_usage(), "")


def test_a_one_line_paragraph_wraps_and_a_paragraph_of_lines_keeps_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "60")
    words = " ".join(f"word{i}" for i in range(40))
    table = "exit codes:\n  0 fine\n  1 not fine"
    text = _help(f"{words}\n\n{table}", epilog="one\n  two")
    lines = text.splitlines()
    assert all(len(line) <= 60 for line in lines), text
    assert " ".join(" ".join(lines).split()).startswith(words)
    assert table in text  # as written, line for line
    assert "one\n  two" in text


@pytest.mark.parametrize("command", ["demo", "estimate", "status", "doctor", "consolidate", "version"])
def test_no_line_of_any_subcommand_help_runs_past_110_columns(monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices[command].format_help()
    assert max(len(line) for line in text.splitlines()) <= 110, text


def test_the_parser_loads_no_torch() -> None:
    """``tiermem demo`` sets the trainer's OpenMP spin before torch loads (libgomp reads it once), and the
    other commands start in a fraction of a second: building the parser must not import torch."""
    code = "import sys; from tiermem.client.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr

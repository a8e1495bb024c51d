"""The usage lines in README.md and docs/operating.md against the parsers: every flag a command takes is documented
there, and every flag documented is one it takes."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "operating.md"]


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--help"}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    from tiermem.client.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def usage_lines(program: str) -> list[str]:
    """Lines (of a code block) or code spans (possibly wrapped) that start with `program ` and show a `[--flag]`."""
    found: list[str] = []
    for doc in DOCS:
        text = doc.read_text()
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
        candidates = text.splitlines() + spans
        found += [line for line in candidates if line.startswith(f"{program} ") and "[--" in line]
    return found


def documented_flags(program: str) -> set[str]:
    lines = usage_lines(program)
    assert len(lines) == 1, f"expected one usage line for {program!r} in README.md or docs/operating.md: {lines}"
    return set(re.findall(r"(--[a-z0-9-]+)", lines[0]))


@pytest.mark.parametrize("command", sorted(set(subcommands()) - {"version"}))
def test_the_usage_line_of_every_tiermem_command_names_its_flags(command: str) -> None:
    assert documented_flags(f"tiermem {command}") == parser_flags(subcommands()[command])


def test_the_usage_line_of_tiermemd_names_its_flags() -> None:
    from tiermemd.main import build_parser

    assert documented_flags("tiermemd") == parser_flags(build_parser())


def test_every_command_the_docs_run_exists() -> None:
    mentioned = set()
    for doc in DOCS:
        mentioned |= set(re.findall(r"`tiermem ([a-z]+)", doc.read_text()))
    assert mentioned <= set(subcommands()), mentioned - set(subcommands())

"""How a ``tiermem`` subcommand is declared: its name, one-line help, description, and what runs it.

Every subcommand's ``--help`` lays out text alike: a paragraph written as one
line is wrapped to the terminal, and a paragraph of several lines (a list, a
table of exit codes, an example) keeps its lines as written.  argparse offers
one or the other for a whole parser: its default formatter wraps everything,
flattening lists, and ``RawDescriptionHelpFormatter`` wraps nothing, so a long
one-line description runs off the screen.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

__all__ = ["Subparsers", "add_command"]

if TYPE_CHECKING:
    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]
else:
    Subparsers = argparse._SubParsersAction  # generic only to type checkers


class _ParagraphFormatter(argparse.HelpFormatter):
    """Wraps a one-line paragraph; keeps a paragraph of several lines as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for para in text.strip("\n").split("\n\n"):
            if "\n" in para:
                paragraphs.append("\n".join(indent + line for line in para.splitlines()))
            else:
                paragraphs.append(textwrap.fill(para, width, initial_indent=indent, subsequent_indent=indent))
        return "\n\n".join(paragraphs)


def add_command(
    sub: Subparsers,
    name: str,
    *,
    help: str,
    run: Callable[[argparse.Namespace], int],
    description: str | None = None,
    epilog: str | None = None,
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` (run by ``run(args)``, which returns the exit code) and return its parser for
    the arguments; ``args.parser`` is this parser, for usage errors found after parsing."""
    parser = sub.add_parser(
        name, help=help, description=description, epilog=epilog, formatter_class=_ParagraphFormatter
    )
    parser.set_defaults(func=run, parser=parser)
    return parser

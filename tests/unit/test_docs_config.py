"""docs/operating.md's configuration table names every field of the config dataclasses, and nothing else."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from tiermem.core.config import DaemonConfig

OPERATING = Path(__file__).resolve().parents[2] / "docs" / "operating.md"
HEADER = ("key", "type", "default", "meaning")


def config_keys() -> set[str]:
    """Every ``section.name`` the loader accepts: the fields of each section's dataclass."""
    sections = typing.get_type_hints(DaemonConfig)
    return {
        f"{section.name}.{field.name}"
        for section in dataclasses.fields(DaemonConfig)
        for field in dataclasses.fields(sections[section.name])
    }


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def documented_keys(markdown: str) -> list[str]:
    """The first column of the table headed ``| key | type | default | meaning |``, backticks removed."""
    lines = markdown.splitlines()
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("|") and tuple(_cells(line)) == HEADER]
    if len(starts) != 1:
        raise AssertionError(f"expected one table headed {' | '.join(HEADER)}, found {len(starts)}")
    keys = []
    for line in lines[starts[0] + 2 :]:  # after the header and its --- row
        if not line.lstrip().startswith("|"):
            break
        keys.append(_cells(line)[0].strip("`"))
    return keys


def key_mismatch(documented: list[str], fields: set[str]) -> str | None:
    """What is wrong with the documented keys: missing, extra or repeated ones; None when they match."""
    problems = []
    missing = sorted(fields - set(documented))
    extra = sorted(set(documented) - fields)
    repeated = sorted({key for key in documented if documented.count(key) > 1})
    if missing:
        problems.append(f"missing from the table: {', '.join(missing)}")
    if extra:
        problems.append(f"documented but not a config field: {', '.join(extra)}")
    if repeated:
        problems.append(f"documented more than once: {', '.join(repeated)}")
    return "; ".join(problems) or None


def test_operating_md_documents_every_config_field_and_no_other() -> None:
    problem = key_mismatch(documented_keys(OPERATING.read_text()), config_keys())
    assert problem is None, f"docs/operating.md, configuration table: {problem}"


def test_the_check_names_missing_extra_and_repeated_keys() -> None:
    table = "\n".join(
        [
            "| key | type | default | meaning |",
            "| --- | --- | --- | --- |",
            "| `pool.size` | size | `0` | the pool |",
            "| `pool.colour` | str | `red` | no such field |",
            "| `pool.size` | size | `0` | again |",
            "",
            "| `pool.mlock` | bool | `true` | after the table: not read |",
        ]
    )
    documented = documented_keys(table)
    assert documented == ["pool.size", "pool.colour", "pool.size"]
    problem = key_mismatch(documented, {"pool.size", "pool.mlock"})
    assert problem == (
        "missing from the table: pool.mlock; documented but not a config field: pool.colour; "
        "documented more than once: pool.size"
    )


def test_a_document_without_the_table_is_refused() -> None:
    with pytest.raises(AssertionError, match="expected one table"):
        documented_keys("# no table here\n")

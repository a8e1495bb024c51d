"""docs/operating.md's configuration table names every field of the config dataclasses, and nothing else."""

from __future__ import annotations

import dataclasses
import os
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


# --------------------------------------------------------------------------- the example settings file

EXAMPLE = Path(__file__).resolve().parents[2] / "systemd" / "tiermemd.toml"
MARKERS = ("(Example", "(Node value")
"""A comment holding one of these marks the keys below it (up to a blank line or another comment) as not the
default; the file's header says every other value shown is the default."""


def unmarked_values(text: str) -> list[tuple[str, str, str]]:
    """(section, key, TOML value) of every key the example file presents as its default."""
    out: list[tuple[str, str, str]] = []
    section, marked, in_comment = "", False, False
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            marked, in_comment = False, False
        elif line.startswith("#"):
            marked = (marked and in_comment) or any(m in line for m in MARKERS)
            in_comment = True
        elif line.startswith("["):
            section, marked, in_comment = line.strip("[]"), False, False
        else:
            key, _, value = line.partition("=")
            in_comment = False
            if section and not marked:
                out.append((section, key.strip(), value.strip()))
    return out


def test_every_value_the_example_file_does_not_mark_is_the_default(tmp_path: Path) -> None:
    from tiermem.core.config import load_config

    env = {"HOME": str(tmp_path)}
    defaults = load_config(None, env=env)
    wrong = []
    for section, key, value in unmarked_values(EXAMPLE.read_text()):
        one = tmp_path / f"{section}.{key}.toml"
        one.write_text(f"[{section}]\n{key} = {value}\n")
        shown = getattr(getattr(load_config(one, env=env), section), key)
        default = getattr(getattr(defaults, section), key)
        if shown != default:
            wrong.append(f"{section}.{key} = {value} is shown as the default, which is {default!r}")
    assert not wrong, "systemd/tiermemd.toml: " + "; ".join(wrong)


def test_the_example_check_sees_marks_and_where_they_end() -> None:
    text = "[jobs]\n# (Example values.)\nmax_pool = 1\nmax_swap = 2\n\n# plain\nmax_jobs = 3\n"
    assert unmarked_values(text) == [("jobs", "max_jobs", "3")]


# --------------------------------------------------------------------------- tiermem estimate's sample


def test_the_estimate_sample_rows_are_what_the_command_prints(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/operating.md's sample of ``tiermem estimate``: every row shown, up to the column that depends on the
    node it runs on (``fits this node``)."""
    from tiermem.client.cli import main

    section = OPERATING.read_text().split("## Will a model fit? `tiermem estimate`", 1)[1].split("\n## ", 1)[0]
    (command,) = [line for line in section.splitlines() if line.startswith("tiermem estimate ") and "[" not in line]
    sample = section.split("```\noffload ", 1)[1].split("```", 1)[0]
    header, *rows = ("offload " + sample).splitlines()
    cut = header.index("fits this node")
    for name in [k for k in os.environ if k.startswith("TIERMEM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr("tiermem.client.estimate_cli.DEFAULT_NODE_CONFIG", "/nonexistent/tiermemd.toml")
    assert main([*command.split()[1:], "--no-daemon"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert header in printed
    shown = {line[:cut].rstrip() for line in printed}
    missing = [row[:cut].rstrip() for row in rows if row != "..." and row[:cut].rstrip() not in shown]
    assert not missing, f"docs/operating.md shows rows tiermem estimate does not print: {missing}"

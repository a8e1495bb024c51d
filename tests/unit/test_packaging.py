"""The wheel carries every package of the tree (an editable install would hide a missing one)."""

from __future__ import annotations

import pathlib

import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed_for_the_wheel() -> None:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join((name, *init.parent.relative_to(ROOT / folder).parts))
        for name, folder in setup["package-dir"].items()
        for init in (ROOT / folder).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert sorted(found - set(setup["packages"])) == []


def test_the_license_file_is_the_license_pyproject_names_and_no_url_points_elsewhere() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "urls" not in project  # the project has no public home to point at

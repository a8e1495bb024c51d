"""tiermemd's command line, in-process: flags, --check-config, --print-config, exit codes, TOML output."""

from __future__ import annotations

import grp
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib
from hypothesis import given
from hypothesis import strategies as st

from tiermem.core.config import config_to_dict, load_config
from tiermemd import exits
from tiermemd import main as daemon_main
from tiermemd.exits import EXIT_CONFIG, EXIT_OK
from tiermemd.main import main, to_toml

EXAMPLE = Path(__file__).resolve().parents[2] / "systemd" / "tiermemd.toml"


def _example_group_exists() -> bool:
    """Whether this machine has the socket group the shipped example names (the install makes it)."""
    try:
        grp.getgrnam(tomllib.loads(EXAMPLE.read_text())["server"]["socket_group"])
    except KeyError:
        return False
    return True


EXAMPLE_CHECKS = EXIT_OK if _example_group_exists() else EXIT_CONFIG
"""What --check-config says of the shipped example here: valid, or (no such group on this machine) exit 2."""


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No TIERMEM_* from the caller, per-test default paths; main() reconfigures logging, so restore it."""
    for name in [n for n in os.environ if n.startswith("TIERMEM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(daemon_main, "DEFAULT_NODE_CONFIG", str(tmp_path / "absent.toml"))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tiermemd.toml"
    path.write_text(text)
    return path


def as_lists(tables: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``config_to_dict`` with tuples as lists, the way TOML reads them back."""
    return {s: {k: list(v) if isinstance(v, tuple) else v for k, v in t.items()} for s, t in tables.items()}


def test_help_describes_the_flags_and_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--config", "--check-config", "--print-config", "--pool-size", "--socket", "--exit-with-parent"):
        assert flag in out
    assert "2 invalid configuration" in " ".join(out.split())


def test_exit_codes_are_the_documented_distinct_numbers() -> None:
    codes = [getattr(exits, name) for name in exits.__all__ if name.startswith("EXIT_")]
    assert sorted(codes) == [0, 1, 2, 3, 4, 5, 6]


def test_check_config_accepts_the_shipped_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(EXAMPLE), "--check-config"]) == EXAMPLE_CHECKS
    err = capsys.readouterr().err
    assert "configuration is valid" in err if EXAMPLE_CHECKS == EXIT_OK else "server.socket_group: no group" in err


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[pool]\nsize = "lots"\n', "pool.size"),
        ('[server]\nmax_frame = "1KiB"\n', "server.max_frame"),
        ("[jobs]\ngrace_period_s = -1\n", "jobs.grace_period_s"),
        ("[adam]\nthread = 2\n", "adam.thread"),
        ("[pools]\nsize = 1\n", "pools"),
        ('[swap]\nengine = "io_uring"\n', "swap.engine"),
        ("[metrics]\nport = 70000\n", "metrics.port"),
        ("[pool\nsize = 1\n", "--config"),
    ],
)
def test_check_config_refuses_an_invalid_file_with_exit_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, field: str
) -> None:
    assert main(["--config", str(write(tmp_path, text)), "--check-config"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "invalid configuration" in err and field in err


def test_an_invalid_environment_override_or_flag_is_named_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TIERMEM_SWAP_QUEUE_DEPTH", "deep")
    assert main(["--check-config"]) == EXIT_CONFIG
    assert "swap.queue_depth" in capsys.readouterr().err
    monkeypatch.delenv("TIERMEM_SWAP_QUEUE_DEPTH")
    assert main(["--pool-size", "huge", "--check-config"]) == EXIT_CONFIG
    assert "pool.size" in capsys.readouterr().err
    monkeypatch.setenv("TIERMEM_POOL_SIZ", "1GiB")
    assert main(["--check-config"]) == EXIT_CONFIG
    assert "TIERMEM_POOL_SIZ" in capsys.readouterr().err


def test_print_config_is_toml_equal_to_the_effective_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TIERMEM_JOBS_GRACE_PERIOD_S", "7.5")
    argv = ["--config", str(EXAMPLE), "--pool-size", "2GiB", "--swap-dir", "/nvme0", "--swap-dir", "/nvme1"]
    assert main([*argv, "--print-config"]) == EXIT_OK
    printed = tomllib.loads(capsys.readouterr().out)
    effective = load_config(
        EXAMPLE,
        env=dict(os.environ),
        overrides={"pool.size": "2GiB", "swap.dirs": ("/nvme0", "/nvme1")},
    )
    assert printed == as_lists(config_to_dict(effective))
    assert printed["pool"]["size"] == 2 << 30
    assert printed["jobs"]["grace_period_s"] == 7.5
    assert printed["swap"]["dirs"] == ["/nvme0", "/nvme1"]
    assert printed["server"]["socket_mode"] == 0o660
    # and the printed file is itself a valid config that means the same
    again = write(tmp_path, to_toml(printed))
    monkeypatch.delenv("TIERMEM_JOBS_GRACE_PERIOD_S")
    assert main(["--config", str(again), "--check-config"]) == EXAMPLE_CHECKS
    assert load_config(again, env={}) == effective


def test_with_no_config_flag_tiermem_config_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TIERMEM_CONFIG", str(write(tmp_path, "[jobs]\nmax_jobs = 3\n")))
    assert main(["--print-config"]) == EXIT_OK
    assert tomllib.loads(capsys.readouterr().out)["jobs"]["max_jobs"] == 3


def test_the_node_config_is_read_when_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(daemon_main, "DEFAULT_NODE_CONFIG", str(write(tmp_path, "[jobs]\nmax_jobs = 5\n")))
    assert main(["--print-config"]) == EXIT_OK
    assert tomllib.loads(capsys.readouterr().out)["jobs"]["max_jobs"] == 5


TOML_SCALARS = (
    st.text(max_size=40)
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.booleans()
    | st.lists(st.text(max_size=10), max_size=4)
    | st.lists(st.integers(0, 2**31), max_size=4)
)


@given(st.dictionaries(st.from_regex(r"[a-z][a-z_]{0,10}", fullmatch=True), TOML_SCALARS, max_size=6))
def test_to_toml_round_trips_any_table_of_settings(values: dict[str, Any]) -> None:
    values = {k: v for k, v in values.items() if not k.endswith("_mode")}
    back = tomllib.loads(to_toml({"section": values}))
    assert back == {"section": values}


def test_to_toml_writes_modes_in_octal_and_special_floats() -> None:
    text = to_toml({"server": {"socket_mode": 0o660}, "x": {"inf": math.inf, "ninf": -math.inf}})
    assert "socket_mode = 0o660" in text
    back = tomllib.loads(text)
    assert back["server"]["socket_mode"] == 0o660
    assert back["x"] == {"inf": math.inf, "ninf": -math.inf}

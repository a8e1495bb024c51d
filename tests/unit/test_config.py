from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiermem.core.config import DaemonConfig, PoolConfig, config_to_dict, load_config
from tiermem.core.errors import ConfigError
from tiermem.core.units import GiB, MiB

EXAMPLE = Path(__file__).resolve().parents[2] / "systemd" / "tiermemd.toml"


def test_defaults_need_no_file_and_resolve_per_user_paths(tmp_path: Path) -> None:
    config = load_config(env={"XDG_RUNTIME_DIR": str(tmp_path / "run"), "HOME": str(tmp_path)})
    assert config.server.socket == str(tmp_path / "run" / "tiermem" / "tiermemd.sock")
    assert config.server.state_dir == str(tmp_path / ".local" / "state" / "tiermem")
    assert config.swap.dirs == (str(tmp_path / ".local" / "state" / "tiermem" / "swap"),)
    assert config.pool.size == 0


def test_shipped_example_config_parses() -> None:
    config = load_config(EXAMPLE, env={})
    assert config.pool.size == 64 * GiB
    assert config.server.socket == "/run/tiermem/tiermemd.sock"
    assert config.server.socket_mode == 0o660
    assert config.swap.dirs == ("/var/lib/tiermem/swap",)
    assert config.jobs.max_window == 1 * GiB
    assert config.jobs.window_size == 2 * MiB
    assert config.metrics.port == 9464


def test_environment_overrides_file_and_flags_override_environment(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text('[pool]\nsize = "1GiB"\n[swap]\nqueue_depth = 8\n')
    env = {"TIERMEM_POOL_SIZE": "2GiB", "TIERMEM_SWAP_DIRS": "/a,/b", "HOME": str(tmp_path)}
    config = load_config(path, env=env, overrides={"pool.size": "3GiB", "metrics.port": 9000})
    assert config.pool.size == 3 * GiB
    assert config.swap.queue_depth == 8
    assert config.swap.dirs == ("/a", "/b")
    assert config.metrics.port == 9000


@pytest.mark.parametrize(
    ("toml", "field", "words"),
    [
        ('[pool]\nsize = "lots"\n', "pool.size", "size"),
        ("[pool]\nsize = -1\n", "pool.size", ">= 0"),
        ("[pool]\nsizee = 1\n", "pool.sizee", "unknown setting"),
        ("[poool]\nsize = 1\n", "poool", "unknown section"),
        ('[swap]\nengine = "spdk"\n', "swap.engine", "libaio"),
        ("[swap]\nblock_size = 1000\n", "swap.block_size", "4KiB"),
        ('[swap]\nqueue_depth = "many"\n', "swap.queue_depth", "integer"),
        ("[metrics]\nport = 70000\n", "metrics.port", "65535"),
        ('[pool]\nmlock = "perhaps"\n', "pool.mlock", "true or false"),
        ("[server]\nsocket_mode = 0o7777\n", "server.socket_mode", "permission"),
        ("pool = 3\n", "pool", "table"),
        ("[pool\n", "--config", "not valid TOML"),
    ],
)
def test_invalid_settings_name_the_field(tmp_path: Path, toml: str, field: str, words: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.field == field
    assert words in str(info.value)


def test_unknown_environment_setting_is_an_error() -> None:
    with pytest.raises(ConfigError, match="TIERMEM_POOL_SIZ"):
        load_config(env={"TIERMEM_POOL_SIZ": "1GiB"})


@pytest.mark.parametrize(
    "name",
    [
        "TIERMEM_SOCKET_PATH",
        "TIERMEM_NO_EMBED",
        "TIERMEM_CLIENT_TIMEOUT_S",
        "TIERMEM_DAEMON_USER",
        "TIERMEM_SECRET_FILE",
    ],
)
def test_the_clients_own_variables_do_not_stop_a_daemon_started_beside_it(name: str) -> None:
    assert load_config(env={name: "/some/value"}).pool == load_config(env={}).pool


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})


def test_cross_field_check_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"pool\.arena_size"):
        PoolConfig(arena_size=5 * MiB + 1)


def test_config_to_dict_round_trips_through_load(tmp_path: Path) -> None:
    config = load_config(EXAMPLE, env={})
    tables = config_to_dict(config)
    overrides = {f"{s}.{k}": v for s, values in tables.items() for k, v in values.items()}
    assert load_config(env={}, overrides=overrides) == config
    assert isinstance(config, DaemonConfig)


def test_adam_warmup_takes_job_dtypes_and_names_a_wrong_one(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    config = load_config(None, env={**env, "TIERMEM_ADAM_WARMUP": "float32,bfloat16"})
    assert config.adam.warmup == ("float32", "bfloat16")
    with pytest.raises(ConfigError, match=r"adam\.warmup.*'fp16'.*float16"):
        load_config(None, env=env, overrides={"adam.warmup": ["fp16"]})


def test_the_warmup_dtypes_are_built_when_the_daemon_kernel_is_made() -> None:
    from tiermem.core.config import AdamConfig
    from tiermemd.kernel import default_kernel, warmup_keys

    assert warmup_keys(("float32", "bfloat16")) == [(torch.float32, None), (torch.bfloat16, torch.bfloat16)]
    kernel = default_kernel(AdamConfig(warmup=("float16",), compile=False))  # the eager build: no compiler here
    try:
        built = [(r.key.grad_dtype, r.key.out_dtype) for r in kernel.engine.kernels()]
    finally:
        kernel.close()
    assert built == [(torch.float16, torch.float16)], built

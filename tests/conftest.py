"""Shared test fixtures and settings."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# A shell without job control starts a background command (``./run.sh test &``) with SIGINT ignored, and an
# ignored signal stays ignored across exec: the children the Ctrl-C tests interrupt would never see it.  With
# Python's own handler here (in the runner and in each worker), every child starts with the default action.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def no_node_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every tiermemd the tests start without ``--config`` reads an empty settings file (``TIERMEM_CONFIG``),
    never the node's ``/etc/tiermem/tiermemd.toml``: on a node with the service installed, its metrics port,
    swap dirs and socket group would otherwise change what the tests see (a test that means to read the node
    file removes the variable itself)."""
    path = tmp_path_factory.mktemp("settings") / "tiermemd.toml"
    path.write_text("# no settings: every test daemon starts from the defaults\n")
    before = os.environ.get("TIERMEM_CONFIG")
    os.environ["TIERMEM_CONFIG"] = str(path)
    yield
    if before is None:
        os.environ.pop("TIERMEM_CONFIG", None)
    else:
        os.environ["TIERMEM_CONFIG"] = before


@pytest.fixture(scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """torch on one intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_intra_op_thread")``).

    Its tensors are tiny: torch's intra-op threads only add barrier waits (costly on a busy machine)."""
    import torch  # only the modules that use it pay for the import

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

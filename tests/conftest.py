"""Shared test fixtures and settings."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """torch on one intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_intra_op_thread")``).

    Its tensors are tiny: torch's intra-op threads only add barrier waits (costly on a busy machine)."""
    import torch  # only the modules that use it pay for the import

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

"""The demo trainer's OpenMP wait: chosen before torch loads, and never over the user's own choice."""

from __future__ import annotations

from tiermem.client.demo.openmp import SPINCOUNT, choose


def test_without_a_policy_the_demo_shortens_the_spin_and_says_so() -> None:
    updates, line = choose({"PATH": "/usr/bin"}, torch_loaded=False)
    assert updates == {"GOMP_SPINCOUNT": SPINCOUNT}
    assert f"GOMP_SPINCOUNT={SPINCOUNT}" in line and "GOMP_SPINCOUNT or OMP_WAIT_POLICY in the environment" in line


def test_a_policy_from_the_environment_is_kept_and_named() -> None:
    updates, line = choose({"OMP_WAIT_POLICY": "PASSIVE"}, torch_loaded=False)
    assert updates == {}
    assert line == "trainer OpenMP: OMP_WAIT_POLICY=PASSIVE (from the environment)"
    updates, line = choose({"GOMP_SPINCOUNT": "5000", "OMP_WAIT_POLICY": "ACTIVE"}, torch_loaded=False)
    assert updates == {}
    assert "GOMP_SPINCOUNT=5000 OMP_WAIT_POLICY=ACTIVE (from the environment)" in line


def test_once_torch_is_loaded_nothing_is_set_and_the_line_says_why() -> None:
    updates, line = choose({}, torch_loaded=True)
    assert updates == {}
    assert "default spin" in line and "torch was loaded" in line

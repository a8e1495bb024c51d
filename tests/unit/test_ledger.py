from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiermem.core.errors import AdmissionError
from tiermem.core.units import GiB, MiB
from tiermemd.ledger import Ledger, Resource


def test_reservation_beyond_capacity_is_refused_naming_the_holders() -> None:
    ledger = Ledger({Resource.POOL: 4 * GiB})
    ledger.reserve("job-a", Resource.POOL, 3 * GiB)
    with pytest.raises(AdmissionError) as info:
        ledger.reserve("job-b", Resource.POOL, 2 * GiB)
    text = str(info.value)
    assert "job-b" in text and "job-a: 3GiB" in text
    # which pool, the exact bytes asked and free, and the knob that fixes it
    assert f"asked for {2 * GiB} bytes (2GiB) of the daemon's host-memory pool" in text
    assert f"only {GiB} bytes (1GiB) of its {4 * GiB} bytes (4GiB) are free" in text
    assert "raise pool.size (TIERMEM_POOL_SIZE; a private daemon: connect(pool_size=...))" in text
    assert ledger.held(Resource.POOL, "job-b") == 0


@pytest.mark.parametrize("resource", list(Resource))
def test_every_resource_names_its_knob_when_short(resource: Resource) -> None:
    ledger = Ledger({resource: MiB})
    with pytest.raises(AdmissionError) as info:
        ledger.reserve("job", resource, MiB + 1)
    knob = {"pool": "pool.size", "window": "jobs.window_budget", "swap": "swap.dirs", "storage": "jobs.storage_budget"}
    assert knob[resource.value] in str(info.value)


def test_quota_caps_one_job_even_when_the_node_has_room() -> None:
    ledger = Ledger({Resource.SWAP: 100 * GiB})
    ledger.set_quota("job-a", Resource.SWAP, 10 * GiB)
    ledger.reserve("job-a", Resource.SWAP, 8 * GiB)
    with pytest.raises(AdmissionError, match="quota of 10GiB"):
        ledger.reserve("job-a", Resource.SWAP, 4 * GiB)


def test_release_all_returns_the_holdings_and_frees_them() -> None:
    ledger = Ledger({Resource.WINDOW: GiB, Resource.POOL: GiB})
    ledger.reserve("j", Resource.WINDOW, 64 * MiB)
    ledger.reserve("j", Resource.POOL, 128 * MiB)
    assert ledger.release_all("j") == {Resource.WINDOW: 64 * MiB, Resource.POOL: 128 * MiB}
    assert ledger.available(Resource.POOL) == GiB
    assert ledger.release_all("j") == {}


def test_releasing_more_than_held_is_an_error() -> None:
    ledger = Ledger({Resource.POOL: GiB})
    ledger.reserve("j", Resource.POOL, MiB)
    with pytest.raises(AdmissionError, match="holds 1MiB"):
        ledger.release("j", Resource.POOL, 2 * MiB)


@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans(), st.integers(0, 300)), max_size=60))
def test_holdings_never_exceed_capacity(ops: list[tuple[str, bool, int]]) -> None:
    ledger = Ledger({Resource.POOL: 1000})
    model = {"a": 0, "b": 0, "c": 0}
    for job, take, n in ops:
        if take:
            try:
                ledger.reserve(job, Resource.POOL, n)
                model[job] += n
            except AdmissionError:
                assert sum(model.values()) + n > 1000
        elif model[job] >= n:
            ledger.release(job, Resource.POOL, n)
            model[job] -= n
        assert ledger.held(Resource.POOL) == sum(model.values()) <= 1000

"""A rank's phase machine: exactly the moves the records module documents, and what FAILED means."""

from __future__ import annotations

import itertools

import pytest

from tiermem.core.errors import InvalidState, StepFailed
from tiermemd.rank.records import PhaseRecord, RankPhase

UNREG, IDLE, OVERLAP, DELAYED, FAILED = (
    RankPhase.UNREGISTERED,
    RankPhase.IDLE,
    RankPhase.OVERLAPPING,
    RankPhase.DELAYED,
    RankPhase.FAILED,
)
REGISTERED = (IDLE, OVERLAP, DELAYED, FAILED)
DOCUMENTED = {
    (UNREG, IDLE),  # register
    (IDLE, OVERLAP),  # BUCKET_READY
    (OVERLAP, IDLE),  # STEP / ABORT
    (IDLE, DELAYED),  # STEP(delayed)
    (DELAYED, IDLE),  # the next request waited for it
    *((phase, FAILED) for phase in REGISTERED),  # an update raised
    (FAILED, IDLE),  # every tensor reset
}
ALL_MOVES = list(itertools.product(RankPhase, RankPhase))


def _at(phase: RankPhase) -> PhaseRecord:
    return PhaseRecord(phase=phase)


@pytest.mark.parametrize(
    ("start", "to"), [m for m in ALL_MOVES if m in DOCUMENTED], ids=lambda p: p.value if isinstance(p, RankPhase) else p
)
def test_move_takes_a_documented_transition(start: RankPhase, to: RankPhase) -> None:
    record = _at(start)
    record.move(to)
    assert record.phase is to


@pytest.mark.parametrize(
    ("start", "to"),
    [m for m in ALL_MOVES if m not in DOCUMENTED],
    ids=lambda p: p.value if isinstance(p, RankPhase) else p,
)
def test_move_refuses_an_undocumented_transition_naming_both_phases(start: RankPhase, to: RankPhase) -> None:
    record = _at(start)
    with pytest.raises(InvalidState) as info:
        record.move(to)
    assert type(info.value) is InvalidState
    assert start.value in str(info.value)
    assert to.value in str(info.value)
    assert record.phase is start


@pytest.mark.parametrize("start", [IDLE, OVERLAP, DELAYED], ids=lambda p: p.value)
def test_fail_records_the_step_and_reason(start: RankPhase) -> None:
    record = _at(start)
    record.fail(7, "RuntimeError: boom")
    assert (record.phase, record.failed_step, record.failed_reason) == (FAILED, 7, "RuntimeError: boom")


def test_fail_keeps_the_first_failed_step() -> None:
    record = _at(IDLE)
    record.fail(7, "first")
    record.fail(9, "second")
    assert (record.phase, record.failed_step, record.failed_reason) == (FAILED, 7, "first")


def test_a_reset_rank_fails_afresh_with_the_new_step() -> None:
    record = _at(IDLE)
    record.fail(7, "first")
    record.move(IDLE)
    record.fail(12, "again")
    assert (record.failed_step, record.failed_reason) == (12, "again")


def test_fail_of_an_unregistered_rank_is_refused() -> None:
    record = PhaseRecord()
    with pytest.raises(InvalidState):
        record.fail(3, "no tensors yet")
    assert record.phase is UNREG


def test_check_usable_of_a_failed_rank_raises_step_failed_naming_the_step() -> None:
    record = _at(IDLE)
    record.fail(41, "OSError: disk gone")
    with pytest.raises(StepFailed) as info:
        record.check_usable()
    assert info.value.step == 41
    assert info.value.reason == "OSError: disk gone"
    assert "step 41" in str(info.value)


def test_check_usable_of_an_unregistered_rank_raises_invalid_state() -> None:
    with pytest.raises(InvalidState) as info:
        PhaseRecord().check_usable()
    assert not isinstance(info.value, StepFailed)
    assert "not registered" in str(info.value)


@pytest.mark.parametrize("phase", [IDLE, OVERLAP, DELAYED], ids=lambda p: p.value)
def test_check_usable_passes_in_working_phases(phase: RankPhase) -> None:
    _at(phase).check_usable()


def test_a_new_record_is_unregistered_with_no_failure() -> None:
    record = PhaseRecord()
    assert (record.phase, record.failed_step, record.failed_reason) == (UNREG, 0, "")

"""The fetch trace of param paging: recorded on the first step, followed (and re-found) afterwards."""

from __future__ import annotations

from tiermem.client.offload.trace import LOOK_AHEAD, FetchTrace

STEP = [(0, 1), (2, 3), (4, 5), (6, 7), (6,), (4,), (2,)]
"""The seed network's uses: four layers forward, then the weights of layers 4, 3 and 2 in backward."""


def recorded() -> FetchTrace:
    trace = FetchTrace()
    for group in STEP:
        assert trace.use(group)
        assert trace.upcoming(2) == []  # nothing is prefetched while the first step records
    trace.end_step()
    return trace


def test_the_first_step_is_recorded_and_the_next_ones_follow_it() -> None:
    trace = recorded()
    assert trace.groups == STEP and not trace.recording
    for i, group in enumerate(STEP):
        assert trace.use(group)
        assert trace.upcoming(2) == STEP[i + 1 : i + 3]
    assert trace.upcoming(1) == []  # the end of the step: nothing after the last use
    assert trace.matched == len(STEP) and trace.missed == 0


def test_an_empty_step_does_not_end_the_recording() -> None:
    trace = FetchTrace()
    trace.end_step()
    assert trace.recording
    trace.use((0,))
    trace.end_step()
    assert not trace.recording and trace.groups == [(0,)]


def test_a_skipped_use_is_found_further_on() -> None:
    trace = recorded()
    trace.use(STEP[0])
    assert trace.use(STEP[2])  # STEP[1] did not happen this time
    assert trace.upcoming(1) == [STEP[3]]


def test_an_inference_pass_then_a_training_step_finds_the_start_again() -> None:
    trace = recorded()
    for group in STEP[:4]:  # forward only, no backward, no step
        trace.use(group)
    assert trace.use(STEP[0])  # the next step's first use is searched from the start
    assert trace.upcoming(1) == [STEP[1]]


def test_an_unknown_use_loses_the_trace_until_a_known_one() -> None:
    trace = recorded()
    trace.use(STEP[0])
    assert not trace.use((99,))
    assert trace.lost and trace.upcoming(3) == [] and trace.missed == 1
    assert trace.use(STEP[3])
    assert not trace.lost and trace.upcoming(1) == [STEP[4]]


def test_repeated_groups_match_the_nearest_occurrence() -> None:
    trace = FetchTrace()
    uses = [(1,), (2,), (1,), (3,)] + [(9,)] * LOOK_AHEAD + [(1,), (4,)]
    for group in uses:
        trace.use(group)
    trace.end_step()
    for i, group in enumerate(uses):
        trace.use(group)
        assert trace.position == i

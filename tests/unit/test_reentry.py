"""``Calls``: which optimizer call a thread is inside, and what a call made from inside it (a signal handler's)
may do."""

from __future__ import annotations

import threading

import pytest

from tiermem.client.offload.reentry import Calls
from tiermem.core.errors import InvalidState


def test_a_read_from_inside_a_call_is_a_reentry_and_a_change_is_refused_naming_both() -> None:
    calls = Calls("OffloadAdam")
    assert calls.inside() == ""
    with calls.enter("step()", reads=False):
        assert calls.inside() == "step()"
        assert not calls.reentered and not calls.reading
        with calls.enter("state_dict()", reads=True):
            assert calls.reentered and calls.reading
            with calls.enter("flush()", reads=True):  # the reentered call's own reads
                assert calls.reentered
            assert calls.inside() == "step()"
        assert not calls.reentered and not calls.reading
        with pytest.raises(InvalidState) as err, calls.enter("zero_grad()", reads=False):
            pass
        assert str(err.value).startswith(
            "OffloadAdam.zero_grad() was called while this thread is inside OffloadAdam.step(), from a signal handler"
        )
        assert "call zero_grad() once step() has returned" in str(err.value)
    assert calls.inside() == "" and not calls.reentered


def test_an_outermost_read_marks_reading_and_a_failing_call_leaves_no_mark() -> None:
    calls = Calls("OffloadAdam")
    with calls.enter("state_dict()", reads=True):
        assert calls.reading and not calls.reentered
    with pytest.raises(ValueError), calls.enter("step()", reads=False):
        raise ValueError("the call failed")
    assert calls.inside() == "" and not calls.reading


def test_another_threads_call_is_no_reentry_and_leaves_this_threads_mark() -> None:
    calls = Calls("OffloadAdam")
    seen: list[tuple[str, bool]] = []

    def other() -> None:
        with calls.enter("state_dict()", reads=True):
            seen.append((calls.inside(), calls.reentered))

    with calls.enter("step()", reads=False):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert calls.inside() == "step()"
    assert seen == [("", False)]

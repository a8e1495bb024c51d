"""``Calls``: which optimizer call a thread is inside, and what a call made from inside it (a signal handler's)
may do."""

from __future__ import annotations

import threading

import pytest

from tiermem.client.offload.reentry import Calls
from tiermem.client.offload.staged import ReentrantQueue
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


def test_a_queue_joined_from_inside_its_own_put_waits_for_the_consumer_instead_of_itself() -> None:
    """What a signal handler's checkpoint does when it lands in a grad hook's ``put`` (the queue's lock held by
    the interrupted frame) and drains the grad pusher: ``join`` lets the lock go while it waits, so the
    consumer thread takes the items and the join returns.  On ``queue.Queue``'s plain lock it waited for good."""
    q = ReentrantQueue()
    taken: list[int] = []

    def consume() -> None:
        while (item := q.get()) is not None:
            taken.append(item)
            q.task_done()
        q.task_done()

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    with q.mutex:  # as inside put(): the lock held by the interrupted frame (a plain lock waits here for good)
        q.put(1)
        q.put(2)
        q.join()
    q.put(None)
    consumer.join(5.0)
    assert taken == [1, 2]

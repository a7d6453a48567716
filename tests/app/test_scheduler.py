"""The round scheduler as a pure function: lanes, round robin and the straggler wait, with chosen times."""

from __future__ import annotations

import pytest

from arstream.app.scheduler import RoundScheduler, Run, TickLanes, Wait


def seconds_waited(decision: Run | Wait) -> float | None:
    """The wait a decision asks for (the test fails on a decision to run)."""
    assert isinstance(decision, Wait), decision
    return decision.seconds


def lanes_with(*queued: tuple[str, str]) -> TickLanes[str]:
    lanes: TickLanes[str] = TickLanes()
    for session_id, job in queued:
        lanes.push(session_id, job)
    return lanes


def test_a_round_takes_one_tick_per_session_and_sends_the_busy_to_the_back() -> None:
    lanes = lanes_with(("a", "a0"), ("a", "a1"), ("b", "b0"), ("c", "c0"), ("c", "c1"))
    assert list(lanes.line) == ["a", "b", "c"] and lanes.queued == 5
    assert lanes.take_round(["a", "b"]) == ["a0", "b0"]
    # c has waited longest; a still has a tick and queues behind it; b has none left
    assert list(lanes.line) == ["c", "a"] and lanes.queued == 3
    assert lanes.take_round(["c", "a"]) == ["c0", "a1"]
    assert lanes.take_round(["c"]) == ["c1"]
    assert list(lanes.line) == [] and lanes.queued == 0


def test_a_round_takes_sessions_in_line_order_and_one_held_back_keeps_its_place() -> None:
    lanes = lanes_with(("a", "a0"), ("b", "b0"), ("b", "b1"), ("c", "c0"))
    with pytest.raises(ValueError, match="in its order"):
        lanes.take_round(["c", "b"])
    with pytest.raises(ValueError, match="in its order"):
        lanes.take_round(["b", "b"])
    assert lanes.front("b") == "b0"
    # a's next chunk may not start yet (the worker's chunks-ahead bound): it stays first, b goes to the back
    assert lanes.take_round(["b", "c"]) == ["b0", "c0"]
    assert list(lanes.line) == ["a", "b"]


def test_taking_a_lane_removes_the_session_from_the_line() -> None:
    lanes = lanes_with(("a", "a0"), ("b", "b0"), ("a", "a1"))
    assert lanes.take_lane("a") == ("a0", "a1")
    assert lanes.take_lane("a") == ()
    assert list(lanes.line) == ["b"] and lanes.queued == 1 and lanes.lane_length("b") == 1


def test_without_a_wait_fraction_the_front_of_the_line_runs_at_once() -> None:
    scheduler = RoundScheduler(0.0, first_round_s=1.0)
    scheduler.round_ran(["a", "b"], 1.0)
    assert scheduler.next_round(["a"], batch_limit=2, now=0.0) == Run(("a",))  # b is late: a partial round
    assert scheduler.next_round(["a", "b", "c"], batch_limit=2, now=0.0) == Run(("a", "b"))


def test_an_empty_line_waits_until_something_is_queued() -> None:
    assert RoundScheduler(1.0).next_round([], batch_limit=2, now=0.0) == Wait(None)


def test_a_round_waits_for_the_last_rounds_stragglers_up_to_its_fraction() -> None:
    scheduler = RoundScheduler(0.5)
    scheduler.round_ran(["a", "b"], 0.4)  # the next round waits up to 0.2 s for b
    assert seconds_waited(scheduler.next_round(["a"], batch_limit=2, now=10.0)) == pytest.approx(0.2)
    assert seconds_waited(scheduler.next_round(["a"], batch_limit=2, now=10.15)) == pytest.approx(0.05)
    # b's tick came: the whole last round is back, one forward for both
    assert scheduler.next_round(["a", "b"], batch_limit=2, now=10.16) == Run(("a", "b"))


def test_a_straggler_that_never_comes_is_waited_for_once() -> None:
    scheduler = RoundScheduler(0.5)
    scheduler.round_ran(["a", "b"], 0.4)
    assert isinstance(scheduler.next_round(["a"], batch_limit=2, now=10.0), Wait)
    assert scheduler.next_round(["a"], batch_limit=2, now=10.2) == Run(("a",))  # the moment is over
    scheduler.round_ran(["a"], 0.4)
    # b is out of the last round now: a's next tick runs at once
    assert scheduler.next_round(["a"], batch_limit=2, now=10.7) == Run(("a",))


def test_a_session_that_left_is_not_waited_for() -> None:
    scheduler = RoundScheduler(0.5)
    scheduler.round_ran(["a", "b"], 0.4)
    scheduler.forget("b")
    assert scheduler.next_round(["a"], batch_limit=2, now=0.0) == Run(("a",))


def test_a_full_batch_never_waits() -> None:
    scheduler = RoundScheduler(1.0)
    scheduler.round_ran(["a", "b", "c"], 1.0)
    assert scheduler.next_round(["a", "b"], batch_limit=2, now=0.0) == Run(("a", "b"))


def test_from_idle_the_first_round_waits_the_whole_moment_for_other_first_ticks() -> None:
    """Sessions starting together share their first forward; one run alone would leave the others a chunk
    behind, and sessions whose histories differ in length cannot share a forward."""
    scheduler = RoundScheduler(1.0, first_round_s=0.2)  # warm-up's one-session step
    assert seconds_waited(scheduler.next_round(["a"], batch_limit=2, now=5.0)) == pytest.approx(0.2)
    assert scheduler.next_round(["a", "b"], batch_limit=2, now=5.05) == Run(("a", "b"))


def test_from_idle_a_lone_session_runs_when_the_moment_is_over() -> None:
    scheduler = RoundScheduler(1.0, first_round_s=0.2)
    assert isinstance(scheduler.next_round(["a"], batch_limit=4, now=5.0), Wait)
    assert scheduler.next_round(["a"], batch_limit=4, now=5.2) == Run(("a",))
    # the next wait starts afresh: the moment counts from when the scheduler first had to wait
    scheduler.round_ran(["a"], 0.2)
    scheduler.forget("a")
    assert seconds_waited(scheduler.next_round(["b"], batch_limit=4, now=9.0)) == pytest.approx(0.2)


def test_an_empty_line_ends_a_wait() -> None:
    """A wait that ended with nobody queued (everyone left) does not shorten a later round's wait."""
    scheduler = RoundScheduler(1.0, first_round_s=0.2)
    assert isinstance(scheduler.next_round(["a"], batch_limit=2, now=0.0), Wait)
    assert scheduler.next_round([], batch_limit=2, now=0.1) == Wait(None)
    assert seconds_waited(scheduler.next_round(["b"], batch_limit=2, now=60.0)) == pytest.approx(0.2)

"""Realtime admission: the capacity arithmetic on exact figures, then a real server with fake-kv at a known compute time."""

from __future__ import annotations

import asyncio
import re
from typing import Any, get_args

import pytest

from arstream.app.admission import (
    ADMISSION_POLICIES,
    AdmissionName,
    KVAdmission,
    RealtimeAdmission,
    RealtimeCapacity,
    RoundTimes,
    admission_policy,
    chunk_period_s,
    cycle_seconds,
    realtime_capacity,
    round_estimate,
)
from arstream.models.fake import FakeKVPipeline
from arstream.runner.runner import ARRunner
from arstream.runner.types import TickRequest
from servers import fake_settings, running_server, session_client

# ---- the policies, on chosen figures ----------------------------------------------------------


def realtime_of(sessions: int) -> RealtimeCapacity:
    return RealtimeCapacity(sessions, chunk_period_s=0.25, batch_limit=1, kv_capacity=8, next_cycle_s=0.3)


def never_asked() -> RealtimeCapacity | None:
    raise AssertionError("kv admission must not compute realtime figures")


def test_every_admission_name_chooses_its_policy() -> None:
    assert set(ADMISSION_POLICIES) == set(get_args(AdmissionName))
    assert isinstance(admission_policy("kv"), KVAdmission) and not isinstance(admission_policy("kv"), RealtimeAdmission)
    assert isinstance(admission_policy("realtime"), RealtimeAdmission)
    with pytest.raises(ValueError, match=r"unknown admission policy 'fifo'; expected one of \['kv', 'realtime'\]"):
        admission_policy("fifo")


def test_kv_admission_counts_only_the_pools_slots() -> None:
    kv = KVAdmission()
    assert kv.refusal(7, 8, never_asked) is None
    assert kv.refusal(8, 8, never_asked) == "all 8 session slots are in use; try again later"
    assert kv.slots(8, never_asked) == 8


def test_realtime_admission_refuses_past_its_capacity_and_never_past_the_pool() -> None:
    realtime = RealtimeAdmission()
    assert realtime.refusal(1, 8, lambda: realtime_of(2)) is None
    refusal = realtime.refusal(2, 8, lambda: realtime_of(2))
    assert refusal is not None and refusal.startswith("realtime admission: 2 session(s) already admitted")
    assert realtime.refusal(4, 4, lambda: realtime_of(6)) == "all 4 session slots are in use; try again later"
    assert realtime.slots(8, lambda: realtime_of(2)) == 2 and realtime.slots(1, lambda: realtime_of(2)) == 1
    # before the model has loaded there are no figures: the pool decides
    assert realtime.refusal(3, 8, lambda: None) is None and realtime.slots(8, lambda: None) == 8


# ---- the arithmetic ---------------------------------------------------------------------------


def test_cycle_is_full_rounds_plus_the_rest() -> None:
    estimates = {1: 0.05, 2: 0.06, 4: 0.08}
    assert cycle_seconds(estimates, 4, batch_limit=4) == pytest.approx(0.08)
    assert cycle_seconds(estimates, 5, batch_limit=4) == pytest.approx(0.08 + 0.05)
    assert cycle_seconds(estimates, 6, batch_limit=4) == pytest.approx(0.08 + 0.06)
    assert cycle_seconds(estimates, 9, batch_limit=4) == pytest.approx(2 * 0.08 + 0.05)
    # Without batching every session is a round of its own.
    assert cycle_seconds(estimates, 3, batch_limit=1) == pytest.approx(3 * 0.05)


def test_an_unmeasured_size_borrows_from_its_neighbours() -> None:
    estimates = {2: 0.06, 4: 0.08}
    assert round_estimate(estimates, 3) == 0.08  # the next larger size: fewer sessions are not slower
    assert round_estimate(estimates, 1) == 0.06
    assert round_estimate(estimates, 8) == pytest.approx(0.16)  # the largest smaller size, scaled up
    assert round_estimate({}, 1) is None


def test_capacity_is_the_largest_count_that_keeps_the_chunk_period() -> None:
    # 16 fps, 2 frames per chunk: 125 ms of video per chunk; 50 ms rounds, no batching -> 2 sessions.
    capacity = realtime_capacity({1: 0.05}, chunk_period_s=0.125, batch_limit=1, kv_capacity=64)
    assert capacity.sessions == 2
    assert capacity.next_cycle_s == pytest.approx(0.15)
    assert capacity.refusal(1) is None
    message = capacity.refusal(2)
    assert message is not None
    assert "2 session(s) already admitted" in message and "150 ms" in message and "125 ms" in message


def test_batching_multiplies_capacity_by_the_batch_when_rounds_cost_the_same() -> None:
    # A forward that takes as long for 4 rows as for 1 (a GPU with idle width): 2 full rounds fit 125 ms.
    estimates = {1: 0.05, 2: 0.05, 3: 0.05, 4: 0.05}
    assert realtime_capacity(estimates, chunk_period_s=0.125, batch_limit=4, kv_capacity=64).sessions == 8


def test_capacity_never_exceeds_the_kv_pool() -> None:
    capacity = realtime_capacity({1: 0.001}, chunk_period_s=0.125, batch_limit=1, kv_capacity=3)
    assert capacity.sessions == 3
    assert capacity.refusal(3) == "realtime admission: all 3 session slots of the KV pool are in use"


def test_every_smaller_count_must_fit_too() -> None:
    # One session alone is too slow (200 ms rounds); two batched would fit, but never get there.
    capacity = realtime_capacity({1: 0.2, 2: 0.05}, chunk_period_s=0.125, batch_limit=2, kv_capacity=8)
    assert capacity.sessions == 0
    message = capacity.refusal(0)
    assert message is not None and "200 ms" in message


def test_with_nothing_measured_one_session_is_admitted_to_measure() -> None:
    capacity = realtime_capacity({}, chunk_period_s=0.125, batch_limit=4, kv_capacity=8)
    assert capacity.sessions == 1
    assert capacity.refusal(0) is None
    message = capacity.refusal(1)
    assert message is not None and "no chunk time measured yet" in message


def test_round_times_keep_the_median_of_recent_rounds() -> None:
    times = RoundTimes(kept=3)
    for seconds in (0.5, 0.1, 0.2, 0.3):  # 0.5 falls out of the window
        times.record(2, seconds)
    times.record(1, 0.04)
    assert times.estimates() == {2: pytest.approx(0.2), 1: pytest.approx(0.04)}
    with pytest.raises(ValueError, match="at least one session"):
        times.record(0, 0.1)


def test_chunk_period_comes_from_the_model_card() -> None:
    assert chunk_period_s({"fps": 16, "frames_per_chunk": 4}) == 0.25
    with pytest.raises(ValueError, match="positive fps"):
        chunk_period_s({"fps": 0, "frames_per_chunk": 2})


# ---- warm-up: every batch size, and the first figures -------------------------------------------


class RowCountingFakePipeline(FakeKVPipeline):
    """Notes the number of rows of every forward."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.rows: list[int] = []

    def generate_chunk(self, tick: TickRequest) -> Any:
        self.rows.append(1)
        return super().generate_chunk(tick)

    def generate_chunks(self, ticks: Any) -> Any:
        self.rows.append(len(ticks))
        return super().generate_chunks(ticks)


def test_warm_up_runs_every_batch_size_and_leaves_the_pool_as_it_found_it() -> None:
    pipeline = RowCountingFakePipeline(compute_delay_s=0.01)
    runner = ARRunner(pipeline, kv_budget_bytes=1 << 20, max_batch_sessions=4)
    free = runner.pool.num_free
    ran = runner.warmup()
    warmup_ticks = len(list(pipeline.warmup_requests("x")))
    assert pipeline.rows == [size for size in (1, 2, 3, 4) for _ in range(warmup_ticks)]
    assert ran == warmup_ticks * (1 + 2 + 3 + 4)
    assert sorted(runner.warmup_round_s) == [1, 2, 3, 4]
    assert all(seconds >= 0.01 for seconds in runner.warmup_round_s.values())  # each step slept once
    assert runner.pool.num_free == free and runner.resident_sessions() == []
    stats = runner.stats()
    assert stats.chunks_total == 0 and stats.batched_forwards_total == 0


# ---- a real server: fake-kv at a known compute time ------------------------------------------

# 16 fps and 4 frames per chunk: a chunk holds 250 ms of video. A forward sleeps 100 ms, so with
# one session per forward two sessions get 200 ms cycles (realtime) and a third would make 300 ms.
SLOW = {"compute_delay_s": 0.1, "frames_per_chunk": 4, "window_frames": 8, "session_capacity": 8}


def realtime_settings(**overrides: Any) -> Any:
    return fake_settings(admission="realtime", max_batch_sessions=1, **overrides)


async def refusal_of_one_more(url: str) -> dict[str, Any]:
    async with session_client(url) as extra:
        await extra.send(type="start")
        closed = await extra.closed_by_server()
    assert closed.code == 1013, closed
    (error,) = closed.messages
    assert error["type"] == "error" and error["code"] == "over_capacity" and error["fatal"] is True
    return error


def test_realtime_admission_refuses_the_session_that_would_break_realtime() -> None:
    with running_server(realtime_settings(), FakeKVPipeline(**SLOW)) as server:
        assert server.stats()["sessions"]["realtime_capacity"] == 2  # from warm-up alone

        async def scenario() -> tuple[dict[str, Any], int, dict[str, Any]]:
            async with session_client(server.ws_url, start={}) as a, session_client(server.ws_url, start={}) as b:
                for client in (a, b):
                    await client.send(type="tick", tick_id=0)
                for client in (a, b):
                    await client.recv_chunk()
                error = await refusal_of_one_more(server.ws_url)
                readyz = await asyncio.to_thread(server.get, "/readyz")
                await b.send(type="close")
                await b.closed_by_server()
                await asyncio.to_thread(server.wait_for_stats, lambda s: s["sessions"]["connected"] == 1)
                readyz_after = await asyncio.to_thread(server.get, "/readyz")
                async with session_client(server.ws_url, start={}) as c:
                    await c.send(type="tick", tick_id=0)
                    chunk, _ = await c.recv_chunk()
            assert readyz_after.status_code == 200
            return error, readyz.status_code, readyz.json() | {"chunk": chunk}

        error, status, readyz = asyncio.run(scenario())
        prefix = "realtime admission: 2 session(s) already admitted"
        assert error["message"].startswith(prefix)
        # three rounds of 100 ms and a bit of Python each, against 250 ms of video per chunk
        assert re.search(r"every 3\d\d ms of model time .* than the 250 ms of video", error["message"]), error
        assert status == 503 and readyz["reason"].startswith(prefix)
        assert readyz["chunk"]["chunk_index"] == 0
        assert server.stats()["sessions"]["realtime_capacity"] == 2


def test_kv_admission_ignores_realtime_but_reports_it() -> None:
    with running_server(fake_settings(max_batch_sessions=1), FakeKVPipeline(**SLOW)) as server:

        async def scenario() -> list[str]:
            async with session_client(server.ws_url, start={}), session_client(server.ws_url, start={}):
                async with session_client(server.ws_url, start={}) as third:
                    assert third.ready is not None
                    return [third.ready["type"], (await asyncio.to_thread(server.get, "/readyz")).json()["ready"]]

        assert asyncio.run(scenario()) == ["ready", True]
        assert server.stats()["sessions"]["realtime_capacity"] == 2


def test_traffic_refines_the_warm_up_figures() -> None:
    pipeline = FakeKVPipeline(**SLOW)
    with running_server(realtime_settings(), pipeline) as server:
        assert server.stats()["sessions"]["realtime_capacity"] == 2
        pipeline.compute_delay_s = 0.005  # the model got faster than warm-up measured

        async def scenario() -> None:
            async with session_client(server.ws_url, start={}) as client:
                for tick_id in range(4):
                    await client.send(type="tick", tick_id=tick_id)
                    await client.recv_chunk()

        asyncio.run(scenario())
        # Median of 1 warm-up figure and 4 fast rounds: rounds of a few ms, so the KV pool is the limit.
        assert server.stats()["sessions"]["realtime_capacity"] == SLOW["session_capacity"]

"""The rewind horizon (runner/rewind_schedule.py): which boundaries a session keeps, what that costs, how a
budget picks the schedule, and a real runner holding exactly what the schedule says (docs/rewind.md)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from arstream.app.settings import Settings
from arstream.models.fake import FakeKVPipeline
from arstream.models.registry import load_pipeline
from arstream.models.tiny_world.pipeline import load_tiny_world
from arstream.runner.contract import ARPipeline
from arstream.runner.pool import plan_pool
from arstream.runner.rewind_schedule import (
    DENSE_SECONDS,
    HORIZON_SLACK,
    PRECISE_DENSE,
    RewindPeak,
    RewindPlanError,
    RewindSchedule,
    boundary_frames,
    plan_rewind,
)
from arstream.runner.runner import ARRunner, rewind_for, runner_for_sessions
from arstream.runner.spec import KVCacheSpec
from runner_fakes import tick, tiny_spec

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


def test_every_recent_boundary_then_every_second_fourth_eighth_none_past_the_horizon() -> None:
    schedule = RewindSchedule(dense=4, horizon=20)
    # ages 0-3 every one (30..27), 4-7 even (26, 24), 8-15 multiples of 4 (20, 16), 16-20 of 8 (none in 10..14)
    assert schedule.kept(30) == [16, 20, 24, 26, 27, 28, 29, 30]
    assert schedule.kept(2) == [0, 1, 2]
    assert [schedule.stride(age) for age in (0, 3, 4, 7, 8, 15, 16, 31, 32)] == [1, 1, 2, 2, 4, 4, 8, 8, 16]
    assert RewindSchedule.last(3).kept(10) == [8, 9, 10]


def test_thinning_only_drops_a_boundary_never_wants_one_back() -> None:
    schedule = RewindSchedule(dense=3, horizon=50)
    for newest in range(200):
        later = set(schedule.kept(newest + 1))
        assert later - {newest + 1} <= set(schedule.kept(newest)), newest


def _worst_miss(schedule: RewindSchedule, back: float) -> float:
    """The furthest, as a share of ``back`` chunks, that the nearest held point ever is from ``back`` chunks back
    (over every newest boundary once a session has played past the horizon's slack)."""
    first = math.ceil(back * HORIZON_SLACK)
    ages = _held_ages(schedule)[first:]
    return max(min(abs(age - back) for age in held) for held in ages) / back


@functools.cache
def _held_ages(schedule: RewindSchedule) -> list[list[int]]:
    """The ages held while each boundary is the newest, for a session that runs a few periods past the horizon."""
    return [[n - b for b in schedule.kept(n)] for n in range(schedule.horizon + 4 * schedule.stride(schedule.horizon))]


def test_a_point_lies_within_a_fifth_of_any_time_back_and_none_past_the_horizons_slack() -> None:
    for need in (240, 40, 7):
        schedule = plan_rewind(tiny_spec(), chunks_per_second=8, seconds=need / 8, budget_bytes=1 << 40)
        assert schedule is not None and schedule.span == need and schedule.seconds == need / 8
        assert schedule.horizon == int(need * HORIZON_SLACK)
        for back in range(schedule.dense, need + 1):
            assert _worst_miss(schedule, back) <= 0.2, (need, back)
        assert max(n - schedule.kept(n)[0] for n in range(3 * schedule.horizon)) == schedule.horizon


def test_boundary_frames_are_the_sink_and_the_window_as_they_were() -> None:
    # sink 1, window history 4, chunks of 2: boundary 5 holds frame 0 and frames 6..9
    assert boundary_frames(5, 2, 1, 4) == ((0, 1), (6, 10))
    assert boundary_frames(0, 2, 1, 4) == ((0, 0), (1, 0))  # before the first chunk: nothing
    # with a strided tail of 10 history frames every 3rd: boundary 7 also holds frames 6 and 9 (one range each)
    assert boundary_frames(7, 2, 1, 4, 10, 3) == ((0, 1), (6, 7), (9, 10), (10, 14))


def test_the_last_k_schedule_costs_what_the_old_rewind_points_did() -> None:
    spec = tiny_spec()  # 5 resident frames, chunks of 2
    for k in (1, 3, 8):
        assert RewindSchedule.last(k).peak(spec) == RewindPeak(frames=spec.resident_frames + k * 2, copies=k)


@pytest.mark.parametrize(("strided", "stride"), [(0, 1), (12, 3)], ids=["dense", "strided"])
def test_a_runner_holds_exactly_the_schedules_boundaries_and_its_peak_blocks(strided: int, stride: int) -> None:
    # strided: boundaries hold sparse histories of their own phase, each frame counted once
    pipeline = FakeKVPipeline(
        sink_frames=1, window_frames=6, frames_per_chunk=2, strided_window_frames=strided, frame_stride=stride
    )
    schedule = RewindSchedule(dense=2, horizon=12)
    runner = ARRunner(pipeline, kv_budget_bytes=1 << 20, rewind=schedule)
    peak = schedule.peak(pipeline.kv_cache_spec())
    held_most = 0
    for index in range(40):
        result = runner.execute_tick(tick("s", index))
        assert result.rewind_held == (*schedule.kept(index), index + 1)
        assert result.rewind_points == (schedule.kept(index)[0], index + 1)
        held_most = max(held_most, runner.pool.num_used)
        assert runner.pool.num_used <= peak.frames  # one branch: one block per frame
    assert held_most == peak.frames, "the plan's worst case is reached, not just bounded"
    runner.close_session("s")
    assert runner.pool.num_free == runner.blocks_free_at_start


def test_the_plan_counts_the_schedules_peak_in_every_session() -> None:
    spec = tiny_spec(model_owned_bytes_per_session=24)
    schedule = RewindSchedule(dense=4, horizon=40)
    peak = schedule.peak(spec)
    plan = plan_pool(spec, 1 << 20, rewind=schedule)
    assert plan.per_session_bytes == peak.frames * spec.block_bytes + (1 + peak.copies) * 24
    assert plan.per_session_bytes - plan_pool(spec, 1 << 20).per_session_bytes == peak.extra_bytes(spec)


def test_a_budget_buys_the_densest_schedule_that_fits_and_a_shorter_horizon_last() -> None:
    spec = tiny_spec()  # 16-byte blocks
    wide = plan_rewind(spec, chunks_per_second=8, seconds=30, budget_bytes=1 << 30)
    # every chunk of the last 2 s; points back to 30 s and none past 36 s (not a whole tier's stride beyond)
    assert wide == RewindSchedule(dense=16, horizon=288, chunks_per_second=8, span=240)
    assert (wide.seconds, 1000 - wide.kept(1000)[0]) == (30, 264)
    budget = RewindSchedule(dense=5, horizon=288).peak(spec).extra_bytes(spec)
    chosen = plan_rewind(spec, chunks_per_second=8, seconds=30, budget_bytes=budget)
    assert chosen is not None and (chosen.dense, chosen.horizon, chosen.seconds) == (5, 288, 30)
    two = RewindSchedule(dense=2, horizon=288).peak(spec).extra_bytes(spec)
    shorter = plan_rewind(spec, chunks_per_second=8, seconds=30, budget_bytes=two - 1)
    assert shorter is not None and shorter.seconds == 15 and shorter.horizon == 144
    assert plan_rewind(spec, chunks_per_second=8, seconds=30, budget_bytes=0) is None
    assert plan_rewind(spec, chunks_per_second=8, seconds=0, budget_bytes=1 << 30) is None
    with pytest.raises(RewindPlanError, match="horizon >= 0 s"):
        plan_rewind(spec, chunks_per_second=8, seconds=float("nan"), budget_bytes=1)


def _models() -> dict[str, ARPipeline]:
    matrix = load_pipeline("matrix-game-2", "cpu", config="tiny", random_init=True)
    assert isinstance(matrix, ARPipeline)
    return {"tiny-world": load_tiny_world(torch.device("cpu")), "matrix-game-2": matrix}


def test_the_servers_defaults_hold_a_point_near_5_10_20_and_30_s_back_and_none_past_36_s() -> None:
    settings = Settings()
    for name, pipeline in _models().items():
        spec = pipeline.kv_cache_spec()
        schedule = rewind_for(pipeline, seconds=settings.rewind_seconds, budget_bytes=settings.rewind_budget_bytes())
        assert schedule is not None and schedule.seconds == 30, name
        rate = schedule.chunks_per_second
        for seconds in (5, 10, 20, 30):
            assert _worst_miss(schedule, seconds * rate) <= 0.2, (name, seconds, schedule)
        assert max(n - schedule.kept(n)[0] for n in range(2000)) / rate <= 36, name
        # the start-up line says it in seconds of play
        words = schedule.describe(spec)
        assert "then sparser back to 30 s (none older than 36 s)" in words and "chunks" not in words, words


def test_a_branch_without_a_chunk_starts_where_the_source_is() -> None:
    runner = runner_for_sessions(FakeKVPipeline(), 2, rewind=RewindSchedule.last(4))
    for index in range(5):
        runner.execute_tick(tick("source", index))
    assert runner.branch_session("source", None, "branch") == 5
    assert runner.next_chunk_index("branch") == 5
    runner.close_session("branch")
    runner.close_session("source")
    assert runner.pool.num_free == runner.blocks_free_at_start


def test_the_peak_counts_a_window_longer_than_the_horizon_until_it_is_whole() -> None:
    """One-frame chunks, a 15-frame history and a 9-chunk horizon (waypoint's shape at a short horizon): the kept
    windows keep spreading until newest is past horizon + history; the peak is the whole run's, counted there."""
    schedule = RewindSchedule(dense=9, horizon=9)
    spec = KVCacheSpec(
        num_layers=1, num_kv_heads=1, head_size=1, tokens_per_frame=1, frames_per_chunk=1, sink_frames=0,
        window_frames=16,
    )  # fmt: skip
    seen = 0
    for newest in range(200):  # the frames a session holds between chunks, newest by newest
        held = {f for b in [*schedule.kept(newest), newest + 1] for f in range(max(0, b - 15), b)}
        seen = max(seen, len(held))
    assert schedule.peak(spec).frames == seen == 25


def test_the_kept_boundaries_are_those_keeps_names() -> None:
    for dense, horizon in ((1, 0), (2, 9), (9, 9), (4, 40), (5, 33)):
        schedule = RewindSchedule(dense, horizon)
        for newest in range(150):
            lo = max(0, newest - horizon)
            assert schedule.kept(newest) == [b for b in range(lo, newest + 1) if schedule.keeps(b, newest)]



def test_the_plan_picks_the_longest_dense_tier_that_fits() -> None:
    """The bisection over the dense tier: the schedule chosen fits, and one dense point more would not (or the
    tier is at its cap)."""
    checked = 0
    for fpc, window, owned, budget in ((1, 16, 0, 400), (2, 8, 3, 600), (3, 9, 50, 4000), (1, 4, 0, 90)):
        spec = KVCacheSpec(
            num_layers=1, num_kv_heads=1, head_size=1, tokens_per_frame=1, frames_per_chunk=fpc, sink_frames=0,
            window_frames=window, model_owned_bytes_per_session=owned,
        )  # fmt: skip
        for rate, seconds in ((4.0, 3.0), (16.0, 1.0), (60.0, 2.0)):
            chosen = plan_rewind(spec, chunks_per_second=rate, seconds=seconds, budget_bytes=budget)
            if chosen is None:  # not even two points fit this budget
                continue
            checked += 1
            assert chosen.peak(spec).extra_bytes(spec) <= budget
            cap = min(chosen.horizon + 1, max(PRECISE_DENSE, math.ceil(DENSE_SECONDS * rate)))
            if chosen.dense < cap:
                longer = RewindSchedule(chosen.dense + 1, chosen.horizon)
                assert longer.peak(spec).extra_bytes(spec) > budget, (fpc, window, rate, chosen)
    assert checked >= 8

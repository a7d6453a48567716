"""The rewind horizon (runner/rewind_schedule.py): which boundaries a session keeps, what that costs, how a
budget picks the schedule, and a real runner holding exactly what the schedule says (docs/rewind.md)."""

from __future__ import annotations

import pytest
import torch

from arstream.app.settings import Settings
from arstream.models.fake import FakeKVPipeline
from arstream.models.registry import load_pipeline
from arstream.models.tiny_world.pipeline import load_tiny_world
from arstream.runner.contract import ARPipeline
from arstream.runner.pool import plan_pool
from arstream.runner.rewind_schedule import RewindPeak, RewindPlanError, RewindSchedule, boundary_frames, plan_rewind
from arstream.runner.runner import ARRunner, rewind_for, runner_for_sessions
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


def test_the_oldest_point_is_always_at_least_the_reach_back() -> None:
    for need in (240, 40, 7, 1):
        schedule = plan_rewind(tiny_spec(), chunks_per_second=8, seconds=need / 8, budget_bytes=1 << 40)
        assert schedule is not None and schedule.reach >= need
        for newest in range(need, need + 4 * schedule.stride(schedule.horizon)):
            assert newest - schedule.kept(newest)[0] >= need, (need, newest)
    for dense, need in ((16, 240), (8, 240), (3, 40), (2, 7)):  # the budget's fallbacks reach as far
        reached = RewindSchedule(dense, need)
        assert plan_rewind(tiny_spec(), chunks_per_second=8, seconds=need / 8,
                           budget_bytes=reached.peak(tiny_spec()).extra_bytes(tiny_spec())) is not None


def test_boundary_frames_are_the_sink_and_the_window_as_they_were() -> None:
    # sink 1, window history 4, chunks of 2: boundary 5 holds frame 0 and frames 6..9
    assert boundary_frames(5, 2, 1, 4) == ((0, 1), (6, 10))
    assert boundary_frames(0, 2, 1, 4) == ((0, 0), (1, 0))  # before the first chunk: nothing


def test_the_last_k_schedule_costs_what_the_old_rewind_points_did() -> None:
    spec = tiny_spec()  # 5 resident frames, chunks of 2
    for k in (1, 3, 8):
        assert RewindSchedule.last(k).peak(spec) == RewindPeak(frames=spec.resident_frames + k * 2, copies=k)


def test_a_runner_holds_exactly_the_schedules_boundaries_and_its_peak_blocks() -> None:
    pipeline = FakeKVPipeline(sink_frames=1, window_frames=6, frames_per_chunk=2)
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
    # every chunk of the last 2 s; the horizon runs past 240 chunks so the oldest point is always 30 s back
    assert wide == RewindSchedule(dense=16, horizon=255, chunks_per_second=8)
    assert (wide.reach, wide.seconds, wide.kept(1000)[0]) == (240, 30, 752)
    budget = RewindSchedule(dense=5, horizon=303).peak(spec).extra_bytes(spec)
    chosen = plan_rewind(spec, chunks_per_second=8, seconds=30, budget_bytes=budget)
    assert chosen is not None and chosen.dense == 5 and chosen.reach >= 240
    two = RewindSchedule(dense=2, horizon=495).peak(spec).extra_bytes(spec)
    shorter = plan_rewind(spec, chunks_per_second=8, seconds=30, budget_bytes=two - 1)
    assert shorter is not None and shorter.reach < 240 and shorter.dense == 2
    assert plan_rewind(spec, chunks_per_second=8, seconds=30, budget_bytes=0) is None
    assert plan_rewind(spec, chunks_per_second=8, seconds=0, budget_bytes=1 << 30) is None
    with pytest.raises(RewindPlanError, match="horizon >= 0 s"):
        plan_rewind(spec, chunks_per_second=8, seconds=float("nan"), budget_bytes=1)


def _models() -> dict[str, ARPipeline]:
    matrix = load_pipeline("matrix-game-2", "cpu", config="tiny", random_init=True)
    assert isinstance(matrix, ARPipeline)
    return {"tiny-world": load_tiny_world(torch.device("cpu")), "matrix-game-2": matrix}


def test_the_servers_defaults_give_tiny_world_thirty_seconds_and_matrix_game_fewer_sparser_points() -> None:
    settings = Settings()
    schedules = {
        name: rewind_for(pipeline, seconds=settings.rewind_seconds, budget_bytes=settings.rewind_budget_bytes())
        for name, pipeline in _models().items()
    }
    tiny, matrix = schedules["tiny-world"], schedules["matrix-game-2"]
    assert tiny is not None and tiny.seconds >= 30
    assert matrix is not None and matrix.seconds >= 30
    assert matrix.dense < tiny.dense and len(matrix.kept(10_000)) < len(tiny.kept(10_000))


def test_a_branch_without_a_chunk_starts_where_the_source_is() -> None:
    runner = runner_for_sessions(FakeKVPipeline(), 2, rewind=RewindSchedule.last(4))
    for index in range(5):
        runner.execute_tick(tick("source", index))
    assert runner.branch_session("source", None, "branch") == 5
    assert runner.next_chunk_index("branch") == 5
    runner.close_session("branch")
    runner.close_session("source")
    assert runner.pool.num_free == runner.blocks_free_at_start

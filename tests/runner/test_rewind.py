"""Rewind and branch in ARRunner (runner/rewind.py): determinism against an uninterrupted run, references, refusals.

Each model runs one reference session uninterrupted (same seed, controls
``KEYS``). A rewound session first takes other controls from chunk ``b`` on,
then rewinds to ``b`` and takes ``KEYS`` again: every chunk from ``b`` must
equal the reference's bit for bit (KV, noise generator, camera, decoder and
action caches all went back). A branch from boundary ``b`` must equal the
reference from ``b`` as well, and its source must go on unaffected.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from arstream.models.fake import FakeKVPipeline
from arstream.models.registry import load_pipeline
from arstream.models.tiny_world.pipeline import load_tiny_world
from arstream.runner.contract import ARPipeline, ModelState
from arstream.runner.kv_state import HistoryTables
from arstream.runner.pool import PagedKVPool, plan_pool, session_frames
from arstream.runner.rewind import Boundary, RewindPoints, copy_model_state
from arstream.runner.rewind_schedule import RewindSchedule
from arstream.runner.runner import ARRunner, runner_for_sessions
from arstream.runner.snapshot import export_session
from arstream.runner.snapshot_import import import_session
from arstream.runner.snapshot_stream import parse_snapshot, snapshot_bytes
from arstream.runner.types import ChunkResult, RewindUnavailable, TickFailure, TickRequest
from runner_fakes import FAKE_KV_BUDGET_BYTES, BatchRecordingFakePipeline, FailingImportFakePipeline, tick

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread

KEYS = [["d"], ["d"], ["w"], [], ["a", "s"], ["d"], ["w", "d"]]
OTHER = [["s", "a"], ["w"], ["a"], ["d", "w"], [], ["s"], ["a"]]
SEED = 1234
K = 4

def _loaded(name: str, **options: Any) -> ARPipeline:
    pipeline = load_pipeline(name, "cpu", **options)
    assert isinstance(pipeline, ARPipeline)  # a built-in model, not a vllm-omni: one
    return pipeline


PIPELINES: dict[str, Callable[[], ARPipeline]] = {
    # a short window, so boundaries reach back past window slides (evicted blocks kept by a boundary, sink kept)
    "fake-kv": lambda: FakeKVPipeline(sink_frames=1, window_frames=6, frames_per_chunk=2),
    # a strided tail behind a short dense window: boundaries keep sparse histories, each its own phase
    "fake-kv-strided": lambda: FakeKVPipeline(
        sink_frames=1, window_frames=4, frames_per_chunk=2, strided_window_frames=12, frame_stride=3
    ),
    "tiny-world": lambda: load_tiny_world(torch.device("cpu")),
    # tiny matrix-game-2 (random weights, seeded): KV, action caches, VAE feature cache, control history, noise
    "matrix-game-2": lambda: _loaded("matrix-game-2", config="tiny", random_init=True),
    # the same with the TAEHV decoder: its per-memory-block state instead of the VAE cache
    "matrix-game-2-taehv": lambda: _loaded("matrix-game-2", config="tiny", random_init=True, decoder="taehv"),
}


@functools.cache
def _pipeline(model: str) -> ARPipeline:
    """Loaded once per run; a session's model state starts afresh at its chunk 0, so earlier tests leave nothing."""
    return PIPELINES[model]()


def _runner(model: str, sessions: int = 3) -> ARRunner:
    return runner_for_sessions(_pipeline(model), sessions, rewind=RewindSchedule.last(K))


def _tick(session: str, index: int, keys: list[list[str]] = KEYS, **fields: Any) -> TickRequest:
    return TickRequest(session_id=session, request_id=index, controls={"keys": keys[index]}, seed=SEED, **fields)


def _run(runner: ARRunner, session: str, indices: range, keys: list[list[str]] = KEYS) -> list[np.ndarray]:
    return [runner.execute_tick(_tick(session, i, keys)).frames for i in indices]


@functools.cache
def _reference(model: str) -> tuple[np.ndarray, ...]:
    runner = _runner(model)
    frames = _run(runner, "reference", range(len(KEYS)))
    runner.close_session("reference")
    return tuple(frames)


def _references(runner: ARRunner) -> Counter[int]:
    """Every block reference the runner's sessions hold: live histories and kept boundaries."""
    held: Counter[int] = Counter()
    for session_id in runner.resident_sessions():
        state = runner.sessions.state(session_id)
        assert state is not None
        held.update(state.held_blocks())
        held.update(runner.rewinds.blocks(session_id))
    return held


def _assert_references_match_the_pool(runner: ARRunner) -> None:
    assert dict(_references(runner)) == runner.pool.ref_counts()
    assert runner.pool.num_free + runner.pool.num_used == runner.pool.num_blocks


def _assert_at_baseline(runner: ARRunner) -> None:
    assert runner.resident_sessions() == []
    assert runner.pool.ref_counts() == {} and runner.pool.num_free == runner.blocks_free_at_start


@pytest.mark.parametrize("model", sorted(PIPELINES))
def test_frames_after_a_rewind_equal_the_uninterrupted_sessions(model: str) -> None:
    reference = _reference(model)
    runner = _runner(model)
    _run(runner, "s", range(3))
    _run(runner, "s", range(3, 5), OTHER)  # a detour: chunks 3 and 4 with other controls
    assert runner.rewind_points("s") == (1, 5)  # K = 4 kept boundaries and the one it is at
    result = runner.execute_tick(_tick("s", 3, rewind_to=3))
    assert (result.chunk_index, result.restarted, result.new_rollout) == (3, "rewind", False)
    assert np.array_equal(result.frames, reference[3])
    assert result.rewind_points == (1, 4)  # boundary 4 of the detour is gone, 3 is kept again
    _run(runner, "s", range(4, 5), OTHER)
    # back again, past the second detour and the first rewind, to a boundary kept from before both
    again = runner.execute_tick(_tick("s", 2, rewind_to=2))
    assert again.chunk_index == 2 and np.array_equal(again.frames, reference[2])
    assert again.rewind_points == (1, 3)
    for index, frames in zip(range(3, 5), _run(runner, "s", range(3, 5))):
        assert np.array_equal(frames, reference[index]), f"chunk {index} differs after the rewinds"
    _assert_references_match_the_pool(runner)
    runner.close_session("s")
    _assert_at_baseline(runner)


@pytest.mark.parametrize("model", sorted(PIPELINES))
def test_a_branch_continues_like_the_uninterrupted_session_and_its_source_goes_on(model: str) -> None:
    reference = _reference(model)
    runner = _runner(model)
    _run(runner, "source", range(5))
    runner.branch_session("source", 2, "kept")  # a boundary kept before the one the source is at
    runner.branch_session("source", 5, "now")  # the boundary the source is at
    assert (runner.next_chunk_index("kept"), runner.next_chunk_index("now")) == (2, 5)
    assert runner.rewind_points("kept") == (2, 2)  # a branch keeps its own boundaries from where it starts
    _assert_references_match_the_pool(runner)
    branched = _run(runner, "kept", range(2, 4), OTHER)  # the branch diverges ...
    assert not np.array_equal(branched[0], reference[2])
    source = _run(runner, "source", range(5, 7))  # ... and the source does not notice
    assert all(np.array_equal(f, reference[i]) for i, f in zip(range(5, 7), source))
    runner.close_session("source")  # the source goes while its branches live: they keep the blocks they share
    for index, frames in zip(range(5, 7), _run(runner, "now", range(5, 7))):
        assert np.array_equal(frames, reference[index]), f"branch chunk {index} differs"
    rewound = runner.execute_tick(_tick("kept", 2, rewind_to=2))  # the branch's own first boundary
    assert np.array_equal(rewound.frames, reference[2])
    _assert_references_match_the_pool(runner)
    runner.close_session("kept")
    runner.close_session("now")
    _assert_at_baseline(runner)


def test_boundaries_share_blocks_with_the_live_window_and_stay_within_the_plan() -> None:
    pipeline = FakeKVPipeline(sink_frames=1, window_frames=6, frames_per_chunk=2)
    runner = runner_for_sessions(pipeline, 2, rewind=RewindSchedule.last(K))
    spec = runner.spec
    peak = 0
    for i in range(12):
        runner.execute_tick(tick("s", i))
        peak = max(peak, runner.pool.num_used)
    # sink + window + K chunks, not (K + 1) copies of sink + window
    assert peak == session_frames(spec, RewindSchedule.last(K)) == spec.resident_frames + K * spec.frames_per_chunk
    assert peak < (K + 1) * spec.resident_frames
    state = runner.sessions.state("s")
    assert state is not None
    boundary_blocks = set(runner.rewinds.blocks("s"))
    assert set(state.sink["main"]) <= boundary_blocks  # the sink is one set of blocks for all of them
    assert set(state.window["main"]) & boundary_blocks  # the live window shares its older blocks
    # every resident session at its peak at once fits the pool: nothing is exhausted
    for session in ("s", "t"):
        for i in range(12):
            runner.execute_tick(tick(session, i))
    assert runner.pool.num_used == 2 * peak <= runner.plan.num_blocks - spec.frames_per_chunk


def test_rewind_points_zero_plans_exactly_todays_pool_and_refuses_rewinds() -> None:
    pipeline = FakeKVPipeline()
    off = ARRunner(pipeline, kv_budget_bytes=FAKE_KV_BUDGET_BYTES)
    assert off.plan == plan_pool(pipeline.kv_cache_spec(), FAKE_KV_BUDGET_BYTES)
    assert off.rewind_points("s") is None
    first = off.execute_tick(tick("s", 0))
    assert first.rewind_points is None and first.restarted is None
    with pytest.raises(RewindUnavailable, match="rewind is off"):
        off.execute_tick(tick("s", 1, rewind_to=1))
    with pytest.raises(RewindUnavailable, match="rewind is off"):
        off.branch_session("s", 1, "b")
    assert off.next_chunk_index("s") == 1 and not off.is_resident("b")
    kept = ARRunner(pipeline, kv_budget_bytes=FAKE_KV_BUDGET_BYTES, rewind=RewindSchedule.last(K))
    assert kept.plan.per_session_bytes > off.plan.per_session_bytes
    assert kept.plan.session_capacity <= off.plan.session_capacity


@pytest.mark.parametrize("target", [0, 1, 7, 8, -1])
def test_a_boundary_not_held_is_refused_and_the_session_is_unchanged(target: int) -> None:
    reference = _reference("fake-kv")
    runner = _runner("fake-kv")
    _run(runner, "s", range(6))  # holds boundaries 2..6
    before = (runner.pool.ref_counts(), runner.next_chunk_index("s"), runner.rewind_points("s"))
    with pytest.raises(RewindUnavailable, match=f"boundary {target} is not held: the session holds boundaries 2, 3, 4, 5, 6 "):
        runner.execute_tick(_tick("s", 6, rewind_to=target))
    with pytest.raises(RewindUnavailable, match=f"boundary {target} is not held"):
        runner.branch_session("s", target, "b")
    assert (runner.pool.ref_counts(), runner.next_chunk_index("s"), runner.rewind_points("s")) == before
    assert not runner.is_resident("b")
    assert np.array_equal(runner.execute_tick(_tick("s", 6)).frames, reference[6])  # model state untouched too


def test_a_refused_rewind_in_a_round_fails_only_its_tick_and_keeps_the_session() -> None:
    runner = runner_for_sessions(BatchRecordingFakePipeline(), 3, max_batch_sessions=3, rewind=RewindSchedule.last(K))
    for i in range(3):
        runner.execute([tick("a", i), tick("b", i), tick("c", i)])
    results = runner.execute(
        [tick("a", 3, rewind_to=1), tick("b", 3, rewind_to=9, close=True), tick("c", 3, rewind_to=3)]
    )
    a, b, c = results
    assert isinstance(a, ChunkResult) and (a.chunk_index, a.restarted, a.rewind_points) == (1, "rewind", (0, 2))
    assert isinstance(b, TickFailure) and isinstance(b.error, RewindUnavailable)
    assert runner.is_resident("b") and runner.next_chunk_index("b") == 3  # not released, not closed, unchanged
    assert isinstance(c, ChunkResult) and (c.chunk_index, c.restarted) == (3, None)  # "where it is": a plain tick
    _assert_references_match_the_pool(runner)


def test_rewinds_in_a_batched_round_equal_the_uninterrupted_sessions() -> None:
    pipeline = BatchRecordingFakePipeline(sink_frames=1, window_frames=6, frames_per_chunk=2)
    runner = runner_for_sessions(pipeline, 3, max_batch_sessions=3, rewind=RewindSchedule.last(K))
    reference = [runner.execute_tick(_tick("reference", i)).frames for i in range(6)]
    runner.close_session("reference")
    runner.execute([_tick("a", 0), _tick("b", 0)])
    for i in range(1, 5):
        runner.execute([_tick("a", i, OTHER), _tick("b", i, OTHER)])
    pipeline.forwards.clear()
    a, b = runner.execute([_tick("a", 1, rewind_to=1), _tick("b", 1, rewind_to=1)])
    assert pipeline.forwards == [["a", "b"]]  # both went back to equally long histories: one forward
    assert isinstance(a, ChunkResult) and isinstance(b, ChunkResult)
    assert np.array_equal(a.frames, reference[1]) and np.array_equal(b.frames, reference[1])
    assert (a.chunk_index, a.new_rollout, a.restarted) == (1, False, "rewind")
    for i in range(2, 6):
        for result in runner.execute([_tick("a", i), _tick("b", i)]):
            assert isinstance(result, ChunkResult) and np.array_equal(result.frames, reference[i])


def test_every_end_of_a_session_returns_its_boundaries() -> None:
    pipeline = FakeKVPipeline(session_capacity=2)
    runner = runner_for_sessions(pipeline, 2, rewind=RewindSchedule.last(K))
    for i in range(5):
        runner.execute_tick(tick("a", i))
    runner.execute_tick(tick("a", 5, reset=True))  # reset: the old rollout's boundaries are gone
    assert runner.rewind_points("a") == (0, 1)
    with pytest.raises(RewindUnavailable, match="not held"):
        runner.execute_tick(tick("a", 6, rewind_to=3))
    for i in range(5):
        runner.execute_tick(tick("b", i))
    runner.branch_session("b", 2, "c")  # capacity 2: makes room by evicting the least recently used, "a"
    assert not runner.is_resident("a") and runner.counters.evictions_total == 1
    assert runner.rewind_points("a") == (0, 0)
    with pytest.raises(RewindUnavailable):
        runner.execute_tick(tick("a", 7, rewind_to=1))
    assert not runner.is_resident("a")
    with pytest.raises(Exception, match="asked to fail"):  # a failed forward releases its boundaries too
        runner.execute_tick(tick("c", 2, controls={"fail": True}))
    _assert_references_match_the_pool(runner)
    runner.execute_tick(tick("b", 5, rewind_to=1))  # a rewind past boundaries drops them
    assert runner.rewind_points("b") == (1, 2)
    _assert_references_match_the_pool(runner)
    runner.close_session("b")
    _assert_at_baseline(runner)


def test_branching_into_a_resident_session_or_from_an_absent_one_is_refused() -> None:
    runner = runner_for_sessions(FakeKVPipeline(), 3, rewind=RewindSchedule.last(K))
    runner.execute_tick(tick("a", 0))
    runner.execute_tick(tick("b", 0))
    with pytest.raises(ValueError, match="already resident"):
        runner.branch_session("a", 1, "b")
    with pytest.raises(RewindUnavailable, match="not resident"):
        runner.branch_session("gone", 0, "c")
    assert runner.resident_sessions() == ["a", "b"]
    _assert_references_match_the_pool(runner)


def test_a_moved_session_arrives_with_its_boundaries_and_keeps_new_ones_there() -> None:
    reference = _reference("fake-kv")
    source = _runner("fake-kv")
    _run(source, "s", range(4))
    held = source.rewind_points("s")
    assert held is not None
    target = runner_for_sessions(FakeKVPipeline(sink_frames=1, window_frames=6, frames_per_chunk=2), 2, rewind=RewindSchedule.last(K))
    snapshot = snapshot_bytes(export_session(source, "s"))
    import_session(target, "s", parse_snapshot(snapshot))
    import_session(target, "t", parse_snapshot(snapshot))  # the same move again, to go back before it
    source.close_session("s")
    _assert_at_baseline(source)
    assert target.rewind_points("s") == held and held[0] < 4  # the boundaries came with the session
    _assert_references_match_the_pool(target)
    _run(target, "s", range(4, 6), OTHER)
    back = target.execute_tick(_tick("s", 4, rewind_to=4))
    assert np.array_equal(back.frames, reference[4])
    before = target.execute_tick(_tick("t", held[0], rewind_to=held[0]))  # a boundary from before the move
    assert np.array_equal(before.frames, reference[held[0]])
    target.close_session("s")
    target.close_session("t")
    _assert_at_baseline(target)


def test_a_rewind_or_branch_whose_model_state_will_not_go_back_fails_closed() -> None:
    pipeline = FailingImportFakePipeline()
    runner = runner_for_sessions(pipeline, 3, rewind=RewindSchedule.last(K))
    for i in range(4):
        runner.execute_tick(tick("s", i))
    pipeline.fail_import = True
    with pytest.raises(RuntimeError, match="on purpose"):
        runner.branch_session("s", 2, "b")
    assert not runner.is_resident("b") and runner.next_chunk_index("s") == 4  # the source is untouched
    _assert_references_match_the_pool(runner)
    (result,) = runner.execute([tick("s", 4, rewind_to=2)])
    assert isinstance(result, TickFailure) and not isinstance(result.error, RewindUnavailable)
    assert not runner.is_resident("s")  # half rewound is no state to go on from: released
    _assert_at_baseline(runner)


def test_model_state_copies_keep_an_unchanged_tensor_once_and_hand_out_private_copies() -> None:
    image, canvas = torch.arange(6.0), torch.zeros(3)
    first = copy_model_state(ModelState({"camera": [0, 0]}, {"image": image, "canvas": canvas}))
    assert first.tensors["image"] is not image and torch.equal(first.tensors["image"], image)  # cloned
    canvas += 1  # the pipeline reuses its tensor in place; the kept copy does not change
    second = copy_model_state(ModelState({"camera": [1, 0]}, {"image": image, "canvas": canvas}), first)
    assert second.tensors["image"] is first.tensors["image"]  # unchanged: kept once
    assert torch.equal(first.tensors["canvas"], torch.zeros(3)) and torch.equal(second.tensors["canvas"], canvas)
    spec = FakeKVPipeline().kv_cache_spec()
    pool = PagedKVPool(spec, plan_pool(spec, FAKE_KV_BUDGET_BYTES), torch.device("cpu"))
    points = RewindPoints(pool, RewindSchedule.last(2))
    for index, model in enumerate((first, second)):
        points.record(Boundary(HistoryTables({"main": []}, {"main": []}, 2 * index, index, 0), model))
    taken = points.take(0)  # what a pipeline gets is its own: writing to it changes no kept boundary
    assert taken.model.tensors["image"] is not first.tensors["image"] and points.holds(0) is False


def test_a_horizon_over_the_budget_is_logged_in_the_flags_unit(caplog: pytest.LogCaptureFixture) -> None:
    """`arstream plan` and `serve` print this line first: the budget in MiB, as --rewind-budget-mib takes it (it
    read "does not fit 25165824 bytes per session")."""
    from arstream.runner.rewinds import rewind_for

    with caplog.at_level("WARNING", logger="arstream.runner"):
        assert rewind_for(FakeKVPipeline(), seconds=30, budget_bytes=0) is None
    assert caplog.messages == [
        "a rewind horizon of 30 s does not fit the rewind budget of 0 MiB a session (--rewind-budget-mib); "
        "rewind is off"
    ]

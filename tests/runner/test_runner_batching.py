"""Cross-session batching in ARRunner.execute, with FakeKVPipeline (frames depend on the KV read)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from arstream.models.fake import FakeForwardError, FakeKVPipeline
from arstream.models.toy_attention import ToyAttentionPipeline
from arstream.runner.chunks import ChunkShapeError
from arstream.runner.runner import ARRunner
from arstream.runner.types import ChunkResult, TickFailure, TickRequest, TickResult
from runner_fakes import (
    FAKE_KV_BUDGET_BYTES,
    BatchRecordingFakePipeline,
    RaisingAfterCommitFakePipeline,
    fake_runner,
    tick,
)

KEYS = ["w", "a", "s", "d"]


def make_runner(max_batch_sessions: int = 4, **options: object) -> tuple[ARRunner, BatchRecordingFakePipeline]:
    """A runner that may batch four sessions, over a fake that records its forwards."""
    return fake_runner(BatchRecordingFakePipeline, max_batch_sessions=max_batch_sessions, **options)


def chunks(results: Sequence[TickResult]) -> list[ChunkResult]:
    assert all(isinstance(r, ChunkResult) for r in results), results
    return list(results)  # type: ignore[arg-type]


def advance(runner: ARRunner, session: str, count: int) -> None:
    for i in range(count):
        runner.execute_tick(tick(session, i, controls={"keys": [KEYS[i % 4]]}))


def test_batched_chunks_equal_one_session_at_a_time() -> None:
    """Sessions at different frame positions, past the window, batched: the frames of a round-robin runner."""
    batched, pipeline = make_runner()
    alone = ARRunner(FakeKVPipeline(), kv_budget_bytes=FAKE_KV_BUDGET_BYTES)
    for runner in (batched, alone):
        for session, head_start in (("a", 3), ("b", 5), ("c", 4)):
            advance(runner, session, head_start)
    pipeline.forwards.clear()
    for round_ in range(4):
        ticks = [tick(s, 10 + round_, controls={"keys": [KEYS[(round_ + n) % 4]]}) for n, s in enumerate("abc")]
        got = chunks(batched.execute(ticks))
        want = [alone.execute_tick(t) for t in ticks]
        for g, w in zip(got, want):
            assert (g.session_id, g.chunk_index, g.new_rollout) == (w.session_id, w.chunk_index, w.new_rollout)
            np.testing.assert_array_equal(g.frames, w.frames)
    assert pipeline.forwards == [["a", "b", "c"]] * 4
    assert batched.stats().batched_forwards_total == 4


def test_sessions_batch_by_visible_history_length() -> None:
    runner, pipeline = make_runner()
    advance(runner, "long1", 3)  # sink + window full
    advance(runner, "long2", 4)
    advance(runner, "short", 1)
    pipeline.forwards.clear()
    results = runner.execute([tick("long1"), tick("new1"), tick("short"), tick("long2"), tick("new2")])
    assert [r.session_id for r in results] == ["long1", "new1", "short", "long2", "new2"]
    assert pipeline.forwards == [["long1", "long2"], ["new1", "new2"], ["short"]]
    assert [r.chunk_index for r in chunks(results)] == [3, 0, 1, 4, 0]


def test_batches_hold_at_most_max_batch_sessions() -> None:
    runner, pipeline = make_runner(max_batch_sessions=2)
    chunks(runner.execute([tick(s) for s in "abcde"]))
    assert pipeline.forwards == [["a", "b"], ["c", "d"], ["e"]]


def test_ticks_of_one_session_run_in_order_within_one_call() -> None:
    runner, pipeline = make_runner()
    results = chunks(runner.execute([tick("a", 0), tick("b", 0), tick("a", 1), tick("b", 1, reset=True)]))
    assert [(r.session_id, r.chunk_index) for r in results] == [("a", 0), ("b", 0), ("a", 1), ("b", 0)]
    assert pipeline.forwards == [["a", "b"], ["a"], ["b"]]


def test_reset_runs_before_and_close_after_a_batched_chunk() -> None:
    runner, pipeline = make_runner()
    advance(runner, "a", 2)
    advance(runner, "b", 2)
    results = chunks(runner.execute([tick("a", reset=True), tick("b", close=True), tick("c")]))
    assert [(r.chunk_index, r.new_rollout) for r in results] == [(0, True), (2, False), (0, True)]
    assert ("reset", "a") in pipeline.events and ("close", "b") in pipeline.events
    assert runner.resident_sessions() == ["a", "c"]
    for session in ("a", "c"):
        runner.close_session(session)
    assert runner.pool.num_free == runner.blocks_free_at_start


def test_a_failing_session_fails_alone_and_the_rest_of_its_batch_gets_chunks() -> None:
    runner, pipeline = make_runner()
    alone = ARRunner(FakeKVPipeline(), kv_budget_bytes=FAKE_KV_BUDGET_BYTES)
    for r in (runner, alone):
        for session in "abc":
            advance(r, session, 3)
    state_b = runner.sessions.state("b")
    assert state_b is not None
    held_by_b = len(state_b.held_blocks())
    used_before = runner.pool.num_used
    pipeline.forwards.clear()
    ticks = [tick("a", 9, controls={"keys": ["w"]}), tick("b", 9, controls={"fail": True}), tick("c", 9)]
    results = runner.execute(ticks)
    assert isinstance(results[1], TickFailure) and isinstance(results[1].error, FakeForwardError)
    assert (results[1].session_id, results[1].request_id) == ("b", 9)
    for got, t in zip((results[0], results[2]), (ticks[0], ticks[2])):
        assert isinstance(got, ChunkResult)
        np.testing.assert_array_equal(got.frames, alone.execute_tick(t).frames)
    assert pipeline.forwards == [["a", "b", "c"], ["a"], ["b"], ["c"]]
    assert not runner.is_resident("b") and ("close", "b") in pipeline.events
    assert runner.pool.num_used == used_before - held_by_b
    stats = runner.stats()
    assert (stats.failures_total, stats.batch_fallbacks_total, stats.batched_forwards_total) == (1, 1, 0)
    for session in ("a", "c"):
        runner.close_session(session)
    assert runner.pool.num_free == runner.blocks_free_at_start


def test_a_batch_that_raises_after_committing_leaves_every_history_as_it_was() -> None:
    pipeline = RaisingAfterCommitFakePipeline()
    runner = ARRunner(pipeline, kv_budget_bytes=FAKE_KV_BUDGET_BYTES, max_batch_sessions=3)
    alone = ARRunner(FakeKVPipeline(), kv_budget_bytes=FAKE_KV_BUDGET_BYTES)
    for r in (runner, alone):
        for session in "abc":
            advance(r, session, 3)
    used = runner.pool.num_used
    pipeline.raise_next_batch = True
    ticks = [tick(s, 9, controls={"keys": ["d"]}) for s in "abc"]
    results = chunks(runner.execute(ticks))
    assert [r.chunk_index for r in results] == [3, 3, 3]  # each chunk committed once, by the retry
    for got, t in zip(results, ticks):
        np.testing.assert_array_equal(got.frames, alone.execute_tick(t).frames)
    assert runner.pool.num_used == used
    assert runner.stats().batch_fallbacks_total == 1 and runner.stats().failures_total == 0


class FloatFramesFakePipeline(FakeKVPipeline):
    """A fake whose batched forward returns float frames (a contract violation found after the model ran)."""

    def generate_chunks(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        return [f.astype(np.float32) for f in super().generate_chunks(ticks)]


def test_a_batch_that_breaks_the_contract_fails_closed_for_every_session() -> None:
    runner = ARRunner(FloatFramesFakePipeline(), kv_budget_bytes=FAKE_KV_BUDGET_BYTES, max_batch_sessions=2)
    runner.execute_tick(tick("a"))
    runner.execute_tick(tick("b"))
    results = runner.execute([tick("a", 1), tick("b", 1)])
    assert all(isinstance(r, TickFailure) and isinstance(r.error, ChunkShapeError) for r in results)
    assert runner.resident_sessions() == [] and runner.pool.num_free == runner.blocks_free_at_start
    assert runner.stats().failures_total == 2


def test_a_fault_at_the_device_sync_fails_the_whole_batch_closed() -> None:
    syncs = {"n": 0}

    def sync_failing_on_the_third_call(device: torch.device) -> None:
        syncs["n"] += 1
        if syncs["n"] == 3:
            raise RuntimeError("device fault surfaced at sync")

    runner = ARRunner(
        FakeKVPipeline(),
        kv_budget_bytes=FAKE_KV_BUDGET_BYTES,
        max_batch_sessions=2,
        sync=sync_failing_on_the_third_call,
    )
    chunks([runner.execute_tick(tick("a")), runner.execute_tick(tick("b"))])
    results = runner.execute([tick("a", 1), tick("b", 1)])
    assert [type(r) for r in results] == [TickFailure, TickFailure]
    assert runner.pool.num_free == runner.blocks_free_at_start


def test_a_batch_of_new_sessions_never_evicts_one_of_its_own() -> None:
    runner, pipeline = make_runner(max_batch_sessions=4, session_capacity=2)
    assert runner.batch_limit == 2
    results = chunks(runner.execute([tick(s) for s in "abc"]))
    assert [r.chunk_index for r in results] == [0, 0, 0]
    assert pipeline.forwards == [["a", "b"], ["c"]]
    assert runner.resident_sessions() == ["b", "c"] and runner.stats().evictions_total == 1


def test_a_batched_forward_records_one_timing_entry_per_chunk() -> None:
    runner, _ = make_runner()
    results = chunks(runner.execute([tick(s) for s in "abc"]))
    assert runner.stats().chunks_total == 3 and len(runner.counters.chunk_times_s) == 3
    # every row waited for the whole forward
    assert len(set(runner.counters.chunk_times_s)) == 1 and {r.compute_s for r in results} == set(runner.counters.chunk_times_s)


def test_a_pipeline_without_batching_runs_every_tick_alone() -> None:
    runner = ARRunner(ToyAttentionPipeline(), kv_budget_bytes=64 << 20, max_batch_sessions=4)
    assert runner.batch_limit == 1 and runner.stats().batch_limit == 1
    results = chunks(runner.execute([tick(s, seed=1) for s in "ab"]))
    assert [r.chunk_index for r in results] == [0, 0]
    assert runner.stats().batched_forwards_total == 0


def test_max_batch_sessions_one_keeps_todays_pool() -> None:
    assert make_runner(max_batch_sessions=1)[0].plan == fake_runner()[0].plan


def test_max_batch_sessions_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_batch_sessions must be an integer >= 1"):
        make_runner(max_batch_sessions=0)

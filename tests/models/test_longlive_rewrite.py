"""The runner's history rewrite (LongLive's re-cache): copy-on-write, fail-closed, seen by rewind, carried by snapshots.

Unit tests of :meth:`SessionKVState.begin_rewrite` on a pool with exact block
ids, then the real tiny LongLive pipeline under the runner: a failed
re-cache frees every block (in a batch, only its session's), a rewind to before a switch reproduces the old
continuation, an export after a switch continues bit-identically, batched
sessions equal their alone runs, and sessions that switch every chunk at full
capacity with rewind points never run the pool dry.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from arstream.models.longlive.loading import load_longlive
from arstream.models.longlive.pipeline import LongLivePipeline
from arstream.models.longlive.prompts import PromptEntry
from arstream.runner.kv_state import PassStateError, SessionKVState
from arstream.runner.pool import PagedKVPool, plan_pool
from arstream.runner.rewind_schedule import RewindSchedule
from arstream.runner.runner import ARRunner, runner_for_sessions
from arstream.runner.snapshot import export_session
from arstream.runner.snapshot_import import import_session
from arstream.runner.snapshot_stream import parse_snapshot, snapshot_bytes
from arstream.runner.spec import KVCacheSpec
from arstream.runner.types import ChunkResult, TickFailure, TickRequest

A, B, C = "a red fox in the snow", "a city street at night, rain", "an underwater reef, bright fish"


def spec(**overrides: object) -> KVCacheSpec:
    fields: dict[str, object] = dict(num_layers=1, num_kv_heads=1, head_size=1, tokens_per_frame=1, frames_per_chunk=1,
                                     sink_frames=1, window_frames=3, history_rewrites=True)  # fmt: skip
    fields.update(overrides)
    return KVCacheSpec(**fields)  # type: ignore[arg-type]


def commit_chunk(state: SessionKVState, value: float) -> None:
    state.begin_pass(commit=True)
    state.write_and_gather(0, torch.full((1, 1, 1), value), torch.full((1, 1, 1), -value))
    state.end_pass()


def rewrite(state: SessionKVState, frames: int, keep_sink: bool, values: Sequence[float]) -> None:
    state.begin_rewrite(frames, keep_sink=keep_sink)
    k = torch.tensor(values).view(frames, 1, 1)
    state.write_and_gather(0, k, -k)
    state.end_pass()


def stored(pool: PagedKVPool, blocks: list[int]) -> list[float]:
    return [float(pool.kv[0, 0, b, 0, 0, 0]) for b in blocks]


@pytest.fixture
def pool() -> PagedKVPool:
    s = spec()
    return PagedKVPool(s, plan_pool(s, 10**6, rewind=RewindSchedule.last(2)), torch.device("cpu"))


def test_a_rewrite_goes_to_fresh_blocks_and_joins_with_the_chunk_leaving_shared_blocks_as_they_were(
    pool: PagedKVPool,
) -> None:
    state = SessionKVState(pool, "s")
    for value in (1.0, 2.0, 3.0, 4.0):
        commit_chunk(state, value)
    assert (state.sink["main"], state.window["main"]) == ([0], [2, 3])
    boundary = state.share_tables()  # a rewind point holds the history before the switch
    rewrite(state, 3, True, [20.0, 30.0, 40.0])  # window_frames=3 frames, the sink kept
    assert (state.sink["main"], state.window["main"]) == ([0], [2, 3])  # nothing moved yet
    assert stored(pool, state.rewritten["main"][1]) == [30.0, 40.0]  # type: ignore[index]
    commit_chunk(state, 5.0)
    window = state.window["main"]
    assert state.sink["main"] == [0] and stored(pool, window) == [40.0, 5.0]
    assert stored(pool, boundary.sink["main"] + boundary.window["main"]) == [1.0, 3.0, 4.0]  # copy-on-write
    state.release()
    pool.free(boundary.blocks())
    assert pool.num_free == pool.num_blocks and pool.ref_counts() == {}


def test_a_rewrite_within_the_first_frames_re_encodes_the_sink(pool: PagedKVPool) -> None:
    state = SessionKVState(pool, "s")
    for value in (1.0, 2.0):
        commit_chunk(state, value)
    with pytest.raises(PassStateError, match="every committed frame"):
        state.begin_rewrite(1, keep_sink=False)
    rewrite(state, 2, False, [10.0, 20.0])
    commit_chunk(state, 3.0)
    assert stored(pool, state.sink["main"] + state.window["main"]) == [10.0, 20.0, 3.0]
    state.release()
    assert pool.num_free == pool.num_blocks


def test_an_aborted_forward_drops_its_rewrite_and_a_spec_without_rewrites_refuses_one(pool: PagedKVPool) -> None:
    state = SessionKVState(pool, "s")
    for value in (1.0, 2.0, 3.0):
        commit_chunk(state, value)
    free = pool.num_free
    state.prepare_forward(hold_commit=True)
    rewrite(state, 2, True, [20.0, 30.0])
    commit_chunk(state, 4.0)
    state.abort_forward()
    assert pool.num_free == free and stored(pool, state.sink["main"] + state.window["main"]) == [1.0, 2.0, 3.0]
    plain = spec(history_rewrites=False)
    other = PagedKVPool(plain, plan_pool(plain, 10**6), torch.device("cpu"))
    with pytest.raises(PassStateError, match="history_rewrites"):
        SessionKVState(other, "t").begin_rewrite(0, keep_sink=True)


def test_the_pool_counts_a_rewrites_blocks_and_whole_histories_per_rewind_point() -> None:
    with_rewrites, without = plan_pool(spec(), 10**6, rewind=RewindSchedule.last(2)), plan_pool(spec(history_rewrites=False), 10**6, rewind=RewindSchedule.last(2))
    s = spec()
    # per session: (1 + rewind points) whole histories; per batch row: a chunk and a rewritten history in flight
    assert with_rewrites.num_blocks == with_rewrites.session_capacity * 3 * s.resident_frames + s.frames_per_chunk + s.resident_frames
    assert without.num_blocks == without.session_capacity * (s.resident_frames + 2) + s.frames_per_chunk


# ---- the real tiny LongLive under the runner ------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline() -> LongLivePipeline:
    return load_longlive(config="tiny", random_init=True)


def run(runner: ARRunner, session: str, prompts: Sequence[str], start: int = 0, **fields: object) -> list[torch.Tensor]:
    out = []
    for i, prompt in enumerate(prompts):
        extra = fields if i == 0 else {}
        result = runner.execute_tick(TickRequest(session_id=session, request_id=start + i, controls={}, prompt=prompt, **extra))  # type: ignore[arg-type]
        assert isinstance(result, ChunkResult)
        out.append(runner.pipeline.last_latents[session].clone())  # type: ignore[attr-defined]
    return out


def test_a_failed_recache_frees_every_block(pipeline: LongLivePipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = runner_for_sessions(pipeline, 2, rewind=RewindSchedule.last(2))
    run(runner, "s", [A, A, A])
    original = pipeline._recache

    def failing(*args: object) -> None:
        original(*args)  # type: ignore[arg-type]
        raise RuntimeError("device fault in the re-cache")

    monkeypatch.setattr(pipeline, "_recache", failing)
    with pytest.raises(RuntimeError, match="re-cache"):
        run(runner, "s", [B])
    assert not runner.is_resident("s") and "s" not in pipeline.session_ids()
    assert runner.pool.num_free == runner.blocks_free_at_start


def test_a_rewind_to_before_a_switch_reproduces_the_old_continuation(pipeline: LongLivePipeline) -> None:
    runner = runner_for_sessions(pipeline, 1, rewind=RewindSchedule.last(3))
    old = run(runner, "s", [A] * 6)
    runner.close_session("s")
    run(runner, "s", [A] * 4 + [B, B])
    assert pipeline.session_prompt("s") == pipeline.prompts.get(B).text
    again = run(runner, "s", [A, A], start=10, rewind_to=4)
    assert all(torch.equal(x, y) for x, y in zip(again, old[4:], strict=True))
    runner.close_session("s")
    assert runner.pool.num_free == runner.blocks_free_at_start


def test_an_export_after_a_switch_continues_bit_identically_elsewhere(pipeline: LongLivePipeline) -> None:
    here = runner_for_sessions(pipeline, 1)
    run(here, "s", [A] * 4 + [B])
    snapshot = parse_snapshot(snapshot_bytes(export_session(here, "s")))
    expected = run(here, "s", [B, C, C], start=5)
    here.close_session("s")
    there = runner_for_sessions(load_longlive(config="tiny", random_init=True), 1)
    import_session(there, "s", snapshot)
    got = run(there, "s", [B, C, C], start=5)
    assert all(torch.equal(x, y) for x, y in zip(got, expected, strict=True))


def test_batched_sessions_with_a_switch_equal_their_alone_runs(pipeline: LongLivePipeline) -> None:
    schedules = {"x": [A] * 4 + [B] * 2, "y": [C] * 6}
    alone = {}
    for session, prompts in schedules.items():
        runner = runner_for_sessions(pipeline, 1)
        alone[session] = run(runner, session, prompts)
    runner = runner_for_sessions(pipeline, 2, max_batch_sessions=2)
    batched: dict[str, list[torch.Tensor]] = {"x": [], "y": []}
    for i in range(6):
        results = runner.execute([TickRequest(session_id=s, request_id=i, controls={}, prompt=schedules[s][i]) for s in "xy"])
        assert all(isinstance(r, ChunkResult) for r in results)
        for s in "xy":
            batched[s].append(pipeline.last_latents[s].clone())
    assert runner.counters.batched_forwards_total == 6
    for s in "xy":
        assert max(float((a - b).abs().max()) for a, b in zip(batched[s], alone[s])) <= 1e-5


def test_sessions_switching_every_chunk_at_capacity_with_rewind_points_never_exhaust_the_pool(
    pipeline: LongLivePipeline,
) -> None:
    runner = runner_for_sessions(pipeline, 2, max_batch_sessions=2, rewind=RewindSchedule.last(2))
    prompts = [A, B, C]
    for i in range(7):
        results = runner.execute(
            [TickRequest(session_id=s, request_id=i, controls={}, prompt=prompts[(i + j) % 3]) for j, s in enumerate("xy")]
        )
        assert all(isinstance(r, ChunkResult) for r in results), results
    for s in "xy":
        runner.close_session(s)
    assert runner.pool.num_free == runner.blocks_free_at_start


def test_a_recache_failing_in_a_batch_fails_only_its_session_and_gives_back_its_prompt_references(
    pipeline: LongLivePipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batched forward aborts, each tick runs again alone: the switching session is released, the other's
    chunk equals its alone run, and no prompt reference the failed forwards took is left behind."""
    alone = run(runner_for_sessions(pipeline, 1), "y", [C] * 4)
    runner = runner_for_sessions(pipeline, 2, max_batch_sessions=2)
    for i in range(3):
        runner.execute([TickRequest(session_id=s, request_id=i, controls={}, prompt=p) for s, p in (("x", A), ("y", C))])
    original = pipeline._recache
    fault = pipeline.prompts.get("a prompt whose re-cache fails").text

    def failing(state: SessionKVState, latents: torch.Tensor, entry: PromptEntry) -> None:
        original(state, latents, entry)
        if entry.text == fault:
            raise RuntimeError("device fault in the re-cache")

    monkeypatch.setattr(pipeline, "_recache", failing)
    results = runner.execute([TickRequest(session_id="x", request_id=3, controls={}, prompt=fault),
                              TickRequest(session_id="y", request_id=3, controls={}, prompt=C)])  # fmt: skip
    assert isinstance(results[0], TickFailure) and isinstance(results[1], ChunkResult)
    assert runner.counters.batch_fallbacks_total == 1 and not runner.is_resident("x")
    assert float((pipeline.last_latents["y"] - alone[3]).abs().max()) <= 1e-5  # batched rows: rounding only
    held = {text: entry.references for text in pipeline.prompts.cached() if (entry := pipeline.prompts.entry(text))}
    assert held.get(pipeline.prompts.get(C).text) == 1 and held.get(fault, 0) == 0  # only y's history holds one
    runner.close_session("y")
    assert runner.pool.num_free == runner.blocks_free_at_start

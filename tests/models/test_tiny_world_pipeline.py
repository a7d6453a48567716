"""TinyWorldPipeline under the real ARRunner: contract, determinism, KV use and release."""

from __future__ import annotations

import jsonschema
import numpy as np
import pytest
import torch

from arstream.models.tiny_world import sampling
from arstream.programs.tiny_world.evaluate import make_runner, rollout
from arstream.models.tiny_world.pipeline import TinyWorldPipeline, load_tiny_world
from arstream.models.tiny_world.sampling import DenseChunkKV, canvas_origin, crop_view, sample_chunk, to_uint8
from arstream.models.tiny_world.world import direction_index, velocity
from arstream.runner.contract import ARPipeline, SupportsWarmup
from arstream.runner.runner import ARRunner, runner_for_sessions
from arstream.runner.types import ChunkResult, TickRequest

KEYS_SEQUENCE = [["d"], ["d"], ["w"], [], ["a", "s"], ["d"], ["w", "d"], ["s"], ["s"], ["a"]]


@pytest.fixture(scope="module")
def pipeline() -> TinyWorldPipeline:
    return load_tiny_world(torch.device("cpu"))


@pytest.fixture
def runner(pipeline: TinyWorldPipeline) -> ARRunner:
    return make_runner(pipeline, sessions=3)


def test_implements_the_contract(pipeline: TinyWorldPipeline) -> None:
    assert isinstance(pipeline, ARPipeline)
    assert isinstance(pipeline, SupportsWarmup)


def test_model_card_and_controls_schema(pipeline: TinyWorldPipeline) -> None:
    card = pipeline.model_card()
    assert {k: card[k] for k in ("name", "width", "height", "frames_per_chunk")} == {
        "name": "tiny-world",
        "width": 64,
        "height": 64,
        "frames_per_chunk": pipeline.kv_cache_spec().frames_per_chunk,
    }
    assert card["fps"] > 0
    validator = jsonschema.Draft202012Validator(card["controls"])
    jsonschema.Draft202012Validator.check_schema(card["controls"])
    assert validator.is_valid({"keys": ["w", "d"]})
    assert validator.is_valid({"keys": []})
    assert not validator.is_valid({"keys": ["x"]})
    assert not validator.is_valid({"keys": ["w", "w"]})
    assert not validator.is_valid({"keys": ["w"], "fail": True})


def test_kv_spec_is_one_block_per_frame(pipeline: TinyWorldPipeline) -> None:
    spec = pipeline.kv_cache_spec()
    cfg = pipeline.cfg
    assert spec.tokens_per_frame == cfg.canvas_cells**2
    assert cfg.canvas_cells * cfg.patch_size >= 64 + cfg.patch_size - 1
    assert spec.num_layers == cfg.num_layers
    assert spec.num_kv_heads * spec.head_size == cfg.d_model
    assert spec.sink_frames >= 1 and spec.window_frames >= spec.frames_per_chunk


def test_chunks_are_uint8_frames(runner: ARRunner) -> None:
    result = runner.execute_tick(TickRequest("s", 0, controls={"keys": ["d"]}, seed=1))
    assert result.frames.dtype == np.uint8
    assert result.frames.shape == (runner.spec.frames_per_chunk, 64, 64, 3)
    assert result.new_rollout and result.chunk_index == 0


def test_same_seed_and_controls_replay_the_same_frames(runner: ARRunner) -> None:
    keys = [[k] for k in "ddwwaass"]
    first = rollout(runner, keys, seed=7, session_id="one")
    second = rollout(runner, keys, seed=7, session_id="two")
    other_seed = rollout(runner, keys, seed=8, session_id="three")
    assert np.array_equal(first, second)
    assert not np.array_equal(first, other_seed)


def test_reset_starts_the_same_rollout_again(runner: ARRunner) -> None:
    ticks = [TickRequest("s", i, controls={"keys": ["s"]}, seed=3) for i in range(3)]
    before = [runner.execute_tick(t).frames for t in ticks]
    replay = [TickRequest("s", 10, controls={"keys": ["s"]}, seed=3, reset=True)] + ticks[1:]
    after = [runner.execute_tick(t).frames for t in replay]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_controls_change_the_frames(runner: ARRunner) -> None:
    right = rollout(runner, [["d"]] * 3, seed=5, session_id="r")
    left = rollout(runner, [["d"], ["a"], ["a"]], seed=5, session_id="l")
    assert np.array_equal(right[:2], left[:2])
    assert not np.array_equal(right[2:], left[2:])


def test_paged_runner_matches_a_dense_reference(pipeline: TinyWorldPipeline, runner: ARRunner) -> None:
    """Past the window (eviction included) the runner's paged KV gives the frames a dense history gives."""
    paged = rollout(runner, KEYS_SEQUENCE, seed=11)
    cfg = pipeline.cfg
    kv = DenseChunkKV(cfg, batch=1)
    generator = torch.Generator().manual_seed(11)
    x = y = 0
    dense: list[np.ndarray] = []
    previous = None  # the frame decoder's last canvas and its cell, carried from chunk to chunk as the pipeline does
    with torch.inference_mode():
        for keys in KEYS_SEQUENCE:
            directions = torch.full((1, cfg.frames_per_chunk), direction_index(keys))
            geometry = []
            for _ in range(cfg.frames_per_chunk):
                x, y = x + velocity(keys)[0], y + velocity(keys)[1]
                geometry.append(canvas_origin(x, y, cfg.patch_size))
            cells = torch.tensor([[(g[0], g[1]) for g in geometry]])
            canvases = sample_chunk(pipeline.model, kv, directions, cells, generator, previous)[0]
            previous = (canvases[None, -1], cells[:, -1])
            dense.extend(to_uint8(crop_view(c, g[2], g[3], cfg.image_size)).numpy() for c, g in zip(canvases, geometry))
    assert np.array_equal(paged, np.stack(dense))


def test_pool_and_model_state_return_to_baseline(pipeline: TinyWorldPipeline, runner: ARRunner) -> None:
    free = runner.pool.num_free
    assert runner.warmup() == 3
    assert runner.pool.num_free == free
    for sid in ("a", "b"):
        for i in range(4):
            runner.execute_tick(TickRequest(sid, i, controls={"keys": ["d"]}))
    assert runner.pool.num_free < free
    assert {"a", "b"} <= set(pipeline.session_ids())
    runner.reset_session("a")
    assert "a" not in pipeline.session_ids()
    runner.close_session("b")
    assert "b" not in pipeline.session_ids()
    assert runner.pool.num_free == free
    assert runner.stats().sessions_resident == 0


def test_eviction_releases_model_state(pipeline: TinyWorldPipeline) -> None:
    runner = make_runner(pipeline, sessions=1)
    assert runner.session_capacity == 1
    runner.execute_tick(TickRequest("first", 0))
    runner.execute_tick(TickRequest("second", 0))
    assert "first" not in pipeline.session_ids()
    runner.close_session("second")
    assert "second" not in pipeline.session_ids()


def staggered_sessions(runner: ARRunner, prefix: str) -> list[str]:
    """Three sessions past the window, at different frame positions, seeds and camera positions."""
    ids = []
    for n, (head_start, keys) in enumerate(((3, ["d"]), (5, ["w", "a"]), (4, ["s"]))):
        sid = f"{prefix}{n}"
        for i in range(head_start):
            runner.execute_tick(TickRequest(sid, i, controls={"keys": keys}, seed=20 + n))
        ids.append(sid)
    return ids


def assert_frames_close(batched: np.ndarray, alone: np.ndarray) -> None:
    """Batched rows are the same math as one row; only float summation order may differ."""
    diff = np.abs(batched.astype(np.int16) - alone.astype(np.int16))
    assert diff.max() <= 2 and diff.mean() < 0.01, (diff.max(), diff.mean())


ROUND_KEYS = ([["d"], [], ["a", "s"]], [["w"], ["d"], ["d"]])


def test_batched_chunks_match_each_session_alone(pipeline: TinyWorldPipeline) -> None:
    batched = runner_for_sessions(pipeline, 6, max_batch_sessions=3)
    solo = runner_for_sessions(pipeline, 6)
    batched_ids, solo_ids = staggered_sessions(batched, "batched-"), staggered_sessions(solo, "solo-")
    states = [batched.sessions.state(s) for s in batched_ids]
    assert len({s.frame_start for s in states if s is not None}) == 3 and None not in states
    for round_, keys in enumerate(ROUND_KEYS):
        request = 10 + round_
        results = batched.execute([TickRequest(s, request, controls={"keys": k}) for s, k in zip(batched_ids, keys)])
        for result, sid, k in zip(results, solo_ids, keys):
            assert isinstance(result, ChunkResult)
            alone = solo.execute_tick(TickRequest(sid, request, controls={"keys": k}))
            assert_frames_close(result.frames, alone.frames)
    assert batched.stats().batched_forwards_total == len(ROUND_KEYS)


def test_a_batch_that_raises_leaves_model_state_as_it_was(
    pipeline: TinyWorldPipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit pass raises after every row drew its noise; the retries alone must not see advanced state."""
    batched = runner_for_sessions(pipeline, 6, max_batch_sessions=3)
    solo = runner_for_sessions(pipeline, 6)
    batched_ids, solo_ids = staggered_sessions(batched, "retried-"), staggered_sessions(solo, "alone-")
    real_commit = sampling.commit_chunk
    calls = {"n": 0}

    def commit_failing_once(*args: object) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("fault in the committing pass")
        real_commit(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(sampling, "commit_chunk", commit_failing_once)
    keys = ROUND_KEYS[0]
    results = batched.execute([TickRequest(s, 10, controls={"keys": k}) for s, k in zip(batched_ids, keys)])
    monkeypatch.undo()
    assert batched.stats().batch_fallbacks_total == 1 and calls["n"] == 4
    for result, sid, k in zip(results, solo_ids, keys):
        assert isinstance(result, ChunkResult)
        alone = solo.execute_tick(TickRequest(sid, 10, controls={"keys": k}))
        np.testing.assert_array_equal(result.frames, alone.frames)

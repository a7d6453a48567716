"""ARRunner lifecycle with FakeKVPipeline, whose frames depend on the KV it reads."""

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from arstream.models.fake import FakeForwardError, FakeKVPipeline, expected_frame_value, frame_code
from arstream.runner.pool import PoolBudgetError
from arstream.runner.chunks import ChunkShapeError
from arstream.runner.runner import ARRunner
from arstream.runner.types import UnsupportedConfiguration
from arstream.runner.types import TickRequest
from runner_fakes import FAKE_KV_BUDGET_BYTES, fake_runner, tick

def dense_expected_values(controls_per_chunk: list[dict], sink: int, window: int, fpc: int) -> list[int]:
    """What FakeKVPipeline must emit, from a dense list of all frame codes.

    A chunk sees the sink frames plus the last ``window`` frames including its own ``fpc``.
    """
    codes: list[float] = []
    values: list[int] = []
    for controls in controls_per_chunk:
        recent = codes[sink:]
        history = codes[:sink] + recent[max(len(recent) - (window - fpc), 0) :]
        chunk = [frame_code(len(codes) + i, controls) for i in range(fpc)]
        values += [expected_frame_value(history + chunk[: i + 1]) for i in range(fpc)]
        codes += chunk
    return values


def test_frames_follow_the_dense_sink_plus_window_reference() -> None:
    runner, _ = fake_runner(sink_frames=1, window_frames=6)
    controls = [{"keys": ["wasd"[i % 4]]} for i in range(10)]
    got = [
        int(v)
        for i, c in enumerate(controls)
        for v in runner.execute_tick(tick("a", i, controls=c)).frames[:, 0, 0, 0]
    ]
    assert got == dense_expected_values(controls, sink=1, window=6, fpc=2)


def test_lru_eviction_closes_the_least_recently_used_session() -> None:
    runner, pipeline = fake_runner(session_capacity=2)
    evicted: list[str] = []
    runner.on_evict = evicted.append
    runner.execute_tick(tick("a"))
    runner.execute_tick(tick("b"))
    runner.execute_tick(tick("a", 1))  # a is now most recent
    result = runner.execute_tick(tick("c"))
    assert runner.resident_sessions() == ["a", "c"]
    assert evicted == ["b"] and ("close", "b") in pipeline.events
    assert runner.stats().evictions_total == 1
    assert result.new_rollout and result.chunk_index == 0
    again = runner.execute_tick(tick("b", 1))
    assert again.new_rollout and again.chunk_index == 0
    assert runner.resident_sessions() == ["c", "b"]


def test_reset_releases_kv_and_restarts_the_rollout() -> None:
    runner, pipeline = fake_runner()
    first = [runner.execute_tick(tick("a", i)).frames for i in range(3)]
    result = runner.execute_tick(tick("a", 3, reset=True))
    assert (result.chunk_index, result.new_rollout) == (0, True)
    assert ("reset", "a") in pipeline.events
    np.testing.assert_array_equal(result.frames, first[0])
    assert runner.pool.num_used == 2


def test_close_flag_releases_after_the_chunk() -> None:
    runner, pipeline = fake_runner()
    result = runner.execute_tick(tick("a", close=True))
    assert result.frames.shape == (2, 8, 8, 3)
    assert not runner.is_resident("a") and ("close", "a") in pipeline.events
    assert runner.pool.num_free == runner.blocks_free_at_start


def test_failure_mid_forward_fails_closed() -> None:
    runner, pipeline = fake_runner()
    runner.execute_tick(tick("a", 0))
    runner.execute_tick(tick("b", 0))
    with pytest.raises(FakeForwardError):
        runner.execute_tick(tick("a", 1, controls={"fail": True}))
    assert not runner.is_resident("a") and runner.is_resident("b")
    assert ("close", "a") in pipeline.events
    assert runner.stats().failures_total == 1
    runner.close_session("b")
    assert runner.pool.num_free == runner.blocks_free_at_start
    assert runner.execute_tick(tick("a", 2)).chunk_index == 0


def test_failure_at_the_device_sync_fails_closed() -> None:
    calls = {"n": 0}

    def failing_sync(device: torch.device) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fault surfaced at sync")

    runner = ARRunner(FakeKVPipeline(), kv_budget_bytes=FAKE_KV_BUDGET_BYTES, sync=failing_sync)
    runner.execute_tick(tick("a", 0))
    with pytest.raises(RuntimeError, match="surfaced at sync"):
        runner.execute_tick(tick("a", 1))
    assert not runner.is_resident("a")
    assert runner.pool.num_free == runner.blocks_free_at_start


class ClosingFailsPipeline(FakeKVPipeline):
    """A fake whose close notification raises, to check the other cleanup still runs."""

    def close_session(self, session_id: str) -> None:
        raise OSError("pipeline close failed")


def test_release_frees_blocks_even_when_the_pipeline_close_raises() -> None:
    runner = ARRunner(ClosingFailsPipeline(), kv_budget_bytes=FAKE_KV_BUDGET_BYTES)
    runner.execute_tick(tick("a"))
    with pytest.raises(OSError, match="pipeline close failed"):
        runner.close_session("a")
    assert runner.pool.num_free == runner.blocks_free_at_start
    with pytest.raises(FakeForwardError):  # the failure path suppresses cleanup errors, keeps the cause
        runner.execute_tick(tick("b", controls={"fail": True}))
    assert runner.pool.num_free == runner.blocks_free_at_start


def test_warmup_runs_the_real_path_and_restores_the_pool() -> None:
    runner, pipeline = fake_runner()
    assert runner.warmup() == 3
    stats = runner.stats()
    assert stats.blocks_free == runner.blocks_free_at_start
    assert (stats.sessions_resident, stats.chunks_total) == (0, 0)
    assert ("close", "__arstream_warmup__") in pipeline.events


def test_one_timing_entry_per_chunk() -> None:
    runner, _ = fake_runner()
    for i in range(4):
        runner.execute_tick(tick("a", i))
    assert len(runner.counters.chunk_times_s) == 4 and runner.stats().chunks_total == 4
    assert all(t > 0 for t in runner.counters.chunk_times_s)


def test_capacity_comes_from_the_budget() -> None:
    pipeline = FakeKVPipeline()
    spec = pipeline.kv_cache_spec()
    fixed = (spec.frames_per_chunk + spec.resident_frames + spec.frames_per_chunk) * spec.block_bytes
    runner = ARRunner(pipeline, kv_budget_bytes=fixed + 3 * spec.resident_frames * spec.block_bytes)
    assert runner.session_capacity == 3


def test_refused_configurations_say_why() -> None:
    with pytest.raises(UnsupportedConfiguration, match="does not implement the ARPipeline contract"):
        ARRunner(object(), kv_budget_bytes=FAKE_KV_BUDGET_BYTES)  # type: ignore[arg-type]
    with pytest.raises(PoolBudgetError, match="cannot hold one session"):
        ARRunner(FakeKVPipeline(), kv_budget_bytes=100)
    with pytest.raises(PoolBudgetError, match="must be given in bytes"):
        ARRunner(FakeKVPipeline())


class WrongSpecPipeline(FakeKVPipeline):
    """A fake that returns something other than a KVCacheSpec."""

    def kv_cache_spec(self):  # type: ignore[no-untyped-def]
        return {"num_layers": 2}


def test_a_spec_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(UnsupportedConfiguration, match="must return KVCacheSpec"):
        ARRunner(WrongSpecPipeline(), kv_budget_bytes=FAKE_KV_BUDGET_BYTES)


class BadFramesPipeline(FakeKVPipeline):
    """A fake that returns float frames."""

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        return super().generate_chunk(tick).astype(np.float32)


class NoCommitPipeline(FakeKVPipeline):
    """A fake that never runs the committing pass."""

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        return np.zeros((2, 8, 8, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    ("pipeline_class", "error", "message"),
    [(BadFramesPipeline, ChunkShapeError, "uint8"), (NoCommitPipeline, RuntimeError, "commit exactly one chunk")],
)
def test_contract_violations_fail_closed(pipeline_class: type, error: type, message: str) -> None:
    runner = ARRunner(pipeline_class(), kv_budget_bytes=FAKE_KV_BUDGET_BYTES)
    with pytest.raises(error, match=message):
        runner.execute_tick(tick("a"))
    assert runner.pool.num_free == runner.blocks_free_at_start and not runner.is_resident("a")


class InterruptedBindPipeline(FakeKVPipeline):
    """A fake whose bind context raises on exit, after a successful forward."""

    @contextmanager
    def bind_session_state(self, session_id, state) -> Iterator[None]:  # type: ignore[no-untyped-def]
        with super().bind_session_state(session_id, state):
            yield
        raise RuntimeError("unbind failed")


def test_failure_while_unbinding_releases_the_session() -> None:
    runner = ARRunner(InterruptedBindPipeline(), kv_budget_bytes=FAKE_KV_BUDGET_BYTES)
    with pytest.raises(RuntimeError, match="unbind failed"):
        runner.execute_tick(tick("a"))
    assert runner.pool.num_free == runner.blocks_free_at_start


class VideoFramesFakePipeline(FakeKVPipeline):
    """Two video frames per latent frame, one fewer on a rollout's first chunk (as a causal video VAE does)."""

    def __init__(self, *, first_chunk_frames: int = 3, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.first_chunk_frames = first_chunk_frames

    def model_card(self) -> dict:
        card = super().model_card()
        card.update(frames_per_chunk=2 * self.spec.frames_per_chunk, first_chunk_frames=self.first_chunk_frames)
        return card

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        first = self.bound_state(tick.session_id).chunk_index == 0
        frames = np.repeat(super().generate_chunk(tick), 2, axis=0)
        return frames[1:] if first else frames


def test_video_frames_per_chunk_come_from_the_model_card_and_the_first_chunk_may_differ() -> None:
    runner = ARRunner(VideoFramesFakePipeline(), kv_budget_bytes=FAKE_KV_BUDGET_BYTES)
    assert (runner.video_frames(0), runner.video_frames(1)) == (3, 4)
    counts = [runner.execute_tick(tick("a", i)).frames.shape[0] for i in range(3)]
    assert counts == [3, 4, 4]
    assert runner.stats().frames_per_chunk == 2  # the KV unit: latent frames


def test_a_chunk_whose_frame_count_differs_from_the_card_fails_closed() -> None:
    runner = ARRunner(VideoFramesFakePipeline(first_chunk_frames=4), kv_budget_bytes=FAKE_KV_BUDGET_BYTES)
    with pytest.raises(ChunkShapeError, match="returned 3 frames, the model card says 4"):
        runner.execute_tick(tick("a"))
    assert not runner.is_resident("a") and runner.pool.num_free == runner.blocks_free_at_start


def test_a_model_card_with_a_bad_frame_count_is_refused() -> None:
    with pytest.raises(UnsupportedConfiguration, match="first_chunk_frames must be an integer >= 1"):
        ARRunner(VideoFramesFakePipeline(first_chunk_frames=0), kv_budget_bytes=FAKE_KV_BUDGET_BYTES)

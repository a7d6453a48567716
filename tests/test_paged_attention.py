"""Attention over the paged pool equals a dense contiguous sink + window cache."""

import torch

from arstream.models.toy_attention import DenseKVCache, ToyAttentionPipeline, chunk_noise, run_chunk, toy_spec
from arstream.runner.runner import ARRunner
from arstream.runner.spec import KVCacheSpec
from arstream.runner.types import TickRequest


def dense_rollout(pipeline: ToyAttentionPipeline, chunks: int, seed: int, spec: KVCacheSpec | None = None) -> list[torch.Tensor]:
    cache = DenseKVCache(spec or pipeline.spec)
    generator = torch.Generator().manual_seed(seed)
    return [
        run_chunk(pipeline.model, cache, chunk_noise(pipeline.spec, pipeline.model.dim, generator), pipeline.steps)
        for _ in range(chunks)
    ]


def test_paged_rollout_matches_dense_reference_over_many_windows() -> None:
    pipeline = ToyAttentionPipeline(sink_frames=1, window_frames=6)
    chunks = 12  # 24 frames: several times the 6-frame window (4 of history)
    runner = ARRunner(pipeline, kv_budget_bytes=16 << 20)
    paged: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    for i in range(chunks):
        # Two sessions interleaved, so each chunk regathers its history from the pool.
        for session, seed in (("a", 1), ("b", 2)):
            runner.execute_tick(TickRequest(session_id=session, request_id=i, seed=seed))
            assert pipeline.last_latent is not None
            paged[session].append(pipeline.last_latent.clone())
    for session, seed in (("a", 1), ("b", 2)):
        for got, want in zip(paged[session], dense_rollout(pipeline, chunks, seed), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_comparison_detects_a_wrong_window() -> None:
    """Negative control: a dense cache with a shorter window diverges from the paged rollout."""
    pipeline = ToyAttentionPipeline(sink_frames=1, window_frames=6)
    runner = ARRunner(pipeline, kv_budget_bytes=16 << 20)
    paged = []
    for i in range(6):
        runner.execute_tick(TickRequest(session_id="a", request_id=i, seed=1))
        assert pipeline.last_latent is not None
        paged.append(pipeline.last_latent.clone())
    wrong = dense_rollout(pipeline, 6, seed=1, spec=toy_spec(sink_frames=1, window_frames=4))
    assert not torch.allclose(paged[-1], wrong[-1], atol=1e-3)

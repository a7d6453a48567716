"""matrix-game-2 on the paged runner equals a dense block-causal reference; batching and failures change nothing."""

import numpy as np
import pytest
import torch

from arstream.models.matrix_game.config import MatrixGameConfig, get_config
from arstream.models.matrix_game.dit import CausalWanDiT
from arstream.models.matrix_game.images import default_image
from arstream.models.matrix_game.pipeline import MatrixGamePipeline
from arstream.models.wan.vae import StreamingVAE, build_vae
from arstream.runner.runner import ARRunner
from arstream.runner.types import ChunkResult, TickRequest
from matrix_game_reference import dense_rollout

BUDGET = 64 << 20
CHUNKS = 6  # 18 latent frames: the 6-frame window slides four times
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


def build(cfg: MatrixGameConfig, seed: int = 0) -> MatrixGamePipeline:
    with torch.device("meta"):
        model = CausalWanDiT(cfg)
    model = model.to_empty(device="cpu")
    model.init_random(seed)
    torch.manual_seed(seed)
    vae = StreamingVAE(build_vae(cfg))
    features = torch.randn(cfg.clip_tokens, cfg.clip_dim, generator=torch.Generator().manual_seed(seed))
    return MatrixGamePipeline(
        model, vae, device=torch.device("cpu"), images={"default": default_image(cfg)}, clip_features=features
    )


def controls_for(session: str, chunk: int) -> dict:
    keys = [["w"], ["a", "w"], [], ["d"], ["s"], ["w", "d"]][(chunk + (session == "b")) % 6]
    return {"keys": keys, "camera": {"yaw": 0.3 * ((chunk % 3) - 1), "pitch": 0.1 * (session == "a")}}


def tick(session: str, chunk: int, seed: int) -> TickRequest:
    return TickRequest(session_id=session, request_id=chunk, controls=controls_for(session, chunk), seed=seed)


SEEDS = {"a": 1, "b": 2}


@pytest.fixture(scope="module")
def pipeline() -> MatrixGamePipeline:
    return build(get_config("tiny"))


def interleaved(runner: ARRunner, pipeline: MatrixGamePipeline) -> dict[str, list[torch.Tensor]]:
    latents: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    for c in range(CHUNKS):
        for session in ("a", "b"):  # interleaved: each chunk regathers its history from the pool
            runner.execute_tick(tick(session, c, SEEDS[session]))
            latents[session].append(pipeline.last_latents[session].clone())
    return latents


def test_paged_chunks_equal_the_dense_block_causal_reference(pipeline: MatrixGamePipeline) -> None:
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET)
    paged = interleaved(runner, pipeline)
    for session in ("a", "b"):
        controls = [controls_for(session, c) for c in range(CHUNKS)]
        reference = dense_rollout(pipeline, controls, SEEDS[session])
        for c, (got, want) in enumerate(zip(paged[session], reference, strict=True)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"session {session} chunk {c}")
    # negative controls: a reference with a longer window, or other controls, gives other latents
    controls = [controls_for("a", c) for c in range(CHUNKS)]
    wider = dense_rollout(pipeline, controls, SEEDS["a"], window=9)
    torch.testing.assert_close(wider[1], paged["a"][1], rtol=1e-4, atol=1e-4)  # no eviction yet
    assert not torch.allclose(wider[-1], paged["a"][-1], atol=1e-2)
    other = dense_rollout(pipeline, [controls_for("b", c) for c in range(CHUNKS)], SEEDS["a"])
    assert not torch.allclose(other[-1], paged["a"][-1], atol=1e-2)


def assert_session_a_matches_the_reference(pipeline: MatrixGamePipeline) -> ARRunner:
    """Roll session "a" through the paged runner; each chunk's latents equal the dense reference's."""
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET)
    latents = []
    for c in range(CHUNKS):
        runner.execute_tick(tick("a", c, SEEDS["a"]))
        latents.append(pipeline.last_latents["a"].clone())
    reference = dense_rollout(pipeline, [controls_for("a", c) for c in range(CHUNKS)], SEEDS["a"])
    for got, want in zip(latents, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    return runner


def test_a_window_with_less_history_than_a_chunk_equals_the_reference() -> None:
    """The GTA variant's window: 4 frames including the 3-frame chunk, so one frame of history."""
    runner = assert_session_a_matches_the_reference(build(get_config("tiny", local_attn_size=4)))
    assert runner.sessions.history_frames("a") == 1


def test_the_temple_run_variant_equals_the_reference() -> None:
    """Keyboard-only action module (no mouse path, no mouse caches), 7 keys, 4 denoising steps."""
    pipeline = build(get_config("tiny-templerun"))
    runner = assert_session_a_matches_the_reference(pipeline)
    history = pipeline._sessions["a"].actions
    assert history.frames == 3 and all(kv[0].numel() == 0 for kv in history.layers.values())
    runner.close_session("a")


def test_positions_past_the_rotary_table_keep_every_distance_in_the_window() -> None:
    """A 9-frame rotary table and 18 frames: the runner shifts positions, the attention is unchanged."""
    assert_session_a_matches_the_reference(build(get_config("tiny", rope_frames=9)))


def test_first_chunk_has_9_video_frames_then_12(pipeline: MatrixGamePipeline) -> None:
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET)
    shapes = [runner.execute_tick(tick("c", c, 3)).frames.shape for c in range(3)]
    cfg = pipeline.cfg
    assert shapes == [(9, cfg.height, cfg.width, 3)] + [(12, cfg.height, cfg.width, 3)] * 2
    runner.close_session("c")
    assert "c" not in pipeline.session_ids() and runner.pool.num_free == runner.blocks_free_at_start


def frames_alone(pipeline: MatrixGamePipeline, rounds: int) -> dict[str, list[np.ndarray]]:
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET)
    out: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    for c in range(rounds):
        for session in ("a", "b"):
            out[session].append(runner.execute_tick(tick(session, c, SEEDS[session])).frames)
    for session in ("a", "b"):
        runner.close_session(session)
    return out


def test_batched_sessions_get_the_frames_they_get_alone(pipeline: MatrixGamePipeline) -> None:
    alone = frames_alone(pipeline, 4)
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET, max_batch_sessions=2)
    for c in range(4):
        results = runner.execute([tick("a", c, SEEDS["a"]), tick("b", c, SEEDS["b"])])
        for session, result in zip(("a", "b"), results):
            assert isinstance(result, ChunkResult)
            # uint8 frames: float rounding in a batched matmul may move a pixel by one level
            assert np.abs(result.frames.astype(int) - alone[session][c].astype(int)).max() <= 1
    assert runner.stats().batched_forwards_total == 4


def test_a_failed_batch_leaves_kv_action_vae_caches_and_noise_as_they_were(pipeline: MatrixGamePipeline) -> None:
    """The batch fails in the VAE, after the DiT ran; each session's retry alone gets its never-batched frames."""
    alone = frames_alone(pipeline, 3)
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET, max_batch_sessions=2)
    for c in range(2):
        runner.execute([tick("a", c, SEEDS["a"]), tick("b", c, SEEDS["b"])])
    before = {s: pipeline._sessions[s] for s in ("a", "b")}
    decode = pipeline.vae.decode
    calls = []

    def failing_once(latents: torch.Tensor, cache: object) -> object:
        if latents.shape[0] > 1 and not calls:  # the batch's decode, after its DiT passes and commit
            calls.append(1)
            raise RuntimeError("injected VAE failure")
        return decode(latents, cache)  # type: ignore[arg-type]

    pipeline.vae.decode = failing_once  # type: ignore[method-assign]
    try:
        results = runner.execute([tick("a", 2, SEEDS["a"]), tick("b", 2, SEEDS["b"])])
    finally:
        pipeline.vae.decode = decode  # type: ignore[method-assign]
    assert calls and runner.stats().batch_fallbacks_total == 1
    for session, result in zip(("a", "b"), results):
        assert isinstance(result, ChunkResult)
        assert np.abs(result.frames.astype(int) - alone[session][2].astype(int)).max() <= 1
        # the retry replaced the session state once: the failed batch had not stored any
        assert pipeline._sessions[session] is not before[session]


def test_a_failed_forward_releases_the_session_and_its_model_state(pipeline: MatrixGamePipeline) -> None:
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET)
    runner.execute_tick(tick("d", 0, 4))
    decode = pipeline.vae.decode

    def failing(latents: torch.Tensor, cache: object) -> object:
        raise RuntimeError("injected VAE failure")

    pipeline.vae.decode = failing  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="injected"):
            runner.execute_tick(tick("d", 1, 4))
    finally:
        pipeline.vae.decode = decode  # type: ignore[method-assign]
    assert "d" not in pipeline.session_ids() and runner.pool.num_free == runner.blocks_free_at_start


def test_chunked_vae_decode_equals_one_call_decode(pipeline: MatrixGamePipeline) -> None:
    vae = pipeline.vae
    latents = torch.randn(1, 16, 9, 4, 6, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        whole = vae.vae.decode(latents * vae.std + vae.mean).sample
    parts, cache, snapshot = [], None, []
    for start in range(0, 9, 3):
        video, new_cache = vae.decode(latents[:, :, start : start + 3], cache)
        if cache is not None:  # decode leaves the cache it was given untouched (a failed batch relies on it)
            assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(cache, snapshot))
        snapshot = [t.clone() if isinstance(t, torch.Tensor) else t for t in new_cache]
        cache = new_cache
        parts.append(video)
    chunked = torch.cat(parts, dim=2)
    assert chunked.shape == whole.shape == (1, 3, 33, 32, 48)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5)


def test_bfloat16_weights_and_kv_run_batched_through_the_runner() -> None:
    """The GPU path's dtype (bf16 weights, KV pool and caches; norms in fp32) on the CPU."""
    from arstream.models.matrix_game.pipeline import load_matrix_game

    pipeline = load_matrix_game("cpu", config="tiny", random_init=True, dtype="bfloat16")
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET, max_batch_sessions=2)
    assert runner.pool.kv.dtype == torch.bfloat16
    for c in range(3):
        results = runner.execute([tick("a", c, 1), tick("b", c, 2)])
        assert all(isinstance(r, ChunkResult) and r.frames.shape[0] == (9 if c == 0 else 12) for r in results)
    assert runner.stats().batched_forwards_total == 3


def test_batched_vae_decode_equals_row_by_row(pipeline: MatrixGamePipeline) -> None:
    vae = pipeline.vae
    generator = torch.Generator().manual_seed(9)
    chunks = [torch.randn(2, 16, 3, 4, 6, generator=generator) for _ in range(3)]
    batched: list = [None, None]
    alone: list = [None, None]
    for latents in chunks:
        videos, batched = vae.decode_rows(latents, batched)
        for row in range(2):
            video, alone[row] = vae.decode(latents[row : row + 1], alone[row])
            torch.testing.assert_close(videos[row], video, rtol=1e-5, atol=1e-5)
    # a new rollout beside a running one: different cache structures decode row by row
    videos, _ = vae.decode_rows(chunks[0], [None, alone[1]])
    torch.testing.assert_close(videos[0], vae.decode(chunks[0][:1], None)[0], rtol=1e-5, atol=1e-5)
    assert videos[0].shape[2] == 9 and videos[1].shape[2] == 12

"""matrix-game-2 with ``decoder: taehv``: the frames are TAEHV's decode of the rollout's latents, its state counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from taehv_reference import decode_clip, reference_decoder

from arstream.models.matrix_game.decoders import TINY_WIDTHS
from arstream.models.matrix_game.pipeline import MatrixGamePipeline
from arstream.models.registry import load_pipeline
from arstream.models.wan_decoders.taehv import StreamingTAEHV
from arstream.runner.runner import runner_for_sessions
from arstream.runner.types import TickRequest


def _pipeline(**options: object) -> MatrixGamePipeline:
    pipeline = load_pipeline("matrix-game-2", "cpu", config="tiny", random_init=True, **options)
    assert isinstance(pipeline, MatrixGamePipeline)
    return pipeline


def test_taehv_frames_are_the_dense_decode_of_the_whole_rollouts_latents() -> None:
    pipeline = _pipeline(decoder="taehv")
    assert isinstance(pipeline.decoder, StreamingTAEHV)
    runner = runner_for_sessions(pipeline, 1)
    frames, latents = [], []
    for i, keys in enumerate((["w"], ["a"], [], ["d"])):
        result = runner.execute_tick(TickRequest("s", i, controls={"keys": keys}, seed=3))
        frames.append(result.frames)
        latents.append(pipeline.last_latents["s"].clone())  # [16, 3, h, w]
    assert [f.shape[0] for f in frames] == [9, 12, 12, 12]
    ref = reference_decoder(TINY_WIDTHS)
    ref.load_state_dict(pipeline.decoder.module.state_dict(), strict=True)
    clip = torch.cat(latents, 1).permute(1, 0, 2, 3)[None]  # [1, T, 16, h, w]
    expected = decode_clip(ref, clip)[0]
    expected_uint8 = ((expected * 2 - 1 + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    got = np.concatenate(frames)
    assert got.shape == expected_uint8.shape
    assert np.abs(got.astype(int) - expected_uint8.astype(int)).max() <= 1
    runner.close_session("s")
    assert runner.pool.num_free == runner.pool.num_blocks and pipeline.session_ids() == []


def test_the_decoder_state_is_counted_in_capacity_and_is_far_smaller_than_the_vae_cache() -> None:
    tiny, vae = _pipeline(decoder="taehv"), _pipeline()
    taehv_state = tiny.kv_cache_spec().model_owned_bytes_per_session - tiny.action_bytes
    # per memory block one frame of its input: 3 blocks at each of the three stages' resolutions (4x6, 8x12, 16x24)
    h, w = tiny.cfg.latent_height, tiny.cfg.latent_width
    expected = 4 * 3 * sum(c * h * w * 4**s for s, c in enumerate(TINY_WIDTHS[:3]))
    assert taehv_state == expected
    assert taehv_state < vae.vae_cache_bytes
    assert tiny.transfer_fingerprint()["decoder"] != vae.transfer_fingerprint()["decoder"]


def test_an_unknown_decoder_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"decoder must be one of \['wan-vae', 'taehv'\], got 'tae'"):
        _pipeline(decoder="tae")
    with pytest.raises(ValueError, match="decoder_file names a file in the checkpoint directory"):
        _pipeline(decoder="taehv", decoder_file="taew2_1.pth")


def test_decode_device_places_taehv_and_its_states_there_and_is_refused_for_the_vae() -> None:
    # Only the CPU here: the option's path (latents moved, states kept and imported there), not a second GPU.
    pipeline = _pipeline(decoder="taehv", decode_device="cpu")
    assert isinstance(pipeline.decoder, StreamingTAEHV) and pipeline.decoder.device.type == "cpu"
    runner = runner_for_sessions(pipeline, 1)
    runner.execute_tick(TickRequest("s", 0, seed=3))
    state = pipeline.export_session_state("s")
    assert state.json["decoder"]["chunks"] == 1 and all(t.device.type == "cpu" for t in state.tensors.values())
    runner.close_session("s")
    with pytest.raises(ValueError, match="decode_device needs decoder 'taehv'"):
        _pipeline(decode_device="cpu")
    with pytest.raises(ValueError, match="decode_device: "):
        _pipeline(decoder="taehv", decode_device="gpu:7")

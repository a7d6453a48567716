"""Waypoint-1.5's own parts on the runner: four frames per latent frame (one control input each) from a streaming
TAEHV decoder whose state is the session's, loaded from the published layout (``taehv1_5.pth``), equal to a dense
reference of the published engine; batched, parked and rewound sessions decode on exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from arstream.models.waypoint.config import CONFIGS, WaypointConfig, config_from_yaml, config_to_yaml, get_config
from arstream.models.waypoint.encoder import TAEHVEncoder
from arstream.models.waypoint.loading import WaypointWeightsError, load_waypoint, random_weights
from arstream.models.waypoint.pipeline import WaypointPipeline, control_vector
from arstream.models.waypoint.taehv_frames import FramesDecoder
from arstream.runner.rewind_schedule import RewindSchedule
from arstream.runner.runner import ARRunner
from arstream.runner.types import ChunkResult, ParkingPolicy, TickRequest
from taehv_reference import reference_decoder
from waypoint_reference import ReferenceWaypoint, reference_taehv_frames
from waypoint_schedule import SEEDS, controls_for, tick

BUDGET = 16 << 20
CHUNKS = 12
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread
Files = dict[str, dict[str, torch.Tensor]]
Published = tuple[Path, Files]
ENCODER_WIDTH = 8  # the tiny TAEHV encoder's (the published one's is 64)


def write_published(root: Path, cfg: WaypointConfig, seed: int = 0) -> Files:
    """Random weights in the published layout: config.yaml + model.safetensors, and ae/taehv1_5.pth (the TAEHV
    file: encoder and decoder tensors in one torch state dict)."""
    model, decoder = random_weights(cfg, seed)
    assert isinstance(decoder, FramesDecoder)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(config_to_yaml(cfg))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    save_file(weights, str(root / "model.safetensors"))
    (root / "ae").mkdir(exist_ok=True)
    taehv = {k: v.clone() for k, v in decoder.state_dict().items()}
    encoder = TAEHVEncoder(cfg.channels, cfg.ae["patch_size"], cfg.latent_shape[1:], width=ENCODER_WIDTH)
    encoder.init_random(seed + 5)
    encoder_state = {k: v.clone() for k, v in encoder.state_dict().items()}
    torch.save({**encoder_state, **taehv}, root / "ae" / "taehv1_5.pth")
    return {"model": weights, "decoder": taehv, "encoder": encoder_state}


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Published:
    root = tmp_path_factory.mktemp("waypoint-1.5")
    return root, write_published(root, get_config("tiny-1.5"))


@pytest.fixture(scope="module")
def pipeline(published: Published) -> WaypointPipeline:
    """Sessions that start from noise: the generation path alone (start images: test_waypoint_seed.py)."""
    return load_waypoint(config="tiny-1.5", weights_path=published[0], from_noise=True)


def reference_rollout(
    cfg: WaypointConfig, files: Files, controls: list[dict[str, Any]], seed: int
) -> tuple[list[torch.Tensor], list[np.ndarray]]:
    ref = ReferenceWaypoint(cfg, files["model"], {})
    holder = reference_decoder(tuple(cfg.ae["widths"]), cfg.ae["latent_channels"], cfg.ae["patch_size"])
    holder.load_state_dict(files["decoder"], strict=True)
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        latents = [ref.gen_frame(torch.randn(cfg.latent_shape, generator=generator), control_vector(c, cfg))
                   for c in controls]
        frames = reference_taehv_frames(holder, latents, (cfg.image_height, cfg.image_width))
    return latents, [f.numpy() for f in frames]


def test_four_frames_a_control_equal_the_published_engine(pipeline: WaypointPipeline, published: Published) -> None:
    """Two sessions interleaved over twelve chunks: each chunk is one latent frame made under one control input and
    decoded to four 72x128 frames, equal to the dense reference (the primed TAEHV stream, resized)."""
    cfg = pipeline.cfg
    assert pipeline.model_card()["frames_per_chunk"] == 4 and pipeline.kv_cache_spec().frames_per_chunk == 1
    assert pipeline.kv_cache_spec().model_owned_bytes_per_session > 0  # the TAEHV stream state, counted
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET)
    latents: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    frames: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    for c in range(CHUNKS):
        for session in ("a", "b"):
            result = runner.execute_tick(tick(session, c))
            assert isinstance(result, ChunkResult)
            assert result.frames.shape == (4, 72, 128, 3)
            frames[session].append(result.frames)
            latents[session].append(pipeline.last_latents[session].clone())
    files = published[1]
    for session in ("a", "b"):
        want_latents, want_frames = reference_rollout(
            cfg, files, [controls_for(session, c) for c in range(CHUNKS)], SEEDS[session]
        )
        for c in range(CHUNKS):
            torch.testing.assert_close(latents[session][c], want_latents[c], rtol=1e-4, atol=1e-4,
                                       msg=f"session {session} chunk {c}")
            assert np.abs(frames[session][c].astype(int) - want_frames[c].astype(int)).max() <= 1, (session, c)
    # the frames move: the four of a chunk differ, and so do chunks
    assert not np.array_equal(frames["a"][5][0], frames["a"][5][3])
    assert not np.array_equal(frames["a"][5], frames["a"][6])
    # negative controls: the stream unprimed, the stream without memory, other controls: other frames
    holder = reference_decoder(tuple(cfg.ae["widths"]), cfg.ae["latent_channels"], cfg.ae["patch_size"])
    holder.load_state_dict(files["decoder"], strict=True)
    size = (cfg.image_height, cfg.image_width)
    want_latents, want_frames = reference_rollout(cfg, files, [controls_for("a", c) for c in range(CHUNKS)], 1)
    with torch.inference_mode():
        unprimed = reference_taehv_frames(holder, want_latents[1:], size)  # chunk 1 decoded as if it came first
        alone = reference_taehv_frames(holder, [want_latents[6]], size)  # chunk 6 without the stream before it
    served = frames["a"]
    assert np.abs(unprimed[0].numpy().astype(int) - served[1].astype(int)).max() > 1
    assert np.abs(alone[0].numpy().astype(int) - served[6].astype(int)).max() > 1
    _, other = reference_rollout(cfg, files, [controls_for("b", c) for c in range(CHUNKS)], SEEDS["a"])
    assert np.abs(other[-1].astype(int) - served[-1].astype(int)).max() > 1
    for session in ("a", "b"):
        runner.close_session(session)
    assert pipeline.session_ids() == [] and runner.pool.num_free == runner.pool.num_blocks


def test_batched_sessions_out_of_phase_get_the_frames_they_get_alone(pipeline: WaypointPipeline) -> None:
    """Session a runs a chunk ahead of b; batched, each gets its alone frames. And one decode holding a session's
    first latent (its stream primed) beside another's next gives each row its own frames."""
    rounds = 8
    alone: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET)
    for session in ("a", "b"):
        for c in range(rounds):
            alone[session].append(runner.execute_tick(tick(session, c)).frames)
        runner.close_session(session)
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET, max_batch_sessions=2)
    runner.execute_tick(tick("a", 0))
    got: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    for c in range(rounds - 1):
        for session, result in zip(("a", "b"), runner.execute([tick("a", c + 1), tick("b", c)])):
            assert isinstance(result, ChunkResult)
            got[session].append(result.frames)
    assert runner.stats().batched_forwards_total >= 3  # batched once both histories fill the window
    for c in range(rounds - 1):
        assert np.abs(got["a"][c].astype(int) - alone["a"][c + 1].astype(int)).max() <= 1, c
        assert np.abs(got["b"][c].astype(int) - alone["b"][c].astype(int)).max() <= 1, c
    for session in ("a", "b"):
        runner.close_session(session)

    decoder = pipeline.decoder
    assert isinstance(decoder, FramesDecoder)
    latents = torch.randn(3, *pipeline.cfg.latent_shape, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        first, state = decoder.decode_frames(latents[:1], [None])
        next_alone, _ = decoder.decode_frames(latents[1:2], state)
        start_alone, _ = decoder.decode_frames(latents[2:3], [None])
        both, _ = decoder.decode_frames(latents[1:3], [state[0], None])
    assert np.abs(both[0].int().numpy() - next_alone[0].int().numpy()).max() <= 1
    assert np.abs(both[1].int().numpy() - start_alone[0].int().numpy()).max() <= 1
    assert not torch.equal(next_alone, decoder.decode_frames(latents[1:2], [None])[0])  # the state mattered


def test_a_parked_or_rewound_session_decodes_on_bit_identically(pipeline: WaypointPipeline) -> None:
    """The TAEHV stream state travels with the session: parked, or rewound to a point after a detour, it gives the
    frames of the straight run."""

    def rollout(park_at: int | None = None, rewind_at: int | None = None) -> list[np.ndarray]:
        runner = ARRunner(pipeline, kv_budget_bytes=BUDGET, rewind=RewindSchedule.last(4),
                          parking=ParkingPolicy(64 << 20))
        frames = []
        for c in range(9):
            if c == park_at:
                assert runner.park_session("a") and not runner.sessions.in_pool("a")
            if c == rewind_at:
                for detour in range(2):
                    runner.execute_tick(tick("a", c + detour, controls={"buttons": [70], "mouse": [3.0, 3.0]}))
                result = runner.execute_tick(TickRequest(session_id="a", request_id=c, controls=controls_for("a", c),
                                                         seed=SEEDS["a"], rewind_to=c))
            else:
                result = runner.execute_tick(tick("a", c))
            frames.append(result.frames)
        runner.close_session("a")
        assert runner.pool.num_free == runner.pool.num_blocks
        return frames

    straight = rollout()
    for variant in (rollout(park_at=4), rollout(rewind_at=5)):
        for c, (want, got) in enumerate(zip(straight, variant, strict=True)):
            assert np.array_equal(want, got), c


def test_the_taehv_file_is_refused_when_it_does_not_fit(tmp_path: Path, published: Published) -> None:
    cfg = get_config("tiny-1.5")
    files = write_published(tmp_path, cfg)
    taehv = dict(files["decoder"])
    taehv.pop("decoder.3.conv.0.weight")
    torch.save(taehv, tmp_path / "ae" / "taehv1_5.pth")
    with pytest.raises(WaypointWeightsError, match=r"taehv1_5\.pth.*missing keys decoder\.3\.conv\.0\.weight"):
        load_waypoint(config="tiny-1.5", weights_path=tmp_path)
    (tmp_path / "ae" / "taehv1_5.pth").unlink()
    with pytest.raises(WaypointWeightsError, match=r"no TAEHV file.*taehv1_5\.pth"):
        load_waypoint(config="tiny-1.5", weights_path=tmp_path)
    wide = {k: torch.zeros(v.shape[0], v.shape[1] * 2, *v.shape[2:]) if k == "decoder.1.weight" else v
            for k, v in files["decoder"].items()}
    torch.save(wide, tmp_path / "ae" / "taehv1_5.pth")
    with pytest.raises(WaypointWeightsError, match=r"taehv1_5\.pth: decodes 8-channel latents; .*channels are 4"):
        load_waypoint(config="tiny-1.5", weights_path=tmp_path)


def test_config_yaml_keys_of_the_later_engine(tmp_path: Path) -> None:
    """What the 1.5 release's config.yaml says is read (four frames a latent frame, 60 fps, the 720p/360p sizes from
    the latent grid, max_frames for the context); what this package cannot serve exactly is refused by name."""
    release = dict(yaml.safe_load(config_to_yaml(CONFIGS["1.5"])))
    release.pop("n_frames")
    release.update(max_frames=512, base_fps=15, inference_fps=60, ae_uri="Overworld-Models/taehv1_5",
                   auto_aspect_ratio=True)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(release))
    for base in ("tiny", "1.5"):  # the file decides, whatever the base
        cfg = config_from_yaml(path, get_config(base))
        assert (cfg.temporal_compression, cfg.fps, cfg.n_frames, cfg.taehv_ae) == (4, 60, 512, True)
        assert (cfg.image_height, cfg.image_width, cfg.tokens_per_frame) == (720, 1280, 512)
        assert [cfg.layer_window(i) for i in (2, 3)] == [(16, 1), (128, 8)] and cfg.window_frames == 128
    path.write_text(yaml.safe_dump({**release, "height": 8, "width": 16, "tokens_per_frame": 128}))
    assert (config_from_yaml(path, get_config("tiny")).image_height, 640) == (360, 640)
    for extra, named in (
        ({"taehv_ae": False}, r"temporal_compression 4 without taehv_ae"),
        ({"base_fps": 60}, r"base_fps 60, inference_fps 60, temporal_compression 4"),
        ({"model_type": "waypoint-2"}, r"model_type 'waypoint-2'"),
        ({"height": 10}, r"auto_aspect_ratio for a 320x1024 picture"),
        ({"height": 4, "width": 8}, r"auto_aspect_ratio for a 128x256 picture"),
    ):
        fixed = {**release, **extra}
        fixed["tokens_per_frame"] = fixed["height"] * fixed["width"]
        path.write_text(yaml.safe_dump(fixed))
        for base in ("tiny", "1.5", "tiny-1.5"):  # no base lends its own size to another grid
            with pytest.raises(ValueError, match=rf"config\.yaml: cannot serve keys .*{named}"):
                config_from_yaml(path, get_config(base))


def test_a_bare_waypoint_1_5_serves_waypoint_1_5s_own_path() -> None:
    """``--model waypoint-1.5`` with no config: tiny-1.5 (TAEHV, four frames a chunk), not Waypoint-1's decoder."""
    from arstream.models.registry import load_pipeline

    pipeline = load_pipeline("waypoint-1.5", "cpu")
    assert isinstance(pipeline, WaypointPipeline)
    card = pipeline.model_card()
    assert (card["width"], card["height"], card["frames_per_chunk"], card["fps"]) == (128, 72, 4, 60), card

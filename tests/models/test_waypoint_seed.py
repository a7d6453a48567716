"""A Waypoint world starts from a picture, as the published engine's ``append_frame`` then ``gen_frame`` make it:
equal to the dense reference over twelve chunks for Waypoint-1 (``tiny``) and Waypoint-1.5 (``tiny-1.5``); the seed's
K/V is ordinary history (parked, rewound, moved), the session's picture survives a reset and a move, and the
encoders' files are read and checked like the decoders'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_waypoint import encoder_conf
from test_waypoint import write_published as write_waypoint_1
from test_waypoint_1_5 import ENCODER_WIDTH
from test_waypoint_1_5 import write_published as write_waypoint_1_5

from arstream.models.waypoint.config import WaypointConfig, get_config
from arstream.models.waypoint.loading import WaypointWeightsError, load_waypoint
from arstream.models.waypoint.pipeline import WaypointPipeline, control_vector
from arstream.models.waypoint.seed import default_pixels
from arstream.runner.rewind_schedule import RewindSchedule
from arstream.runner.runner import ARRunner
from arstream.runner.snapshot import export_session
from arstream.runner.snapshot_import import import_session
from arstream.runner.snapshot_stream import parse_snapshot, snapshot_bytes
from arstream.runner.types import ChunkResult, ParkingPolicy, StartImage, TickFailure, TickRequest
from taehv_reference import reference_decoder, reference_encoder
from waypoint_reference import ReferenceWaypoint, reference_encode, reference_taehv_frames, reference_taehv_seed
from waypoint_schedule import SEEDS, controls_for

BUDGET = 16 << 20
CHUNKS = 12  # the seed and eleven generated frames
CONFIGS = ("tiny", "tiny-1.5")
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread
Files = dict[str, dict[str, torch.Tensor]]


def picture(height: int, width: int, seed: int) -> np.ndarray:
    """A client's picture at the frame's size (the server cuts uploads to it): smooth colour fields plus noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    return np.clip(base + rng.integers(-40, 40, (height, width, 3)), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module", params=CONFIGS)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[WaypointPipeline, Files]:
    config = request.param
    root = tmp_path_factory.mktemp(f"waypoint-seed-{config}")
    write = write_waypoint_1_5 if config == "tiny-1.5" else write_waypoint_1
    files = write(root, get_config(config))
    return load_waypoint(config=config, weights_path=root, image_cache=2), files


def choices(cfg: WaypointConfig) -> dict[str, StartImage | None]:
    """Session a starts from the default picture, b from a client's own."""
    return {"a": None, "b": StartImage("sha-b", pixels=picture(cfg.image_height, cfg.image_width, 2))}


def pixels_of(cfg: WaypointConfig, choice: StartImage | None) -> np.ndarray:
    if choice is None:
        return default_pixels(cfg.image_height, cfg.image_width)
    assert choice.pixels is not None
    return choice.pixels


def tick(
    session: str, chunk: int, start: StartImage | None, controls: dict[str, Any] | None = None, **extra: Any
) -> TickRequest:
    return TickRequest(session_id=session, request_id=chunk,
                       controls=controls_for(session, chunk) if controls is None else controls,
                       seed=SEEDS[session], start_image=start, **extra)


def reference_rollout(
    cfg: WaypointConfig, files: Files, pixels: np.ndarray, session: str, seed_controls: bool = False
) -> tuple[list[torch.Tensor], list[np.ndarray]]:
    """``engine.reset(); engine.append_frame(seed)`` then ``gen_frame`` for the session's controls (chunks 1..);
    ``seed_controls``: the seed appended with chunk 0's controls instead of none (a negative control)."""
    pixels_t = torch.from_numpy(pixels)
    size = (cfg.image_height, cfg.image_width)
    grid = cfg.latent_shape[1:]
    with torch.inference_mode():
        if cfg.taehv_ae:
            ref = ReferenceWaypoint(cfg, files["model"], {})
            encoder = reference_encoder(ENCODER_WIDTH, cfg.channels, cfg.ae["patch_size"])
            encoder.load_state_dict(files["encoder"], strict=True)
            seed = reference_taehv_seed(encoder, pixels_t, (grid[0] * 16, grid[1] * 16))
        else:
            ref = ReferenceWaypoint(cfg, files["model"], files["decoder"])
            conf = encoder_conf(cfg)
            scale = 2 ** len(conf["encoder_blocks_per_stage"])
            seed = reference_encode(files["encoder"], conf, pixels_t, (grid[0] * scale, grid[1] * scale))
        ref.append_frame(seed, control_vector(controls_for(session, 0), cfg) if seed_controls else None)
        generator = torch.Generator().manual_seed(SEEDS[session])
        latents = [seed]
        for c in range(1, CHUNKS):
            noise = torch.randn(cfg.latent_shape, generator=generator)
            latents.append(ref.gen_frame(noise, control_vector(controls_for(session, c), cfg)))
        shown = np.repeat(pixels[None], cfg.temporal_compression, axis=0)  # append_frame hands the seed back
        if cfg.taehv_ae:
            holder = reference_decoder(tuple(cfg.ae["widths"]), cfg.ae["latent_channels"], cfg.ae["patch_size"])
            holder.load_state_dict(files["decoder"], strict=True)
            frames = [shown] + [f.numpy() for f in reference_taehv_frames(holder, latents[1:], size)]
        else:
            frames = [shown] + [ref.decode(latent, size).numpy()[None] for latent in latents[1:]]
    return latents, frames


def test_a_seeded_rollout_equals_append_frame_then_gen_frame(served: tuple[WaypointPipeline, Files]) -> None:
    """Two sessions batched over twelve chunks, one from the default picture, one from a client's: chunk 0 is the
    picture (its latent the encoder's), every later chunk the reference's frame after the seed."""
    pipeline, files = served
    cfg = pipeline.cfg
    assert pipeline.model_card()["start_images"] == ["default"]
    starts = choices(cfg)
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET, max_batch_sessions=2)
    latents: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    frames: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    for c in range(CHUNKS):
        results = runner.execute([tick(s, c, start) for s, start in starts.items()])
        for session, result in zip(starts, results, strict=True):
            assert isinstance(result, ChunkResult)
            frames[session].append(result.frames)
            latents[session].append(pipeline.last_latents[session].clone())
    assert runner.stats().batched_forwards_total == CHUNKS
    for session, start in starts.items():
        want_latents, want_frames = reference_rollout(cfg, files, pixels_of(cfg, start), session)
        for c in range(CHUNKS):
            torch.testing.assert_close(latents[session][c], want_latents[c], rtol=1e-4, atol=1e-4,
                                       msg=f"session {session} chunk {c}")
            assert frames[session][c].shape == want_frames[c].shape
            assert np.abs(frames[session][c].astype(int) - want_frames[c].astype(int)).max() <= 1, (session, c)
        assert np.array_equal(frames[session][0], want_frames[0])  # the picture itself
    # negative controls on the first generated frame (the seed leaves the 4-frame window by chunk 4): the other
    # picture, the seed appended with controls, or no seed at all give other frames
    other, other_frames = reference_rollout(cfg, files, pixels_of(cfg, starts["b"]), "a")
    with_controls, _ = reference_rollout(cfg, files, pixels_of(cfg, None), "a", seed_controls=True)
    for wrong in (other, with_controls):
        assert not torch.allclose(wrong[1], latents["a"][1], atol=1e-3)
    assert np.abs(other_frames[1].astype(int) - frames["a"][1].astype(int)).max() > 1
    unseeded = ReferenceWaypoint(cfg, files["model"], {})
    generator = torch.Generator().manual_seed(SEEDS["a"])
    with torch.inference_mode():
        noise_only = [unseeded.gen_frame(torch.randn(cfg.latent_shape, generator=generator),
                                         control_vector(controls_for("a", c), cfg)) for c in range(1, CHUNKS)]
    assert not torch.allclose(noise_only[0], latents["a"][1], atol=1e-3)
    for session in starts:
        runner.close_session(session)
    assert pipeline.session_ids() == [] and runner.pool.num_free == runner.pool.num_blocks


def test_a_seeded_session_parks_rewinds_resets_and_moves_bit_identically(
    served: tuple[WaypointPipeline, Files], tmp_path: Path
) -> None:
    """The seed's K/V is history like any frame's: parked, rewound to the boundary after the seed or later, the
    session goes on as straight; a reset (whose ticks no longer name the picture) starts again from the picture;
    moved to another pipeline it goes on, and a reset there starts from the same client picture."""
    pipeline, _ = served
    start = choices(pipeline.cfg)["b"]
    assert start is not None

    def rollout(park_at: int | None = None, rewind_at: int | None = None) -> list[np.ndarray]:
        runner = ARRunner(pipeline, kv_budget_bytes=BUDGET, rewind=RewindSchedule.last(8),
                          parking=ParkingPolicy(64 << 20))
        frames = []
        for c in range(8):
            if c == park_at:
                assert runner.park_session("b") and not runner.sessions.in_pool("b")
            if c == rewind_at:  # a detour of two chunks with other controls, then back to boundary c
                for detour in range(2):
                    runner.execute_tick(tick("b", c + detour, None, controls={"buttons": [70], "mouse": [3.0, 3.0]}))
                result = runner.execute_tick(tick("b", c, None, rewind_to=c))
            else:
                result = runner.execute_tick(tick("b", c, start if c == 0 else None))
            assert isinstance(result, ChunkResult)
            frames.append(result.frames)
        runner.close_session("b")
        assert runner.pool.num_free == runner.pool.num_blocks
        return frames

    straight = rollout()
    assert start.pixels is not None and np.array_equal(straight[0][0], start.pixels)
    for variant in (rollout(park_at=3), rollout(rewind_at=1), rollout(rewind_at=5)):
        for c, (want, got) in enumerate(zip(straight, variant, strict=True)):
            assert np.array_equal(want, got), c

    here = ARRunner(pipeline, kv_budget_bytes=BUDGET)
    for c in range(3):
        here.execute_tick(tick("b", c, start))
    again = [here.execute_tick(tick("b", c, None, reset=c == 0)).frames for c in range(3)]
    assert all(np.array_equal(a, b) for a, b in zip(again, straight[:3], strict=True))
    here.execute_tick(tick("b", 3, None))
    snapshot = parse_snapshot(snapshot_bytes(export_session(here, "b")))
    here.close_session("b")
    config = "tiny-1.5" if pipeline.cfg.taehv_ae else "tiny"
    files = tmp_path / "peer"
    (write_waypoint_1_5 if pipeline.cfg.taehv_ae else write_waypoint_1)(files, get_config(config))
    peer = load_waypoint(config=config, weights_path=files)
    assert peer.transfer_fingerprint() == pipeline.transfer_fingerprint()
    there = ARRunner(peer, kv_budget_bytes=BUDGET)
    import_session(there, "b", snapshot)
    moved = [there.execute_tick(tick("b", c, None)).frames for c in range(4, 8)]
    assert all(np.array_equal(a, b) for a, b in zip(moved, straight[4:], strict=True))
    after_move = there.execute_tick(tick("b", 0, None, reset=True)).frames  # the picture travelled with the session
    assert np.array_equal(after_move, straight[0])
    there.close_session("b")
    assert there.pool.num_free == there.pool.num_blocks


def test_named_pictures_and_a_bad_name(served: tuple[WaypointPipeline, Files], tmp_path: Path) -> None:
    """An ``images`` directory's pictures are offered by name after the default, cut to the frame; a client's
    pixels are encoded once (an LRU by digest); a name not offered fails that session only."""
    from PIL import Image

    pipeline, _ = served
    cfg = pipeline.cfg
    config = "tiny-1.5" if cfg.taehv_ae else "tiny"
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(picture(cfg.image_height, cfg.image_width, 5)).save(folder / "meadow.png")
    (folder / "notes.txt").write_text("not an image")
    root = tmp_path / "files"
    (write_waypoint_1_5 if cfg.taehv_ae else write_waypoint_1)(root, get_config(config))
    offering = load_waypoint(config=config, weights_path=root, images=str(folder))
    assert offering.model_card()["start_images"] == ["default", "meadow"]
    runner = ARRunner(offering, kv_budget_bytes=BUDGET, max_batch_sessions=2)
    free = runner.pool.num_free
    results = runner.execute([
        TickRequest("ok", 0, {}, start_image=StartImage("name:meadow", name="meadow")),
        TickRequest("bad", 0, {}, start_image=StartImage("name:moon", name="moon")),
    ])
    assert isinstance(results[0], ChunkResult)
    assert np.array_equal(results[0].frames[0], picture(cfg.image_height, cfg.image_width, 5))
    assert isinstance(results[1], TickFailure) and "unknown start image 'moon'" in str(results[1].error)
    runner.close_session("ok")
    assert runner.pool.num_free == free and offering.session_ids() == []

    seeds = pipeline.seeds
    assert seeds is not None
    own = StartImage("sha-own", pixels=picture(cfg.image_height, cfg.image_width, 7))
    assert seeds.resolve(own) is seeds.resolve(own)  # encoded once
    larger = seeds.resolve(StartImage("sha-larger", pixels=picture(2 * cfg.image_height, 3 * cfg.image_width, 8)))
    assert larger.frames.shape == (cfg.temporal_compression, cfg.image_height, cfg.image_width, 3)  # fitted
    with pytest.raises(ValueError, match=r"uint8 \[H, W, 3\]"):
        seeds.resolve(StartImage("sha-grey", pixels=np.zeros((4, 4), np.uint8)))
    for n in range(3):  # the LRU holds image_cache=2 clients' pictures
        seeds.resolve(StartImage(f"other-{n}", pixels=picture(cfg.image_height, cfg.image_width, 10 + n)))
    assert seeds.cached_digests() == ["other-1", "other-2"]


def test_the_encoders_files_are_read_and_checked(tmp_path: Path) -> None:
    """A missing or mismatched encoder file is refused naming the file and the keys; ``from_noise`` reads none and
    offers no start image."""
    cfg = get_config("tiny")
    files = write_waypoint_1(tmp_path, cfg)
    encoder = dict(files["encoder"])
    encoder.pop("blocks.1.down.proj.parametrizations.weight.original1")
    encoder["extra.weight"] = torch.zeros(1)
    save_file(encoder, str(tmp_path / "ae" / "encoder.safetensors"))
    with pytest.raises(WaypointWeightsError, match=r"encoder\.safetensors: missing keys blocks\.1\.down\.proj.*extra"):
        load_waypoint(weights_path=tmp_path)
    (tmp_path / "ae" / "encoder.safetensors").unlink()
    with pytest.raises(WaypointWeightsError, match=r"encoder\.safetensors: no such file"):
        load_waypoint(weights_path=tmp_path)
    noise = load_waypoint(weights_path=tmp_path, from_noise=True)
    assert noise.encoder is None and "start_images" not in noise.model_card()
    (tmp_path / "ae" / "encoder_conf.yml").unlink()
    with pytest.raises(WaypointWeightsError, match=r"encoder_conf\.yml"):
        load_waypoint(weights_path=tmp_path)

    cfg = get_config("tiny-1.5")
    files = write_waypoint_1_5(tmp_path / "1.5", cfg)
    taehv = {**files["decoder"], **files["encoder"]}
    taehv.pop("encoder.9.conv.2.weight")
    torch.save(taehv, tmp_path / "1.5" / "ae" / "taehv1_5.pth")
    with pytest.raises(WaypointWeightsError, match=r"taehv1_5\.pth: missing keys encoder\.9\.conv\.2\.weight"):
        load_waypoint(config="tiny-1.5", weights_path=tmp_path / "1.5")
    torch.save(files["decoder"], tmp_path / "1.5" / "ae" / "taehv1_5.pth")
    with pytest.raises(WaypointWeightsError, match=r"taehv1_5\.pth: not a TAEHV encoder, missing keys encoder\.0"):
        load_waypoint(config="tiny-1.5", weights_path=tmp_path / "1.5")
    assert load_waypoint(config="tiny-1.5", weights_path=tmp_path / "1.5", from_noise=True).seeds is None

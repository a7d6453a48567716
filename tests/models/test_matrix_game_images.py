"""matrix-game-2 start images: the reference's preprocessing, the conditioning stream, and a start image per session."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from arstream.models.matrix_game.config import get_config
from arstream.models.matrix_game.images import ConditionStream, crop_box, default_image, prepare_image
from arstream.models.matrix_game.pipeline import MatrixGamePipeline, load_matrix_game
from arstream.models.wan.vae import StreamingVAE, build_vae
from arstream.runner.runner import ARRunner
from arstream.runner.types import ChunkResult, StartImage, TickFailure, TickRequest
from matrix_game_reference import whole_rollout_condition

BUDGET = 64 << 20
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


def noise_image(height: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.random((height, width, 3)) * 255).astype(np.uint8)


# ---- preprocessing -------------------------------------------------------------------------------


def reference_transform(pixels: np.ndarray, th: int, tw: int) -> torch.Tensor:
    """Matrix-Game's ``_resizecrop`` then ``v2.Resize((th, tw), antialias=True)`` on the PIL image (PIL's
    bilinear), ``ToTensor`` and ``Normalize(0.5, 0.5)``, transcribed step by step (float crop box and all)."""
    from PIL import Image

    image = Image.fromarray(pixels)
    w, h = image.size
    if h / w > th / tw:
        new_w = int(w)
        new_h = int(new_w * th / tw)
    else:
        new_h = int(h)
        new_w = int(new_h * tw / th)
    image = image.crop(((w - new_w) / 2, (h - new_h) / 2, (w + new_w) / 2, (h + new_h) / 2))
    image = image.resize((tw, th), Image.Resampling.BILINEAR)
    return (torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255 - 0.5) / 0.5


@pytest.mark.parametrize("size", [(480, 640), (720, 1280), (1000, 333), (353, 641), (37, 101)])
def test_start_images_are_cropped_and_resized_as_the_reference_does(size: tuple[int, int]) -> None:
    cfg = get_config("1.3b")
    pixels = noise_image(*size, seed=sum(size))
    got = prepare_image(pixels, cfg)
    assert got.shape == (3, 352, 640)
    torch.testing.assert_close(got, reference_transform(pixels, 352, 640), rtol=0, atol=1e-6)


def test_the_crop_keeps_the_models_aspect_and_the_resize_is_antialiased_bilinear() -> None:
    cfg = get_config("1.3b")
    assert crop_box(1920, 800, cfg) == (233, 0, 1687, 800)  # wider than 640:352: the sides go
    assert crop_box(1280, 720, cfg) == (0, 8, 1280, 712)  # 16:9 is a little taller: top and bottom go
    assert crop_box(640, 640, cfg) == (0, 144, 640, 496)
    pixels = noise_image(704, 1280, seed=3)  # exactly twice the model's size: no crop
    got = prepare_image(pixels, cfg)
    as_float = torch.from_numpy(pixels).permute(2, 0, 1)[None].float()
    # torch's own antialiased bilinear (an independent implementation of the same filter), within a level
    antialiased = F.interpolate(as_float, size=(352, 640), mode="bilinear", antialias=True, align_corners=False)[0]
    assert (got - (antialiased / 127.5 - 1)).abs().max() <= 1.5 / 127.5
    # without the antialias (or bicubic, as before) the noise image comes out clearly different
    plain = F.interpolate(as_float, size=(352, 640), mode="bilinear", align_corners=False)[0]
    assert (got - (plain / 127.5 - 1)).abs().max() > 0.2


def test_a_bad_pixel_array_is_refused() -> None:
    cfg = get_config("tiny")
    with pytest.raises(ValueError, match=r"uint8 \[H, W, 3\]"):
        prepare_image(np.zeros((4, 4), np.uint8), cfg)
    with pytest.raises(ValueError, match=r"uint8 \[H, W, 3\]"):
        prepare_image(np.zeros((4, 4, 3), np.float32), cfg)


# ---- the conditioning stream ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def vae() -> StreamingVAE:
    torch.manual_seed(0)
    return StreamingVAE(build_vae(get_config("tiny")))


def test_the_stream_equals_encoding_the_whole_rollout_at_once(vae: StreamingVAE) -> None:
    """30 latent frames (past the 8 encoded before and past the fixed point), read a chunk at a time."""
    image = default_image(get_config("tiny"))
    stream = ConditionStream(vae, image, dtype=torch.float32)
    whole = whole_rollout_condition(vae, image, 30)
    chunks = torch.cat([stream.condition(start, 3) for start in range(0, 30, 3)], dim=1)
    torch.testing.assert_close(chunks, whole, rtol=0, atol=1e-5)
    # the random VAE's conditioning keeps changing well past frame 8: reusing the 8th (as before) was wrong
    assert (whole[4:, 12] - whole[4:, 7]).abs().max() > 0.05


def test_the_stream_stops_encoding_at_the_fixed_point_and_later_frames_repeat_exactly(vae: StreamingVAE) -> None:
    image = default_image(get_config("tiny"))
    stream = ConditionStream(vae, image, dtype=torch.float32)
    stream.condition(0, 60)
    assert stream.fixed_at is not None and not stream.encoding
    assert stream.frames == stream.fixed_at + 1 < 60  # it stopped encoding there
    # The rule's premise, checked by encoding on past it: the same cache gives the same step, bitwise.
    latent, cache = vae.encode_step(image[None, :, None], None)
    black = torch.zeros(1, 3, 4, *image.shape[1:])
    latents = [latent]
    for _ in range(stream.fixed_at + 10):
        latent, cache = vae.encode_step(black, cache)
        latents.append(latent)
    last = stream.condition(stream.fixed_at, 1)[4:, 0]
    assert torch.equal(latents[stream.fixed_at][:, 0], last)
    assert all(torch.equal(latents[k][:, 0], last) for k in range(stream.fixed_at, len(latents)))
    assert not torch.equal(latents[stream.fixed_at - 2][:, 0], last)  # not constant from the start


def test_a_stream_that_has_not_settled_stops_at_its_bound_and_says_so(
    vae: StreamingVAE, caplog: pytest.LogCaptureFixture
) -> None:
    image = default_image(get_config("tiny"))
    stream = ConditionStream(vae, image, dtype=torch.float32, max_frames=8)
    assert stream.encoding and stream.nbytes() > 0
    cond = stream.condition(9, 3)
    assert stream.frames == 8 and not stream.encoding and stream.fixed_at is None
    assert "did not settle in 8 latent frames" in caplog.text
    for k in range(3):
        assert torch.equal(cond[4:, k], stream.condition(7, 1)[4:, 0])
    assert cond[:4].abs().sum() == 0  # the mask marks frame 0 only
    assert torch.equal(stream.condition(0, 1)[:4], torch.ones(4, 1, *cond.shape[2:]))


def test_the_old_eight_frame_conditioning_would_not_match_the_reference() -> None:
    """Negative control for the equivalence test: the conditioning bounded at 8 frames (the old behaviour)
    gives other latents than the whole-rollout reference once the rollout passes frame 8."""
    from matrix_game_reference import dense_rollout
    from test_matrix_game_equivalence import build, controls_for, tick

    pipeline = build(get_config("tiny"))
    pipeline.condition_frames = 8
    pipeline.images = type(pipeline.images)(
        {"default": default_image(pipeline.cfg)}, pipeline._encode_image, pipeline.cfg
    )
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET)
    latents = []
    for c in range(4):
        runner.execute_tick(tick("a", c, 1))
        latents.append(pipeline.last_latents["a"].clone())
    reference = dense_rollout(pipeline, [controls_for("a", c) for c in range(4)], 1)
    torch.testing.assert_close(latents[1], reference[1], rtol=1e-4, atol=1e-4)  # frames 3-5: inside the 8
    assert not torch.allclose(latents[3], reference[3], atol=1e-3)  # frames 9-11: reused the 8th


# ---- a start image per session -------------------------------------------------------------------


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    Image.fromarray(noise_image(60, 90, seed=1)).save(folder / "forest.png")
    Image.fromarray(noise_image(90, 60, seed=2)).save(folder / "city.png")
    (folder / "notes.txt").write_text("not an image")
    return folder


@pytest.fixture(scope="module")
def pipeline(image_dir: Path) -> MatrixGamePipeline:
    return load_matrix_game("cpu", config="tiny", random_init=True, images=str(image_dir), image_cache=2)


def rollout(pipeline: MatrixGamePipeline, session: str, start: StartImage | None, chunks: int = 2) -> list[np.ndarray]:
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET)
    frames = []
    for c in range(chunks):
        result = runner.execute_tick(TickRequest(session, c, {"keys": ["w"]}, seed=5, start_image=start))
        frames.append(result.frames)
    runner.close_session(session)
    return frames


def test_the_card_lists_the_offered_images_default_first(pipeline: MatrixGamePipeline) -> None:
    assert pipeline.model_card()["start_images"] == ["default", "city", "forest"]


def test_a_named_image_conditions_the_session(pipeline: MatrixGamePipeline, image_dir: Path) -> None:
    forest = rollout(pipeline, "f", StartImage("d-forest", name="forest"))
    default = rollout(pipeline, "d", None)
    assert np.abs(forest[0].astype(int) - default[0].astype(int)).max() > 10
    # the same rollout as a server whose default image is that file (CLIP context and conditioning alike)
    alone = load_matrix_game("cpu", config="tiny", random_init=True, image=str(image_dir / "forest.png"))
    for got, want in zip(forest, rollout(alone, "f", None), strict=True):
        assert np.array_equal(got, want)


def test_a_clients_own_pixels_are_cropped_resized_and_cached_by_digest(
    pipeline: MatrixGamePipeline, image_dir: Path
) -> None:
    from PIL import Image

    pixels = np.asarray(Image.open(image_dir / "city.png").convert("RGB"))
    own = rollout(pipeline, "p", StartImage("sha-city", pixels=pixels))
    named = rollout(pipeline, "n", StartImage("d-city", name="city"))
    for got, want in zip(own, named, strict=True):
        assert np.array_equal(got, want)
    assert "sha-city" in pipeline.images.cached_digests()
    encodings = pipeline.images.resolve(StartImage("sha-city", pixels=pixels))
    assert pipeline.images.resolve(StartImage("sha-city", pixels=pixels)) is encodings  # encoded once
    for n in range(3):  # the LRU holds image_cache=2 clients' images
        pipeline.images.resolve(StartImage(f"other-{n}", pixels=noise_image(10, 20, seed=n)))
    assert pipeline.images.cached_digests() == ["other-1", "other-2"]


def test_rows_with_different_images_batch_and_get_their_frames_alone(pipeline: MatrixGamePipeline) -> None:
    choices = {"a": None, "b": StartImage("d-forest", name="forest"), "c": StartImage("x", pixels=noise_image(50, 50, 9))}
    alone = {s: rollout(pipeline, s, start, chunks=3) for s, start in choices.items()}
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET, max_batch_sessions=3)
    for c in range(3):
        results = runner.execute(
            [TickRequest(s, c, {"keys": ["w"]}, seed=5, start_image=start) for s, start in choices.items()]
        )
        for s, result in zip(choices, results):
            assert isinstance(result, ChunkResult)
            assert np.abs(result.frames.astype(int) - alone[s][c].astype(int)).max() <= 1
    assert runner.stats().batched_forwards_total == 3
    for s in choices:
        runner.close_session(s)


def test_a_reset_session_keeps_its_image(pipeline: MatrixGamePipeline) -> None:
    forest = StartImage("d-forest", name="forest")
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET)
    first = runner.execute_tick(TickRequest("r", 0, {"keys": ["w"]}, seed=5, start_image=forest)).frames
    runner.execute_tick(TickRequest("r", 1, {"keys": ["w"]}, seed=5, start_image=forest))
    # a new rollout whose ticks no longer name the image: the session's choice stands
    again = runner.execute_tick(TickRequest("r", 2, {"keys": ["w"]}, seed=5, reset=True)).frames
    assert np.array_equal(first, again)
    runner.close_session("r")


def test_an_unknown_name_fails_that_session_only(pipeline: MatrixGamePipeline) -> None:
    runner = ARRunner(pipeline, kv_budget_bytes=BUDGET, max_batch_sessions=2)
    free = runner.pool.num_free
    results = runner.execute(
        [
            TickRequest("ok", 0, {}, start_image=StartImage("d-city", name="city")),
            TickRequest("bad", 0, {}, start_image=StartImage("d-moon", name="moon")),
        ]
    )
    assert isinstance(results[0], ChunkResult)
    assert isinstance(results[1], TickFailure) and "unknown start image 'moon'" in str(results[1].error)
    assert "bad" not in pipeline.session_ids()
    runner.close_session("ok")
    assert runner.pool.num_free == free

"""tiny-world's frame decoder: the cell shift, frame-by-frame decoding, the pipeline's state, its trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from arstream.programs.tiny_world import train_decoder
from arstream.programs.tiny_world.evaluate import make_runner
from arstream.models.tiny_world.decoder import (
    NUM_CLASSES,
    align_previous,
    decode_chunk,
    nearest_class,
    palette_canvas,
    view_prior_logits,
)
from arstream.models.tiny_world.model import TinyWorldConfig, TinyWorldDiT
from arstream.models.tiny_world.pipeline import load_tiny_world
from arstream.models.tiny_world.weights import save_weights
from arstream.models.tiny_world.world import CLASS_SHARES
from arstream.runner.types import ChunkResult, TickRequest

SMALL = {"d_model": 32, "num_layers": 1, "num_heads": 2}
SIZE = 72
CELL = 8


def class_canvas(seed: int) -> torch.Tensor:
    """A random palette canvas ``[SIZE, SIZE, 3]``."""
    classes = torch.randint(NUM_CLASSES, (SIZE, SIZE), generator=torch.Generator().manual_seed(seed))
    return palette_canvas()[classes]


def test_align_previous_shifts_by_whole_cells_and_masks_what_enters() -> None:
    previous = class_canvas(0)[None]
    # the camera's canvas moved one cell right and one cell down: new pixel (y, x) is previous (y + 8, x + 8)
    shifted, mask = align_previous(previous, torch.tensor([[10, 20]]), torch.tensor([[11, 21]]), CELL)
    assert torch.equal(shifted[0, : SIZE - CELL, : SIZE - CELL], previous[0, CELL:, CELL:])
    assert mask[0, : SIZE - CELL, : SIZE - CELL].all()
    assert not mask[0, SIZE - CELL :].any() and not mask[0, :, SIZE - CELL :].any()
    assert not shifted[0, SIZE - CELL :].any()
    # the same cell: everything carries over; a jump past the canvas: nothing does
    same, same_mask = align_previous(previous, torch.tensor([[3, 3]]), torch.tensor([[3, 3]]), CELL)
    assert torch.equal(same, previous) and same_mask.all()
    _, far_mask = align_previous(previous, torch.tensor([[0, 0]]), torch.tensor([[9, 0]]), CELL)
    assert not far_mask.any()


class CopyingFakeDecoder(torch.nn.Module):
    """A fake decoder for the decoding loop: the previous frame's class where it exists, else the estimate's."""

    def forward(self, estimate: torch.Tensor, previous: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        classes = torch.where(mask[..., 0].bool(), nearest_class(previous), nearest_class(estimate))
        return torch.nn.functional.one_hot(classes, NUM_CLASSES).float()


def test_decode_chunk_decodes_frames_in_order_into_palette_colours() -> None:
    first, second = class_canvas(1), class_canvas(2)
    # a muddy estimate (halfway to grey) still decodes to palette colours
    estimates = torch.stack([first * 0.6, second * 0.6])[None]
    cells = torch.tensor([[[0, 0], [1, 0]]])
    decoded = decode_chunk(CopyingFakeDecoder(), estimates, cells, None, None, CELL)
    palette = palette_canvas()
    assert ((decoded[..., None, :] - palette).abs().sum(-1).min(-1).values == 0).all()
    # frame 0 had no previous frame: it is the estimate, snapped
    assert torch.equal(nearest_class(decoded[0, 0]), nearest_class(first))
    # frame 1 moved one cell right: it keeps frame 0's picture where frame 0 was, shifted, and decodes the rest
    assert torch.equal(decoded[0, 1, :, : SIZE - CELL], decoded[0, 0, :, CELL:])
    assert torch.equal(nearest_class(decoded[0, 1, :, SIZE - CELL :]), nearest_class(second[:, SIZE - CELL :]))
    # a given previous frame (one cell to the right of this chunk's first canvas) is used for the first frame
    carried = decode_chunk(CopyingFakeDecoder(), estimates, cells, decoded[:, 1], torch.tensor([[1, 0]]), CELL)
    assert torch.equal(carried[0, 0, :, CELL:], decoded[0, 1, :, : SIZE - CELL])


def test_unseen_window_smooths_new_content_and_keeps_what_was_seen() -> None:
    """Where the previous frame does not reach, a pixel takes its neighbourhood's most likely class."""
    canvas = torch.zeros(1, 1, SIZE, SIZE, 3)
    speckled = canvas.clone()  # a pixel whose estimate says 'rock' inside an area that says 'water'
    speckled[...] = palette_canvas()[0]
    speckled[0, 0, 20, SIZE - 4] = palette_canvas()[4]  # in the cell column entering on the right
    speckled[0, 0, 20, 4] = palette_canvas()[4]  # in the part the previous frame covers
    # the previous frame: water everywhere except that one seen rock pixel (one cell to the left of this canvas)
    previous = torch.zeros(1, SIZE, SIZE, 3)
    previous[...] = palette_canvas()[0]
    previous[0, 20, 4 + CELL] = palette_canvas()[4]
    cells = torch.tensor([[[1, 0]]])
    decode = lambda window: decode_chunk(  # noqa: E731
        CopyingFakeDecoder(), speckled, cells, previous, torch.tensor([[0, 0]]), CELL, unseen_window=window
    )
    plain, smoothed = nearest_class(decode(0)[0, 0]), nearest_class(decode(3)[0, 0])
    assert plain[20, SIZE - 4] == 4 and smoothed[20, SIZE - 4] == 0  # new content: the lone pixel joins its area
    assert plain[20, 4] == 4 and smoothed[20, 4] == 4  # seen content is kept as it was
    assert torch.equal(plain[:, : SIZE - CELL], smoothed[:, : SIZE - CELL])


def test_view_prior_draws_new_content_toward_the_colours_missing_from_the_view() -> None:
    water_view = torch.zeros(2, SIZE, SIZE, 3)
    water_view[...] = palette_canvas()[0]
    mask = torch.ones(2, SIZE, SIZE, 1)
    mask[1] = 0  # the second row has seen nothing yet
    offsets = view_prior_logits(water_view, mask, 1.0)[:, 0, 0]
    # a view full of water: less water where the view grows, more of every other colour
    assert offsets[0, 0] < 0 and (offsets[0, 1:] > 0).all()
    # an empty view: the map's shares against an even split (the commonest colour, water, drawn most)
    expected = (torch.tensor(CLASS_SHARES) / (1 / NUM_CLASSES)).log()
    assert torch.allclose(offsets[1], expected)
    assert torch.allclose(view_prior_logits(water_view, mask, 2.0), 2 * view_prior_logits(water_view, mask, 1.0))


def small_weights(tmp_path: Path) -> Path:
    model = TinyWorldDiT(TinyWorldConfig(**SMALL))
    weights = tmp_path / "small" / "tiny_world.safetensors"
    save_weights(model, weights, weights.parent / "config.json")
    return weights


def train(tmp_path: Path, weights: Path, steps: int, *extra: str) -> int:
    argv = [
        "--init-from", str(weights), "--channels", "4", "--pairs", "16", "--pair-batch", "2", "--clip-chunks", "3",
        "--steps", str(steps), "--batch-size", "2", "--worlds", "1", "--threads", "1", "--log-every", "1",
        "--calibrate-rounds", "1", "--calibrate-walks", "2", "--calibrate-chunks", "2", "--out", str(tmp_path / "run"),
    ]  # fmt: skip
    return train_decoder.main(argv + list(extra))


def test_decoder_training_checkpoints_resumes_and_exports_a_model_that_serves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = small_weights(tmp_path)
    assert train(tmp_path, weights, 3, "--stop-at", "2") == 0
    first = capsys.readouterr().out
    assert "pairs 16/16" in first and "step 2/3 loss" in first and "step 3/3" not in first
    assert train(tmp_path, weights, 3, "--resume", "auto", "--unseen-window", "3") == 0
    second = capsys.readouterr().out
    assert "pairs: 16 from" in second and "checkpoint.pt at step 2" in second and "step 3/3 loss" in second
    assert "calibration round 1:" in second  # after the last step only
    assert "calibration" not in first

    run = tmp_path / "run"
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["decoder_channels"] == 4 and config["training"]["decoder"]["step"] == 3
    assert config["model"]["decoder_keep_logit"] == 3.0 and len(config["model"]["decoder_class_bias"]) == 5
    assert config["model"]["decoder_unseen_window"] == 3  # given on the command line
    assert config["model"]["decoder_view_prior"] == 1.0  # the shipped recipe's default
    pipeline = load_tiny_world("cpu", run / "tiny_world.safetensors")
    # the transformer is the one it was trained on, unchanged
    source = load_tiny_world("cpu", weights)
    for name, tensor in source.model.state_dict().items():
        assert torch.equal(pipeline.model.state_dict()[name], tensor), name

    runner = make_runner(pipeline)
    palette = torch.as_tensor(palette_canvas() * 127.5 + 127.5).round().to(torch.uint8)
    frames = []
    for tick_id, keys in enumerate([[], ["d"], ["d"], []]):
        result = runner.execute([TickRequest(session_id="s", request_id=tick_id, controls={"keys": keys})])[0]
        assert isinstance(result, ChunkResult)
        frames.append(torch.as_tensor(result.frames))
    pixels = torch.cat(frames).reshape(-1, 3)
    # every pixel is a palette colour
    assert (pixels[:, None, :] == palette).all(-1).any(-1).all()
    # per-session decoder state goes with reset and close
    assert pipeline._sessions["s"].last_canvas is not None
    runner.execute([TickRequest(session_id="s", request_id=9, controls={}, reset=True)])
    runner.close_session("s")
    assert "s" not in pipeline.session_ids()


class EstimateLeaningFakeDecoder(torch.nn.Module):
    """A fake decoder one logit surer of the estimate's class than of the previous frame's."""

    def forward(self, estimate: torch.Tensor, previous: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        one_hot = torch.nn.functional.one_hot
        return 2.0 * one_hot(nearest_class(estimate), NUM_CLASSES) + mask * one_hot(nearest_class(previous), NUM_CLASSES)


@pytest.mark.parametrize("keep_logit", [0.0, 1.5])
def test_keep_logit_keeps_what_the_viewer_has_seen_unless_the_decoder_is_surer(keep_logit: float) -> None:
    shown, wandering = class_canvas(3), class_canvas(4)
    cells = torch.tensor([[[5, 5]]])
    decoded = decode_chunk(
        EstimateLeaningFakeDecoder(), wandering[None, None], cells, shown[None], torch.tensor([[5, 5]]), CELL, keep_logit
    )
    expected = shown if keep_logit > 1 else wandering
    assert torch.equal(nearest_class(decoded[0, 0]), nearest_class(expected))


def test_class_offsets_are_fitted_without_the_window_and_prior_the_init_weights_carry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The offsets are fitted the same way whatever window and prior --init-from's config carries (they leaked in once)."""
    plain = small_weights(tmp_path)
    carrying = tmp_path / "carrying" / "tiny_world.safetensors"
    model = TinyWorldDiT(TinyWorldConfig(**SMALL, decoder_unseen_window=5, decoder_view_prior=2.0))
    model.load_state_dict(TinyWorldDiT(TinyWorldConfig(**SMALL)).state_dict())
    save_weights(model, carrying, carrying.parent / "config.json")
    carrying.write_bytes(plain.read_bytes())  # the same tensors; only the config differs
    calibrations = []
    for weights, out in ((plain, "a"), (carrying, "b")):
        assert train(tmp_path / out, weights, 2) == 0
        calibrations.append([line for line in capsys.readouterr().out.splitlines() if line.startswith("calibration")])
    assert calibrations[0] and calibrations[0] == calibrations[1]

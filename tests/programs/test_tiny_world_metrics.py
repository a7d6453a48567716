"""Picture-quality metrics on ground truth, on made-up failures, and the eval's contact sheets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from arstream.programs.tiny_world.evaluate import contact_sheet, idle_walk, truth_rollout, write_contact_sheets
from arstream.programs.tiny_world.metrics import (
    class_shares,
    class_tv,
    coherence,
    grid_peak,
    idle_change,
    palette_fraction,
    picture_quality,
    pixel_classes,
)
from arstream.models.tiny_world.world import CLASS_SHARES, PALETTE, ProceduralWorld


@pytest.fixture(scope="module")
def walk() -> np.ndarray:
    keys = [["d"]] * 40 + [["s"]] * 40 + [["a"]] * 40 + [["w"]] * 40
    return ProceduralWorld(seed=5).rollout(0, 0, keys)[0]


def mosaic(frames: int, seed: int = 0, cell: int = 8) -> np.ndarray:
    """Frames of ``cell``-px squares, each one random palette colour: the failures grid_peak and coherence see."""
    cells = np.random.default_rng(seed).integers(0, len(PALETTE), (frames, 64 // cell, 64 // cell))
    return PALETTE[cells.repeat(cell, axis=1).repeat(cell, axis=2)]


def test_pixel_classes_are_the_nearest_palette_colour() -> None:
    frame = PALETTE[None, :, :].copy()
    frame[0, 2] += np.array([20, 0, 0], dtype=np.uint8)  # a little off grass is still grass
    assert pixel_classes(frame).tolist() == [[0, 1, 2, 3, 4]]


def test_ground_truth_scores_like_the_issue_says(walk: np.ndarray) -> None:
    figures = picture_quality([walk])
    assert figures["palette_share"] == 1.0
    assert 0.88 <= figures["coherence"] < 1.0
    assert figures["grid_peak"] < 1.8
    assert figures["class_tv"] < 0.25  # one 160-frame walk sees a few features, not the map's exact shares


def test_a_mosaic_of_cells_peaks_at_one_phase(walk: np.ndarray) -> None:
    assert grid_peak(mosaic(16)) > 3.0 > grid_peak(walk)


def test_speckle_is_incoherent(walk: np.ndarray) -> None:
    assert coherence(mosaic(16, cell=2)) < 0.7 < 0.88 < coherence(walk)


def test_off_palette_pixels_lower_the_palette_share() -> None:
    grey = np.full((2, 64, 64, 3), 128, np.uint8)  # 8+ units of RGB from rock in each channel, but within 40
    washed = np.full((2, 64, 64, 3), (70, 140, 100), np.uint8)  # between grass, forest and water
    assert palette_fraction(grey) == 1.0
    assert palette_fraction(washed) == 0.0


def test_class_tv_is_zero_for_the_map_shares_and_large_without_water() -> None:
    counts = (np.array(CLASS_SHARES) * 4096).round().astype(int)
    frame = PALETTE[np.repeat(np.arange(len(PALETTE)), counts)[:4096]].reshape(1, 64, 64, 3)
    assert class_tv(frame) < 0.01
    no_water = frame.copy()
    no_water[pixel_classes(no_water) == 0] = PALETTE[2]
    assert class_shares(no_water)[0] == 0.0
    assert class_tv(no_water) == pytest.approx(CLASS_SHARES[0], abs=0.01)


def test_idle_change_counts_pixels_that_change_class_while_still() -> None:
    keys, release = idle_walk(frames_per_chunk=2)
    truth = truth_rollout(keys, seed=3, frames_per_chunk=2)
    assert idle_change(truth, release) == 0.0
    reshaped = truth.copy()
    reshaped[release + 8 + 64, :16] = PALETTE[4]  # a quarter of the frame turns to rock (some already was)
    changed = idle_change(reshaped, release)
    assert 0.0 < changed <= 0.25
    with pytest.raises(ValueError, match="needs"):
        idle_change(truth[: release + 8 + 64], release)


def test_picture_quality_over_rollouts_equals_the_figures_on_all_frames(walk: np.ndarray) -> None:
    rollouts = [walk[:70], mosaic(30, seed=1), walk[70:]]
    stacked = np.concatenate(rollouts)
    figures = picture_quality(rollouts)
    assert figures["palette_share"] == pytest.approx(palette_fraction(stacked))
    assert figures["coherence"] == pytest.approx(coherence(stacked))
    assert figures["grid_peak"] == pytest.approx(grid_peak(stacked))
    assert figures["class_tv"] == pytest.approx(class_tv(stacked))


def test_contact_sheet_puts_ground_truth_above_generated(walk: np.ndarray) -> None:
    generated = mosaic(len(walk))
    sheet = np.asarray(contact_sheet(walk, generated, [0, 50, 100], scale=2))
    # layout: 92 px of labels, 14 px of header, 128 px frames 4 px apart
    assert sheet.shape == (14 + 2 * 132, 92 + 3 * 132, 3)
    assert (sheet[14 : 14 + 128, 92 + 132 : 92 + 132 + 128:2][::2] == walk[50]).all()
    assert (sheet[14 + 132 : 14 + 132 + 128, 92 : 92 + 128:2][::2] == generated[0]).all()


def test_write_contact_sheets_writes_one_png_per_kind_of_rollout(tmp_path: Path) -> None:
    keys, _release = idle_walk(frames_per_chunk=2)
    truth = truth_rollout(keys, seed=1, frames_per_chunk=2)
    record = [("idle", 1, keys, truth), ("idle", 2, keys, truth), ("hold d", 1, [["d"]] * 8, truth[:16])]
    paths = write_contact_sheets(tmp_path / "sheets", record, frames_per_chunk=2)
    assert [p.name for p in paths] == ["contact_idle_seed1.png", "contact_hold_d_seed1.png"]
    with Image.open(paths[0]) as image:
        assert image.size[0] > 8 * 128  # the idle sheet adds the release and idle-change frames

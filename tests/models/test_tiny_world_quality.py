"""Short versions of the shipped model's quality checks, through the real runner.

``arstream eval tiny-world`` runs the long versions (more frames, more seeds,
a 320-frame square walk) whose figures are in docs/models.md.
"""

from __future__ import annotations

import pytest
import torch

from arstream.programs.tiny_world.evaluate import (
    MAX_TV,
    RESPONSIVE_SHARE,
    drift_checks,
    hold,
    idle_walk,
    make_runner,
    rollout,
    square_walk,
)
from arstream.programs.tiny_world.metrics import MIN_SHIFT_PX, drift_report, idle_change, picture_quality, responsiveness
from arstream.models.tiny_world.pipeline import load_tiny_world
from arstream.runner.runner import ARRunner

HOLD_FRAMES = 24
SQUARE_FRAMES = 96


@pytest.fixture(scope="module")
def runner() -> ARRunner:
    return make_runner(load_tiny_world(torch.device("cpu")), sessions=1)


@pytest.mark.parametrize("key", ["w", "a", "s", "d"])
def test_held_key_moves_the_content_the_right_way(runner: ARRunner, key: str) -> None:
    frames = rollout(runner, hold([key], HOLD_FRAMES, runner.spec.frames_per_chunk), seed=21)
    result = responsiveness(frames, [key])
    assert result["fraction_right_way"] >= RESPONSIVE_SHARE, result


def test_no_key_holds_still(runner: ARRunner) -> None:
    frames = rollout(runner, hold([], HOLD_FRAMES, runner.spec.frames_per_chunk), seed=22)
    result = responsiveness(frames, [])
    assert result["mean_shift"] < MIN_SHIFT_PX, result


def test_square_walk_does_not_drift(runner: ARRunner) -> None:
    frames = rollout(runner, square_walk(SQUARE_FRAMES, runner.spec.frames_per_chunk), seed=23)
    report = drift_report(frames)
    assert report["tv_first_last_quarter"] <= MAX_TV, report
    assert all(drift_checks(report).values()), (drift_checks(report), report)


# Lenient bounds on the picture-quality figures, mostly looser than the eval's targets (the
# shipped weights' figures over the eval's rollouts are in docs/models.md; on this one rollout 1.00,
# 0.93, 2.5, 0.09, 0.000; the decoder without its unseen window and view prior: 1.00, 0.85, 1.95,
# 0.08, 0.001; v1 without the frame decoder: 0.81, 0.85, 3.3, 0.32, 0.09): they leave room for seed
# noise and catch a collapse: noise (palette share ~0.1, coherence ~0.3), one flat colour (class TV
# >= 0.7), a mosaic of cells or speckle, off-palette colours, a world that keeps reshaping while the
# camera stands still.
LENIENT_QUALITY = {"palette_share": 0.99, "coherence": 0.88, "grid_peak": 3.5, "class_tv": 0.3, "idle_change": 0.05}


def test_picture_quality_within_lenient_bounds(runner: ARRunner) -> None:
    keys, release = idle_walk(runner.spec.frames_per_chunk)
    frames = rollout(runner, keys, seed=24)
    figures = picture_quality([frames])
    figures["idle_change"] = idle_change(frames, release)
    bounds = LENIENT_QUALITY
    assert figures["palette_share"] >= bounds["palette_share"], figures
    assert figures["coherence"] >= bounds["coherence"], figures
    assert figures["grid_peak"] <= bounds["grid_peak"], figures
    assert figures["class_tv"] <= bounds["class_tv"], figures
    assert figures["idle_change"] <= bounds["idle_change"], figures

"""The procedural world renderer and the quality metrics, checked on ground truth."""

from __future__ import annotations

import numpy as np
import pytest

from arstream.programs.tiny_world.metrics import (
    color_histogram,
    drift_report,
    frame_stats,
    phase_correlation_shift,
    responsiveness,
    total_variation,
)
from arstream.models.tiny_world.world import (
    CAMERA_SPEED,
    PALETTE,
    ProceduralWorld,
    direction_index,
    keys_for_direction,
    velocity,
)


@pytest.fixture(scope="module")
def world() -> ProceduralWorld:
    return ProceduralWorld(seed=11)


def test_same_seed_same_map_and_different_seed_different_map() -> None:
    assert np.array_equal(ProceduralWorld(3).map, ProceduralWorld(3).map)
    assert not np.array_equal(ProceduralWorld(3).map, ProceduralWorld(4).map)


def test_map_uses_only_the_palette_and_every_class(world: ProceduralWorld) -> None:
    colours = np.unique(world.map.reshape(-1, 3), axis=0)
    assert sorted(map(tuple, colours)) == sorted(map(tuple, PALETTE))


def test_render_wraps_around_the_map(world: ProceduralWorld) -> None:
    assert np.array_equal(world.render(world.size - 10, 5), world.render(-10, 5 + world.size))
    corner = world.render(world.size - 1, world.size - 1)
    assert np.array_equal(corner[1, 1], world.map[0, 0])


@pytest.mark.parametrize(
    ("keys", "camera"),
    [(["d"], (1, 0)), (["a"], (-1, 0)), (["w"], (0, -1)), (["s"], (0, 1)), (["w", "d"], (1, -1)), ([], (0, 0))],
)
def test_keys_move_the_camera(keys: list[str], camera: tuple[int, int]) -> None:
    assert velocity(keys) == (camera[0] * CAMERA_SPEED, camera[1] * CAMERA_SPEED)


def test_opposite_keys_cancel() -> None:
    assert velocity(["w", "s"]) == (0, 0)
    assert velocity(["a", "d", "w"]) == (0, -CAMERA_SPEED)


def test_direction_index_round_trips() -> None:
    for index in range(9):
        assert direction_index(keys_for_direction(index)) == index
    assert direction_index([]) == 4


def test_d_moves_content_left_and_w_moves_it_down(world: ProceduralWorld) -> None:
    frames, cams = world.rollout(40, 40, [["d"], ["d"], ["w"]])
    assert cams.tolist() == [[42, 40], [44, 40], [44, 38]]
    # pixel columns slide left under d: column c of the next frame is column c + speed of the last
    assert np.array_equal(frames[1][:, :-CAMERA_SPEED], frames[0][:, CAMERA_SPEED:])
    # and rows slide down under w
    assert np.array_equal(frames[2][CAMERA_SPEED:], frames[1][:-CAMERA_SPEED])


@pytest.mark.parametrize("keys", [["w"], ["a"], ["s"], ["d"], ["s", "a"]])
def test_phase_correlation_recovers_the_content_motion(world: ProceduralWorld, keys: list[str]) -> None:
    frames, _ = world.rollout(100, 300, [keys] * 12)
    dx, dy = velocity(keys)
    for a, b in zip(frames[:-1], frames[1:]):
        mx, my = phase_correlation_shift(a, b)
        assert mx == pytest.approx(-dx, abs=0.25)
        assert my == pytest.approx(-dy, abs=0.25)
    assert responsiveness(frames, keys)["fraction_right_way"] == 1.0


def test_still_camera_measures_no_motion(world: ProceduralWorld) -> None:
    frames, _ = world.rollout(7, 9, [[]] * 6)
    assert responsiveness(frames, [])["mean_shift"] < 0.05


def test_histogram_distance_is_zero_for_same_frames_and_one_for_disjoint_colours() -> None:
    red = np.zeros((2, 8, 8, 3), np.uint8)
    red[..., 0] = 255
    blue = np.zeros((2, 8, 8, 3), np.uint8)
    blue[..., 2] = 255
    assert color_histogram(red).sum() == pytest.approx(1.0)
    assert total_variation(color_histogram(red), color_histogram(red)) == 0.0
    assert total_variation(color_histogram(red), color_histogram(blue)) == pytest.approx(1.0)


def test_ground_truth_square_walk_passes_the_drift_bar(world: ProceduralWorld) -> None:
    keys = [["d"]] * 80 + [["s"]] * 80 + [["a"]] * 80 + [["w"]] * 80
    frames, _ = world.rollout(0, 0, keys)
    report = drift_report(frames)
    assert report["tv_first_last_quarter"] <= 0.35
    assert report["last_palette_fraction"] == 1.0
    assert report["last_mean_shift"] == pytest.approx(CAMERA_SPEED, abs=0.1)


def test_frame_stats_tell_grey_and_noise_from_terrain(world: ProceduralWorld) -> None:
    terrain = frame_stats(world.rollout(0, 0, [["d"]] * 4)[0])
    grey = frame_stats(np.full((4, 64, 64, 3), 128, np.uint8))
    noise = frame_stats(np.random.default_rng(0).integers(0, 256, (4, 64, 64, 3), dtype=np.uint8))
    assert grey["contrast"] == 0.0
    assert terrain["contrast"] > 10.0
    assert noise["pixel_noise"] > 10 * terrain["pixel_noise"]
    assert noise["palette_fraction"] < 0.2 < terrain["palette_fraction"]

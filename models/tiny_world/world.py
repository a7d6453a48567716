"""The procedural top-down world tiny-world is trained on, and its ground-truth renderer.

A world is a wrapping ``size x size`` map of smooth low-frequency terrain
quantised to five colours (water, sand, grass, forest, rock), deterministic
from a seed. An observation is the ``view x view`` crop under a camera whose
top-left corner is ``(x, y)`` in map pixels. Held keys move the camera a fixed
number of pixels per frame: ``d`` right (content moves left on screen), ``a``
left, ``w`` up (content moves down), ``s`` down; opposite keys cancel.

The renderer makes the training data and is the reference the quality checks
compare generated frames against.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

KEYS = ("w", "a", "s", "d")
MAP_SIZE = 512
VIEW_SIZE = 64
CAMERA_SPEED = 2

# water, sand, grass, forest, rock: far apart in RGB so classes never blur together
PALETTE = np.array(
    [
        [38, 84, 170],
        [222, 200, 130],
        [96, 176, 70],
        [28, 96, 44],
        [136, 128, 120],
    ],
    dtype=np.uint8,
)
CLASS_NAMES = ("water", "sand", "grass", "forest", "rock")
# share of the map each class covers, in palette order
CLASS_SHARES = (0.30, 0.08, 0.27, 0.20, 0.15)
# terrain features span roughly 30-80 px: a 64 px view usually holds a boundary, and a
# 160 px walk sees enough features that its colour histogram is stable (the drift check)
TERRAIN_CUTOFF_CYCLES = 9.0


def velocity(keys: Iterable[str]) -> tuple[int, int]:
    """Camera motion ``(dx, dy)`` in pixels per frame for a set of held keys."""
    held = set(keys)
    dx = (("d" in held) - ("a" in held)) * CAMERA_SPEED
    dy = (("s" in held) - ("w" in held)) * CAMERA_SPEED
    return int(dx), int(dy)


def direction_index(keys: Iterable[str]) -> int:
    """0..8: the camera direction a key set means, ``(sign dy + 1) * 3 + (sign dx + 1)``; 4 is still."""
    dx, dy = velocity(keys)
    return (int(np.sign(dy)) + 1) * 3 + (int(np.sign(dx)) + 1)


def keys_for_direction(index: int) -> list[str]:
    """A key set for a direction index (the inverse of :func:`direction_index`)."""
    sy, sx = divmod(index, 3)
    keys = []
    if sy == 0:
        keys.append("w")
    if sy == 2:
        keys.append("s")
    if sx == 0:
        keys.append("a")
    if sx == 2:
        keys.append("d")
    return keys


def terrain_height(seed: int, size: int = MAP_SIZE) -> np.ndarray:
    """Smooth, wrapping height field in [0, 1): white noise low-passed in Fourier space."""
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal((size, size))
    freq = np.fft.fftfreq(size) * size
    radius2 = freq[:, None] ** 2 + freq[None, :] ** 2
    smooth = np.fft.ifft2(np.fft.fft2(noise) * np.exp(-radius2 / (2 * TERRAIN_CUTOFF_CYCLES**2))).real
    ranks = smooth.ravel().argsort().argsort().reshape(size, size)
    return ranks / float(size * size)


class ProceduralWorld:
    """One seeded map and its camera renderer."""

    def __init__(self, seed: int, size: int = MAP_SIZE, view: int = VIEW_SIZE) -> None:
        self.seed = seed
        self.size = size
        self.view = view
        height = terrain_height(seed, size)
        edges = np.cumsum(CLASS_SHARES)[:-1]
        self.classes = np.searchsorted(edges, height, side="right").astype(np.uint8)
        self.map = PALETTE[self.classes]
        # wrap padding lets every crop (views, and the slightly larger model canvases) be a plain slice
        self._pad = 2 * view
        self._padded = np.pad(self.map, ((0, self._pad), (0, self._pad), (0, 0)), mode="wrap")

    def render(self, x: int, y: int, size: int | None = None) -> np.ndarray:
        """uint8 ``[size, size, 3]`` crop (default: the view) whose top-left map pixel is ``(x, y)``, wrapping."""
        size = self.view if size is None else size
        if size > self._pad:
            raise ValueError(f"crop size {size} exceeds the supported {self._pad}")
        x %= self.size
        y %= self.size
        return self._padded[y : y + size, x : x + size]

    def rollout(self, x: int, y: int, keys_per_frame: Sequence[Iterable[str]]) -> tuple[np.ndarray, np.ndarray]:
        """Frames after each step of held keys, and the camera position of each frame.

        Frame ``i`` is rendered after moving by ``keys_per_frame[i]`` from frame
        ``i - 1`` (frame 0 moves from ``(x, y)``), matching how a model is
        asked for frame ``i`` with that frame's controls.
        """
        frames = np.empty((len(keys_per_frame), self.view, self.view, 3), dtype=np.uint8)
        cams = np.empty((len(keys_per_frame), 2), dtype=np.int64)
        for i, keys in enumerate(keys_per_frame):
            dx, dy = velocity(keys)
            x, y = x + dx, y + dy
            frames[i] = self.render(x, y)
            cams[i] = (x, y)
        return frames, cams

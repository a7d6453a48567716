"""Start images for Waypoint: the published engine's ``append_frame`` as a session's first chunk.

Overworld's engine always starts a world from a picture: ``reset()`` then
``append_frame(seed)`` (``world_engine`` commit
208c909824d906bf441122b7c40b9b4e1050d7c3, ``src/world_engine.py``; Overworld's
Biome does it for every session), then ``gen_frame(controls)`` for every frame
after. ``append_frame`` encodes the picture with the autoencoder's encoder and
runs the model once on that clean latent, at sigma 0, with no controls (its
``ctrl`` is left out: no button, no mouse motion, no scroll), at frame
position 0 (the first ``frame_timestamp`` after a reset), in the committing
pass that writes its K/V into the cache. It draws no noise and decodes
nothing: the picture it returns is the one it was given, and the decoder's
stream (Waypoint-1.5's TAEHV) is first primed by the first generated frame.

Here that is a rollout's first chunk (chunk 0, after a start or a ``reset``):
one committing pass of the seed's latent, whose K/V is the session's history
frame 0 like any other frame (parked, rewound and moved with the rest), and
whose frames are the start picture itself, ``temporal_compression`` times (the
published seed for Waypoint-1.5 is the picture repeated to four frames; the
engine hands it back as it was given). The tick's controls are not read for
it, as the published call takes none; the noise generator is untouched, so
chunk 1 draws the first noise, as ``gen_frame`` does after ``append_frame``.

Pictures: those the model offers (the ``image`` file and an ``images``
directory, or the built-in picture Matrix-Game offers by default), encoded at
load and kept, and clients' own (already cut to the frame by the server),
encoded on first use and kept in a small LRU by digest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..matrix_game.images import DEFAULT_NAME, image_files, read_pixels, sky_and_ground
from ..start_images import EncodedStartImages
from ...runner.types import StartImage, centre_crop_box


@dataclass(frozen=True)
class Seed:
    """One start picture as a session reads it: its clean latent and the frames its chunk shows."""

    latent: torch.Tensor  # [C, h, w], the model's device and dtype
    frames: np.ndarray  # uint8 [temporal_compression, H, W, 3]


def fit_pixels(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """A picture file's pixels cut as the server cuts a client's (the centred box of the frame's aspect), resized
    (PIL's antialiased bilinear) to the frame: uint8 ``[height, width, 3]``."""
    from PIL import Image

    image = Image.fromarray(np.ascontiguousarray(pixels))
    image = image.crop(centre_crop_box(image.width, image.height, width, height))
    return np.asarray(image.resize((width, height), Image.Resampling.BILINEAR), dtype=np.uint8)


def default_pixels(height: int, width: int) -> np.ndarray:
    """The built-in start picture (Matrix-Game's default: sky over ground) at the frame's size, uint8."""
    picture = (sky_and_ground(height, width) + 1) * 127.5
    return picture.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()


def offered_pictures(image: str | None, images: str | None, height: int, width: int) -> dict[str, np.ndarray]:
    """The default (the ``image`` file, named by its stem, or the built-in picture) first, then the directory's."""
    offered = {
        Path(image).stem if image is not None else DEFAULT_NAME:
            fit_pixels(read_pixels(image), height, width) if image is not None else default_pixels(height, width)
    }
    for name, path in (image_files(images) if images is not None else {}).items():
        if name not in offered:  # the ``image`` file may sit in the directory too: it stays the default
            offered[name] = fit_pixels(read_pixels(path), height, width)
    return offered


class SeedImages(EncodedStartImages[Seed]):
    """The pictures a model offers (encoded at load, kept) and clients' own (an LRU by digest)."""

    def __init__(
        self, offered: dict[str, np.ndarray], encode: Callable[[np.ndarray], torch.Tensor], frames_per_chunk: int,
        size: tuple[int, int], *, capacity: int = 4,
    ) -> None:
        """``size``: the frame's (height, width); pictures of another size (not cut by the server) are fitted."""
        self._encode = encode
        self.frames_per_chunk = frames_per_chunk
        self.size = size
        super().__init__(
            {name: self._seed(pixels) for name, pixels in offered.items()}, self._seed, capacity=capacity,
            model="waypoint",
        )

    def _seed(self, pixels: np.ndarray) -> Seed:
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3 or min(pixels.shape[:2]) < 1:
            raise ValueError(f"a start image must be uint8 [H, W, 3] RGB, got {pixels.dtype} {list(pixels.shape)}")
        if pixels.shape[:2] != self.size:
            pixels = fit_pixels(pixels, *self.size)
        with torch.inference_mode():
            latent = self._encode(pixels)
        frames = np.repeat(np.ascontiguousarray(pixels, dtype=np.uint8)[None], self.frames_per_chunk, axis=0)
        return Seed(latent=latent, frames=frames)

    def offered_latents(self) -> dict[str, torch.Tensor]:
        return {name: seed.latent for name, seed in self.offered().items()}


def append_seeds(model: Any, ctx: Any, latents: torch.Tensor, controls: torch.Tensor) -> None:
    """The published ``append_frame`` less the encode: one committing pass of clean latents at sigma 0."""
    ctx.begin_pass(commit=True)
    model(latents, latents.new_zeros(latents.shape[0]), controls, ctx)
    ctx.end_pass()


def choice_json(choice: StartImage | None) -> dict[str, Any] | None:
    return None if choice is None else {"digest": choice.digest, "name": choice.name}


def choice_from(values: dict[str, Any] | None, pixels: torch.Tensor | None) -> StartImage | None:
    if values is None:
        return None
    return StartImage(digest=values["digest"], name=values["name"], pixels=None if pixels is None else pixels.numpy())

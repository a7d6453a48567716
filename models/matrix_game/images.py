"""Start images: preprocessing as Matrix-Game does it, the image conditioning stream, and a cache by digest.

A session's start image conditions every chunk twice: its CLIP tokens are
the DiT's cross-attention context, and the VAE encoding of "the image
followed by black frames" gives each latent frame ``k`` its own conditioning
latent ``k`` (Matrix-Game encodes that whole video up front: 150 latent frames
in ``inference.py``, 360 in ``inference_streaming.py``). Here the latents of one
image are a lazily extended :class:`ConditionStream`, shared by every session
with that image: it encodes one more latent frame (four black frames through
the causal encoder's feature cache) when a session first needs it.

Black frames are all alike, so once the encoder's cache after a step equals,
bitwise, the cache after the step before, every later step repeats that step
exactly: the stream stops encoding and later frames reuse the last latent
(the random tiny VAE gets there after 21 latent frames). A stream that never
gets there stops at ``max_frames`` (default 360, the published streaming
demo's length; nothing later exists there to match) and reuses the last one,
with a warning; until then it holds its encoder cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import MatrixGameConfig
from ..wan.vae import FeatureCache, StreamingVAE, cache_bytes
from ..start_images import EncodedStartImages
from ...runner.types import centre_crop_box

log = logging.getLogger("arstream.models.matrix_game")

DEFAULT_NAME = "default"
# Latent frames a stream encodes at most: inference_streaming.py's --max_num_output_frames.
MAX_CONDITION_FRAMES = 360
# Image files an `images` directory may offer (each is encoded at load and kept).
MAX_OFFERED = 32
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
MASK_CHANNELS = 4


def default_image(cfg: MatrixGameConfig) -> torch.Tensor:
    """A built-in start image ``[3, H, W]`` in [-1, 1]: sky over ground with a horizon."""
    return sky_and_ground(cfg.height, cfg.width)


def sky_and_ground(h: int, w: int) -> torch.Tensor:
    """The built-in start picture at ``h`` x ``w``, ``[3, h, w]`` in [-1, 1] (other models offer it too)."""
    y = torch.linspace(0, 1, h)[:, None].expand(h, w)
    x = torch.linspace(0, 1, w)[None, :].expand(h, w)
    sky = torch.stack([0.3 + 0.3 * y, 0.5 + 0.3 * y, 0.9 + 0 * y])
    ground = torch.stack([0.35 + 0.1 * x, 0.55 - 0.2 * y, 0.25 + 0 * y])
    image = torch.where(y[None] < 0.45, sky, ground)
    return image.clamp(0, 1) * 2 - 1


def crop_box(width: int, height: int, cfg: MatrixGameConfig) -> tuple[int, int, int, int]:
    """Matrix-Game's ``_resizecrop``: the centred box of the model's aspect, rounded as PIL's ``crop`` rounds."""
    return centre_crop_box(width, height, cfg.width, cfg.height)


def prepare_image(pixels: np.ndarray, cfg: MatrixGameConfig) -> torch.Tensor:
    """uint8 ``[H, W, 3]`` RGB of any size -> ``[3, height, width]`` in [-1, 1], as the reference prepares it.

    Centre-crop to the model's aspect, then torchvision's ``Resize(antialias=True)``
    on a PIL image, which is PIL's bilinear resize (antialiased: its filter
    widens with the scale), then ``ToTensor`` and ``Normalize(0.5, 0.5)``.
    """
    from PIL import Image

    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3 or min(pixels.shape[:2]) < 1:
        raise ValueError(f"a start image must be uint8 [H, W, 3] RGB, got {pixels.dtype} {list(pixels.shape)}")
    image = Image.fromarray(np.ascontiguousarray(pixels))
    image = image.crop(crop_box(image.width, image.height, cfg))
    image = image.resize((cfg.width, cfg.height), Image.Resampling.BILINEAR)
    array = np.asarray(image, dtype=np.float32)
    return torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1


def read_pixels(path: str | Path) -> np.ndarray:
    """An image file as uint8 RGB, upright (EXIF orientation applied, as diffusers' ``load_image`` does)."""
    from PIL import Image, ImageOps

    with Image.open(path) as img:
        return np.asarray(ImageOps.exif_transpose(img).convert("RGB"))


def read_image(path: str | Path, cfg: MatrixGameConfig) -> torch.Tensor:
    return prepare_image(read_pixels(path), cfg)


def image_files(directory: str | Path) -> dict[str, Path]:
    """The image files of an ``images`` directory by name (file stem), sorted by name."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ValueError(f"images: {folder} is not a directory")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if len(files) > MAX_OFFERED:
        raise ValueError(f"images: {folder} holds {len(files)} images; at most {MAX_OFFERED} can be offered")
    return {p.stem: p for p in files}


def _same(a: FeatureCache, b: FeatureCache) -> bool:
    def equal(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            return x.shape == y.shape and torch.equal(x, y)
        return x is y or x == y

    return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))


class ConditionStream:
    """The conditioning latents of one start image, encoded as far as sessions have read them.

    :meth:`condition` gives latent frames ``start .. start + count - 1`` as
    ``[20, count, h, w]`` (4 mask channels: ones on frame 0 only, as in
    Matrix-Game's ``cond_concat``; then the image latent).
    """

    def __init__(
        self, vae: StreamingVAE, image: torch.Tensor, *, dtype: torch.dtype, max_frames: int = MAX_CONDITION_FRAMES
    ) -> None:
        self.vae = vae
        self.dtype = dtype
        self.max_frames = max_frames
        self._black = torch.zeros(1, 3, 4, *image.shape[1:], device=self.vae.mean.device)
        first, cache = vae.encode_step(image[None, :, None].to(self._black.device), None)
        self._cache: FeatureCache | None = cache  # None once the latents settled (or max_frames were made)
        self._latents = [first[:, 0].to(dtype)]
        self.fixed_at: int | None = None  # the last distinct latent frame, once the cache stopped changing

    @property
    def frames(self) -> int:
        """Latent frames encoded so far."""
        return len(self._latents)

    @property
    def frame_bytes(self) -> int:
        """Bytes of one latent frame of the stream."""
        return self._latents[0].numel() * self._latents[0].element_size()

    @property
    def encoding(self) -> bool:
        """Still holding an encoder cache (neither at the fixed point nor at ``max_frames``)."""
        return self._cache is not None

    def nbytes(self) -> int:
        held = sum(t.numel() * t.element_size() for t in self._latents)
        return held + (cache_bytes(self._cache) if self._cache is not None else 0)

    def condition(self, start: int, count: int) -> torch.Tensor:
        self._extend(start + count)
        last = len(self._latents) - 1
        latents = torch.stack([self._latents[min(p, last)] for p in range(start, start + count)], dim=1)
        mask = torch.zeros(MASK_CHANNELS, *latents.shape[1:], device=latents.device, dtype=latents.dtype)
        if start == 0:
            mask[:, 0] = 1.0
        return torch.cat([mask, latents])

    def _extend(self, frames: int) -> None:
        while self._cache is not None and len(self._latents) < min(frames, self.max_frames):
            latent, cache = self.vae.encode_step(self._black, self._cache)
            self._latents.append(latent[:, 0].to(self.dtype))
            if _same(cache, self._cache):
                # Same cache, same input: every later step repeats this one, so every later latent is this one.
                self.fixed_at = len(self._latents) - 1
                self._cache = None
                log.info("image conditioning settled at latent frame %d; later frames reuse it", self.fixed_at)
                return
            self._cache = cache
        if self._cache is not None and len(self._latents) >= self.max_frames:
            self._cache = None
            log.warning(
                "image conditioning did not settle in %d latent frames; later frames reuse the last", self.max_frames
            )


@dataclass(frozen=True)
class ImageEncodings:
    """What the DiT reads of one start image: its cross-attention context and its conditioning stream."""

    context: torch.Tensor  # [1, clip_tokens, dim]
    stream: ConditionStream


class StartImages(EncodedStartImages[ImageEncodings]):
    """The images a model offers (encoded at load, kept) and clients' own (encoded on first use, an LRU by digest).

    ``offered`` is ordered: the first is the default. ``encode`` turns a
    prepared image ``[3, H, W]`` (and its name, if offered) into its encodings;
    a client's pixels are prepared as Matrix-Game prepares its start image.
    """

    def __init__(
        self,
        offered: dict[str, torch.Tensor],
        encode: Callable[[torch.Tensor, str | None], ImageEncodings],
        cfg: MatrixGameConfig,
        *,
        capacity: int = 4,
    ) -> None:
        super().__init__(
            {name: encode(image, name) for name, image in offered.items()},
            lambda pixels: encode(prepare_image(pixels, cfg), None),
            capacity=capacity,
            model="a matrix-game model",
        )
        self.cfg = cfg


def stack_conditions(streams: Sequence[ConditionStream], starts: Sequence[int], count: int) -> torch.Tensor:
    """Each row's conditioning for its own latent frames: ``[B, 20, count, h, w]``."""
    return torch.stack([stream.condition(start, count) for stream, start in zip(streams, starts)])

"""A session's start image (PROTOCOL.md, "Start images"): one the model offers by name, or the client's own file.

``start.image`` is ``{"name": N}`` (one of the card's ``start_images``) or
``{"data": B}`` (base64 of a PNG, JPEG or WebP file). What a client sends is
bounded before it costs anything: the base64 text by length before it is
decoded, the file by ``max_start_image_bytes``, the picture by
``max_start_image_pixels`` read from the file's header before a pixel is
decoded (a small file can claim a huge picture: a decompression bomb).
Decoding runs in a worker thread, at most :data:`DECODE_CONCURRENCY` at once
per server, so the event loop never waits on Pillow and a crowd of uploads
cannot hold many decoded pictures at the same time. Anything refused is a
:class:`StartImageRefused`, which the connection answers with ``invalid_image``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from arstream.runner.types import StartImage

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP")
DECODE_CONCURRENCY = 2


class StartImageRefused(ValueError):
    """``start.image`` cannot be used; the text says what was expected and what came."""


def offered_start_images(model_card: Mapping[str, Any]) -> tuple[str, ...]:
    """The start image names a model card offers (first: the default); empty when it offers none.

    Raises ValueError for a card whose ``start_images`` is not a list of distinct non-empty strings.
    """
    names = model_card.get("start_images") or []
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"the model card's start_images must be a list of distinct non-empty names, got {names!r}")
    return tuple(names)


def base64_length(byte_count: int) -> int:
    """Characters of padded base64 for ``byte_count`` bytes."""
    return 4 * ((byte_count + 2) // 3)


def named_start_image(name: str, offered: Sequence[str]) -> StartImage:
    if not offered:
        raise StartImageRefused("this model takes no start image (its card offers no start_images)")
    if name not in offered:
        raise StartImageRefused(f"start image {name!r} is not offered; expected one of {list(offered)}")
    return StartImage(digest=f"name:{name}", name=name)


def decode_base64(data: str, max_bytes: int) -> bytes:
    """The file ``data`` encodes; its length is checked before anything is decoded."""
    if len(data) > base64_length(max_bytes):
        raise StartImageRefused(
            f"the start image is over {max_bytes} bytes (max_start_image_bytes): "
            f"{len(data)} base64 characters, at most {base64_length(max_bytes)}"
        )
    try:
        encoded = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise StartImageRefused(f"start.image.data is not base64 ({exc})") from None
    if len(encoded) > max_bytes:
        raise StartImageRefused(f"the start image is {len(encoded)} bytes, over {max_bytes} (max_start_image_bytes)")
    if not encoded:
        raise StartImageRefused("start.image.data is empty")
    return encoded


def decode_pixels(encoded: bytes, max_pixels: int) -> np.ndarray:
    """uint8 ``[H, W, 3]`` RGB of a PNG, JPEG or WebP file (its first frame, turned upright), read-only.

    The size in the header is checked before the pixels are decoded.
    """
    try:
        with Image.open(io.BytesIO(encoded), formats=ALLOWED_FORMATS) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise StartImageRefused(
                    f"the start image is {width}x{height} = {width * height} pixels, "
                    f"over {max_pixels} (max_start_image_pixels)"
                )
            # Upright as a viewer shows it: phone photos are stored turned, with an EXIF orientation.
            pixels = np.array(ImageOps.exif_transpose(image).convert("RGB"), dtype=np.uint8)
    except StartImageRefused:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own limit, far above ours, fired in Image.open: a header claiming an enormous picture.
        raise StartImageRefused(f"the start image claims too many pixels ({exc})") from None
    except UnidentifiedImageError:
        raise StartImageRefused(f"start.image.data is not a {', '.join(ALLOWED_FORMATS)} file") from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds (OSError, SyntaxError, ValueError, ...)
        # The reason, without Python's names for objects (the client sees this): "<_io.BytesIO object at 0x...>".
        reason = re.sub(r"<[^<>]* object at 0x[0-9a-fA-F]+>", "the file", str(exc))
        raise StartImageRefused(
            f"start.image.data is not a {', '.join(ALLOWED_FORMATS)} file that decodes: {reason}"
        ) from None
    pixels.flags.writeable = False  # pipelines share it through every tick; none may change it
    return pixels


def pixels_digest(pixels: np.ndarray) -> str:
    """A content id of decoded pixels: SHA-256 over the size and the RGB bytes."""
    height, width, _ = pixels.shape
    digest = hashlib.sha256(f"{width}x{height}:".encode())
    digest.update(pixels.tobytes())
    return f"sha256:{digest.hexdigest()}"


def uploaded_start_image(data: str, *, max_bytes: int, max_pixels: int) -> StartImage:
    """The StartImage of a client's own file (blocking: run it off the event loop)."""
    pixels = decode_pixels(decode_base64(data, max_bytes), max_pixels)
    return StartImage(digest=pixels_digest(pixels), pixels=pixels)


class StartImageResolver:
    """Turns ``start.image`` into a :class:`StartImage` for one server: its limits and its decode slots."""

    def __init__(self, *, max_bytes: int, max_pixels: int) -> None:
        self.max_bytes = max_bytes
        self.max_pixels = max_pixels
        self._decode_slots = asyncio.Semaphore(DECODE_CONCURRENCY)

    async def resolve(self, *, name: str | None, data: str | None, offered: Sequence[str]) -> StartImage:
        """Raises :class:`StartImageRefused`."""
        if name is not None:
            return named_start_image(name, offered)
        assert data is not None
        if not offered:
            raise StartImageRefused("this model takes no start image (its card offers no start_images)")
        async with self._decode_slots:
            return await asyncio.to_thread(
                uploaded_start_image, data, max_bytes=self.max_bytes, max_pixels=self.max_pixels
            )

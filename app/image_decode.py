"""Decoding a client's start image file: the checks before any pixel is decoded, and the pixels a model uses.

Pure functions of the file's bytes (PIL and numpy only): they run in the
decode worker processes (:mod:`arstream.app.image_worker`), which a deadline
can kill, never in the server's own process. A file is bounded before its
pixels are decoded: the picture by ``max_start_image_pixels`` read from its
header (a small file can claim a huge picture: a decompression bomb), a JPEG
by its scans (``max_start_image_jpeg_scans``: libjpeg makes a pass over the
whole picture per scan, so a progressive file of thousands of tiny scans
costs minutes of a core), counted by walking the markers as libjpeg reads
them, so bytes it skips cannot hide a scan from the count.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..runner.types import centre_crop_box

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP")
# Pillow opens a JPEG holding more than one picture (a phone's MPO) as "MPO"; its first picture is a JPEG.
JPEG_FORMATS = ("JPEG", "MPO")
JPEG_START_OF_SCAN = 0xDA
JPEG_END_OF_IMAGE = 0xD9
JPEG_STANDALONE_MARKERS = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RSTn: no length field
# libjpeg's next marker: a 0xFF (after any fill 0xFFs) followed by anything but 0x00 (a stuffed data byte).
# Every other byte between segments is skipped with a warning ("extraneous bytes before marker"), and the
# decode goes on; in a scan's entropy-coded data the same rule ends the scan, and a restart marker found
# there (0xD0-0xD7) is read as a marker of no length.
JPEG_MARKER = re.compile(rb"\xff[^\x00\xff]")


class StartImageRefused(ValueError):
    """``start.image`` cannot be used; the text says what was expected and what came."""


@dataclass(frozen=True)
class ImageLimits:
    """What one upload may cost: file bytes, pixels, JPEG scans, and the model's frame size it is cut to."""

    max_bytes: int
    max_pixels: int
    max_jpeg_scans: int
    frame: tuple[int, int] | None = None  # (width, height); None: kept at its own size (no model card yet)


def jpeg_scans(encoded: bytes, stop_after: int) -> int:
    """The scans (SOS markers) of a JPEG file, counted up to ``stop_after + 1``, without decoding any.

    Finds each marker as libjpeg does (bytes that are not a marker are skipped, not an end), steps over a
    segment by its length (so bytes inside other segments, an EXIF thumbnail's own markers, are not counted)
    and over a scan's entropy-coded data to the next marker. It counts every scan libjpeg would decode, and
    possibly more in a file libjpeg refuses; it stops at the end of the first picture.
    """
    scans, pos, end = 0, 2, len(encoded)  # after SOI
    while scans <= stop_after:
        found = JPEG_MARKER.search(encoded, pos)
        if found is None:
            break
        marker, pos = encoded[found.start() + 1], found.start()
        if marker == JPEG_END_OF_IMAGE:
            break
        if marker in JPEG_STANDALONE_MARKERS:
            pos += 2
            continue
        if pos + 3 >= end:
            break
        pos += 2 + int.from_bytes(encoded[pos + 2 : pos + 4], "big")
        if marker == JPEG_START_OF_SCAN:
            scans += 1
    return scans


def fit_to_frame(image: Image.Image, frame: tuple[int, int] | None) -> Image.Image:
    """The part of ``image`` a model with ``frame`` (width, height) shows, at the frame's size: the centred box of
    the frame's aspect, resized to the frame (PIL's antialiased bilinear), as Matrix-Game prepares its start image,
    so a model that crops and resizes it again gets the same picture it would have made of the whole upload."""
    if frame is None:
        return image
    width, height = frame
    left, top, right, bottom = centre_crop_box(image.width, image.height, width, height)
    if right <= left or bottom <= top:
        raise StartImageRefused(
            f"the start image ({image.width}x{image.height}) is too narrow for the model's {width}x{height} frame"
        )
    if (left, top, right, bottom) != (0, 0, image.width, image.height):
        image = image.crop((left, top, right, bottom))
    return image if image.size == (width, height) else image.resize((width, height), Image.Resampling.BILINEAR)


def decode_pixels(encoded: bytes, limits: ImageLimits) -> np.ndarray:
    """uint8 ``[H, W, 3]`` RGB of a PNG, JPEG or WebP file (its first frame, turned upright, fitted to the model's
    frame), read-only. The size in the header, and a JPEG's scans, are checked before the pixels are decoded."""
    try:
        with Image.open(io.BytesIO(encoded), formats=ALLOWED_FORMATS) as image:
            width, height = image.size
            if width * height > limits.max_pixels:
                raise StartImageRefused(
                    f"the start image is {width}x{height} = {width * height} pixels, "
                    f"over {limits.max_pixels} (max_start_image_pixels)"
                )
            if image.format in JPEG_FORMATS:
                scans = jpeg_scans(encoded, limits.max_jpeg_scans)
                if scans > limits.max_jpeg_scans:
                    raise StartImageRefused(
                        f"the start image is a JPEG of more than {limits.max_jpeg_scans} scans "
                        f"(max_start_image_jpeg_scans; a progressive JPEG has about 10)"
                    )
            # Upright as a viewer shows it: phone photos are stored turned, with an EXIF orientation.
            # In place, and converted only when not RGB already: each copy of a 16 MP picture is 64 MB more at
            # the decode's peak.
            ImageOps.exif_transpose(image, in_place=True)
            rgb = image if image.mode == "RGB" else image.convert("RGB")
            pixels = np.array(fit_to_frame(rgb, limits.frame), dtype=np.uint8)
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

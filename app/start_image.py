"""A session's start image (PROTOCOL.md, "Start images"): one the model offers by name, or the client's own file.

``start.image`` is ``{"name": N}`` (one of the card's ``start_images``) or
``{"data": B}`` (base64 of a PNG, JPEG or WebP file). What a client sends is
bounded before it costs anything: the base64 text by length before it is
decoded, the file by ``max_start_image_bytes``, the picture by
``max_start_image_pixels`` read from the file's header before a pixel is
decoded (a small file can claim a huge picture: a decompression bomb), and a
JPEG by its scans, counted before decoding (``max_start_image_jpeg_scans``:
libjpeg makes a pass over the whole picture per scan, so a progressive file of
thousands of tiny scans costs minutes of a core). Decoding runs on
:data:`DECODE_CONCURRENCY` threads of its own per server, niced like the
encoders (``encoder_nice``), so the event loop never waits on Pillow, the model
worker gets a core first, and a crowd of uploads cannot hold many decoded
pictures at once. A decode waits for a thread and runs within
``start_image_timeout_s`` in all; a connection whose client has gone stops
waiting at once (its decode is dropped if it has not started). What is kept is
what a model uses (:func:`fit_to_frame`): the centred part of the frame's
aspect at the frame's size, so a session holds one frame of pixels however
large the upload. Anything refused is a
:class:`StartImageRefused` (``invalid_image``), a decode that could not get a
thread in time :class:`StartImageBusy` (``over_capacity``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import re
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .encoding import lower_thread_priority
from ..runner.types import StartImage, centre_crop_box

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP")
DECODE_CONCURRENCY = 2
# Pillow opens a JPEG holding more than one picture (a phone's MPO) as "MPO"; its first picture is a JPEG.
JPEG_FORMATS = ("JPEG", "MPO")
JPEG_START_OF_SCAN = 0xDA
# In entropy-coded data 0xFF is followed by 0x00 (a stuffed byte), a restart marker (0xD0-0xD7) or a fill
# byte (0xFF): anything else is the next marker.
JPEG_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
JPEG_STANDALONE_MARKERS = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RSTn: no length field
JPEG_END_OF_IMAGE = 0xD9


class StartImageRefused(ValueError):
    """``start.image`` cannot be used; the text says what was expected and what came."""


class StartImageBusy(RuntimeError):
    """No decode thread was free within ``start_image_timeout_s``: the client may try again."""


class ClientGone(Exception):
    """The client went away while its start image was waiting or decoding."""


@dataclass(frozen=True)
class ImageLimits:
    """What one upload may cost: file bytes, pixels, JPEG scans, and the model's frame size it is cut to."""

    max_bytes: int
    max_pixels: int
    max_jpeg_scans: int
    frame: tuple[int, int] | None = None  # (width, height); None: kept at its own size (no model card yet)


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


def jpeg_scans(encoded: bytes, stop_after: int) -> int:
    """The scans (SOS markers) of a JPEG file, counted up to ``stop_after + 1``, without decoding any.

    Walks the marker segments by their lengths and skips each scan's entropy-coded data to the next marker,
    so bytes inside other segments (an EXIF thumbnail's own markers) are not counted. A file that is not
    well formed is left to the decoder, which refuses it.
    """
    scans, pos, end = 0, 2, len(encoded)  # after SOI
    while pos + 1 < end and scans <= stop_after:
        if encoded[pos] != 0xFF:
            break
        marker = encoded[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
        elif marker == JPEG_END_OF_IMAGE:
            break
        elif marker in JPEG_STANDALONE_MARKERS:
            pos += 2
        elif pos + 3 >= end:
            break
        else:
            pos += 2 + int.from_bytes(encoded[pos + 2 : pos + 4], "big")
            if marker == JPEG_START_OF_SCAN:
                scans += 1
                found = JPEG_NEXT_MARKER.search(encoded, pos)
                pos = found.start() if found is not None else end
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


def pixels_digest(pixels: np.ndarray) -> str:
    """A content id of decoded pixels: SHA-256 over the size and the RGB bytes."""
    height, width, _ = pixels.shape
    digest = hashlib.sha256(f"{width}x{height}:".encode())
    digest.update(pixels.tobytes())
    return f"sha256:{digest.hexdigest()}"


def uploaded_start_image(data: str, limits: ImageLimits) -> StartImage:
    """The StartImage of a client's own file (blocking: run it off the event loop)."""
    pixels = decode_pixels(decode_base64(data, limits.max_bytes), limits)
    return StartImage(digest=pixels_digest(pixels), pixels=pixels)


class StartImageResolver:
    """Turns ``start.image`` into a :class:`StartImage` for one server: its limits and its decode threads."""

    def __init__(
        self, *, max_bytes: int, max_pixels: int, max_jpeg_scans: int, timeout_s: float, nice: int = 0
    ) -> None:
        self.limits = ImageLimits(max_bytes, max_pixels, max_jpeg_scans)
        self.timeout_s = timeout_s
        # Its own threads (not the loop's default executor): at most DECODE_CONCURRENCY decodes run, whoever
        # waits; a decode whose client gave up before it started never runs.
        self._executor = ThreadPoolExecutor(
            DECODE_CONCURRENCY, thread_name_prefix="arstream-image", initializer=partial(lower_thread_priority, nice)
        )
        self._lock = threading.Lock()
        self._decoding = 0  # submitted and not finished (waiting for a thread, or running), cancelled ones aside

    @property
    def decoding(self) -> int:
        """Uploads waiting for a decode thread or decoding now (in ``/v1/stats``)."""
        with self._lock:
            return self._decoding

    def _finished(self, _job: Future[StartImage]) -> None:
        with self._lock:
            self._decoding -= 1

    def set_frame(self, width: int, height: int) -> None:
        """The served model's frame size (from its card): uploads are cut to it."""
        self.limits = ImageLimits(self.limits.max_bytes, self.limits.max_pixels, self.limits.max_jpeg_scans,
                                  (width, height))

    async def resolve(
        self, *, name: str | None, data: str | None, offered: Sequence[str], gone: asyncio.Event | None = None
    ) -> StartImage:
        """Raises :class:`StartImageRefused`, :class:`StartImageBusy`, or :class:`ClientGone` once ``gone`` is set."""
        if name is not None:
            return named_start_image(name, offered)
        assert data is not None
        if not offered:
            raise StartImageRefused("this model takes no start image (its card offers no start_images)")
        job: Future[StartImage] = self._executor.submit(uploaded_start_image, data, self.limits)
        with self._lock:
            self._decoding += 1
        job.add_done_callback(self._finished)  # run on the decode thread, or here when cancelled
        decoded = asyncio.wrap_future(job)
        waits: set[asyncio.Future[Any]] = {decoded}
        if gone is not None:
            waits.add(asyncio.ensure_future(gone.wait()))
        try:
            await asyncio.wait(waits, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits - {decoded}:
                waiting.cancel()
        if decoded.done():
            return decoded.result()
        # Cancelled before it started, it never runs; started, it runs to its end (bounded by the limits above)
        # on its thread, which then takes the next decode, and its result is dropped.
        never_started = job.cancel()
        decoded.cancel()
        if gone is not None and gone.is_set():
            raise ClientGone()
        if never_started:
            raise StartImageBusy(
                f"no start image decode could start within {self.timeout_s:g} s (start_image_timeout_s; "
                f"{DECODE_CONCURRENCY} run at once); try again shortly"
            )
        raise StartImageRefused(f"the start image did not decode within {self.timeout_s:g} s (start_image_timeout_s)")

    def close(self) -> None:
        """Start no more decodes (at server shutdown); one running finishes on its thread."""
        self._executor.shutdown(wait=False, cancel_futures=True)

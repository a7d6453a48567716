"""A session's start image (PROTOCOL.md, "Start images"): one the model offers by name, or the client's own file.

``start.image`` is ``{"name": N}`` (one of the card's ``start_images``) or
``{"data": B}`` (base64 of a PNG, JPEG or WebP file). What a client sends is
bounded before it costs anything: the base64 text by length before it is
decoded, the file by ``max_start_image_bytes``, and the picture and a JPEG's
scans before a pixel is decoded (:mod:`arstream.app.image_decode`). Decoding
runs on :data:`DECODE_CONCURRENCY` threads of its own per server, each with a
worker process (:mod:`arstream.app.image_worker`) niced like the encoders
(``encoder_nice``), so the event loop never waits on Pillow, the model worker
gets a core first, and a crowd of uploads cannot hold many decoded pictures at
once. A decode waits for a thread and runs within ``start_image_timeout_s`` in
all: at the deadline, or when its client goes, its worker is killed and the
thread is free (a decode not started yet never runs). What is kept is what a
model uses (:func:`fit_to_frame`): the centred part of the frame's aspect at
the frame's size, so a session holds one frame of pixels however large the
upload. Anything refused is a :class:`StartImageRefused` (``invalid_image``),
a decode that could not start in time :class:`StartImageBusy`
(``over_capacity``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np

from .encoding import lower_thread_priority
# What a decode checks and keeps is part of this module's interface too.
from .image_decode import ImageLimits as ImageLimits
from .image_decode import StartImageRefused as StartImageRefused
from .image_decode import decode_pixels as decode_pixels
from .image_decode import fit_to_frame as fit_to_frame
from .image_decode import jpeg_scans as jpeg_scans
from .image_worker import DecodeDeadline, DecodeJob, DecodeWorkers
from ..runner.types import StartImage

DECODE_CONCURRENCY = 2


class StartImageBusy(RuntimeError):
    """No decode thread was free within ``start_image_timeout_s``: the client may try again."""


class ClientGone(Exception):
    """The client went away while its start image was waiting or decoding."""


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


def pixels_digest(pixels: np.ndarray) -> str:
    """A content id of decoded pixels: SHA-256 over the size and the RGB bytes."""
    height, width, _ = pixels.shape
    digest = hashlib.sha256(f"{width}x{height}:".encode())
    digest.update(pixels.tobytes())
    return f"sha256:{digest.hexdigest()}"


class StartImageResolver:
    """Turns ``start.image`` into a :class:`StartImage` for one server: its limits, decode threads and workers."""

    def __init__(
        self, *, max_bytes: int, max_pixels: int, max_jpeg_scans: int, timeout_s: float, nice: int = 0
    ) -> None:
        self.limits = ImageLimits(max_bytes, max_pixels, max_jpeg_scans)
        self.timeout_s = timeout_s
        # Its own threads (not the loop's default executor): at most DECODE_CONCURRENCY decodes run, whoever
        # waits; a decode whose client gave up before it started never runs. A thread's worker process is
        # started from it, so it runs at the thread's lowered priority.
        self._executor = ThreadPoolExecutor(
            DECODE_CONCURRENCY, thread_name_prefix="arstream-image", initializer=partial(lower_thread_priority, nice)
        )
        self.workers = DecodeWorkers(DECODE_CONCURRENCY)
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
        # The model offers start images: a worker per decode thread, started now from the threads (their priority).
        for _ in range(DECODE_CONCURRENCY):
            self._executor.submit(self.workers.start_spare)

    def _decode(self, data: str, limits: ImageLimits, deadline: float, job: DecodeJob) -> StartImage:
        """On a decode thread: the file, then its pixels from a worker process."""
        pixels = self.workers.decode(decode_base64(data, limits.max_bytes), limits, deadline, job)
        return StartImage(digest=pixels_digest(pixels), pixels=pixels)

    async def resolve(
        self, *, name: str | None, data: str | None, offered: Sequence[str], gone: asyncio.Event | None = None
    ) -> StartImage:
        """Raises :class:`StartImageRefused`, :class:`StartImageBusy`, or :class:`ClientGone` once ``gone`` is set."""
        if name is not None:
            return named_start_image(name, offered)
        assert data is not None
        if not offered:
            raise StartImageRefused("this model takes no start image (its card offers no start_images)")
        control = DecodeJob()
        deadline = time.monotonic() + self.timeout_s
        job: Future[StartImage] = self._executor.submit(self._decode, data, self.limits, deadline, control)
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
        if not decoded.done():
            # Cancelled before it started, it never runs; started, its worker is killed and the thread is free
            # as soon as it has reaped it, which this waits for (so /v1/stats never counts a stopped decode).
            never_started = job.cancel()
            if not never_started:
                control.abort()
                await asyncio.wait({decoded})
            if gone is not None and gone.is_set():
                raise ClientGone()
            if never_started:
                raise self._busy()
        try:
            return decoded.result()
        except DecodeDeadline as stopped:
            if not stopped.started:
                raise self._busy() from None
            raise StartImageRefused(
                f"the start image did not decode within {self.timeout_s:g} s (start_image_timeout_s)"
            ) from None

    def _busy(self) -> StartImageBusy:
        return StartImageBusy(
            f"no start image decode could start within {self.timeout_s:g} s (start_image_timeout_s; "
            f"{DECODE_CONCURRENCY} run at once); try again shortly"
        )

    def close(self) -> None:
        """Start no more decodes (at server shutdown) and kill the workers, a running decode's too."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.workers.close()

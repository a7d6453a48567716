"""Client-side helpers for the ARStream wire protocol (version 1, see PROTOCOL.md).

Shared by the example client (:mod:`arstream.app.client`) and the load generator
(:mod:`arstream.app.bench`): build the JSON messages a client sends, parse the 20-byte
header of binary frame messages, decode their payloads, and turn the URL a
user typed into the session WebSocket URL. The server has its own module; this
one only knows what a client needs.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np

PROTOCOL_VERSION = 1
SESSIONS_PATH = "/v1/sessions"

FRAME_MAGIC = b"ARF1"
# magic, codec, flags, frame index, chunk_index, tick_id, width, height (little-endian)
FRAME_HEADER = struct.Struct("<4sBBHIIHH")
FRAME_HEADER_BYTES = FRAME_HEADER.size
FLAG_LAST_FRAME = 0x01

CODEC_RAW = 0
CODEC_JPEG = 1
CODEC_IDS = {"raw": CODEC_RAW, "jpeg": CODEC_JPEG}

MAX_ID = 2**32 - 1


class WireError(ValueError):
    """A message from the server does not follow the protocol."""


@dataclass(frozen=True)
class FrameHeader:
    """The fixed header in front of every binary frame message."""

    codec: int
    last_in_chunk: bool
    frame_index: int
    chunk_index: int
    tick_id: int
    width: int
    height: int


def parse_frame(message: bytes) -> tuple[FrameHeader, memoryview]:
    """Split a binary frame message into its header and payload (a view, no copy)."""
    if len(message) < FRAME_HEADER_BYTES:
        raise WireError(f"binary frame of {len(message)} bytes is shorter than the {FRAME_HEADER_BYTES}-byte header")
    magic, codec, flags, frame_index, chunk_index, tick_id, width, height = FRAME_HEADER.unpack_from(message)
    if magic != FRAME_MAGIC:
        raise WireError(f"binary frame magic is {magic!r}, expected {FRAME_MAGIC!r}")
    if codec not in (CODEC_RAW, CODEC_JPEG):
        raise WireError(f"binary frame codec id is {codec}, expected 0 (raw) or 1 (jpeg)")
    payload = memoryview(message)[FRAME_HEADER_BYTES:]
    if codec == CODEC_RAW and len(payload) != width * height * 3:
        raise WireError(f"raw payload is {len(payload)} bytes, expected {width}*{height}*3 = {width * height * 3}")
    header = FrameHeader(
        codec=codec,
        last_in_chunk=bool(flags & FLAG_LAST_FRAME),
        frame_index=frame_index,
        chunk_index=chunk_index,
        tick_id=tick_id,
        width=width,
        height=height,
    )
    return header, payload


def decode_frame(header: FrameHeader, payload: bytes | memoryview) -> np.ndarray:
    """The frame as uint8 ``[height, width, 3]`` RGB."""
    if header.codec == CODEC_RAW:
        return np.frombuffer(payload, dtype=np.uint8).reshape(header.height, header.width, 3).copy()
    # Imported here so that a client that asks for raw frames never needs the JPEG library.
    import simplejpeg

    image = simplejpeg.decode_jpeg(bytes(payload), colorspace="RGB")
    if image.shape[:2] != (header.height, header.width):
        raise WireError(f"JPEG is {image.shape[1]}x{image.shape[0]}, header says {header.width}x{header.height}")
    return image


def _message(fields: dict[str, Any]) -> str:
    # allow_nan=False: the server refuses NaN/Infinity, so fail here with a Python error instead.
    return json.dumps({k: v for k, v in fields.items() if v is not None}, allow_nan=False)


def _check_id(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_ID:
        raise ValueError(f"{name} must be an integer in [0, 2^32), got {value!r}")


def start_message(
    *, codec: str = "jpeg", seed: int | None = None, prompt: str | None = None, quality: int | None = None
) -> str:
    if codec not in CODEC_IDS:
        raise ValueError(f"codec must be one of {sorted(CODEC_IDS)}, got {codec!r}")
    return _message({"type": "start", "codec": codec, "seed": seed, "prompt": prompt, "quality": quality})


def tick_message(
    tick_id: int,
    *,
    controls: dict[str, Any] | None = None,
    prompt: str | None = None,
    reset: bool = False,
    close: bool = False,
) -> str:
    """Ask for one chunk; ``controls``/``prompt`` (optional) update the session first."""
    _check_id("tick_id", tick_id)
    fields: dict[str, Any] = {"type": "tick", "tick_id": tick_id, "controls": controls, "prompt": prompt}
    if reset:
        fields["reset"] = True
    if close:
        fields["close"] = True
    return _message(fields)


def input_message(event_id: int, *, controls: dict[str, Any] | None = None, prompt: str | None = None) -> str:
    """Update controls and/or prompt without asking for a chunk; applied at the next chunk that starts."""
    _check_id("event_id", event_id)
    return _message({"type": "input", "event_id": event_id, "controls": controls, "prompt": prompt})


def close_message() -> str:
    return _message({"type": "close"})


def session_url(url: str, *, token: str | None = None) -> str:
    """The ``ws(s)://host:port/v1/sessions`` URL for what a user typed.

    Accepts a full WebSocket URL, or an ``http(s)://host:port`` base URL (its
    scheme is swapped and, when it has no path, ``/v1/sessions`` is added). A
    token becomes the ``?token=`` query parameter.
    """
    parts = urlsplit(url if "://" in url else f"ws://{url}")
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None:
        raise ValueError(f"URL scheme must be ws, wss, http or https, got {parts.scheme!r} in {url!r}")
    if not parts.netloc:
        raise ValueError(f"URL has no host: {url!r}")
    path = parts.path if parts.path not in ("", "/") else SESSIONS_PATH
    query = parse_qsl(parts.query)
    if token is not None:
        query = [(k, v) for k, v in query if k != "token"] + [("token", token)]
    return urlunsplit((scheme, parts.netloc, path, urlencode(query), ""))


def http_base_url(url: str) -> str:
    """``http(s)://host:port`` of the server behind a session URL (for /v1/stats and friends)."""
    parts = urlsplit(session_url(url))
    return urlunsplit(({"ws": "http", "wss": "https"}[parts.scheme], parts.netloc, "", "", ""))

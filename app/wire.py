"""The ARStream wire format, protocol version 1 (docs/PROTOCOL.md): the one module for it.

Binary frame messages are the 20-byte ``ARF1`` header plus a payload. Header,
little-endian: magic ``ARF1``, codec u8 (:class:`Codec`), flags u8 (bit 0:
last frame of the chunk; bit 1: an H.264 keyframe), frame index u16,
chunk_index u32, tick_id u32, width u16, height u16. H.264 payloads carry
state from frame to frame: :mod:`arstream.app.video` encodes and decodes them. The server encodes with :func:`encode_chunk`; clients
and tests parse with :func:`parse_frame` / :func:`decode_frame`.

Also here: what both sides of the wire share (the protocol version, the HTTP paths, the id bound). The JSON
messages of both directions are :mod:`arstream.app.protocol`'s models (clients use them through
:mod:`arstream.programs.client_lib`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import simplejpeg

PROTOCOL_VERSION = 1
SESSIONS_PATH = "/v1/sessions"
# A replica's cluster routes (app/migration.py serves them, ``arstream drain`` calls them).
DRAIN_PATH = "/v1/cluster/drain"
HOLDER_PATH = "/v1/cluster/sessions"

MAGIC = b"ARF1"
# magic, codec, flags, frame index, chunk_index, tick_id, width, height (little-endian)
HEADER = struct.Struct("<4sBBHIIHH")
HEADER_BYTES = HEADER.size
FLAG_LAST_IN_CHUNK = 0x01
FLAG_KEYFRAME = 0x02  # codec 2 only: the payload starts a stream (a decoder can begin here)

# tick_id and event_id: 0 <= id < ID_LIMIT (docs/PROTOCOL.md), u32 in a frame's header.
ID_LIMIT = 2**32


class Codec(IntEnum):
    """Codec ids in the header's codec byte; the lower-case member name is the codec's name in ``start``.

    A new codec is one line here (its id; ids are never reused), a stateless one's payload in
    :func:`encode_frame` and :func:`decode_payload`, and its row in the codec table
    (:mod:`arstream.app.codecs`).
    """

    RAW = 0  # RGB24, row-major, width * height * 3 bytes
    JPEG = 1  # one baseline JPEG per frame
    H264 = 2  # one H.264 access unit per frame (Annex B), decoded in order from a keyframe

    @property
    def wire_name(self) -> str:
        return self.name.lower()

    @property
    def stateful(self) -> bool:
        """Whether a frame depends on earlier ones (then :func:`encode_frame` and :func:`decode_payload` refuse it)."""
        return self is Codec.H264

    @classmethod
    def from_name(cls, name: str) -> Codec:
        try:
            return cls[name.upper()]
        except KeyError:
            raise WireError(f"unknown codec {name!r}; expected one of {[codec.wire_name for codec in cls]}") from None


class WireError(ValueError):
    """A message does not follow the protocol; the text says what was expected and what came."""


@dataclass(frozen=True)
class FrameHeader:
    """The fixed header in front of every binary frame message."""

    codec: Codec
    last_in_chunk: bool
    frame_index: int
    chunk_index: int
    tick_id: int
    width: int
    height: int
    keyframe: bool = False

    def pack(self) -> bytes:
        flags = (FLAG_LAST_IN_CHUNK if self.last_in_chunk else 0) | (FLAG_KEYFRAME if self.keyframe else 0)
        return HEADER.pack(
            MAGIC, self.codec, flags, self.frame_index, self.chunk_index, self.tick_id, self.width, self.height
        )

    @classmethod
    def unpack(cls, message: bytes | memoryview) -> FrameHeader:
        if len(message) < HEADER_BYTES:
            raise WireError(f"binary frame of {len(message)} bytes is shorter than the {HEADER_BYTES}-byte header")
        magic, codec, flags, frame_index, chunk_index, tick_id, width, height = HEADER.unpack_from(message)
        if magic != MAGIC:
            raise WireError(f"binary frame magic is {magic!r}, expected {MAGIC!r}")
        try:
            codec_id = Codec(codec)
        except ValueError:
            known = ", ".join(f"{c.value} ({c.wire_name})" for c in Codec)
            raise WireError(f"binary frame codec id is {codec}, expected one of {known}") from None
        last, keyframe = bool(flags & FLAG_LAST_IN_CHUNK), bool(flags & FLAG_KEYFRAME)
        return cls(codec_id, last, frame_index, chunk_index, tick_id, width, height, keyframe=keyframe)


# JPEG frames up to this many pixels keep full chroma resolution (4:4:4).
FULL_CHROMA_MAX_PIXELS = 128 * 128


def encode_frame(frame: np.ndarray, codec: Codec, quality: int) -> bytes:
    """One uint8 ``[H, W, 3]`` frame as a payload in ``codec``."""
    if codec is Codec.RAW:
        return np.ascontiguousarray(frame).tobytes()
    if codec.stateful:
        raise WireError("h264 frames depend on earlier ones: encode them with arstream.app.video.H264Stream")
    # 4:2:0 chroma, as libjpeg and cameras default to: half the encode time and ~40% fewer bytes than 4:4:4.
    # Small frames keep full chroma: at 64x64 halving the colour resolution smears every edge between two
    # colours over a sixteenth of the picture (tiny-world's palette-true frames arrived with 83 % of their
    # pixels on the palette at q80; 95 % with 4:4:4, for 3.3 instead of 2.4 KB a frame).
    subsampling = "444" if frame.shape[0] * frame.shape[1] <= FULL_CHROMA_MAX_PIXELS else "420"
    return simplejpeg.encode_jpeg(
        np.ascontiguousarray(frame), quality=quality, colorspace="RGB", colorsubsampling=subsampling
    )


def encode_chunk(frames: np.ndarray, *, codec: Codec, quality: int, chunk_index: int, tick_id: int) -> list[bytes]:
    """Every frame of a chunk as a complete binary message (header + payload), in order."""
    count, height, width, _ = frames.shape
    messages = []
    for index in range(count):
        header = FrameHeader(codec, index == count - 1, index, chunk_index, tick_id, width, height)
        messages.append(header.pack() + encode_frame(frames[index], codec, quality))
    return messages


def parse_frame(message: bytes) -> tuple[FrameHeader, memoryview]:
    """Split a binary frame message into its header and payload (a view, no copy)."""
    header = FrameHeader.unpack(message)
    payload = memoryview(message)[HEADER_BYTES:]
    expected = header.width * header.height * 3
    if header.codec is Codec.RAW and len(payload) != expected:
        raise WireError(f"raw payload is {len(payload)} bytes, expected {header.width}*{header.height}*3 = {expected}")
    return header, payload


def decode_payload(header: FrameHeader, payload: bytes | memoryview) -> np.ndarray:
    """The frame as uint8 ``[height, width, 3]`` RGB."""
    if header.codec is Codec.RAW:
        return np.frombuffer(payload, dtype=np.uint8).reshape(header.height, header.width, 3).copy()
    if header.codec.stateful:
        raise WireError("h264 frames depend on earlier ones: decode them with arstream.app.codecs.FrameDecoder")
    image = simplejpeg.decode_jpeg(bytes(payload), colorspace="RGB")
    if image.shape[:2] != (header.height, header.width):
        raise WireError(f"JPEG is {image.shape[1]}x{image.shape[0]}, header says {header.width}x{header.height}")
    return image


def decode_frame(message: bytes) -> tuple[FrameHeader, np.ndarray]:
    """Header and uint8 ``[H, W, 3]`` pixels of one binary frame message."""
    header, payload = parse_frame(message)
    return header, decode_payload(header, payload)

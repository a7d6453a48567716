"""Binary frame messages: the 20-byte ``ARF1`` header plus a raw RGB24 or JPEG payload.

Header, little-endian: magic ``ARF1``, codec u8 (0 raw, 1 JPEG), flags u8
(bit 0: last frame of the chunk), frame index u16, chunk_index u32,
tick_id u32, width u16, height u16.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import simplejpeg

MAGIC = b"ARF1"
HEADER = struct.Struct("<4sBBHIIHH")
HEADER_BYTES = HEADER.size
FLAG_LAST_FRAME = 0x01


class Codec(IntEnum):
    RAW = 0
    JPEG = 1

    @classmethod
    def from_name(cls, name: str) -> Codec:
        return {"raw": cls.RAW, "jpeg": cls.JPEG}[name]


class FrameFormatError(ValueError):
    """A frame header or payload that does not follow the protocol."""


@dataclass(frozen=True)
class FrameHeader:
    codec: Codec
    last: bool
    frame_index: int
    chunk_index: int
    tick_id: int
    width: int
    height: int

    def pack(self) -> bytes:
        flags = FLAG_LAST_FRAME if self.last else 0
        return HEADER.pack(
            MAGIC, self.codec, flags, self.frame_index, self.chunk_index, self.tick_id, self.width, self.height
        )

    @classmethod
    def unpack(cls, message: bytes) -> FrameHeader:
        if len(message) < HEADER_BYTES:
            raise FrameFormatError(f"frame message has {len(message)} bytes, the header alone needs {HEADER_BYTES}")
        magic, codec, flags, frame_index, chunk_index, tick_id, width, height = HEADER.unpack_from(message)
        if magic != MAGIC:
            raise FrameFormatError(f"expected magic {MAGIC!r}, got {magic!r}")
        try:
            codec_value = Codec(codec)
        except ValueError:
            raise FrameFormatError(f"unknown codec byte {codec}; expected 0 (raw) or 1 (jpeg)") from None
        return cls(codec_value, bool(flags & FLAG_LAST_FRAME), frame_index, chunk_index, tick_id, width, height)


def encode_frame(frame: np.ndarray, codec: Codec, quality: int) -> bytes:
    """One uint8 ``[H, W, 3]`` frame as a payload in ``codec``."""
    if codec is Codec.RAW:
        return np.ascontiguousarray(frame).tobytes()
    return simplejpeg.encode_jpeg(np.ascontiguousarray(frame), quality=quality, colorspace="RGB")


def encode_chunk(frames: np.ndarray, *, codec: Codec, quality: int, chunk_index: int, tick_id: int) -> list[bytes]:
    """Every frame of a chunk as a complete binary message (header + payload), in order."""
    count, height, width, _ = frames.shape
    messages = []
    for index in range(count):
        header = FrameHeader(codec, index == count - 1, index, chunk_index, tick_id, width, height)
        messages.append(header.pack() + encode_frame(frames[index], codec, quality))
    return messages


def decode_frame(message: bytes) -> tuple[FrameHeader, np.ndarray]:
    """Header and uint8 ``[H, W, 3]`` pixels of one binary frame message (for clients and tests)."""
    header = FrameHeader.unpack(message)
    payload = message[HEADER_BYTES:]
    if header.codec is Codec.RAW:
        expected = header.width * header.height * 3
        if len(payload) != expected:
            raise FrameFormatError(f"raw payload has {len(payload)} bytes, expected {expected}")
        pixels = np.frombuffer(payload, dtype=np.uint8).reshape(header.height, header.width, 3)
    else:
        pixels = simplejpeg.decode_jpeg(payload, colorspace="RGB")
    return header, pixels

"""H.264 video frames over ARF1 (codec id 2), with PyAV's libx264 and FFmpeg's decoder.

A JPEG frame costs 30-40 KB at 640x352; an H.264 stream sends one keyframe
and then only what changed, a few KB per frame. The price is state: each
session has its own encoder whose reference frames carry over from chunk to
chunk, and a client must decode a stream's frames in order from its first
frame, a keyframe.

The encoder is tuned for interactive streaming, one packet per frame and no
frame held back: ``ultrafast`` preset, ``zerolatency`` tune (no lookahead, no
B-frames), Constrained Baseline profile (every browser's hardware decoder
takes it; WebCodecs ``avc1.42E0xx``). The payload of each binary frame message
is one access unit in Annex B form (start codes, SPS and PPS in front of each
keyframe), flag bit 1 marks keyframes. A new stream (a new encoder) starts at
every rollout start (chunk_index 0: start, reset, restart after eviction), on
resume and when the session's codec or quality changes; see
:class:`arstream.app.encoding.EncoderPool`; the codec table (:mod:`arstream.app.codecs`) maps
``h264`` to :class:`H264ChunkEncoder`.

``quality`` (1..100, as for JPEG) maps to x264's constant rate factor:
``crf = round(51 - 0.35 * quality)``, so the default 80 gives crf 23, x264's own
default. Odd widths or heights are padded by repeating the last column or row
(4:2:0 needs even sizes); decoders crop back to the header's size.

PyAV is the optional ``video`` extra; importing this module does not need it,
using the codec does.
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Any

import numpy as np

from arstream.app import wire

ENCODER = "libx264"
DECODER = "h264"
ENCODER_OPTIONS = {
    "preset": "ultrafast",
    "tune": "zerolatency",
    "profile": "baseline",
    # Say in the stream which RGB->YUV matrix made it (swscale's default: BT.601, limited range), so that
    # decoders convert back with the same one; browsers otherwise guess BT.709 and shift every colour.
    "x264-params": "colorprim=smpte170m:transfer=smpte170m:colormatrix=smpte170m:range=tv",
}


class VideoUnavailable(RuntimeError):
    """PyAV (the ``video`` extra) or its libx264 encoder is missing."""


def _av() -> Any:
    try:
        import av
    except ImportError:
        raise VideoUnavailable("the h264 codec needs PyAV: pip install 'arstream[video]'") from None
    return av


@functools.cache
def h264_available() -> bool:
    """Whether this process can encode the h264 codec (PyAV with libx264)."""
    try:
        return ENCODER in _av().codecs_available
    except VideoUnavailable:
        return False


def crf_for_quality(quality: int) -> int:
    """x264's constant rate factor for a 1..100 quality (module docstring)."""
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be in 1..100, got {quality}")
    return round(51 - 0.35 * quality)


def _even(frame: np.ndarray) -> np.ndarray:
    """The frame padded to even width and height by repeating its edge."""
    height, width = frame.shape[:2]
    pad = ((0, height % 2), (0, width % 2), (0, 0))
    return np.pad(frame, pad, mode="edge") if any(p[1] for p in pad[:2]) else frame


class H264Stream:
    """One session's H.264 encoder: frames in, one Annex B access unit out per frame."""

    def __init__(self, width: int, height: int, *, quality: int, fps: int = 16) -> None:
        av = _av()
        if ENCODER not in av.codecs_available:
            raise VideoUnavailable(f"this PyAV build has no {ENCODER} encoder")
        self.width, self.height = width, height
        context = av.CodecContext.create(ENCODER, "w")
        context.width, context.height = width + width % 2, height + height % 2
        context.pix_fmt = "yuv420p"
        context.time_base = Fraction(1, fps)
        context.options = {**ENCODER_OPTIONS, "crf": str(crf_for_quality(quality))}
        # One thread per stream: the encoder pool runs streams of different sessions side by side.
        context.thread_count = 1
        self._context = context
        self._frame_class = av.VideoFrame
        self._pts = 0

    def encode(self, frame: np.ndarray) -> tuple[bytes, bool]:
        """One uint8 ``[H, W, 3]`` RGB frame as (access unit, is keyframe)."""
        if frame.shape[:2] != (self.height, self.width):
            raise ValueError(f"the stream is {self.width}x{self.height}, got a {frame.shape[1]}x{frame.shape[0]} frame")
        picture = self._frame_class.from_ndarray(np.ascontiguousarray(_even(frame)), format="rgb24")
        picture = picture.reformat(format="yuv420p")
        picture.pts = self._pts
        self._pts += 1
        packets = self._context.encode(picture)
        if len(packets) != 1:
            # zerolatency emits each frame at once; anything else would break the one-frame-per-message rule
            raise RuntimeError(f"{ENCODER} returned {len(packets)} packets for one frame, expected 1")
        packet = packets[0]
        return bytes(packet), bool(packet.is_keyframe)

    def close(self) -> None:
        self._context = None


class H264ChunkEncoder:
    """The encoder pool's chunk encoder for ``codec: "h264"``: one stream across the session's chunks."""

    def __init__(self, codec: str, quality: int) -> None:
        self.codec = codec
        self.quality = quality
        self._stream: H264Stream | None = None

    def encode(self, frames: np.ndarray, *, chunk_index: int, tick_id: int) -> list[bytes]:
        count, height, width, _ = frames.shape
        if self._stream is None:
            self._stream = H264Stream(width, height, quality=self.quality)
        messages = []
        for index in range(count):
            payload, keyframe = self._stream.encode(frames[index])
            header = wire.FrameHeader(
                wire.Codec.H264, index == count - 1, index, chunk_index, tick_id, width, height, keyframe=keyframe
            )
            messages.append(header.pack() + payload)
        return messages

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


class H264Decoder:
    """Decodes one session's H.264 frames, in order, to uint8 ``[H, W, 3]`` RGB (for clients and tests)."""

    def __init__(self) -> None:
        av = _av()
        self._context = av.CodecContext.create(DECODER, "r")
        # Frame threads would hold frames back; one thread gives each frame out as it comes in.
        self._context.thread_count = 1
        self._packet_class = av.Packet
        self.started = False

    def decode(self, header: wire.FrameHeader, payload: bytes | memoryview) -> np.ndarray:
        if not self.started and not header.keyframe:
            raise wire.WireError(
                f"h264 frame {header.frame_index} of chunk {header.chunk_index} is not a keyframe, "
                "and a stream must begin with one"
            )
        self.started = True
        pictures = self._context.decode(self._packet_class(bytes(payload)))
        if len(pictures) != 1:
            raise wire.WireError(f"h264 access unit of {len(payload)} bytes decoded to {len(pictures)} pictures, expected 1")
        image = pictures[0].to_ndarray(format="rgb24")
        if image.shape[0] < header.height or image.shape[1] < header.width:
            raise wire.WireError(f"h264 picture is {image.shape[1]}x{image.shape[0]}, header says {header.width}x{header.height}")
        return np.ascontiguousarray(image[: header.height, : header.width])

"""Fragmented MP4 (``m4s``) for the realtime video dialect: an init segment, then one fragment per chunk.

vLLM-Omni's ``WS /v1/realtime/video`` sends each generated chunk as one
binary message of fragmented MP4 bytes; concatenated in order they are one
playable stream, and a browser appends them to a Media Source Extensions
``SourceBuffer`` as they come. The frames are those of
:class:`arstream.app.video.H264Stream` (libx264, zerolatency, Constrained
Baseline: one access unit per frame, nothing held back); this module only
boxes them.

Why boxes written here rather than FFmpeg's mp4 muxer: the muxer writes a
fragment only when the next packet arrives (it needs the next timestamp to
close the fragment), and PyAV exposes no flush. Its fragments would lag a
frame behind: the last frame of every chunk would travel with the next
chunk. Writing ``moof`` + ``mdat`` here puts every frame of a chunk in that
chunk's message, the moment it is encoded.

Layout (ISO/IEC 14496-12 and -15): the first message is ``ftyp`` + ``moov``
(the init segment, with the ``avcC`` record built from the first keyframe's
SPS and PPS) followed by the first chunk's fragment; every later message is
one fragment, ``moof`` (``mfhd``, ``traf``: ``tfhd`` default-base-is-moof,
``tfdt``, ``trun`` with per-sample sizes and sync flags) + ``mdat`` holding
the chunk's access units as 4-byte-length-prefixed NAL units. A new stream
(a new encoder: rollout start, restart after eviction) begins with a new init
segment; its decode times start again at 0.
"""

from __future__ import annotations

import struct
from fractions import Fraction

import numpy as np

from .video import H264Stream

CODEC_PREFIX = "fmp4/"
TIMESCALE = 90_000  # ticks per second of the track's clock (the MPEG convention)
MIME_CODEC_PREFIX = "avc1."

NAL_SPS, NAL_PPS, NAL_AUD = 7, 8, 9
# trun sample flags: a sync sample depends on nothing; the others depend on earlier ones and are not sync.
SYNC_SAMPLE_FLAGS = 0x02000000
NON_SYNC_SAMPLE_FLAGS = 0x01010000
UNITY_MATRIX = struct.pack(">9I", 0x00010000, 0, 0, 0, 0x00010000, 0, 0, 0, 0x40000000)


def fmp4_codec(fps: float) -> str:
    """The session codec name for an fMP4 stream at ``fps`` (the encoder pool builds encoders by name)."""
    return f"{CODEC_PREFIX}{Fraction(fps).limit_denominator(1001)}"


def fps_of_codec(codec: str) -> Fraction:
    if not codec.startswith(CODEC_PREFIX):
        raise ValueError(f"not an fmp4 codec name: {codec!r} (expected {CODEC_PREFIX}<fps>)")
    return Fraction(codec[len(CODEC_PREFIX) :])


def box(kind: bytes, *payload: bytes) -> bytes:
    body = b"".join(payload)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def full_box(kind: bytes, version: int, flags: int, *payload: bytes) -> bytes:
    return box(kind, struct.pack(">I", (version << 24) | flags), *payload)


def nal_units(access_unit: bytes) -> list[bytes]:
    """The NAL units of an Annex B access unit (start codes of 3 or 4 bytes), without their start codes."""
    # Emulation prevention guarantees 00 00 01 never occurs inside a NAL unit; a 4-byte start code's leading
    # zero is left on the unit before it, and stripped (NAL units end in a nonzero byte, trailing zero words aside).
    units = []
    start = access_unit.find(b"\x00\x00\x01")
    while start >= 0:
        end = access_unit.find(b"\x00\x00\x01", start + 3)
        unit = access_unit[start + 3 : None if end < 0 else end].rstrip(b"\x00")
        if unit:
            units.append(unit)
        start = end
    return units


def avc_codec_string(sps: bytes) -> str:
    """The RFC 6381 codec string (``avc1.PPCCLL``) of a stream with this SPS, for MediaSource.isTypeSupported."""
    return MIME_CODEC_PREFIX + sps[1:4].hex().upper()


def init_segment(sps: bytes, pps: bytes, width: int, height: int) -> bytes:
    """``ftyp`` + ``moov`` for one H.264 video track of ``width`` x ``height``."""
    ftyp = box(b"ftyp", b"isom", struct.pack(">I", 0x200), b"isom", b"iso5", b"iso6", b"avc1", b"mp41")
    mvhd = full_box(
        b"mvhd", 0, 0,
        struct.pack(">IIII", 0, 0, TIMESCALE, 0),
        struct.pack(">IH", 0x00010000, 0x0100), bytes(10), UNITY_MATRIX, bytes(24),
        struct.pack(">I", 2),  # next track id
    )  # fmt: skip
    tkhd = full_box(
        b"tkhd", 0, 0x3,  # enabled, in movie
        struct.pack(">IIIII", 0, 0, 1, 0, 0), bytes(8), struct.pack(">hhhH", 0, 0, 0, 0), UNITY_MATRIX,
        struct.pack(">II", width << 16, height << 16),
    )  # fmt: skip
    mdhd = full_box(b"mdhd", 0, 0, struct.pack(">IIIIHH", 0, 0, TIMESCALE, 0, 0x55C4, 0))  # language "und"
    hdlr = full_box(b"hdlr", 0, 0, struct.pack(">I4s", 0, b"vide"), bytes(12), b"ARStream video\x00")
    avcc = box(
        b"avcC",
        bytes([1, sps[1], sps[2], sps[3], 0xFF, 0xE1]),  # version, profile, compatibility, level, 4-byte lengths, 1 SPS
        struct.pack(">H", len(sps)), sps, b"\x01", struct.pack(">H", len(pps)), pps,
    )  # fmt: skip
    avc1 = box(
        b"avc1",
        bytes(6), struct.pack(">H", 1),  # reserved, data reference index
        bytes(16), struct.pack(">HH", width, height), struct.pack(">II", 0x00480000, 0x00480000),  # 72 dpi
        bytes(4), struct.pack(">H", 1), bytes(32), struct.pack(">Hh", 0x0018, -1),
        avcc,
    )  # fmt: skip
    stbl = box(
        b"stbl",
        full_box(b"stsd", 0, 0, struct.pack(">I", 1), avc1),
        full_box(b"stts", 0, 0, struct.pack(">I", 0)),
        full_box(b"stsc", 0, 0, struct.pack(">I", 0)),
        full_box(b"stsz", 0, 0, struct.pack(">II", 0, 0)),
        full_box(b"stco", 0, 0, struct.pack(">I", 0)),
    )
    dinf = box(b"dinf", full_box(b"dref", 0, 0, struct.pack(">I", 1), full_box(b"url ", 0, 1)))
    minf = box(b"minf", full_box(b"vmhd", 0, 1, bytes(8)), dinf, stbl)
    trak = box(b"trak", tkhd, box(b"mdia", mdhd, hdlr, minf))
    mvex = box(b"mvex", full_box(b"trex", 0, 0, struct.pack(">IIIII", 1, 1, 0, 0, 0)))
    return ftyp + box(b"moov", mvhd, trak, mvex)


def fragment(sequence: int, base_decode_time: int, sample_duration: int, samples: list[tuple[bytes, bool]]) -> bytes:
    """``moof`` + ``mdat`` for ``samples`` (AVCC access units, is sync) starting at ``base_decode_time``."""
    entries = b"".join(
        struct.pack(">II", len(data), SYNC_SAMPLE_FLAGS if sync else NON_SYNC_SAMPLE_FLAGS) for data, sync in samples
    )

    def moof(data_offset: int) -> bytes:
        tfhd = full_box(b"tfhd", 0, 0x020008, struct.pack(">II", 1, sample_duration))  # base is moof; default duration
        tfdt = full_box(b"tfdt", 1, 0, struct.pack(">Q", base_decode_time))
        trun = full_box(b"trun", 0, 0x000601, struct.pack(">Ii", len(samples), data_offset), entries)
        return box(b"moof", full_box(b"mfhd", 0, 0, struct.pack(">I", sequence)), box(b"traf", tfhd, tfdt, trun))

    size = len(moof(0))
    return moof(size + 8) + box(b"mdat", *(data for data, _ in samples))


class FragmentedMP4Stream:
    """One H.264 track as fragmented MP4: :meth:`encode_chunk` returns that chunk's bytes, init segment first."""

    def __init__(self, width: int, height: int, *, quality: int, fps: Fraction) -> None:
        self.width, self.height = width + width % 2, height + height % 2  # H264Stream pads to even sizes
        self._h264 = H264Stream(width, height, quality=quality, fps=max(1, round(fps)))
        self._sample_duration = round(TIMESCALE / fps)
        self._sequence = 0
        self._decode_time = 0
        self.codec_string: str | None = None

    def encode_chunk(self, frames: np.ndarray) -> bytes:
        """A chunk's uint8 ``[F, H, W, 3]`` RGB frames as one fragment (after the init segment on the first)."""
        prefix = b""
        samples = []
        for frame in frames:
            access_unit, keyframe = self._h264.encode(frame)
            units = nal_units(access_unit)
            if self.codec_string is None:
                sps = next((u for u in units if u[0] & 0x1F == NAL_SPS), None)
                pps = next((u for u in units if u[0] & 0x1F == NAL_PPS), None)
                if sps is None or pps is None or not keyframe:
                    raise RuntimeError("the stream's first access unit is not a keyframe with its SPS and PPS")
                prefix = init_segment(sps, pps, self.width, self.height)
                self.codec_string = avc_codec_string(sps)
            # Parameter sets live in avcC; access unit delimiters are not samples' business.
            kept = [u for u in units if u[0] & 0x1F not in (NAL_SPS, NAL_PPS, NAL_AUD)]
            samples.append((b"".join(struct.pack(">I", len(u)) + u for u in kept), keyframe))
        self._sequence += 1
        body = fragment(self._sequence, self._decode_time, self._sample_duration, samples)
        self._decode_time += self._sample_duration * len(samples)
        return prefix + body

    def close(self) -> None:
        self._h264.close()


class FragmentedMP4ChunkEncoder:
    """The encoder pool's chunk encoder for an fMP4 codec name (:func:`fmp4_codec`): one message per chunk."""

    def __init__(self, codec: str, quality: int) -> None:
        self.codec = codec
        self.quality = quality
        self._fps = fps_of_codec(codec)
        self._stream: FragmentedMP4Stream | None = None

    def encode(self, frames: np.ndarray, *, chunk_index: int, tick_id: int) -> list[bytes]:
        if self._stream is None:
            _, height, width, _ = frames.shape
            self._stream = FragmentedMP4Stream(width, height, quality=self.quality, fps=self._fps)
        return [self._stream.encode_chunk(frames)]

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

"""The codec table: every frame codec the server encodes, by name (as static/decode.js has for the page).

Each entry says which encoder class a session with that codec gets, which id
its binary frames carry in the ARF1 header (:class:`arstream.app.wire.Codec`,
whose member names are the codecs' names; none for the realtime dialect's
fMP4, which is not sent in ARF1 frames), which decoder a client reads them
with (:class:`FrameDecoder` picks it by the header's id), and the optional
dependency it needs. A codec whose dependency is missing is
refused where it is named: ``--codec`` at start-up (settings.py) and a
``start`` message's ``codec`` (protocol.py), never at the first chunk.

A new codec: its header id in ``wire.Codec``, an encoder class answering
:class:`ChunkEncoder` and a decoder answering :class:`PayloadDecoder`, one entry in :data:`CODECS` and its
name in :data:`CodecName` (the type checker's copy of the table's names); the page's decoder in
static/decode.js (the page offers what ``GET /v1/codecs`` lists and it can decode). tests/test_codec.py
has the tests to copy (round trip, refusal when its dependency is missing).

Import order, one way only: this module imports the encoders (video.py,
fmp4.py), which import only the wire format; encoding.py imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from arstream.app import fmp4, video, wire


class ChunkEncoder(Protocol):
    """Encodes one session's chunks, in order, into complete binary frame messages."""

    codec: str
    quality: int

    def encode(self, frames: np.ndarray, *, chunk_index: int, tick_id: int) -> list[bytes]: ...

    def close(self) -> None:
        """Free codec resources (a video stream's reference frames)."""
        ...


class PayloadDecoder(Protocol):
    """Decodes one session's payloads of one codec, in order, to uint8 ``[H, W, 3]`` RGB (for clients and tests)."""

    def decode(self, header: wire.FrameHeader, payload: bytes | memoryview) -> np.ndarray: ...


class StatelessDecoder:
    """The stateless codecs (raw, JPEG): each payload decoded alone."""

    def decode(self, header: wire.FrameHeader, payload: bytes | memoryview) -> np.ndarray:
        return wire.decode_payload(header, payload)


class FrameEncoder:
    """The stateless codecs (raw, JPEG): each frame encoded alone into one ARF1 message."""

    def __init__(self, codec: str, quality: int) -> None:
        self.codec = codec
        self.quality = quality
        # Resolved once: the name never changes for this encoder (a new codec gets a new encoder).
        self._codec = wire.Codec.from_name(codec)

    def encode(self, frames: np.ndarray, *, chunk_index: int, tick_id: int) -> list[bytes]:
        return wire.encode_chunk(frames, codec=self._codec, quality=self.quality, chunk_index=chunk_index, tick_id=tick_id)

    def close(self) -> None:
        """Holds nothing."""


def _always() -> bool:
    return True


def _h264_available() -> bool:
    # Looked up at call time, so that a test can stand in for a machine without PyAV.
    return video.h264_available()


@dataclass(frozen=True)
class Codec:
    """One row of the codec table."""

    name: str
    header_id: wire.Codec | None  # the ARF1 header's codec byte; None: not carried in ARF1 frames
    encoder: Callable[[str, int], ChunkEncoder]  # (codec name, quality) -> a session's encoder
    decoder: Callable[[], PayloadDecoder] | None  # a client's decoder for one stream; None: not read here
    needs: str | None = None  # the optional dependency, as a user would install it
    available: Callable[[], bool] = _always

    @classmethod
    def arf1(
        cls,
        header_id: wire.Codec,
        encoder: Callable[[str, int], ChunkEncoder],
        decoder: Callable[[], PayloadDecoder],
        needs: str | None = None,
        available: Callable[[], bool] = _always,
    ) -> Codec:
        """A codec carried in ARF1 frames: its name is its header id's (``wire.Codec.JPEG`` -> ``jpeg``)."""
        return cls(header_id.wire_name, header_id, encoder, decoder, needs, available)

    def unavailable_reason(self) -> str | None:
        """Why this process cannot encode the codec (its dependency is missing), or None."""
        return None if self.available() else f"the {self.name} codec needs {self.needs}"


H264_NEEDS = "PyAV with libx264 (pip install 'arstream[video]')"

# The names a client's `start` and --codec take.
CodecName = Literal["jpeg", "raw", "h264"]
CODECS: dict[str, Codec] = {
    codec.name: codec
    for codec in (
        Codec.arf1(wire.Codec.RAW, FrameEncoder, StatelessDecoder),
        Codec.arf1(wire.Codec.JPEG, FrameEncoder, StatelessDecoder),
        Codec.arf1(wire.Codec.H264, video.H264ChunkEncoder, video.H264Decoder, H264_NEEDS, _h264_available),
    )
}
CODEC_NAMES: tuple[str, ...] = tuple(CODECS)
_BY_HEADER_ID = {codec.header_id: codec for codec in CODECS.values()}
# The realtime dialect's fragmented MP4, one name per frame rate (fmp4.fmp4_codec): not a `start` codec, and
# read by browsers' media elements, not here.
FMP4 = Codec(f"{fmp4.CODEC_PREFIX}<fps>", None, fmp4.FragmentedMP4ChunkEncoder, None, H264_NEEDS, _h264_available)


def codec_named(name: str) -> Codec:
    """The table's row for a session codec name (``fmp4/<fps>`` included)."""
    if name.startswith(fmp4.CODEC_PREFIX):
        return FMP4
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; expected one of {list(CODECS)}") from None


def new_encoder(codec: str, quality: int) -> ChunkEncoder:
    """The encoder for a session that asked for ``codec`` at ``quality``."""
    return codec_named(codec).encoder(codec, quality)


def offered_codecs() -> list[dict[str, object]]:
    """What ``GET /v1/codecs`` lists: each codec a `start` may name and this process can encode, with its id."""
    return [
        {"name": codec.name, "id": int(codec.header_id)}
        for codec in CODECS.values()
        if codec.header_id is not None and codec.available()
    ]


class FrameDecoder:
    """Decodes every binary frame message of one session, whatever its codec, with the table's decoders.

    One decoder per codec, made at the codec's first frame; a keyframe (a stateful codec's new stream: a
    reset, a resume) gets a fresh one.
    """

    def __init__(self) -> None:
        self._decoders: dict[wire.Codec, PayloadDecoder] = {}

    def decode_frame(self, message: bytes) -> tuple[wire.FrameHeader, np.ndarray]:
        """Header and uint8 ``[H, W, 3]`` pixels of the session's next binary frame message."""
        header, payload = wire.parse_frame(message)
        return header, self.decode(header, payload)

    def decode(self, header: wire.FrameHeader, payload: bytes | memoryview) -> np.ndarray:
        """The pixels of a parsed frame (:func:`arstream.app.wire.parse_frame`)."""
        decoder = self._decoders.get(header.codec)
        if decoder is None or header.keyframe:
            make = _BY_HEADER_ID[header.codec].decoder
            assert make is not None  # every ARF1 codec has a decoder (Codec.arf1)
            decoder = self._decoders[header.codec] = make()
        return decoder.decode(header, payload)

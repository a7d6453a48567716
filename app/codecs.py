"""The codec table: every frame codec the server encodes, by name (as static/decode.js has for the page).

Each entry says which encoder class a session with that codec gets, which id
its binary frames carry in the ARF1 header (:class:`arstream.app.wire.Codec`;
none for the realtime dialect's fMP4, which is not sent in ARF1 frames), and
the optional dependency it needs. A codec whose dependency is missing is
refused where it is named: ``--codec`` at start-up (settings.py) and a
``start`` message's ``codec`` (protocol.py), never at the first chunk.

A new codec: its header id in ``wire.Codec``, an encoder class answering
:class:`ChunkEncoder`, one entry in :data:`CODECS` and its name in
:data:`CodecName`; the page's decoder in static/decode.js. tests/test_codec.py
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
    needs: str | None = None  # the optional dependency, as a user would install it
    available: Callable[[], bool] = _always

    def unavailable_reason(self) -> str | None:
        """Why this process cannot encode the codec (its dependency is missing), or None."""
        return None if self.available() else f"the {self.name} codec needs {self.needs}"


H264_NEEDS = "PyAV with libx264 (pip install 'arstream[video]')"

# The names a client's `start` and --codec take.
CodecName = Literal["jpeg", "raw", "h264"]
CODECS: dict[str, Codec] = {
    codec.name: codec
    for codec in (
        Codec("raw", wire.Codec.RAW, FrameEncoder),
        Codec("jpeg", wire.Codec.JPEG, FrameEncoder),
        Codec("h264", wire.Codec.H264, video.H264ChunkEncoder, H264_NEEDS, _h264_available),
    )
}
# The realtime dialect's fragmented MP4, one name per frame rate (fmp4.fmp4_codec): not a `start` codec.
FMP4 = Codec(f"{fmp4.CODEC_PREFIX}<fps>", None, fmp4.FragmentedMP4ChunkEncoder, H264_NEEDS, _h264_available)


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

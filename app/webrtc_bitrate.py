"""Per-session bitrate bounds for the WebRTC track's encoder (aiortc's H.264 and VP8; PROTOCOL.md, "Who encodes").

aiortc encodes a track's frames at a target bitrate that starts at its codec's default and follows the
browser's REMB estimates, clamped to bounds that are constants of its codec modules (H.264 500 kbps to
3 Mbps, VP8 250 kbps to 1.5 Mbps) and the same for every peer connection in the process. Changing those
constants would change every sender at once, so each session's sender gets an encoder of its own instead: the
codec's encoder with the target clamped to the server's bounds (``--webrtc-min-bitrate-kbps``,
``--webrtc-max-bitrate-kbps``), where a bound not set stays aiortc's.

aiortc creates a sender's encoder when the first frame is sent, unless the sender already holds one. It keeps
that slot private: :func:`install_encoder` fills it before the first frame, and is the only place that does (it
refuses a sender without that slot, so another aiortc series fails the tests rather than sending unbounded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiortc.codecs import h264, vpx
from av.frame import Frame

# Where aiortc's RTCRtpSender keeps its encoder (None until its first frame; read by its RTCP handler for REMB).
_SENDER_ENCODER_SLOT = "_RTCRtpSender__encoder"


@dataclass(frozen=True)
class BitrateBounds:
    """The server's bounds in bits per second; None: the codec's own (aiortc's)."""

    min_bps: int | None = None
    max_bps: int | None = None

    @classmethod
    def from_kbps(cls, min_kbps: int | None, max_kbps: int | None) -> BitrateBounds:
        return cls(None if min_kbps is None else min_kbps * 1000, None if max_kbps is None else max_kbps * 1000)

    def for_codec(self, codec_min_bps: int, codec_max_bps: int) -> tuple[int, int]:
        """The (lowest, highest) target for a codec whose own bounds are given; a server bound replaces the
        codec's, and a lone server maximum below the codec's minimum lowers that minimum to it."""
        highest = codec_max_bps if self.max_bps is None else self.max_bps
        lowest = min(codec_min_bps, highest) if self.min_bps is None else self.min_bps
        return lowest, max(lowest, highest)


class BitrateBounded:
    """What a bounded encoder adds to aiortc's: its target bitrate clamped to the session's bounds (at the start
    and at each REMB estimate the sender's RTCP handler sets), and its encoded bytes counted. It comes first in a
    bounded encoder's bases, so its ``target_bitrate`` is the one aiortc's sender reads and sets."""

    lowest_bps: int
    highest_bps: int
    payload_bytes: int  # the encoded frames' RTP payloads, counted
    _target_bps: int

    def _bound(self, bounds: BitrateBounds, codec_min_bps: int, codec_max_bps: int, codec_default_bps: int) -> None:
        self.lowest_bps, self.highest_bps = bounds.for_codec(codec_min_bps, codec_max_bps)
        self.payload_bytes = 0
        self.target_bitrate = codec_default_bps

    def _target_changed(self) -> None:
        """What a codec keeps of the target beside aiortc's property (none but VP8's rate buffer)."""

    def _counted(self, encoded: tuple[list[bytes], int]) -> tuple[list[bytes], int]:
        self.payload_bytes += sum(len(payload) for payload in encoded[0])
        return encoded

    @property
    def target_bitrate(self) -> int:
        return self._target_bps

    @target_bitrate.setter
    def target_bitrate(self, bitrate: int) -> None:
        self._target_bps = max(self.lowest_bps, min(int(bitrate), self.highest_bps))
        self._target_changed()


class BoundedH264Encoder(BitrateBounded, h264.H264Encoder):
    """aiortc's H.264 encoder with its target bitrate held within this session's bounds."""

    def __init__(self, bounds: BitrateBounds) -> None:
        super().__init__()
        self._bound(bounds, h264.MIN_BITRATE, h264.MAX_BITRATE, h264.DEFAULT_BITRATE)

    def encode(self, frame: Frame, force_keyframe: bool = False) -> tuple[list[bytes], int]:
        return self._counted(super().encode(frame, force_keyframe))


class BoundedVp8Encoder(BitrateBounded, vpx.Vp8Encoder):
    """aiortc's VP8 encoder with its target bitrate held within this session's bounds."""

    def __init__(self, bounds: BitrateBounds) -> None:
        super().__init__()
        self._bound(bounds, vpx.MIN_BITRATE, vpx.MAX_BITRATE, vpx.DEFAULT_BITRATE)

    def encode(self, frame: Frame, force_keyframe: bool = False) -> tuple[list[bytes], int]:
        return self._counted(super().encode(frame, force_keyframe))

    def _target_changed(self) -> None:
        # aiortc sizes libvpx's rate-control buffer from its own copy of the target (one second of it): keep that
        # copy equal to the bounded target.
        self._Vp8Encoder__target_bitrate = self._target_bps


BoundedEncoder = BoundedH264Encoder | BoundedVp8Encoder


def bounded_encoder(codec: str | None, bounds: BitrateBounds) -> BoundedEncoder | None:
    """The bounded encoder for a negotiated codec name (``H264``, ``VP8``), or None for another codec."""
    name = (codec or "").upper()
    if name == "H264":
        return BoundedH264Encoder(bounds)
    if name == "VP8":
        return BoundedVp8Encoder(bounds)
    return None


def install_encoder(sender: Any, encoder: BoundedEncoder) -> None:
    """Give a sender its encoder before its first frame (it would otherwise make aiortc's own, unbounded)."""
    if getattr(sender, _SENDER_ENCODER_SLOT, "missing") is not None:
        raise RuntimeError("the sender already has an encoder, or aiortc keeps it elsewhere")
    setattr(sender, _SENDER_ENCODER_SLOT, encoder)

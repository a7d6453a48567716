"""A WebRTC peer connection and the video track a session's frames go on (aiortc; PROTOCOL.md, "WebRTC video").

:class:`WebRTCDelivery` answers one complete (non-trickle) offer and sends a :class:`ChunkTrack`, whose
frames are numbered from 0 and whose RTP timestamps follow from their numbers once the sender's random
origin is known. What a protocol-1 session does with it is :mod:`arstream.app.webrtc`'s.

The track's frames are the session's raw pixels: aiortc's own encoder (H.264 where the browser offers
it, else VP8) encodes them once, answers the browser's picture-loss requests with a keyframe, and
adapts its bitrate to the browser's REMB estimates, within the server's per-session bounds
(:mod:`arstream.app.webrtc_bitrate`). The server's own H.264 encoder is not used on this path.

aiortc is the ``webrtc`` extra: without it a ``webrtc_offer`` is refused with ``webrtc_failed``.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .webrtc_ports import HostCandidates, PortsExhausted, bound_host_candidates
from .wire import Codec, decode_payload, parse_frame

if TYPE_CHECKING:
    import av

try:
    from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
    from aiortc.rtcrtpsender import RTCRtpSender

    from .webrtc_bitrate import BitrateBounds, BoundedEncoder, bounded_encoder, install_encoder

    AVAILABLE = True
except ImportError:  # the webrtc extra is not installed
    AVAILABLE = False
    MediaStreamTrack = object  # type: ignore[misc,assignment]

log = logging.getLogger("arstream.webrtc")

# RTP's video clock: a track frame n carries the RTP timestamp origin + n * (VIDEO_CLOCK_HZ // fps).
VIDEO_CLOCK_HZ = 90_000
RTP_TIMESTAMP_MODULUS = 2**32
# Frames waiting for the encoder, at most; past it the oldest is dropped (a late frame is worth less than
# the newest one, and a peer that stopped taking frames must not hold the server's memory).
MAX_QUEUED_FRAMES = 64
# The codecs the answer prefers, in order, among those the offer lists.
PREFERRED_CODECS = ("video/H264", "video/VP8")

# Every peer connection this process holds, from the offer taken to its close (counted in /v1/stats, capped by
# `webrtc_max_peers`, and by the tests).
_open_peers: set[WebRTCDelivery] = set()


class ChannelInputCounts:
    """Inputs this process read on `inputs` data channels (counted in /v1/stats): taken (staged for a chunk) and
    overtaken (dropped: a newer one already held)."""

    def __init__(self) -> None:
        self.taken = 0
        self.overtaken = 0


channel_inputs = ChannelInputCounts()


class WebRTCError(Exception):
    """An offer the server cannot answer; the message says why (sent as ``webrtc_failed``)."""


def open_peer_connections() -> int:
    """How many peer connections this process holds open."""
    return len(_open_peers)


def open_encoders() -> list[BoundedEncoder]:
    """The encoder of each open peer connection whose codec is known (its ``target_bitrate`` is in bits per
    second; its ``codec`` is the libx264 or libvpx context, once a frame was encoded)."""
    return [peer.encoder for peer in _open_peers if peer.encoder is not None]


def frame_step(fps: float) -> int:
    """The RTP timestamp step between two frames of a track at ``fps``."""
    return max(1, round(VIDEO_CLOCK_HZ / max(fps, 1e-3)))


class ChunkTrack(MediaStreamTrack):
    """A video track fed with a session's frames as its chunks are made; numbered from 0."""

    kind = "video"

    def __init__(self, fps: float) -> None:
        super().__init__()
        self.step = frame_step(fps)
        self._queued: deque[av.VideoFrame] = deque()
        self._wake = asyncio.Event()
        self.frames_in = 0  # track frame numbers given out so far
        self.frames_dropped = 0  # dropped while the encoder was behind
        self.sender: Any = None  # the RTCRtpSender that takes this track's frames
        self._last_pts: int | None = None  # the pts of the frame the sender took last
        # The RTP timestamp of track frame 0 (the sender starts at a random one), once its first frame left.
        self.rtp_origin: int | None = None
        self.origin_known = asyncio.Event()

    def rtp_timestamp(self, frame_number: int) -> int | None:
        """The RTP timestamp a track frame carries, once the sender's origin is known."""
        if self.rtp_origin is None:
            return None
        return (self.rtp_origin + frame_number * self.step) % RTP_TIMESTAMP_MODULUS

    def push(self, frames: Sequence[Any]) -> int:
        """Queue RGB frames (height x width x 3 uint8); returns the track frame number of the first."""
        import av

        first = self.frames_in
        for rgb in frames:
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = self.frames_in * self.step
            frame.time_base = fractions.Fraction(1, VIDEO_CLOCK_HZ)
            self.frames_in += 1
            if len(self._queued) >= MAX_QUEUED_FRAMES:
                self._queued.popleft()
                self.frames_dropped += 1
            self._queued.append(frame)
        self._wake.set()
        return first

    async def recv(self) -> av.VideoFrame:
        self._learn_origin()
        while not self._queued:
            if self.readyState != "live":
                from aiortc.mediastreams import MediaStreamError

                raise MediaStreamError
            self._wake.clear()
            await self._wake.wait()
        frame = self._queued.popleft()
        self._last_pts = frame.pts
        return frame

    def _learn_origin(self) -> None:
        """The sender asks for the next frame only once it has sent every packet of the last one, so its last
        RTP timestamp is that frame's: the origin follows. aiortc keeps that timestamp private (read here
        and only here; the tests check the mapping against the pictures a browser shows)."""
        if self.rtp_origin is not None or self._last_pts is None or self.sender is None:
            return
        sent = getattr(self.sender, "_RTCRtpSender__rtp_timestamp", None)
        if isinstance(sent, int) and sent != 0:
            self.rtp_origin = (sent - self._last_pts) % RTP_TIMESTAMP_MODULUS
            self.origin_known.set()

    def stop(self) -> None:
        super().stop()
        self._wake.set()
        self.origin_known.set()


def _prefer_codecs(transceiver: Any) -> None:
    """Put H.264 first, then VP8, among the codecs this side can send (the offer's order decides otherwise)."""
    capabilities = RTCRtpSender.getCapabilities("video").codecs
    ordered = [c for name in PREFERRED_CODECS for c in capabilities if c.mimeType == name]
    ordered += [c for c in capabilities if c not in ordered]
    transceiver.setCodecPreferences(ordered)


def negotiated_codec(sdp: str) -> str | None:
    """The first codec of the answer's video section (what the track is sent in), e.g. ``H264``."""
    in_video, first_payload = False, None
    for line in sdp.splitlines():
        if line.startswith("m="):
            in_video = line.startswith("m=video")
            first_payload = line.split()[3] if in_video and len(line.split()) > 3 else None
        elif in_video and first_payload is not None and line.startswith(f"a=rtpmap:{first_payload} "):
            return line.split()[1].split("/")[0]
    return None


class WebRTCDelivery:
    """One protocol-1 session's peer connection and its video track."""

    def __init__(self, fps: float, on_state: Callable[[str], None], on_channel: Callable[[Any], None],
                 host_candidates: HostCandidates | None = None, min_bitrate_kbps: int | None = None,
                 max_bitrate_kbps: int | None = None) -> None:
        if not AVAILABLE:
            raise WebRTCError("this server has no WebRTC (install the webrtc extra)")
        self.track = ChunkTrack(fps)
        _open_peers.add(self)  # its slot, held until close()
        self._on_state = on_state
        self._on_channel = on_channel  # a data channel the client opened (RTCDataChannel)
        self._host_candidates = host_candidates or HostCandidates()  # None: as aioice gathers them
        self._bitrate = BitrateBounds.from_kbps(min_bitrate_kbps, max_bitrate_kbps)  # None: aiortc's own
        self.encoder: BoundedEncoder | None = None  # the track's encoder, once the answer chose the codec
        self._pc: Any = None
        self.codec: str | None = None
        self.state = "new"
        self.settled = asyncio.Event()  # connected, failed or closed: what the connect deadline waits for
        self.ended = asyncio.Event()  # failed or closed

    @property
    def connected(self) -> bool:
        return self.state == "connected"

    async def answer(self, offer_sdp: str) -> str:
        """Answer a complete (non-trickle) offer; returns the answer's SDP, with the server's candidates."""
        # The server's own candidates are its host addresses (or the advertised one) only: no STUN or TURN server
        # of its own (aiortc's default would ask a public STUN server). A client behind NAT reaches them through the
        # relay the ICE servers name (`ready.webrtc.ice_servers`).
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self._pc = pc

        @pc.on("connectionstatechange")
        def changed() -> None:
            self._state(pc.connectionState)

        pc.on("datachannel", self._on_channel)

        # The track's transceiver comes first, so that the offer's video section takes it and the codec
        # preference applies when the offer is read (aiortc picks the codecs there).
        sending = pc.addTransceiver(self.track, direction="sendonly")
        self.track.sender = sending.sender
        _prefer_codecs(sending)
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
        except Exception as exc:  # noqa: BLE001 - aiortc raises ValueError and others on SDP it cannot use
            raise WebRTCError(f"the offer's SDP cannot be used: {exc}") from None
        video = [t for t in pc.getTransceivers() if t.kind == "video" and t.mid is not None]
        if len(video) != 1 or video[0] is not sending:
            raise WebRTCError(f"the offer must have exactly one video section, not {len(video)}")
        if self._host_candidates.adapted:
            bound_host_candidates(pc, self._host_candidates)
        try:
            await pc.setLocalDescription(await pc.createAnswer())  # gathers the server's candidates
        except PortsExhausted as exc:
            raise WebRTCError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - no codec in common, a direction the server cannot send
            raise WebRTCError(f"no answer to this offer: {exc}") from None
        sdp: str = pc.localDescription.sdp
        self.codec = negotiated_codec(sdp)
        # The sender takes its first frame once DTLS is up, after this answer: its encoder is ours from the start.
        self.encoder = bounded_encoder(self.codec, self._bitrate)
        if self.encoder is not None:
            install_encoder(sending.sender, self.encoder)
        return sdp

    def push_chunk(self, frame_messages: Sequence[bytes]) -> int | None:
        """Put a chunk's frames on the track; returns its first track frame number, or None when the
        frames are not raw pixels (a chunk made before the session switched to raw goes on the WebSocket)."""
        pixels = []
        for message in frame_messages:
            header, payload = parse_frame(message)
            if header.codec is not Codec.RAW:
                return None
            pixels.append(decode_payload(header, payload))
        return self.track.push(pixels)

    def _state(self, state: str) -> None:
        if state == self.state or self._pc is None:  # unchanged, or closed here (the session is ending)
            return
        self.state = state
        if state in ("connected", "failed", "closed"):
            self.settled.set()
            if state != "connected":
                self.ended.set()
            self._on_state(state)

    async def close(self) -> None:
        """Close the peer connection (every session end comes here)."""
        self.track.stop()
        pc, self._pc = self._pc, None
        try:
            if pc is not None:
                # Shielded: a close cancelled half-way would cancel the future aiortc's own close (begun when the
                # peer's DTLS closed) completes, and that close would fail.
                closing = asyncio.ensure_future(pc.close())
                closing.add_done_callback(_log_close_failure)
                await asyncio.shield(closing)
        finally:
            _open_peers.discard(self)


def _log_close_failure(closing: asyncio.Future[None]) -> None:
    if not closing.cancelled() and closing.exception() is not None:
        log.warning("a peer connection did not close cleanly: %r", closing.exception())

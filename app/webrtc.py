"""WebRTC video delivery for protocol-1 sessions (PROTOCOL.md, "WebRTC video").

The session's WebSocket stays the control plane and carries the signalling: the client sends one
``webrtc_offer`` (non-trickle: its ICE candidates inside the SDP), the server answers with
``webrtc_answer`` (its candidates inside too). Once the peer connection is connected, each chunk's
frames go on one video track instead of as binary WebSocket messages; the chunk's ``chunk`` message
still goes on the WebSocket and says which track frames hold it, so a client maps what it shows back
to its chunk and tick.

The track's frames are the session's raw pixels: aiortc's own encoder (H.264 where the browser offers
it, else VP8) encodes them once, answers the browser's picture-loss requests with a keyframe, and
adapts its bitrate to the browser's REMB estimates. The server's own H.264 encoder is not used on this
path.

aiortc is the ``webrtc`` extra: without it a ``webrtc_offer`` is refused with ``webrtc_failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .protocol import ErrorCode, ProtocolError, dumps, error_message
from .wire import Codec, decode_payload, parse_frame

if TYPE_CHECKING:
    import av

    from .live_session import LiveSession
    from .worker import TickOutcome

try:
    from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription
    from aiortc.rtcrtpsender import RTCRtpSender

    AVAILABLE = True
except ImportError:  # the webrtc extra is not installed
    AVAILABLE = False
    MediaStreamTrack = object  # type: ignore[misc,assignment]

log = logging.getLogger("arstream.webrtc")

# RTP's video clock: a track frame n carries the RTP timestamp origin + n * (VIDEO_CLOCK_HZ // fps).
VIDEO_CLOCK_HZ = 90_000
RTP_TIMESTAMP_MODULUS = 2**32
# How long the first chunk on the track waits for its first frame to leave, so that its `chunk` message can
# carry the RTP timestamp (the encoder takes milliseconds; a stuck one must not hold the session's writer).
FIRST_FRAME_WAIT_S = 2.0
# Frames waiting for the encoder, at most; past it the oldest is dropped (a late frame is worth less than
# the newest one, and a peer that stopped taking frames must not hold the server's memory).
MAX_QUEUED_FRAMES = 64
# The codecs the answer prefers, in order, among those the offer lists.
PREFERRED_CODECS = ("video/H264", "video/VP8")

# Every peer connection this process holds open (counted in /v1/stats and by the tests).
_open_peers: set[Any] = set()


class WebRTCError(Exception):
    """An offer the server cannot answer; the message says why (sent as ``webrtc_failed``)."""


def open_peer_connections() -> int:
    """How many peer connections this process holds open."""
    return len(_open_peers)


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

    def __init__(self, fps: float, on_state: Callable[[str], None]) -> None:
        if not AVAILABLE:
            raise WebRTCError("this server has no WebRTC (install the webrtc extra)")
        self.track = ChunkTrack(fps)
        self._on_state = on_state
        self._pc: Any = None
        self.codec: str | None = None
        self.state = "new"

    @property
    def connected(self) -> bool:
        return self.state == "connected"

    async def answer(self, offer_sdp: str) -> str:
        """Answer a complete (non-trickle) offer; returns the answer's SDP, with the server's candidates."""
        pc = RTCPeerConnection()
        self._pc = pc
        _open_peers.add(pc)

        @pc.on("connectionstatechange")
        def changed() -> None:
            self._state(pc.connectionState)

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
        try:
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as exc:  # noqa: BLE001 - no codec in common, a direction the server cannot send
            raise WebRTCError(f"no answer to this offer: {exc}") from None
        sdp: str = pc.localDescription.sdp
        self.codec = negotiated_codec(sdp)
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
            self._on_state(state)

    async def close(self) -> None:
        """Close the peer connection (every session end comes here)."""
        self.track.stop()
        pc, self._pc = self._pc, None
        if pc is None:
            return
        try:
            await pc.close()
        finally:
            _open_peers.discard(pc)


class SessionVideo:
    """A protocol-1 controller's WebRTC path: the offer it answers, the track its chunks go on once
    connected, and the codec switch that comes with it (the session makes raw pixels for the track
    while connected, and goes back to its own codec, on the WebSocket, if the connection fails)."""

    def __init__(self, live: LiveSession) -> None:
        self._live = live
        self._delivery: WebRTCDelivery | None = None
        self._answering: asyncio.Task[None] | None = None
        self._own_format: tuple[str, int] | None = None  # the session's codec and quality before the switch
        self._closing = False

    def offer(self, sdp: str) -> None:
        """Answer ``webrtc_offer`` (once per session); refusals are ``webrtc_failed``, the session goes on."""
        if self._delivery is not None:
            raise ProtocolError(ErrorCode.WEBRTC_FAILED, "this session already has a peer connection")
        session = self._live.session
        assert session is not None
        if not self._live.settings.webrtc:
            raise ProtocolError(ErrorCode.WEBRTC_FAILED, "this server does not offer WebRTC (--webrtc is off)")
        fps = float(self._live.gate.model_card.get("fps") or 30)
        try:
            self._delivery = WebRTCDelivery(fps, self._state_changed)
        except WebRTCError as exc:
            raise ProtocolError(ErrorCode.WEBRTC_FAILED, str(exc)) from None
        self._answering = asyncio.create_task(self._answer(self._delivery, sdp), name=f"webrtc-{session.id}")

    async def _answer(self, delivery: WebRTCDelivery, sdp: str) -> None:
        live = self._live
        try:
            answer = await delivery.answer(sdp)
        except Exception as exc:  # noqa: BLE001 - any failure to answer leaves the session on the WebSocket
            if not isinstance(exc, WebRTCError):
                log.exception("session=%s webrtc answer failed", live.session_id)
            detail = str(exc) if isinstance(exc, WebRTCError) else "the server could not answer this offer"
            live.reply(error_message(ErrorCode.WEBRTC_FAILED, detail))
            self._delivery = None  # the client may offer again
            await delivery.close()
            return
        live.reply({"type": "webrtc_answer", "sdp": answer, "codec": delivery.codec})
        log.info("session=%s webrtc answered codec=%s", live.session_id, delivery.codec)

    def _state_changed(self, state: str) -> None:
        live, session = self._live, self._live.session
        if session is None or self._closing:
            return
        if state == "connected" and self._own_format is None:
            self._own_format = (session.codec, session.quality)
            session.codec = "raw"  # pixels for the track; nothing of it crosses the WebSocket
            self._replan_viewers()
        elif state != "connected":
            self._restore_format()
        log.info("session=%s webrtc %s", live.session_id, state)
        live.notify({"type": "webrtc_state", "state": state})

    def _restore_format(self) -> None:
        """The session makes frames in its own codec again (for the WebSocket)."""
        session = self._live.session
        if self._own_format is not None and session is not None:
            session.codec, session.quality = self._own_format
            self._replan_viewers()
        self._own_format = None

    def _replan_viewers(self) -> None:
        """The session's own frames changed format: its viewers' formats are now encoded apart (or shared)."""
        session = self._live.session
        if session is not None:
            session.viewer_formats = self._live.gate.shares.formats_needed(session.id, (session.codec, session.quality))

    def stop_sending(self) -> None:
        """From now on the session's frames go on the WebSocket, in its own codec (control passes to a viewer,
        whose frames come on its own socket); the peer connection is closed with the socket."""
        self._closing = True
        self._restore_format()

    async def send_chunk(self, outcome: TickOutcome, header: dict[str, Any]) -> bool:
        """Send a chunk by the track (its `chunk` message on the WebSocket says which track frames hold it);
        False when the chunk goes on the WebSocket as binary frames instead."""
        delivery = self._delivery
        if delivery is None or not delivery.connected or self._closing:
            return False
        first = delivery.push_chunk(outcome.frame_messages)
        if first is None:
            return False
        track = delivery.track
        if not track.origin_known.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(track.origin_known.wait(), FIRST_FRAME_WAIT_S)
        message = {**header, "delivery": "webrtc", "track_frame": first}
        rtp_timestamp = track.rtp_timestamp(first)
        if rtp_timestamp is not None:
            message["rtp_timestamp"] = rtp_timestamp
        await self._live.ws.send_text(dumps(message))
        return True

    async def close(self) -> None:
        """Close the peer connection: on every end of the session."""
        self.stop_sending()
        if self._answering is not None and not self._answering.done():
            self._answering.cancel()
            await asyncio.wait({self._answering})
        delivery, self._delivery = self._delivery, None
        if delivery is not None:
            await delivery.close()

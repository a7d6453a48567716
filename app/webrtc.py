"""WebRTC video delivery for protocol-1 sessions (PROTOCOL.md, "WebRTC video").

The session's WebSocket stays the control plane and carries the signalling: the client sends one
``webrtc_offer`` (non-trickle: its ICE candidates inside the SDP), the server answers with
``webrtc_answer`` (its candidates inside too). Once the peer connection is connected, each chunk's
frames go on one video track (:mod:`arstream.app.webrtc_track`) instead of as binary WebSocket messages;
the chunk's ``chunk`` message still goes on the WebSocket and says which track frames hold it, so a
client maps what it shows back to its chunk and tick.

The track's frames are the session's raw pixels: aiortc's own encoder (H.264 where the browser offers
it, else VP8) encodes them once, answers the browser's picture-loss requests with a keyframe, and
adapts its bitrate to the browser's REMB estimates. The server's own H.264 encoder is not used on this
path.

aiortc is the ``webrtc`` extra: without it (or without ``--webrtc``) a ``webrtc_offer`` is refused with
``webrtc_failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .dialect import ChunkSent
from .outbox import QueuedText, ViewerChunk
from .protocol import ErrorCode, InputMessage, PingMessage, ProtocolError, WebRTCAnswerMessage, WebRTCStateMessage
from .protocol import dumps, error_message, parse_client_message, pong_message, too_large
from .webrtc_ice import ice_servers_for
from .webrtc_ports import HostCandidates
from .webrtc_track import AVAILABLE, WebRTCDelivery, WebRTCError, channel_inputs, open_peer_connections
from .writer import observe_action_to_frame

if TYPE_CHECKING:
    from .dialect import SessionPort
    from .settings import Settings
    from .worker import TickOutcome

log = logging.getLogger("arstream.webrtc")

# How long the first chunk on the track waits for its first frame to leave, so that its `chunk` message can
# carry the RTP timestamp (the encoder takes milliseconds; a stuck one must not hold the session's writer).
FIRST_FRAME_WAIT_S = 2.0


# The label of the data channel a client sends its inputs on (latest wins); another label's channel is closed.
INPUT_CHANNEL = "inputs"


def webrtc_ice_servers(settings: Settings, session_id: str) -> list[dict[str, Any]] | None:
    """`ready.webrtc.ice_servers` for a session, or None when this server does not answer offers."""
    if not (settings.webrtc and AVAILABLE):
        return None
    return ice_servers_for(settings, session_id)


class InputTaker(Protocol):
    """The dialect's staging of an `input` (its checks raise ProtocolError); True: a recent duplicate."""

    def __call__(self, live: SessionPort, message: InputMessage, *, latest_wins: bool) -> bool: ...


class SessionVideo:
    """A protocol-1 socket's delivery: the offer it answers, the track its chunks go on once connected (the
    WebSocket otherwise), and the format switch that comes with it.

    A controller's session makes raw pixels for the track while connected, and goes back to its own codec, on
    the WebSocket, if the connection fails. A viewer is served raw pixels while connected (the controller's own
    frames when it is on a track too, else encoded apart once per chunk for every such viewer), and its own
    format again otherwise; its `chunk` messages stay on its WebSocket."""

    def __init__(self, take_input: InputTaker, refuse: Callable[[SessionPort, ProtocolError], None]) -> None:
        self._take_input = take_input  # an input from the data channel, staged as the WebSocket's are
        self._refuse = refuse  # a refused channel message: its error goes on the WebSocket
        self.inputs_overtaken = 0  # channel inputs dropped because a newer one was already taken
        self._live: SessionPort | None = None  # the controller's live session, from its first offer
        self._delivery: WebRTCDelivery | None = None
        self._answering: asyncio.Task[None] | None = None
        self._own_format: tuple[str, int] | None = None  # the session's codec and quality before the switch
        self._closing = False
        self._watching = False  # offered by a viewer: its chunks are the audience's (send_viewer_chunk_on_track)
        # A plain attribute, read on every chunk: a session that never offered does not call into this module.
        self.offered = False

    def offer(self, live: SessionPort, sdp: str) -> None:
        """Answer ``webrtc_offer`` (once per session); refusals are ``webrtc_failed``, the session goes on."""
        if self._delivery is not None:
            raise ProtocolError(ErrorCode.WEBRTC_FAILED, "this session already has a peer connection")
        self._live = live
        self._watching = live.watch is not None
        session = live.session
        assert session is not None
        settings = live.gate.settings
        if not settings.webrtc:
            raise ProtocolError(ErrorCode.WEBRTC_FAILED, "this server does not offer WebRTC (--webrtc is off)")
        if open_peer_connections() >= settings.webrtc_max_peers:
            detail = f"this server holds its {settings.webrtc_max_peers} WebRTC peer connections; try again later"
            raise ProtocolError(ErrorCode.WEBRTC_FAILED, detail)
        fps = float(live.gate.model_card.get("fps") or 30)
        try:
            where = HostCandidates(settings.webrtc_port_range(), settings.webrtc_advertised_address)
            self._delivery = WebRTCDelivery(fps, self._state_changed, self._channel_opened, where,
                                            settings.webrtc_min_bitrate_kbps, settings.webrtc_max_bitrate_kbps)
            self.offered = True
        except WebRTCError as exc:
            raise ProtocolError(ErrorCode.WEBRTC_FAILED, str(exc)) from None
        self._answering = asyncio.create_task(self._answer(self._delivery, sdp), name=f"webrtc-{session.id}")

    def _session_id(self) -> str:
        session = None if self._live is None else self._live.session
        return "" if session is None else session.id

    def _reply(self, payload: dict[str, Any]) -> None:
        """An answer to the offer (or its refusal), queued as a reply."""
        assert self._live is not None
        self._live.outbox.push_reply(dumps(payload))
        self._live.check_send_backlog()

    async def _answer(self, delivery: WebRTCDelivery, sdp: str) -> None:
        try:
            answer = await delivery.answer(sdp)
        except Exception as exc:  # noqa: BLE001 - any failure to answer leaves the session on the WebSocket
            if not isinstance(exc, WebRTCError):
                log.exception("session=%s webrtc answer failed", self._session_id())
            detail = str(exc) if isinstance(exc, WebRTCError) else "the server could not answer this offer"
            self._reply(error_message(ErrorCode.WEBRTC_FAILED, detail))
            self._delivery = None  # the client may offer again
            await delivery.close()
            return
        self._reply(WebRTCAnswerMessage(type="webrtc_answer", sdp=answer, codec=delivery.codec).wire())
        log.info("session=%s webrtc answered codec=%s", self._session_id(), delivery.codec)
        assert self._live is not None
        deadline_s = self._live.gate.settings.webrtc_connect_timeout_s
        try:
            await asyncio.wait_for(delivery.settled.wait(), deadline_s)
        except TimeoutError:  # its ICE or DTLS never completed
            log.info("session=%s webrtc not connected within %g s: closed", self._session_id(), deadline_s)
            if not self._closing:
                failed = WebRTCStateMessage(type="webrtc_state", state="failed").wire()
                self._live.outbox.push(QueuedText(dumps(failed)))
        else:
            await delivery.ended.wait()  # it failed or closed, here or after it connected (said by _state_changed)
        # Its slot comes back, and the client may offer again.
        if self._delivery is delivery:
            self._delivery = None
        await delivery.close()

    def _channel_opened(self, channel: Any) -> None:
        if channel.label != INPUT_CHANNEL:
            channel.close()
            return
        channel.on("message", lambda data: self._channel_message(channel, data))

    def _channel_message(self, channel: Any, data: str | bytes) -> None:
        """An `input` (latest wins) or a `ping` on the inputs channel; refusals go on the WebSocket, non-fatal."""
        live = self._live
        session = None if live is None else live.session
        if live is None or session is None or self._closing:
            return  # control passed, or the session ended: the channel's inputs are no longer the session's
        try:
            limit = live.gate.settings.max_message_bytes
            if not isinstance(data, str):
                raise ProtocolError(ErrorCode.INVALID_MESSAGE, "the inputs channel carries text messages")
            if too_large(data, limit):
                raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"channel messages are limited to {limit} bytes")
            parsed = parse_client_message(data)
            if isinstance(parsed, PingMessage):
                channel.send(dumps(pong_message(parsed.t)))
            elif not isinstance(parsed, InputMessage):
                detail = f"the inputs channel carries input and ping, not {parsed.type}"
                raise ProtocolError(ErrorCode.INVALID_MESSAGE, detail)
            elif self._watching:
                raise ProtocolError(ErrorCode.NOT_CONTROLLER, "a viewer may not send input; the controller can pass control")
            elif session.event_floor is not None and parsed.event_id <= session.event_floor:
                self.inputs_overtaken += 1  # a newer input already holds
                channel_inputs.overtaken += 1
            else:
                self._take_input(live, parsed, latest_wins=True)
                channel_inputs.taken += 1
        except ProtocolError as exc:
            self._refuse(live, exc)

    def _state_changed(self, state: str) -> None:
        session = None if self._live is None else self._live.session
        if self._live is None or session is None or self._closing:
            return
        if state == "connected" and self._own_format is None:
            if self._watching:
                role = self._live.watch
                if role is None:  # it took control: its frames are on the WebSocket from then on
                    return
                self._own_format = role.format
                role.format = ("raw", session.quality)  # the controller's own pixels when it is on a track too
            else:
                self._own_format = session.chosen_format = (session.codec, session.quality)
                session.codec = "raw"  # pixels for the track; nothing of it crosses the WebSocket
            self._replan_viewers()
        elif state != "connected":
            self._restore_format()
        log.info("session=%s webrtc %s", session.id, state)
        self._live.outbox.push(QueuedText(dumps(WebRTCStateMessage(type="webrtc_state", state=state).wire())))

    def _restore_format(self) -> None:
        """The session makes frames in its own codec again, or the viewer is served its own format (for the
        WebSocket)."""
        session = None if self._live is None else self._live.session
        if self._own_format is not None and session is not None:
            role = self._live.watch if self._live is not None else None
            if not self._watching:
                session.codec, session.quality = self._own_format
                session.chosen_format = None
            elif role is not None:
                role.format = self._own_format
            self._replan_viewers()
        self._own_format = None

    def _replan_viewers(self) -> None:
        """The session's own frames changed format: its viewers' formats are now encoded apart (or shared)."""
        session = None if self._live is None else self._live.session
        if self._live is not None and session is not None:
            session.viewer_formats = self._live.gate.shares.formats_needed(session.id, (session.codec, session.quality))

    def stop_sending(self) -> None:
        """From now on the session's frames go on the WebSocket, in its own codec (control passes to a viewer,
        whose frames come on its own socket, or a viewer takes control); the peer connection is closed with the
        socket. Called once the pass is sure to happen: nothing undoes it."""
        self._closing = True
        self._restore_format()

    async def send_on_track(self, live: SessionPort, outcome: TickOutcome, header: dict[str, Any]) -> ChunkSent | None:
        """A controller's chunk on the track while it is connected (its `chunk` message on the WebSocket says which
        track frames hold it), or None when the track does not take it (not connected, or not raw pixels): the
        dialect then sends it on the WebSocket."""
        if self._watching:  # a viewer that took control: its peer's format was the audience's
            self.stop_sending()
            return None
        message = await self._put_on_track(outcome.frame_messages, header)
        if message is None:
            return None
        await live.ws.send_text(dumps(message))
        observe_action_to_frame(live, outcome)
        return ChunkSent(len(outcome.frame_messages), 0, on_track=True)

    async def send_viewer_chunk_on_track(self, live: SessionPort, chunk: ViewerChunk, skipped: int) -> ChunkSent | None:
        """A viewer's chunk on its track while it is connected (its `chunk` message on its WebSocket), or None
        when the track does not take it: the writer then sends it on the WebSocket."""
        if not self._watching or live.watch is None:
            return None
        message = await self._put_on_track(chunk.frames, {**chunk.header, "skipped_before": skipped})
        if message is None:
            return None
        await live.ws.send_text(dumps(message))
        return ChunkSent(len(chunk.frames), 0, on_track=True)

    async def _put_on_track(self, frame_messages: Sequence[bytes], header: dict[str, Any]) -> dict[str, Any] | None:
        """Hand a chunk's frames to the track; returns its `chunk` message (which track frames hold it), or None
        when the track does not take it (not connected, or not raw pixels)."""
        delivery = self._delivery
        if delivery is None or not delivery.connected or self._closing:
            return None
        first = delivery.push_chunk(frame_messages)
        if first is None:
            return None
        track = delivery.track
        if not track.origin_known.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(track.origin_known.wait(), FIRST_FRAME_WAIT_S)
        message = {**header, "delivery": "webrtc", "track_frame": first}
        rtp_timestamp = track.rtp_timestamp(first)
        if rtp_timestamp is not None:
            message["rtp_timestamp"] = rtp_timestamp
        return message

    async def close(self) -> None:
        """Close the peer connection: on every end of the session."""
        self.stop_sending()
        if self._answering is not None and not self._answering.done():
            self._answering.cancel()
            await asyncio.wait({self._answering})
        delivery, self._delivery = self._delivery, None
        if delivery is not None:
            await delivery.close()

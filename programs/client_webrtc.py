"""Receive a protocol-1 session's frames on a WebRTC video track (PROTOCOL.md, "WebRTC video"), with aiortc.

    session = Session(await connect(url))
    await session.start(seed=1)
    receiver = TrackReceiver(fps=session.model["fps"], ice_servers=session.ice_servers)
    await session.offer_webrtc(receiver)  # its answer and state are read with the session's next messages
    ...  # tick as usual: a chunk whose `delivery` is "webrtc" has no binary frames, they come on the track
    await receiver.wait_shown()  # before the session's close: frames still on the track then are not sent
    frames = await receiver.close()  # every frame the track showed, in track order

The offer goes on the session's WebSocket with its ICE candidates inside (aiortc gathers them all before its
offer exists); the server answers, and says ``webrtc_state`` ``connected`` when chunks start going on the
track. A refused offer (``webrtc_failed``) or a connection that fails leaves the frames on the WebSocket: the
session reads them there as before. Each decoded frame is numbered on the track by its RTP timestamp (the
receiver counts it from the first frame it got, track frame 0: the offer went before any frame was on the track),
so the frame that first shows a chunk's input gives the key-to-frame time.

Needs the ``webrtc`` extra (aiortc).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

import numpy as np

from ..app.protocol import WebRTCAnswerMessage

RTP_CLOCK_HZ = 90_000


class TrackReceiver:
    """One session's peer connection from the client's side: a recvonly video track, its decoded frames."""

    def __init__(self, fps: float, ice_servers: list[dict[str, Any]] | None = None, relay_only: bool = False) -> None:
        """``ice_servers``: the session's ``ready.webrtc.ice_servers`` (None: aiortc's default); ``relay_only``:
        offer relay candidates only (through those servers' TURN relay), as a client behind a strict NAT would."""
        from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection
        from aiortc.rtcconfiguration import RTCIceTransportPolicy

        self.step = max(1, round(RTP_CLOCK_HZ / fps))
        servers = None if ice_servers is None else [RTCIceServer(**server) for server in ice_servers]
        policy = RTCIceTransportPolicy.RELAY if relay_only else RTCIceTransportPolicy.ALL
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=servers, iceTransportPolicy=policy))
        self.codec: str | None = None  # the server's answer says which
        self.state = "new"  # the server's last webrtc_state ('connected', 'failed', 'closed')
        self.refused: str | None = None  # the webrtc_failed message, when the server refused the offer
        self.frames: dict[int, np.ndarray] = {}  # track frame number -> RGB picture
        self.action_to_frame_s: list[float] = []  # an applied input's send -> the first frame of its chunk shown
        self.first_shown_at = math.nan  # perf_counter when the track showed its first frame
        self._inputs_at: dict[int, list[float]] = {}  # a chunk's first track frame -> when its inputs were sent
        self.frames_sent = 0  # track frames the server's chunk messages announced so far
        self._shown = asyncio.Event()  # set at each frame shown
        self._tasks: set[asyncio.Task[None]] = set()
        self.pc.on("track", self._track)

    async def offer_sdp(self) -> str:
        """The offer: one recvonly video section, every ICE candidate inside."""
        self.pc.addTransceiver("video", direction="recvonly")
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return str(self.pc.localDescription.sdp)

    def answered(self, message: WebRTCAnswerMessage) -> None:
        """``webrtc_answer``: apply it (ICE and DTLS go on in the background)."""
        from aiortc import RTCSessionDescription

        self.codec = message.codec
        self._spawn(self.pc.setRemoteDescription(RTCSessionDescription(sdp=message.sdp, type="answer")))

    def chunk_on_track(self, track_frame: int, frames: int, inputs_sent_at: list[float]) -> None:
        """A ``chunk`` on the track: its first frame, when shown, answers these inputs."""
        if inputs_sent_at:
            self._inputs_at[track_frame] = inputs_sent_at
        self.frames_sent = max(self.frames_sent, track_frame + frames)

    def _track(self, track: Any) -> None:
        self._spawn(self._read(track))

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read(self, track: Any) -> None:
        from aiortc.mediastreams import MediaStreamError

        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            number = int(frame.pts) // self.step  # aiortc counts pts from the first frame it received
            self.frames[number] = frame.to_ndarray(format="rgb24")
            shown_at = time.perf_counter()
            if math.isnan(self.first_shown_at):
                self.first_shown_at = shown_at
            self.action_to_frame_s += [shown_at - sent for sent in self._inputs_at.pop(number, [])]
            self._shown.set()

    async def wait_shown(self, timeout_s: float = 5.0) -> bool:
        """Wait until every frame announced so far but the last is shown (a receiver lets a frame out once the next
        one begins), at most ``timeout_s`` (a lost frame never comes); False if some are missing. Call it before
        the session's ``close``: frames still on the server's track when the session ends are never sent."""

        async def all_in() -> None:
            while not all(number in self.frames for number in range(self.frames_sent - 1)):
                self._shown.clear()
                await self._shown.wait()

        try:
            await asyncio.wait_for(all_in(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self) -> list[np.ndarray]:
        """Close the peer connection; every frame the track showed, in track order (the last frame sent is not
        among them: :meth:`wait_shown`)."""
        await self.pc.close()
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        return [self.frames[number] for number in sorted(self.frames)]

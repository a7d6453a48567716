"""An aiortc client's side of WebRTC video (PROTOCOL.md, "WebRTC video") on a session's WebSocket, for the tests
that play a session on a track (tests/server/test_webrtc.py, tests/cluster/test_webrtc_move.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from servers import ProbeClient

GUARD_S = 30.0  # hang guard only


async def next_of(client: ProbeClient, kind: str, seen: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The next text message of ``kind``, skipping (and keeping in ``seen``) others; binary frames skipped."""
    while True:
        message = await client.recv()
        if isinstance(message, bytes):
            continue
        parsed = json.loads(message)
        if parsed["type"] == kind:
            return parsed
        if seen is not None:
            seen.append(parsed)


async def next_of_either(client: ProbeClient, *kinds: str) -> dict[str, Any]:
    """The next text message of one of ``kinds`` (others and binary frames skipped)."""
    while True:
        message = await client.recv()
        if not isinstance(message, bytes) and (parsed := json.loads(message))["type"] in kinds:
            return dict(parsed)


async def offer_sdp(pc: Any) -> str:
    pc.addTransceiver("video", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())  # aiortc gathers every candidate here
    return str(pc.localDescription.sdp)


async def connect_video(client: ProbeClient, pc: Any = None) -> tuple[Any, asyncio.Future[Any], dict[str, Any]]:
    """Offer, apply the answer, wait until the server says the peer connection is up."""
    pc = pc or aiortc().RTCPeerConnection()
    track: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def on_track(received: Any) -> None:
        if not track.done():
            track.set_result(received)

    pc.on("track", on_track)
    await client.send(type="webrtc_offer", sdp=await offer_sdp(pc))
    answer = await next_of_either(client, "webrtc_answer", "error")
    assert answer["type"] == "webrtc_answer", answer
    await pc.setRemoteDescription(aiortc().RTCSessionDescription(sdp=answer["sdp"], type="answer"))
    state = await next_of(client, "webrtc_state")
    assert state["state"] == "connected", state
    return pc, track, answer


async def play_on_a_new_track(client: ProbeClient, tick_ids: tuple[int, int]) -> tuple[list[dict[str, Any]], list[int]]:
    """Offer a track on ``client`` (a resumed connection offers again), tick twice, and read the first chunk's frames
    off the track: the two chunk messages and the first chunk's mean greens (fake-kv's picture of its index)."""
    pc, track_future, _ = await connect_video(client)
    try:
        chunks = []
        for tick_id in tick_ids:
            await client.send(type="tick", tick_id=tick_id)
            chunks.append(await next_of(client, "chunk"))
        track = await asyncio.wait_for(track_future, GUARD_S)
        greens = []
        for _ in range(chunks[0]["frames"]):  # the first chunk's frames (the last chunk's last is held)
            frame = await asyncio.wait_for(track.recv(), GUARD_S)
            greens.append(int(frame.to_ndarray(format="rgb24")[..., 1].mean().round()))
    finally:
        await pc.close()
    return chunks, greens


def aiortc() -> Any:
    """aiortc, imported where a test runs (its module skips without the webrtc extra)."""
    import aiortc as module

    return module

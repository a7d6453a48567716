"""A drain moves a session that plays on WebRTC (PROTOCOL.md, "WebRTC video"; app/migration.py): two real
servers on loopback, an aiortc client.

The session plays on a track on r0; a drain moves it to r1, whose `moved` the client follows: it resumes on
r1, where the session starts on the WebSocket in its own codec, offers again, and plays on a new track where
the world left off (fake-kv's green channel is the frame's position in the rollout).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from arstream.app import webrtc_track
from arstream.models.fake import FakeKVPipeline
from servers import running_server, session_client, wait_until
from test_migration import cluster_settings, drain
from webrtc_clients import connect_video, next_of, play_on_a_new_track

aiortc = pytest.importorskip("aiortc")

STEP = webrtc_track.frame_step(16)  # fake-kv's frame rate
# Chunks played before the move (on the WebSocket, then on the track): fake-kv's green has grown past the
# near-black values that YUV's limited range clips.
CHUNKS_BEFORE = 20


def test_a_drained_webrtc_session_offers_again_on_the_peer_and_plays_on() -> None:
    async def scenario(r0: Any, r1: Any) -> tuple[dict[str, Any], list[Any], list[dict[str, Any]], list[int]]:
        async with session_client(r0.ws_url, start={"codec": "jpeg", "seed": 3}) as client:
            for tick_id in range(CHUNKS_BEFORE - 2):
                await client.send(type="tick", tick_id=tick_id)
                await client.recv_chunk()
            pc, _, _ = await connect_video(client)
            try:
                for tick_id in (CHUNKS_BEFORE - 2, CHUNKS_BEFORE - 1):
                    await client.send(type="tick", tick_id=tick_id)
                    assert (await next_of(client, "chunk"))["delivery"] == "webrtc"
                response = await asyncio.to_thread(drain, r0, [r1.base_url])
                assert response.status_code == 200 and response.json()["moved"] == 1, response.text
                moved = await next_of(client, "moved")
            finally:
                await pc.close()
        token = moved["resume"]
        async with session_client(f"{r1.ws_url}?resume={token}", start={"resume": token}) as resumed:
            # on the new socket the session starts on the WebSocket, in its own codec
            await resumed.send(type="tick", tick_id=CHUNKS_BEFORE)
            before, frames = await resumed.recv_chunk()
            # the client offers again, to the peer
            chunks, greens = await play_on_a_new_track(resumed, (CHUNKS_BEFORE + 1, CHUNKS_BEFORE + 2))
            await resumed.send(type="close")
            await next_of(resumed, "closed")
            return before, [header.codec.name for header, _ in frames], chunks, greens

    with running_server(cluster_settings("r0", webrtc=True), FakeKVPipeline(width=64, height=64)) as r0:
        with running_server(cluster_settings("r1", webrtc=True), FakeKVPipeline(width=64, height=64)) as r1:
            before, codecs, chunks, greens = asyncio.run(scenario(r0, r1))
            wait_until(lambda: webrtc_track.open_peer_connections() == 0)
            r1.settled(r1.stats()["kv"]["blocks_total"])
    assert before["chunk_index"] == CHUNKS_BEFORE and "delivery" not in before
    assert codecs == ["JPEG"] * before["frames"]
    # the world goes on where it was, on a new track numbered from 0
    assert [(c["chunk_index"], c["delivery"], c["track_frame"]) for c in chunks] == [
        (CHUNKS_BEFORE + 1, "webrtc", 0),
        (CHUNKS_BEFORE + 2, "webrtc", 2),
    ]
    first = 2 * (CHUNKS_BEFORE + 1)
    assert all(abs(green - (first + i)) <= 3 for i, green in enumerate(greens)), greens

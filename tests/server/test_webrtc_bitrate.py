"""Per-session bitrate bounds of the WebRTC track's encoder (--webrtc-min/max-bitrate-kbps; app/webrtc_bitrate.py).

A real server sends a 640x352 stream on a track to an aiortc client; the encoder the server installed on the
session's sender holds its target within the bounds (whatever the client's REMB estimates say), and the bytes
it encodes for a fixed number of frames, all received, stay within the highest bound. fake-kv's flat colours cost
about 50 kbps whatever the target, so the stream here pans a texture over fake-kv's frames: an encoder left
at aiortc's own bounds sends about three times the bound set here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from arstream.app import webrtc_track
from arstream.models.fake import FakeKVPipeline
from servers import LiveServer, fake_settings, running_server, session_client, wait_until
from webrtc_clients import connect_video, next_of

aiortc = pytest.importorskip("aiortc")

from arstream.app.webrtc_bitrate import BitrateBounds, BoundedH264Encoder, BoundedVp8Encoder, install_encoder  # noqa: E402

GUARD_S = 30.0  # hang guard only
FPS = 16  # fake-kv's model card
MIN_KBPS, MAX_KBPS = 100, 300
CHUNKS = 24  # 48 frames, 3 s of video: fewer than the track queues, so none is dropped
# x264 holds its average near the target over a few seconds; the first keyframe and the REMB changes land on
# top (measured: 0.91 of the bound over 64 frames; aiortc's own bounds: 3.3 times it)
SLACK = 1.3


class PanningTextureFakeKV(FakeKVPipeline):
    """fake-kv whose frames show a random texture panned by the frame's position (its green channel), so an
    encoder has detail to spend its bitrate on."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        rng = np.random.default_rng(0)
        self.texture = rng.integers(0, 256, (self.height + 64, self.width + 64, 3), dtype=np.uint8)

    def _decode(self, chunks: Sequence[Any]) -> list[np.ndarray]:
        panned = []
        for frames in super()._decode(chunks):
            out = np.empty_like(frames)
            for i, frame in enumerate(frames):
                step = int(frame[0, 0, 1])
                down, right = step % 64, (3 * step) % 64
                out[i] = self.texture[down : down + self.height, right : right + self.width]
            panned.append(out)
        return panned


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    settings = fake_settings(webrtc=True, webrtc_min_bitrate_kbps=MIN_KBPS, webrtc_max_bitrate_kbps=MAX_KBPS)
    with running_server(settings, PanningTextureFakeKV(width=640, height=352)) as live:
        yield live


def test_a_track_s_encoder_and_bytes_stay_within_the_session_bitrate_bounds(server: LiveServer) -> None:
    async def scenario() -> tuple[list[tuple[int, int | None, int]], str]:
        async with session_client(server.ws_url, start={"seed": 3}) as client:
            pc, track_future, answer = await connect_video(client)
            try:
                frames = 0
                for tick_id in range(CHUNKS):
                    await client.send(type="tick", tick_id=tick_id)
                    chunk = await next_of(client, "chunk")
                    assert chunk["delivery"] == "webrtc"
                    frames += chunk["frames"]
                track = await asyncio.wait_for(track_future, GUARD_S)
                for _ in range(frames - 1):  # the receiver lets a frame out once the next one begins
                    await asyncio.wait_for(track.recv(), GUARD_S)
                encoders = [(e.target_bitrate, e.codec.bit_rate, e.payload_bytes) for e in webrtc_track.open_encoders()
                            if e.codec is not None]
            finally:
                await pc.close()
            await client.send(type="close")
            await next_of(client, "closed")
            assert frames == 2 * CHUNKS
            return encoders, str(answer["codec"])

    encoders, codec = asyncio.run(scenario())
    assert codec == "H264"
    # the session's encoder (the server's own, on the sender) aims within the bounds, and libx264 was told so
    assert len(encoders) == 1, encoders
    target, told, sent = encoders[0]
    assert MIN_KBPS * 1000 <= target <= MAX_KBPS * 1000 and told is not None
    assert MIN_KBPS * 1000 <= told <= MAX_KBPS * 1000, encoders
    # what it encoded for those frames (every one of them reached the client): at most the highest bound's
    # bytes for their duration
    budget = MAX_KBPS * 1000 / 8 * (2 * CHUNKS / FPS)
    assert 0 < sent <= SLACK * budget, (sent, budget)
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)
    wait_until(lambda: server.stats()["kv"]["blocks_used"] == 0)


@pytest.mark.parametrize("encoder_class", [BoundedH264Encoder, BoundedVp8Encoder])
def test_the_target_starts_and_follows_remb_within_the_bounds(encoder_class: Any) -> None:
    encoder = encoder_class(BitrateBounds.from_kbps(MIN_KBPS, MAX_KBPS))
    assert encoder.target_bitrate == MAX_KBPS * 1000  # aiortc starts at 1000 (H.264) or 500 kbps (VP8)
    encoder.target_bitrate = 10_000  # a REMB estimate, as the sender's RTCP handler applies it
    assert encoder.target_bitrate == MIN_KBPS * 1000
    encoder.target_bitrate = 200_000
    assert encoder.target_bitrate == 200_000
    encoder.target_bitrate = 50_000_000
    assert encoder.target_bitrate == MAX_KBPS * 1000


def test_a_bound_not_set_stays_aiortc_s() -> None:
    from aiortc.codecs import h264

    alone = BoundedH264Encoder(BitrateBounds.from_kbps(None, None))
    assert (alone.lowest_bps, alone.highest_bps) == (h264.MIN_BITRATE, h264.MAX_BITRATE)
    assert alone.target_bitrate == h264.DEFAULT_BITRATE
    low_cap = BoundedH264Encoder(BitrateBounds.from_kbps(None, 200))  # below aiortc's 500 kbps floor
    assert (low_cap.lowest_bps, low_cap.highest_bps) == (200_000, 200_000)


def test_an_encoder_goes_only_into_an_aiortc_sender_s_empty_slot() -> None:
    async def scenario() -> None:
        pc = aiortc.RTCPeerConnection()
        try:
            sender = pc.addTransceiver("video", direction="sendonly").sender
            encoder = BoundedH264Encoder(BitrateBounds())
            install_encoder(sender, encoder)
            with pytest.raises(RuntimeError):  # filled already
                install_encoder(sender, encoder)
            with pytest.raises(RuntimeError):  # not an aiortc sender (another aiortc keeps its encoder elsewhere)
                install_encoder(object(), encoder)
        finally:
            await pc.close()

    asyncio.run(scenario())


def test_bounds_out_of_order_are_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="--webrtc-min-bitrate-kbps \\(500\\) is above --webrtc-max-bitrate-kbps"):
        fake_settings(webrtc=True, webrtc_min_bitrate_kbps=500, webrtc_max_bitrate_kbps=100)

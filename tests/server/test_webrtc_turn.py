"""A session played through a TURN relay: a real coturn (``turnserver``, Debian's coturn package) on loopback, a real
server that hands out time-limited TURN credentials (`--webrtc-turn-secret`) in `ready.webrtc.ice_servers`, and an
aiortc client with relay-only ICE (iceTransportPolicy "relay"), as a player behind a strict NAT would be.

scripts/test.sh installs coturn; the module skips only on a machine without ``turnserver``. Chromium through the
relay: tests/browser/test_webrtc_turn_browser.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from arstream.app import webrtc_track
from arstream.models.fake import FakeKVPipeline
from arstream.programs import client as client_program
from servers import LiveServer, fake_settings, running_server, session_client, wait_until
from turn_relay import Relay, needs_turnserver, running_relay
from webrtc_clients import GUARD_S, connect_video, next_of

aiortc = pytest.importorskip("aiortc")
pytestmark = needs_turnserver

RELAY = aiortc.rtcconfiguration.RTCIceTransportPolicy.RELAY


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    with running_relay(tmp_path_factory.mktemp("coturn")) as started:
        yield started


@pytest.fixture(scope="module")
def server(relay: Relay) -> Iterator[LiveServer]:
    settings = fake_settings(webrtc=True, webrtc_ice_servers=relay.ice_servers(), webrtc_turn_secret=relay.secret)
    with running_server(settings, FakeKVPipeline(width=64, height=64)) as live:
        yield live


def candidate_types(sdp: str) -> set[str]:
    return {line.split()[7] for line in sdp.splitlines() if line.startswith("a=candidate:")}


def test_a_session_plays_through_the_relay_with_relay_only_ice(server: LiveServer, relay: Relay) -> None:
    async def scenario() -> tuple[dict[str, Any], set[str], Any, list[dict[str, Any]], list[int]]:
        async with session_client(server.ws_url, start={}) as client:
            assert client.ready is not None
            ice_servers = client.ready["webrtc"]["ice_servers"]
            configuration = aiortc.RTCConfiguration(
                iceServers=[aiortc.RTCIceServer(**entry) for entry in ice_servers], iceTransportPolicy=RELAY
            )
            pc = aiortc.RTCPeerConnection(configuration)
            track_future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

            def on_track(received: Any) -> None:
                if not track_future.done():
                    track_future.set_result(received)

            pc.on("track", on_track)
            try:
                await connect_video(client, pc)
                offered = candidate_types(pc.localDescription.sdp)
                # aiortc keeps the selected pair in its aioice connection (read here and only here)
                ice = pc.getTransceivers()[0].receiver.transport.transport
                selected = ice._connection._nominated[1]
                chunks = []
                for tick_id in (0, 1):
                    await client.send(type="tick", tick_id=tick_id)
                    chunks.append(await next_of(client, "chunk"))
                track = await asyncio.wait_for(track_future, GUARD_S)
                greens = []
                for _ in range(chunks[0]["frames"]):
                    frame = await asyncio.wait_for(track.recv(), GUARD_S)
                    greens.append(int(frame.to_ndarray(format="rgb24")[..., 1].mean().round()))
            finally:
                await pc.close()
            return client.ready, offered, selected, chunks, greens

    ready, offered, selected, chunks, greens = asyncio.run(scenario())
    # the relay's time-limited credentials, minted for this session
    (entry,) = ready["webrtc"]["ice_servers"]
    expires, user = entry["username"].split(":", 1)
    assert user == ready["session_id"] and int(expires) > time.time() and entry["credential"]
    # relay-only: the offer has relay candidates only, and the pair ICE chose goes through coturn's relayed address
    assert offered == {"relay"}
    assert selected.local_candidate.type == "relay"
    assert selected.local_candidate.host == "127.0.0.1" and selected.local_candidate.port in relay.relay_ports
    # the session played on the track: chunk messages say so, and the first chunk's frames were decoded
    assert [c["delivery"] for c in chunks] == ["webrtc", "webrtc"]
    assert len(greens) == chunks[0]["frames"]
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)
    wait_until(lambda: server.stats()["kv"]["blocks_used"] == 0)


def test_a_wrong_secret_gets_no_relay(relay: Relay) -> None:
    """The relay checks the credentials: ones made with another secret give no relay candidate (so the test above
    shows the server's credentials, not an open relay)."""
    from arstream.app.webrtc_ice import turn_rest_credentials

    async def relay_candidates(secret: str) -> set[str]:
        username, credential = turn_rest_credentials(secret, "s-test", int(time.time()) + 60)
        server = aiortc.RTCIceServer(urls=f"turn:127.0.0.1:{relay.port}?transport=udp", username=username,
                                     credential=credential)
        pc = aiortc.RTCPeerConnection(aiortc.RTCConfiguration(iceServers=[server], iceTransportPolicy=RELAY))
        try:
            pc.addTransceiver("video", direction="recvonly")
            await pc.setLocalDescription(await pc.createOffer())
            return candidate_types(pc.localDescription.sdp)
        finally:
            await pc.close()

    assert asyncio.run(relay_candidates("not-" + relay.secret)) == set()
    assert asyncio.run(relay_candidates(relay.secret)) == {"relay"}



def test_the_client_program_plays_through_the_relay(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`arstream client --webrtc-relay-only`: the operator's check of a relay, from where the client runs."""
    code = client_program.main([server.base_url, "--webrtc-relay-only", "--keys", "d*3", "--out", str(tmp_path)])
    output = capsys.readouterr().out
    assert code == 0, output
    assert "frames by WebRTC (H264, relay only)" in output, output
    # three chunks of two frames on the track; a receiver holds back the last frame sent
    assert "delivery: WebRTC (H264), 5 frames on the track" in output, output
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)

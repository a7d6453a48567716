"""The server's ICE host candidates bound to `--webrtc-udp-ports` and carrying `--webrtc-advertised-address`
(arstream.app.webrtc_ports): a real server with a range of two ports, aiortc clients.

With an advertised address each peer connection takes one port, so two peers hold the range: a third offer is
refused with `webrtc_failed` (its session plays on over the WebSocket, its slot comes back), and once a peer has
gone its port serves the next offer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from arstream.app import webrtc_track
from arstream.app.webrtc_ports import HostCandidates
from arstream.models.fake import FakeKVPipeline
from servers import LiveServer, fake_settings, running_server, session_client, wait_until
from turn_relay import free_udp_ports
from webrtc_clients import connect_video, next_of, offer_sdp, play_on_a_new_track

aiortc = pytest.importorskip("aiortc")

ADVERTISED = "127.0.0.1"
LOW = free_udp_ports(2)  # two neighbouring ports free on every IPv4 address


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    settings = fake_settings(webrtc=True, webrtc_udp_ports=f"{LOW}-{LOW + 1}", webrtc_advertised_address=ADVERTISED)
    with running_server(settings, FakeKVPipeline(width=64, height=64)) as live:
        yield live


def host_candidates(sdp: str) -> list[tuple[str, int]]:
    """The (address, port) of each host candidate in an SDP."""
    found = []
    for line in sdp.splitlines():
        if line.startswith("a=candidate:"):
            fields = line.split()
            if fields[7] == "host":
                found.append((fields[4], int(fields[5])))
    return found


def test_candidates_take_ports_of_the_range_and_a_peer_past_it_is_refused(server: LiveServer) -> None:
    async def scenario() -> tuple[list[list[tuple[str, int]]], dict[str, Any], dict[str, Any], int, Any]:
        async with session_client(server.ws_url, start={}) as first, session_client(server.ws_url, start={}) as second:
            pc_first, _, answer_first = await connect_video(first)
            pc_second, _, answer_second = await connect_video(second)
            async with session_client(server.ws_url, start={}) as third:
                refused_pc = aiortc.RTCPeerConnection()
                try:
                    await third.send(type="webrtc_offer", sdp=await offer_sdp(refused_pc))
                    refused = await next_of(third, "error")
                finally:
                    await refused_pc.close()
                # the refused session plays on over the WebSocket
                await third.send(type="tick", tick_id=0)
                on_websocket, frames = await third.recv_chunk()
                # its slot came back; the two peers hold theirs
                await asyncio.to_thread(wait_until, lambda: webrtc_track.open_peer_connections() == 2)
                await pc_first.close()
                await first.send(type="close")
                await next_of(first, "closed")
                # the first peer's port is free again: the next offer gets it, and its session plays on the track
                await asyncio.to_thread(wait_until, lambda: webrtc_track.open_peer_connections() == 1)
                chunks, greens = await play_on_a_new_track(third, (1, 2))
            await pc_second.close()
            candidates = [host_candidates(answer_first["sdp"]), host_candidates(answer_second["sdp"])]
            return candidates, refused, on_websocket, len(frames), (chunks, greens)

    candidates, refused, on_websocket, frames, (chunks, greens) = asyncio.run(scenario())
    # each answer has one host candidate, on the advertised address, its port in the range, and the two differ
    assert [len(found) for found in candidates] == [1, 1]
    (first_host, first_port), (second_host, second_port) = candidates[0][0], candidates[1][0]
    assert first_host == second_host == ADVERTISED
    assert {first_port, second_port} == {LOW, LOW + 1}
    assert refused["code"] == "webrtc_failed" and refused["fatal"] is False
    assert "no free UDP port" in refused["message"] and f"{LOW}-{LOW + 1}" in refused["message"]
    assert "delivery" not in on_websocket and frames == on_websocket["frames"]
    assert [c["delivery"] for c in chunks] == ["webrtc", "webrtc"] and len(greens) == chunks[0]["frames"]
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)
    wait_until(lambda: server.stats()["kv"]["blocks_used"] == 0)


def test_without_an_advertised_address_each_host_address_takes_a_port_of_the_range() -> None:
    """The range alone: one host candidate per address aioice would gather on (this machine's IPv4 and global IPv6
    addresses), each on a port of the range (a port number is taken per address, so two addresses may share one);
    a peer connection answered in-process, no session."""
    from aioice.ice import get_host_addresses

    addresses = get_host_addresses(use_ipv4=True, use_ipv6=True)
    ports = range(LOW, LOW + 2)  # the first test's peers are closed: the range is free again

    async def answer() -> str:
        client = aiortc.RTCPeerConnection()
        delivery = webrtc_track.WebRTCDelivery(16.0, lambda state: None, lambda channel: None,
                                               HostCandidates(ports=ports))
        try:
            return await delivery.answer(await offer_sdp(client))
        finally:
            await delivery.close()
            await client.close()

    found = host_candidates(asyncio.run(answer()))
    assert sorted(host for host, _ in found) == sorted(addresses)
    assert all(port in ports for _, port in found), found

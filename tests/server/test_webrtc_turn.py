"""A session played through a TURN relay: a real coturn (``turnserver``, Debian's coturn package) on loopback, a real
server that hands out time-limited TURN credentials (`--webrtc-turn-secret`) in `ready.webrtc.ice_servers`, and an
aiortc client with relay-only ICE (iceTransportPolicy "relay"), as a player behind a strict NAT would be.

Then Debian's Chromium plays the demo page (`?delivery=webrtc`) through the same relay, its peer connection held to
relay candidates by a test shim around RTCPeerConnection (the page itself asks for no policy).

scripts/test.sh installs coturn; the module skips only on a machine without ``turnserver``.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from arstream.app import webrtc_track
from arstream.models.fake import FakeKVPipeline
from browser_helpers import CHROMIUM, PageErrors, debug, new_page, until
from servers import LiveServer, fake_settings, running_server, session_client, wait_until
from webrtc_clients import GUARD_S, connect_video, next_of

aiortc = pytest.importorskip("aiortc")
TURNSERVER = shutil.which("turnserver")
pytestmark = pytest.mark.skipif(TURNSERVER is None, reason="coturn's turnserver is not installed (scripts/test.sh "
                                "installs the coturn package)")

RELAY = aiortc.rtcconfiguration.RTCIceTransportPolicy.RELAY
RELAY_PORTS = 16  # coturn's relay ports: one per allocation


@dataclass
class Relay:
    port: int  # coturn's listening port (UDP and TCP)
    secret: str  # its static-auth-secret
    relay_ports: range  # the ports its relayed addresses take


def free_udp_ports(count: int) -> int:
    """The first of ``count`` neighbouring UDP ports free on every IPv4 address, below Linux's ephemeral range."""
    for low in range(33000 - count, 20000, -count):
        held = []
        try:
            for port in range(low, low + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                held.append(sock)
                sock.bind(("0.0.0.0", port))
            return low
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {count} neighbouring UDP ports are free")


def free_tcp_and_udp_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind(("127.0.0.1", 0))
            port = int(tcp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port


def stun_answers(port: int) -> bool:
    """Whether a STUN Binding request to 127.0.0.1:port gets a response (coturn's UDP listener is up)."""
    from aioice import stun

    request = stun.Message(message_method=stun.Method.BINDING, message_class=stun.Class.REQUEST)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(0.5)
        sock.sendto(bytes(request), ("127.0.0.1", port))
        try:
            data = sock.recv(2048)
        except OSError:
            return False
    return stun.parse_message(data).transaction_id == request.transaction_id


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    assert TURNSERVER is not None
    folder = tmp_path_factory.mktemp("coturn")
    port, secret = free_tcp_and_udp_port(), secrets.token_hex(16)
    low = free_udp_ports(RELAY_PORTS)
    config = folder / "turnserver.conf"
    config.write_text("\n".join([
        "listening-ip=127.0.0.1",
        f"listening-port={port}",
        "relay-ip=127.0.0.1",
        f"min-port={low}",
        f"max-port={low + RELAY_PORTS - 1}",
        "realm=arstream.test",
        "use-auth-secret",
        f"static-auth-secret={secret}",
        "fingerprint",
        "no-tls",
        "no-dtls",
        "no-cli",
        "no-stdout-log",
        "simple-log",
        f"log-file={folder / 'turn.log'}",
        f"pidfile={folder / 'turnserver.pid'}",
        f"userdb={folder / 'turndb'}",
        "",
    ]))
    # In the foreground (coturn daemonises only when asked), its log in the folder.
    process = subprocess.Popen([TURNSERVER, "-c", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + GUARD_S  # hang guard only
        while not stun_answers(port):
            if process.poll() is not None or time.monotonic() > deadline:
                log = next(iter(folder.glob("turn*.log")), None)
                raise RuntimeError(f"turnserver did not start: {log.read_text() if log else 'no log'}")
        yield Relay(port, secret, range(low, low + RELAY_PORTS))
    finally:
        process.terminate()
        process.wait(GUARD_S)


@pytest.fixture(scope="module")
def server(relay: Relay) -> Iterator[LiveServer]:
    ice = [{"urls": [f"turn:127.0.0.1:{relay.port}?transport=udp"]}]
    settings = fake_settings(webrtc=True, webrtc_ice_servers=ice, webrtc_turn_secret=relay.secret)
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


# Every RTCPeerConnection the page makes gathers relay candidates only, and is kept for the test to read its stats.
RELAY_ONLY_SHIM = """
(() => {
  const Native = window.RTCPeerConnection;
  window.relayOnlyPeers = [];
  window.RTCPeerConnection = function (configuration) {
    const pc = new Native({ ...(configuration || {}), iceTransportPolicy: 'relay' });
    window.relayOnlyPeers.push(pc);
    return pc;
  };
  window.RTCPeerConnection.prototype = Native.prototype;
})();
"""

# The page's peer connection: the types of its offer's candidates, and the local candidate of the selected pair.
SELECTED_PAIR = """
async () => {
  const pc = window.relayOnlyPeers[window.relayOnlyPeers.length - 1];
  const stats = new Map();
  (await pc.getStats()).forEach((entry) => stats.set(entry.id, entry));
  const transport = [...stats.values()].find((entry) => entry.type === 'transport' && entry.selectedCandidatePairId);
  const local = stats.get(stats.get(transport.selectedCandidatePairId).localCandidateId);
  const offered = pc.localDescription.sdp.split('\\r\\n').filter((line) => line.startsWith('a=candidate:'));
  return { type: local.candidateType, port: local.port, offered: offered.map((line) => line.split(' ')[7]) };
}
"""


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's Chromium is not installed at /usr/bin/chromium")
def test_chromium_plays_the_page_through_the_relay_with_relay_only_ice(
    server: LiveServer, relay: Relay, browser: Any, errors: PageErrors
) -> None:
    context = browser.new_context()  # under the server's real CSP
    try:
        context.add_init_script(RELAY_ONLY_SHIM)
        page = new_page(context, errors)
        page.goto(server.base_url + "/?delivery=webrtc")
        until(page, "window.arstreamDebug.delivery === 'webrtc'")
        until(page, "window.arstreamDebug.trackFramesShown > 8")
        pair = page.evaluate(SELECTED_PAIR)
        state = debug(page)
        page.click("#play")  # Stop
    finally:
        context.close()
    assert set(pair["offered"]) == {"relay"}
    assert pair["type"] == "relay" and pair["port"] in relay.relay_ports
    assert state["errors"] == [] and state["delivery"] == "webrtc"
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)
    wait_until(lambda: server.stats()["kv"]["blocks_used"] == 0)

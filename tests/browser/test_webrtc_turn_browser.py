"""Debian's Chromium plays the demo page (`?delivery=webrtc`) through a real TURN relay (coturn on loopback,
tests/turn_relay.py) with relay-only ICE: its peer connection held to relay candidates by a test shim around
RTCPeerConnection (the page itself asks for no policy), using the ICE servers and credentials of its `ready`.
The aiortc side of the same relay: tests/server/test_webrtc_turn.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from arstream.app import webrtc_track
from arstream.models.fake import FakeKVPipeline
from browser_helpers import PageErrors, browser_marks, debug, new_page, until
from servers import LiveServer, fake_settings, running_server, wait_until
from turn_relay import Relay, needs_turnserver, running_relay

pytest.importorskip("aiortc")
pytestmark = [*browser_marks, needs_turnserver]


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    with running_relay(tmp_path_factory.mktemp("coturn")) as started:
        yield started


@pytest.fixture(scope="module")
def server(relay: Relay) -> Iterator[LiveServer]:
    settings = fake_settings(webrtc=True, webrtc_ice_servers=relay.ice_servers(), webrtc_turn_secret=relay.secret)
    with running_server(settings, FakeKVPipeline(width=64, height=64)) as live:
        yield live


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

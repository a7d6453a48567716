"""WebRTC video (PROTOCOL.md, "WebRTC video") played in Debian's Chromium over loopback, from a real server.

The page opens its own session (no demo page code involved), offers a recvonly video section once ICE
gathering is complete (non-trickle), plays the answer's track in a <video> element and ticks. It counts
the frames Chromium decoded (the inbound RTP stats) and, for each frame shown
(``requestVideoFrameCallback``), maps its RTP timestamp to a track frame number by the chunk messages'
``rtp_timestamp``. (The pictures are checked in tests/server/test_webrtc.py, decoded by aiortc: Chromium
converts the track's YUV with another colour matrix than aiortc's encoder, so its flat colours shift.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from arstream.app import webrtc_track
from arstream.models.fake import FakeKVPipeline
from browser_helpers import PageErrors, browser_marks, debug, new_page, page_at, until, wait
from servers import LiveServer, fake_settings, running_server, wait_until

pytest.importorskip("aiortc")
pytestmark = browser_marks

FPS = 16  # fake-kv's model card
CHUNKS = 12
# Chunks played on the WebSocket first: the track starts mid-session.
CHUNKS_BEFORE = 4

SESSION_SCRIPT = """
async ({ wsUrl, chunksBefore, chunks }) => {
  const ws = new WebSocket(wsUrl);
  ws.binaryType = 'arraybuffer';
  const inbox = [];
  let wake = null;
  ws.onmessage = (event) => { inbox.push(event.data); if (wake) { wake(); wake = null; } };
  const next = async (type) => {
    for (;;) {
      while (!inbox.length) await new Promise((resolve) => { wake = resolve; });
      const data = inbox.shift();
      if (typeof data !== 'string') continue;
      const message = JSON.parse(data);
      if (message.type === type) return message;
      if (message.type === 'error') throw new Error(JSON.stringify(message));
    }
  };
  await new Promise((resolve, reject) => { ws.onopen = resolve; ws.onerror = reject; });
  ws.send(JSON.stringify({ type: 'start' }));
  const ready = await next('ready');
  let tickId = 0;
  for (; tickId < chunksBefore; tickId++) {
    ws.send(JSON.stringify({ type: 'tick', tick_id: tickId }));
    await next('chunk');
  }

  const pc = new RTCPeerConnection();
  pc.addTransceiver('video', { direction: 'recvonly' });
  const video = document.createElement('video');
  video.muted = true;
  video.playsInline = true;
  document.body.appendChild(video);
  pc.ontrack = (event) => { video.srcObject = new MediaStream([event.track]); video.play(); };
  await pc.setLocalDescription(await pc.createOffer());
  if (pc.iceGatheringState !== 'complete') {
    await new Promise((resolve) => pc.addEventListener('icegatheringstatechange',
      () => { if (pc.iceGatheringState === 'complete') resolve(); }));
  }
  ws.send(JSON.stringify({ type: 'webrtc_offer', sdp: pc.localDescription.sdp }));
  const answer = await next('webrtc_answer');
  await pc.setRemoteDescription({ type: 'answer', sdp: answer.sdp });
  const state = await next('webrtc_state');

  const shown = [];
  const onFrame = (now, metadata) => {
    shown.push({ rtp: metadata.rtpTimestamp });
    video.requestVideoFrameCallback(onFrame);
  };
  video.requestVideoFrameCallback(onFrame);

  const chunkMessages = [];
  for (let i = 0; i < chunks; i++, tickId++) {
    ws.send(JSON.stringify({ type: 'tick', tick_id: tickId }));
    chunkMessages.push(await next('chunk'));
    // at about the model's pace, so the page shows frames as a player would see them
    await new Promise((resolve) => setTimeout(resolve, 1000 * ready.model.frames_per_chunk / ready.model.fps));
  }
  const total = chunkMessages.reduce((sum, chunk) => sum + chunk.frames, 0);
  const decoded = async () => {
    const stats = await pc.getStats();
    for (const report of stats.values()) {
      if (report.type === 'inbound-rtp' && report.kind === 'video') return report.framesDecoded;
    }
    return 0;
  };
  while ((await decoded()) < total) await new Promise((resolve) => setTimeout(resolve, 50));
  const framesDecoded = await decoded();
  let codec = null;
  for (const report of (await pc.getStats()).values()) if (report.type === 'codec') codec = report.mimeType;
  ws.send(JSON.stringify({ type: 'close' }));
  await next('closed');
  pc.close();
  return { answerCodec: answer.codec, codec, state: state.state, chunks: chunkMessages, framesDecoded, total,
           shown, step: Math.round(90000 / ready.model.fps) };
}
"""


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server(fake_settings(webrtc=True), FakeKVPipeline(width=64, height=64)) as live:
        yield live


def test_chromium_plays_the_track_and_maps_each_shown_frame_to_its_chunk(browser: Any, server: LiveServer) -> None:
    with page_at(browser, server.base_url + "/") as page:
        result = page.evaluate(
            SESSION_SCRIPT, {"wsUrl": server.ws_url, "chunksBefore": CHUNKS_BEFORE, "chunks": CHUNKS}
        )
    assert result["state"] == "connected"
    assert result["answerCodec"] == "H264" and result["codec"] == "video/H264"  # Chromium offers H.264
    chunks = result["chunks"]
    assert all(c["delivery"] == "webrtc" for c in chunks)
    assert [c["track_frame"] for c in chunks] == [2 * i for i in range(CHUNKS)]
    # every frame put on the track was decoded, none twice
    assert result["framesDecoded"] == result["total"] == 2 * CHUNKS
    # each frame shown maps, by its RTP timestamp and the chunk messages' rtp_timestamp, to a frame put on the
    # track (a wrong origin leaves a remainder modulo the step), in the order they were made
    assert all("rtp_timestamp" in c for c in chunks)
    first = chunks[0]
    numbers = []
    for frame in result["shown"]:
        offset = (frame["rtp"] - first["rtp_timestamp"]) % 2**32
        assert offset % result["step"] == 0, frame
        numbers.append(first["track_frame"] + offset // result["step"])
    assert len(numbers) > CHUNKS, "too few frames were shown to check the mapping"
    assert numbers == sorted(set(numbers)) and 0 <= numbers[0] and numbers[-1] < result["total"]
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)
    wait_until(lambda: server.stats()["kv"]["blocks_used"] == 0)


def test_the_page_plays_by_webrtc_when_asked_and_keys_steer(
    server: LiveServer, browser: Any, errors: PageErrors
) -> None:
    context = browser.new_context()  # no CSP bypass: WebRTC must work under the server's real policy
    try:
        page = new_page(context, errors)
        violations: list[str] = []
        page.on("console", lambda message: violations.append(message.text))
        page.goto(server.base_url + "/?delivery=webrtc")
        until(page, "window.arstreamDebug.delivery === 'webrtc'")
        assert page.text_content("#hud-delivery") == "WebRTC (H264)"
        assert page.is_visible("#screen-video")
        assert page.evaluate("document.getElementById('delivery-row').hidden") is False  # the menu offers it
        until(page, "window.arstreamDebug.trackFramesShown > 8")
        until(page, "window.arstreamDebug.inputChannelOpen()")
        taken = server.stats()["webrtc"]["channel_inputs"]
        page.keyboard.down("d")
        until(page, "window.arstreamDebug.sentEventIds.length === 1")
        press = page.evaluate("window.arstreamDebug.sentEventIds[0]")
        until(page, f"window.arstreamDebug.appliedEventIds.includes({press})")
        # key -> frame is measured when a frame of the applying chunk is shown by the track
        until(page, "window.arstreamDebug.samples.action.length >= 1")
        page.keyboard.up("d")
        until(page, "window.arstreamDebug.sentEventIds.length === 2")
        release = page.evaluate("window.arstreamDebug.sentEventIds[1]")
        until(page, f"window.arstreamDebug.appliedEventIds.includes({release})")
        state = page.evaluate("JSON.parse(JSON.stringify(window.arstreamDebug))")
        # both inputs went on the data channel, and the server took them there
        assert state["channelInputs"] == 2
        assert server.stats()["webrtc"]["channel_inputs"] == taken + 2
        assert state["errors"] == [] and state["delivery"] == "webrtc"
        assert state["trackFramesShown"] <= state["framesDrawn"]
        assert webrtc_track.open_peer_connections() == 1
        page.click("#play")  # Stop
        wait_until(lambda: webrtc_track.open_peer_connections() == 0)
        wait_until(lambda: server.stats()["kv"]["blocks_used"] == 0)
        assert [text for text in violations if "Content Security Policy" in text] == []
    finally:
        context.close()


SKIPPED_FIRST_FRAMES = """
async () => {
  const { TrackLink } = await import('/webrtc.js');
  const shown = [];
  // a stand-in for the <video>: shown() asks it for the next frame's callback
  const video = { requestVideoFrameCallback: () => 1, cancelVideoFrameCallback() {}, hidden: true };
  const link = new TrackLink({ video, fps: 16, send() {}, onShown: (entry) => shown.push(entry), onState() {} });
  const step = 90000 / 16;
  link.noteChunk({ rtp_timestamp: 1000, track_frame: 0, frames: 2, applied_event_ids: [7] }, 0);
  link.noteChunk({ rtp_timestamp: 1000 + 2 * step, track_frame: 2, frames: 2, applied_event_ids: [8, 9] }, 0);
  link.noteChunk({ rtp_timestamp: 1000 + 4 * step, track_frame: 4, frames: 2, applied_event_ids: [10] }, 0);
  link.shown({ rtpTimestamp: 1000 + step });      // frame 1: the track dropped frame 0, chunk 0's first
  link.shown({ rtpTimestamp: 1000 + 3 * step });  // frame 3: it dropped frame 2, chunk 1's first
  link.shown({ rtpTimestamp: 1000 + 4 * step });  // frame 4: chunk 2's first, shown
  return shown.map((entry) => [entry.trackFrame, entry.applied]);
}
"""


def test_an_input_whose_first_frame_the_track_dropped_is_measured_at_the_next_frame_shown(
    server: LiveServer, page: Any
) -> None:
    # On a lossy link the track drops frames it cannot complete; key to frame still counts the press, at the
    # first frame shown after its chunk began (before, such a press was never measured).
    page.goto(server.base_url + "/?autoconnect=0")
    assert page.evaluate(SKIPPED_FIRST_FRAMES) == [[1, [7]], [3, [8, 9]], [4, [10]]]


def test_the_page_stays_on_the_websocket_by_default(server: LiveServer, page: Any) -> None:
    page.goto(server.base_url + "/")
    wait(page, "window.arstreamDebug.framesDrawn > 4")
    state = debug(page)
    assert state["delivery"] == "websocket" and state["trackFramesShown"] == 0
    assert page.text_content("#hud-delivery") == "WebSocket"
    assert webrtc_track.open_peer_connections() == 0


# Makes the server refuse this page's offer (webrtc_failed: its SDP cannot be used).
UNUSABLE_OFFER_SCRIPT = r"""
const send = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) {
  if (typeof data === 'string' && data.includes('"webrtc_offer"')) {
    data = JSON.stringify({ ...JSON.parse(data), sdp: 'v=0' });
  }
  return send.call(this, data);
};
"""


def test_the_page_falls_back_to_the_websocket_when_the_server_refuses_the_offer(server: LiveServer, page: Any) -> None:
    page.add_init_script(UNUSABLE_OFFER_SCRIPT)
    page.goto(server.base_url + "/?delivery=webrtc")
    wait(page, "window.arstreamDebug.errors.some((e) => e.code === 'webrtc_failed')")
    drawn = debug(page)["framesDrawn"]
    wait(page, f"window.arstreamDebug.framesDrawn > {drawn + 4}")
    page.keyboard.down("d")  # no data channel: the key goes on the WebSocket, and steers
    wait(page, "window.arstreamDebug.sentEventIds.length === 1")
    press = page.evaluate("window.arstreamDebug.sentEventIds[0]")
    wait(page, f"window.arstreamDebug.appliedEventIds.includes({press})")
    page.keyboard.up("d")
    state = debug(page)
    assert state["channelInputs"] == 0
    assert state["delivery"] == "websocket" and state["trackFramesShown"] == 0
    assert page.text_content("#hud-delivery") == "WebSocket (WebRTC could not connect)"
    assert not page.is_visible("#screen-video")


# Makes this page's WebRTC unable to connect: its offer goes without ICE candidates (and promises more), and it
# never applies the server's answer, so neither side ever sends an ICE check.
NO_ICE_SCRIPT = r"""
const send = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) {
  if (typeof data === 'string' && data.includes('"webrtc_offer"')) {
    const offer = JSON.parse(data);
    offer.sdp = offer.sdp.split('\r\n').filter((line) => !/^a=(candidate|end-of-candidates)/.test(line)).join('\r\n');
    data = JSON.stringify(offer);
  }
  return send.call(this, data);
};
RTCPeerConnection.prototype.setRemoteDescription = function () { return Promise.resolve(); };
"""


def test_the_page_falls_back_to_the_websocket_when_webrtc_cannot_connect(page: Any) -> None:
    settings = fake_settings(webrtc=True, webrtc_connect_timeout_s=1.0)
    with running_server(settings, FakeKVPipeline(width=64, height=64)) as stuck:
        page.add_init_script(NO_ICE_SCRIPT)
        page.goto(stuck.base_url + "/?delivery=webrtc")
        # the server gives the peer up at its connect deadline and says so; the page shows where frames come from
        wait(page, "document.getElementById('hud-delivery').textContent === 'WebSocket (WebRTC could not connect)'")
        drawn = debug(page)["framesDrawn"]
        wait(page, f"window.arstreamDebug.framesDrawn > {drawn + 4}")  # and plays on, over the WebSocket
        state = debug(page)
        assert state["delivery"] == "websocket" and state["trackFramesShown"] == 0
        assert not page.is_visible("#screen-video")
        assert stuck.stats()["webrtc"]["peer_connections"] == 0  # its slot came back


def test_a_watching_page_plays_by_webrtc_and_lets_its_track_go_when_it_takes_control(
    server: LiveServer, browser: Any, errors: PageErrors
) -> None:
    player_context, viewer_context = browser.new_context(), browser.new_context()  # a background tab is throttled
    try:
        player = new_page(player_context, errors)
        player.goto(server.base_url + "/")  # the player on the WebSocket
        until(player, "window.arstreamDebug.framesDrawn > 3 && window.arstreamDebug.shareToken !== null")
        token = player.evaluate("window.arstreamDebug.shareToken")
        viewer = new_page(viewer_context, errors)
        viewer.goto(f"{server.base_url}/?delivery=webrtc#watch={token}")
        until(viewer, "window.arstreamDebug.delivery === 'webrtc'")
        until(viewer, "window.arstreamDebug.trackFramesShown > 8")
        state = viewer.evaluate("JSON.parse(JSON.stringify(window.arstreamDebug))")
        assert state["role"] == "viewer" and state["errors"] == []
        assert viewer.text_content("#hud-delivery") == "WebRTC (H264)"
        assert debug(player)["delivery"] == "websocket"
        assert server.stats()["webrtc"]["peer_connections"] == 1  # the viewer's own
        until(player, "!document.getElementById('pass-box').hidden")
        player.click("#pass")
        until(viewer, "window.arstreamDebug.role === 'controller'")
        # its frames come on the WebSocket from then on: the page lets its track go, and the server its slot
        until(viewer, "window.arstreamDebug.delivery === 'websocket'")
        wait_until(lambda: server.stats()["webrtc"]["peer_connections"] == 0)
        drawn = debug(viewer)["framesDrawn"]
        until(viewer, f"window.arstreamDebug.framesDrawn > {drawn + 4}")
        assert not viewer.is_visible("#screen-video") and viewer.text_content("#hud-delivery") == "WebSocket"
        assert debug(viewer)["errors"] == []
        viewer.close()
    finally:
        viewer_context.close()
        player_context.close()
    wait_until(lambda: server.stats()["kv"]["blocks_used"] == 0)

"""The realtime video page (static/realtime-video.html) in Debian's Chromium: vLLM-Omni's dialect through MSE.

The page opens ``WS /v1/realtime/video``, appends every fMP4 binary to one
Media Source Extensions SourceBuffer and plays it; W A S D go out as camera
velocities. fake-kv paints B = a bit per held key (d = 8), so the pixels the
<video> element shows say whether the stream plays and the camera event
reached the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from arstream.programs.bench import ServerProcess
from browser_helpers import browser_marks

WIDTH, HEIGHT = 64, 48
KEY_D = 8
WAIT_MS = 30_000  # hang guard only

pytestmark = browser_marks

FRAMES_SHOWN = "() => document.getElementById('video').getVideoPlaybackQuality().totalVideoFrames"
# The blue channel at the centre of what the <video> element shows now (-1 before a frame is shown).
CENTRE_BLUE = """
() => {
  const video = document.getElementById('video');
  if (video.readyState < 2) return -1;
  const canvas = document.createElement('canvas');
  canvas.width = video.videoWidth;
  canvas.height = video.videoHeight;
  const context = canvas.getContext('2d', { willReadFrequently: true });
  context.drawImage(video, 0, 0);
  return context.getImageData(canvas.width >> 1, canvas.height >> 1, 1, 1).data[2];
}
"""


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    options = json.dumps({"compute_delay_s": 0.02, "width": WIDTH, "height": HEIGHT})
    with ServerProcess(["--model", "fake-kv", "--model-options", options]) as process:
        yield process


@pytest.fixture(scope="module")
def page(server: ServerProcess, browser: Any) -> Iterator[Any]:
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.goto(server.base_url + "/realtime-video.html")
    yield page
    page.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def test_chromium_plays_the_dialect_through_media_source_extensions(page: Any) -> None:
    supported = page.evaluate("() => MediaSource.isTypeSupported('video/mp4; codecs=\"avc1.42C00A\"')")
    assert supported, "this Chromium plays no H.264 through MSE"
    page.click("#start")
    page.wait_for_function("() => window.realtimeVideo && window.realtimeVideo.chunks >= 4", timeout=WAIT_MS)
    page.wait_for_function(f"() => ({FRAMES_SHOWN})() > 0", timeout=WAIT_MS)
    size = page.evaluate("() => { const v = document.getElementById('video'); return [v.videoWidth, v.videoHeight]; }")
    assert size == [WIDTH, HEIGHT]
    assert abs(page.evaluate(CENTRE_BLUE)) <= 3  # no key held yet

    page.keyboard.down("d")  # a camera velocity along +X: the model's D key
    page.wait_for_function(f"() => Math.abs(({CENTRE_BLUE})() - {KEY_D}) <= 3", timeout=WAIT_MS)
    page.keyboard.up("d")
    page.wait_for_function(f"() => Math.abs(({CENTRE_BLUE})()) <= 3", timeout=WAIT_MS)

    page.click("#stop")
    page.wait_for_function("() => document.getElementById('status').textContent.includes('(stopped)')", timeout=WAIT_MS)
    played = page.evaluate(FRAMES_SHOWN)
    assert played > 0

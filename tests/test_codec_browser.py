"""The h264 codec decoded in Debian's Chromium with WebCodecs, by static/video-decoder.js, from a real server.

The page opens its own session (no demo page code involved), asks for h264,
decodes every frame with the module's decoder, draws it on a canvas and reads
the centre pixel. fake-kv paints G = the frame's absolute position and B = a
bit per held key (d = 8), so the pixels say whether the right frames came out
in the right order, across a reset that starts a new stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from arstream.programs.bench import ServerProcess
from browser_helpers import browser_marks

KEY_D = 8

pytestmark = browser_marks

# Runs in the page: one h264 session of five ticks (the fourth resets), every frame decoded and sampled.
SESSION_SCRIPT = """
async ({ wsUrl, plan, resetAt }) => {
  const decoderModule = await import('/video-decoder.js');
  if (!(await decoderModule.h264Supported())) return { supported: false };
  const ws = new WebSocket(wsUrl);
  ws.binaryType = 'arraybuffer';
  const inbox = [];
  let wake = null;
  ws.onmessage = (event) => { inbox.push(event.data); if (wake) { wake(); wake = null; } };
  const next = async () => {
    while (!inbox.length) await new Promise((resolve) => { wake = resolve; });
    return inbox.shift();
  };
  await new Promise((resolve, reject) => { ws.onopen = resolve; ws.onerror = reject; });
  ws.send(JSON.stringify({ type: 'start', codec: 'h264', quality: 95 }));
  const ready = JSON.parse(await next());
  const decoder = decoderModule.createH264Decoder();
  const canvas = new OffscreenCanvas(ready.model.width, ready.model.height);
  const context = canvas.getContext('2d', { willReadFrequently: true });
  const frames = [];
  for (let tick = 0; tick < plan.length; tick++) {
    ws.send(JSON.stringify({ type: 'tick', tick_id: tick, controls: { keys: plan[tick] }, reset: tick === resetAt }));
    const chunk = JSON.parse(await next());
    for (let index = 0; index < chunk.frames; index++) {
      const buffer = await next();
      const view = new DataView(buffer);
      const header = { width: view.getUint16(16, true), height: view.getUint16(18, true) };
      const picture = await decoder.decode(header, new Uint8Array(buffer, 20));
      context.drawImage(picture.source, 0, 0);
      const pixel = context.getImageData(header.width >> 1, header.height >> 1, 1, 1).data;
      frames.push({
        chunkIndex: chunk.chunk_index, codec: view.getUint8(4), keyframe: (view.getUint8(5) & 2) !== 0,
        size: [picture.source.displayWidth, picture.source.displayHeight], rgb: Array.from(pixel.slice(0, 3)),
      });
      picture.close();
    }
  }
  decoder.close();
  ws.close();
  return { supported: true, ready: ready.codec, frames };
}
"""


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    options = json.dumps({"compute_delay_s": 0.005, "width": 64, "height": 48})
    with ServerProcess(["--model", "fake-kv", "--model-options", options]) as process:
        yield process


@pytest.fixture(scope="module")
def page(server: ServerProcess, browser: Any) -> Iterator[Any]:
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    # Any page of the server's origin: a secure context (loopback) where WebCodecs exists.
    page.goto(server.base_url + "/video-decoder.js")
    yield page
    page.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def test_chromium_decodes_h264_frames_with_webcodecs(server: ServerProcess, page: Any) -> None:
    plan = [[], ["d"], ["d"], [], ["d"]]
    result = page.evaluate(SESSION_SCRIPT, {"wsUrl": server.sessions_url, "plan": plan, "resetAt": 3})
    assert result["supported"], "this Chromium has no H.264 WebCodecs decoder"
    assert result["ready"] == "h264"
    frames = result["frames"]
    assert [f["chunkIndex"] for f in frames] == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1]
    assert all(f["codec"] == 2 and f["size"] == [64, 48] for f in frames)
    # A keyframe at the start and at the reset, nowhere else.
    assert [i for i, f in enumerate(frames) if f["keyframe"]] == [0, 6]
    positions = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]  # G: the frame's position in its rollout (the reset restarts it)
    held = [0, 0, KEY_D, KEY_D, KEY_D, KEY_D, 0, 0, KEY_D, KEY_D]  # B: the keys held for that chunk
    for frame, position, keys in zip(frames, positions, held):
        _red, green, blue = frame["rgb"]
        assert abs(green - position) <= 3 and abs(blue - keys) <= 3, frame

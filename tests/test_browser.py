"""The browser demo (static/) in Debian's Chromium, driven by Playwright, against a real server.

The server runs the fake-kv pipeline, whose 8x8 frames are one flat colour:
G is the frame's absolute position (so the picture changes every frame) and B
has a bit per held key (w=1, a=2, s=4, d=8), so a test can see a key press
reach the screen. The page exposes ``window.arstreamDebug`` (sent and applied
event ids, frames drawn, errors, the last close) for these checks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from arstream.app.bench import ServerProcess

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
FAKE_OPTIONS = json.dumps({"compute_delay_s": 0.01})
KEY_D_BIT = 8
# Waits have no wall-clock limit (0 = none): pytest-timeout is the hang guard.
WAIT_MS = 0

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's Chromium is not installed at /usr/bin/chromium"),
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(["--model", "fake-kv", "--model-options", FAKE_OPTIONS]) as process:
        yield process


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    page = context.new_page()
    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    yield page
    context.close()
    assert not page_errors, f"JavaScript errors on the page: {page_errors}"


def _center_pixel(page: Any) -> list[int]:
    return page.evaluate(
        """() => {
            const c = document.getElementById('screen');
            return Array.from(c.getContext('2d').getImageData(c.width >> 1, c.height >> 1, 1, 1).data);
        }"""
    )


def _debug(page: Any) -> dict[str, Any]:
    return page.evaluate("() => JSON.parse(JSON.stringify(window.arstreamDebug))")


def _wait_frames_drawn(page: Any, more_than: int) -> None:
    page.wait_for_function(f"window.arstreamDebug.framesDrawn > {more_than}", timeout=WAIT_MS)


def test_page_streams_frames_and_a_key_press_reaches_the_screen(server: ServerProcess, page: Any) -> None:
    page.goto(server.base_url + "/")
    _wait_frames_drawn(page, 2)
    first = _center_pixel(page)
    drawn = _debug(page)["framesDrawn"]
    _wait_frames_drawn(page, drawn + 2)
    assert _center_pixel(page) != first, "the canvas did not change between frames"

    page.keyboard.down("d")
    page.wait_for_function("window.arstreamDebug.sentEventIds.length > 0", timeout=WAIT_MS)
    event_id = _debug(page)["sentEventIds"][-1]
    page.wait_for_function(f"window.arstreamDebug.appliedEventIds.includes({event_id})", timeout=WAIT_MS)
    # Frames of chunks that applied the press carry the d bit in blue (JPEG shifts flat colours a little).
    page.wait_for_function(
        f"""() => {{
            const c = document.getElementById('screen');
            const blue = c.getContext('2d').getImageData(0, 0, 1, 1).data[2];
            return Math.abs(blue - {KEY_D_BIT}) <= 3;
        }}""",
        timeout=WAIT_MS,
    )
    page.keyboard.up("d")
    page.wait_for_function(f"window.arstreamDebug.appliedEventIds.includes({event_id + 1})", timeout=WAIT_MS)
    debug = _debug(page)
    assert 1 <= debug["maxTicksInFlight"] <= 2
    assert debug["sentEventIds"] == sorted(set(debug["sentEventIds"])), "event ids must strictly increase"
    assert debug["sentTickIds"] == sorted(set(debug["sentTickIds"])), "tick ids must strictly increase"
    assert debug["errors"] == []
    # Key -> frame is measured when the first frame of the applying chunk is drawn, shown on the next HUD refresh.
    page.wait_for_function(
        "/^\\d+ ms \\(median \\d+ ms\\)$/.test(document.getElementById('hud-action').textContent)",
        timeout=WAIT_MS,
    )


def test_hud_shows_model_latency_and_kv_blocks(server: ServerProcess, page: Any) -> None:
    page.goto(server.base_url + "/")
    _wait_frames_drawn(page, 8)
    # Stats are polled every second: wait for a poll taken while the session holds KV blocks.
    page.wait_for_function(
        "(m => m && Number(m[1]) > 0)(/^(\\d+) \\/ \\d+/.exec(document.getElementById('hud-kv').textContent))",
        timeout=WAIT_MS,
    )
    model = server.get_json("/v1/model")
    assert page.inner_text("#hud-model") == f"{model['name']} {model['width']}×{model['height']} @ {model['fps']} fps"
    assert re.search(r"\d+ ms", page.inner_text("#hud-chunk"))
    used, total = (int(n) for n in re.findall(r"\d+", page.inner_text("#hud-kv"))[:2])
    assert total == server.get_json("/v1/stats")["kv"]["blocks_total"]
    assert 0 < used <= total
    assert page.inner_text("#hud-status") == "streaming"


def test_raw_codec_reset_and_close(server: ServerProcess, page: Any) -> None:
    page.goto(server.base_url + "/?autoconnect=0")
    page.select_option("#codec", "raw")
    page.click("#connect")
    _wait_frames_drawn(page, 4)
    page.keyboard.down("ArrowRight")
    # Raw frames are exact: the d bit (ArrowRight is d) in blue, nothing else.
    page.wait_for_function(
        f"""() => {{
            const c = document.getElementById('screen');
            return c.getContext('2d').getImageData(0, 0, 1, 1).data[2] === {KEY_D_BIT};
        }}""",
        timeout=WAIT_MS,
    )
    page.keyboard.up("ArrowRight")
    sent_before = len(_debug(page)["sentEventIds"])
    page.fill("#prompt", "a snowy forest")
    page.press("#prompt", "Enter")
    page.wait_for_function(f"window.arstreamDebug.sentEventIds.length === {sent_before + 1}", timeout=WAIT_MS)
    prompt_event = _debug(page)["sentEventIds"][-1]
    page.wait_for_function(f"window.arstreamDebug.appliedEventIds.includes({prompt_event})", timeout=WAIT_MS)
    page.click("#reset")
    page.wait_for_function(
        "Array.from(document.querySelectorAll('#log li')).some(li => li.textContent.includes('new rollout (reset)'))",
        timeout=WAIT_MS,
    )
    page.click("#close")
    page.wait_for_function("window.arstreamDebug.state === 'closed'", timeout=WAIT_MS)
    debug = _debug(page)
    assert debug["lastClose"]["code"] == 1000
    assert debug["errors"] == []
    assert "Session closed" in page.inner_text("#overlay")
    page.wait_for_function("!document.getElementById('connect').disabled", timeout=WAIT_MS)


def test_model_failure_is_shown_and_reset_recovers(server: ServerProcess, page: Any) -> None:
    page.goto(server.base_url + "/")
    _wait_frames_drawn(page, 2)
    # The fake pipeline raises inside the forward when its controls say so.
    page.evaluate("window.arstreamDebug.sendInput({controls: {keys: [], fail: true}})")
    page.wait_for_function("window.arstreamDebug.state === 'failed'", timeout=WAIT_MS)
    assert "Press Reset" in page.inner_text("#overlay")
    assert "session_failed" in page.inner_text("#log")
    assert {error["code"] for error in _debug(page)["errors"]} == {"session_failed"}

    page.evaluate("window.arstreamDebug.sendInput({controls: {keys: [], fail: false}})")
    chunks = _debug(page)["chunksReceived"]
    page.click("#reset")
    page.wait_for_function(
        f"window.arstreamDebug.state === 'streaming' && window.arstreamDebug.chunksReceived > {chunks + 2}",
        timeout=WAIT_MS,
    )
    assert page.locator("#overlay.hidden").count() == 1
    assert "new rollout (reset)" in page.inner_text("#log")


def test_missing_token_is_shown_as_a_fatal_close_and_the_token_param_works(browser: Any) -> None:
    with ServerProcess(["--model", "fake-kv", "--auth-token", "let-me-in"]) as secured:
        context = browser.new_context()
        try:
            page = context.new_page()
            page.goto(secured.base_url + "/")
            page.wait_for_function("window.arstreamDebug.state === 'closed'", timeout=WAIT_MS)
            debug = _debug(page)
            assert debug["lastClose"]["code"] == 1008
            assert "unauthorized" in page.inner_text("#overlay")
            assert "1008" in page.inner_text("#overlay")
            assert page.locator("#log li.fatal").count() >= 1

            page.goto(secured.base_url + "/?token=let-me-in")
            _wait_frames_drawn(page, 2)
            assert _debug(page)["errors"] == []
        finally:
            context.close()

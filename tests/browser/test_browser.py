"""The demo page (static/) in Debian's Chromium, driven by Playwright, against a real server.

Desktop checks: streaming and steering, the details panel, codec/prompt/focus
handling, reset and Stop, model failure in plain words, the token field, the
page under the server's real CSP, fullscreen, recording and the share link.
Phones are in test_browser_touch.py, recovery in test_browser_recovery.py.
"""

from __future__ import annotations

import importlib.util
import re
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from browser_helpers import (
    KEY_BITS,
    PageErrors,
    browser_marks,
    corner_blue,
    debug,
    new_page,
    open_context,
    overlay_text,
    wait,
    wait_blue,
    wait_frames_drawn,
    wait_state,
)
from arstream.app import video
from arstream.app.protocol import ERROR_CLOSE_CODES, ErrorCode
from servers import REPO_ROOT, LiveServer, fake_settings, running_server

pytestmark = browser_marks
EBML_MAGIC = bytes.fromhex("1a45dfa3")  # every WebM file starts with it


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    options = {"compute_delay_s": 0.01, "reads_prompt": True}
    with running_server(fake_settings(model_options=options)) as live:
        yield live


def _pixel(page: Any) -> list[int]:
    return page.evaluate("Array.from(document.getElementById('screen').getContext('2d').getImageData(4, 4, 1, 1).data)")


def _blue_is(value: int) -> str:
    """A predicate: the drawn frame's blue is exactly ``value`` (raw frames are exact)."""
    return f"document.getElementById('screen').getContext('2d').getImageData(0, 0, 1, 1).data[2] === {value}"


def _log_count(page: Any, text: str) -> int:
    return page.evaluate(
        "(text) => Array.from(document.querySelectorAll('#log li')).filter(li => li.textContent.includes(text)).length",
        text,
    )


def test_page_streams_frames_and_a_key_press_reaches_the_screen(server: LiveServer, page: Any) -> None:
    page.goto(server.base_url + "/")
    wait_frames_drawn(page, 2)
    first = _pixel(page)
    drawn = debug(page)["framesDrawn"]
    wait_frames_drawn(page, drawn + 2)
    assert _pixel(page) != first
    assert debug(page)["sentEventIds"] == [], "no key held: the page sends no input"

    page.keyboard.down("d")
    wait(page, "window.arstreamDebug.sentEventIds.length === 1")
    press = debug(page)["sentEventIds"][0]
    wait(page, f"window.arstreamDebug.appliedEventIds.includes({press})")
    wait_blue(page, KEY_BITS["d"])
    assert page.locator("#pad [data-key=d].held").count() == 1, "the pad shows the held key"
    page.keyboard.up("d")
    wait(page, f"window.arstreamDebug.appliedEventIds.includes({press + 1})")
    wait_blue(page, 0)
    state = debug(page)
    assert 1 <= state["maxTicksInFlight"] <= 2
    assert state["sentTickIds"] == sorted(set(state["sentTickIds"])), "tick ids must strictly increase"
    assert state["errors"] == []
    # Key -> frame is measured when the first frame of the applying chunk is drawn; the badge shows its median.
    wait(page, "window.arstreamDebug.samples.action.length >= 1")
    wait(page, "/key→frame \\d+ ms/.test(document.getElementById('badge').textContent)")
    assert "fake-kv" in page.inner_text("#explain"), "a line says what the picture is"
    assert page.evaluate("getComputedStyle(document.getElementById('screen')).imageRendering") == "pixelated"
    assert page.locator("#screen[role=img]").count() == 1
    assert "fake-kv" in page.get_attribute("#screen", "aria-label")
    assert page.get_attribute("#overlay", "role") == "status"
    # a card without `inputs` is driven by W A S D, the arrows the same keys
    assert page.inner_text(".howto").startswith("Hold W A S D or the arrow keys, hold the pad, or drag on the world")


def test_details_show_model_latency_and_kv_blocks(server: LiveServer, page: Any) -> None:
    page.goto(server.base_url + "/")
    wait_frames_drawn(page, 8)
    assert not page.is_visible("#hud-kv"), "the developer numbers are folded away"
    page.click("#details summary")
    # Stats are polled every second while the details are open: wait for one taken while the session holds KV.
    wait(page, "(m => m && Number(m[1]) > 0)(/^(\\d+) \\/ \\d+/.exec(document.getElementById('hud-kv').textContent))")
    model = server.get("/v1/model").json()
    assert page.inner_text("#hud-model") == f"{model['name']} {model['width']}×{model['height']} @ {model['fps']} fps"
    assert re.search(r"\d+ ms", page.inner_text("#hud-chunk"))
    used, total = (int(n) for n in re.findall(r"\d+", page.inner_text("#hud-kv"))[:2])
    assert total == server.stats()["kv"]["blocks_total"]
    assert 0 < used <= total
    assert page.inner_text("#hud-status") == "streaming"


def test_a_server_without_webrtc_is_offered_none_and_the_menu_does_not_offer_it(server: LiveServer, page: Any) -> None:
    """This server has no --webrtc (its `ready` has no `webrtc`): a link asking for WebRTC still plays on the
    WebSocket, with no offer sent to be refused, and the details have no delivery choice to make."""
    sent: list[str] = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(str(payload))))
    page.goto(server.base_url + "/?delivery=webrtc")
    wait_frames_drawn(page, 4)
    page.click("#details summary")
    assert page.is_visible("#codec") and not page.is_visible("#delivery")
    assert not any("webrtc_offer" in message for message in sent), sent
    assert debug(page)["errors"] == [] and page.text_content("#hud-delivery") == "WebSocket"


def test_codec_prompt_focus_reset_and_stop(server: LiveServer, page: Any) -> None:
    page.goto(server.base_url + "/?autoconnect=0")
    # the page shows the prompt box once it has read the card (/v1/model), which it fetches after load
    page.wait_for_selector("#prompt-form", state="visible")  # this model's card says it reads prompts
    page.click("#details summary")
    page.select_option("#codec", "raw")
    page.click("#overlay-action")  # Play
    wait_frames_drawn(page, 4)
    # The codec menu gave the keys back: raw frames are exact, the d bit (ArrowRight is d) and nothing else.
    page.keyboard.down("ArrowRight")
    wait(page, _blue_is(KEY_BITS["d"]))
    page.keyboard.up("ArrowRight")
    wait(page, _blue_is(0))

    # A click into the prompt takes the keys; Escape gives them back without sending.
    sent = len(debug(page)["sentEventIds"])
    page.click("#prompt")
    page.keyboard.type("wasd")
    assert debug(page)["heldKeys"] == [] and len(debug(page)["sentEventIds"]) == sent
    assert "Esc" in page.inner_text("#hint")
    page.keyboard.press("Escape")
    page.keyboard.down("a")
    wait(page, _blue_is(KEY_BITS["a"]))

    page.fill("#prompt", "a snowy forest")
    page.press("#prompt", "Enter")
    wait(page, f"window.arstreamDebug.sentEventIds.length === {sent + 2}")  # the held a, then the prompt
    prompt_event = debug(page)["sentEventIds"][-1]
    wait(page, f"window.arstreamDebug.appliedEventIds.includes({prompt_event})")

    # Restart world, clicked with the mouse; Space afterwards must not press it again.
    page.click("#reset")
    wait(page, "(document.getElementById('log').textContent || '').includes('new rollout (reset)')")
    chunks = debug(page)["chunksReceived"]
    page.keyboard.press("Space")
    wait(page, f"window.arstreamDebug.chunksReceived > {chunks + 4}")
    assert _log_count(page, "new rollout (reset)") == 1
    assert corner_blue(page) == KEY_BITS["a"], "the world restarted with the held key"
    page.keyboard.up("a")

    assert page.inner_text("#play") == "Stop"
    page.click("#play")
    wait_state(page, "stopped")
    wait(page, "window.arstreamDebug.lastClose !== null")
    state = debug(page)
    assert state["lastClose"]["code"] == 1000
    assert state["errors"] == []
    assert "Stopped" in overlay_text(page)
    assert page.inner_text("#play") == "Play"
    server.wait_for_stats(lambda stats: stats["sessions"]["connected"] == 0)

    # Stop and Play again at once: the new session does not wait for the old one's close.
    page.click("#play")
    wait_state(page, "streaming")
    page.click("#play")
    page.click("#play")
    wait_state(page, "streaming")
    wait_frames_drawn(page, debug(page)["framesDrawn"] + 4)
    assert page.inner_text("#play") == "Stop"


def test_model_failure_in_plain_words_and_restart_recovers_with_the_held_keys(server: LiveServer, page: Any) -> None:
    page.goto(server.base_url + "/")
    wait_frames_drawn(page, 2)
    page.keyboard.down("s")
    wait_blue(page, KEY_BITS["s"])
    # The fake pipeline raises inside the forward while its controls say so (these controls drop the s).
    page.evaluate("window.arstreamDebug.sendInput({controls: {keys: [], fail: true}})")
    wait_state(page, "failed")
    text = overlay_text(page)
    assert "The model failed" in text
    assert "session_failed" not in text and "Error" not in text, "protocol words stay in the details log"
    assert "session_failed" in (page.text_content("#log") or "")
    assert page.inner_text("#overlay-action") == "Restart world"

    # No key changed since: only the reset tick can carry the held s, replacing the controls that failed.
    reset_tick = debug(page)["sentTickIds"][-1] + 1  # a failed session sends no tick until the reset
    page.click("#overlay-action")
    wait_state(page, "streaming")
    wait_blue(page, KEY_BITS["s"])
    chunks = debug(page)["chunksReceived"]
    wait(page, f"window.arstreamDebug.chunksReceived > {chunks + 3}")
    page.keyboard.up("s")
    # The failing tick, and one queued behind it, fail; nothing from the reset on.
    errors = debug(page)["errors"]
    assert {error["code"] for error in errors} == {"session_failed"}
    assert all(error["tick_id"] < reset_tick for error in errors), errors
    assert page.is_hidden("#overlay")


def test_token_field_on_unauthorized_and_token_kept_out_of_the_url(browser: Any, errors: PageErrors) -> None:
    with running_server(fake_settings(auth_token="let-me-in")) as secured:
        context = open_context(browser, viewport=None)
        try:
            page = new_page(context, errors)
            page.goto(secured.base_url + "/")
            wait_state(page, "needs-token")
            assert "access token" in overlay_text(page)
            assert page.is_visible("#token")
            page.fill("#token", "let-me-in")
            page.press("#token", "Enter")
            wait_frames_drawn(page, 2)
            assert page.evaluate("sessionStorage.getItem('arstream-token')") == "let-me-in"

            second = new_page(context, errors)
            second.goto(secured.base_url + "/?token=let-me-in&seed=5")
            wait_frames_drawn(second, 2)
            assert "token" not in second.url and "seed=5" in second.url, "the token leaves the address bar"
            assert debug(second)["errors"] == []
        finally:
            context.close()
    # A server that refuses before the upgrade (HTTP 401): the page sees only failed sockets while /readyz says yes.
    with running_server(fake_settings(auth_token="let-me-in", refuse_before_upgrade=True)) as strict:
        context = open_context(browser, viewport=None)
        try:
            page = new_page(context, errors)
            page.goto(strict.base_url + "/")
            wait_state(page, "needs-token")
            assert "refused the connection" in overlay_text(page)
            page.fill("#token", "let-me-in")
            page.press("#token", "Enter")
            wait_frames_drawn(page, 2)
        finally:
            context.close()


def test_the_page_runs_under_the_servers_content_security_policy(
    server: LiveServer, browser: Any, errors: PageErrors
) -> None:
    context = browser.new_context()  # no CSP bypass: only evaluate (not eval) is used here
    try:
        page = new_page(context, errors)
        violations: list[str] = []
        page.on("console", lambda message: violations.append(message.text))
        response = page.goto(server.base_url + "/")
        assert response is not None and "script-src 'self'" in response.headers["content-security-policy"]
        while page.evaluate("window.arstreamDebug.framesDrawn") < 3:
            time.sleep(0.05)
        assert [text for text in violations if "Content Security Policy" in text] == []
    finally:
        context.close()


def test_fullscreen_recording_download_and_share_link(
    server: LiveServer, context: Any, page: Any, errors: PageErrors
) -> None:
    page.goto(server.base_url + "/?seed=4242")
    wait_frames_drawn(page, 4)
    small = page.evaluate("document.getElementById('screen').getBoundingClientRect().height")

    page.click("#fullscreen")
    wait(page, "document.fullscreenElement && document.fullscreenElement.id === 'player'")
    wait(page, f"document.getElementById('screen').getBoundingClientRect().height > {small}")
    # The button's label follows the fullscreenchange event, which may land after the element: wait for it.
    wait(page, "document.getElementById('fullscreen').textContent === 'Exit fullscreen'")
    page.evaluate("document.exitFullscreen()")
    wait(page, "document.fullscreenElement === null")
    wait(page, "document.getElementById('fullscreen').textContent === 'Fullscreen'")

    page.click("#record")
    assert page.is_visible("#rec-dot")
    drawn = debug(page)["framesDrawn"]
    wait_frames_drawn(page, drawn + 24)
    with page.expect_download() as download_info:
        page.click("#record")
    download = download_info.value
    assert re.fullmatch(r"arstream-fake-kv-seed4242-[\d-]+\.webm", download.suggested_filename)
    clip = Path(download.path()).read_bytes()
    assert clip[:4] == EBML_MAGIC and len(clip) > 1000
    # The clip says how long it is (MediaRecorder writes none; the page adds it) and every frame decodes.
    import av

    with av.open(download.path()) as container:
        duration_s = container.duration / av.time_base if container.duration else 0.0
        decoded = sum(1 for _ in container.decode(video=0))
    assert duration_s > 0.5 and decoded > 0, (duration_s, decoded)
    assert page.is_hidden("#rec-dot")

    page.click("#share")
    link = page.input_value("#share-link")
    assert "seed=4242" in link and "model=fake-kv" in link and "token" not in link
    opened = new_page(context, errors)
    opened.goto(link)
    wait_frames_drawn(opened, 2)
    assert debug(opened)["seed"] == 4242


def test_the_screenshot_script_captures_the_page(server: LiveServer, browser: Any, tmp_path: Path) -> None:
    """scripts/screenshots.py makes the README's pictures; run its capture at the phone size."""
    spec = importlib.util.spec_from_file_location("screenshots", REPO_ROOT / "scripts" / "screenshots.py")
    assert spec is not None and spec.loader is not None
    screenshots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(screenshots)
    shot = screenshots.SHOTS["demo-phone-390x844.png"]
    path = tmp_path / "phone.png"
    screenshots.capture(browser, server.base_url, path, shot)
    png = path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert (width, height) == (shot.width, shot.height)


def test_every_protocol_code_has_plain_words(server: LiveServer, page: Any) -> None:
    page.goto(server.base_url + "/?autoconnect=0")
    words = page.evaluate("import('/messages.js').then(m => ({errors: m.ERROR_TEXT, closes: m.CLOSE_TEXT}))")
    missing_errors = [code.value for code in ErrorCode if not words["errors"].get(code.value)]
    close_codes = {1000, 1001, 1006, *ERROR_CLOSE_CODES.values()}
    missing_closes = [code for code in sorted(close_codes) if not words["closes"].get(str(code))]
    assert missing_errors == [] and missing_closes == []


def test_h264_from_the_codec_menu_and_jpeg_when_the_server_cannot(
    server: LiveServer, page: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    page.goto(server.base_url + "/?autoconnect=0")
    if not page.evaluate("import('/decode.js').then(m => m.h264Supported())"):
        pytest.skip("this Chromium decodes no H.264 through WebCodecs")
    wait(page, "!document.querySelector('#codec option[value=h264]').hidden")
    page.click("#details summary")
    page.select_option("#codec", "h264")
    page.click("#overlay-action")  # Play
    wait_frames_drawn(page, 4)
    page.keyboard.down("d")
    wait_blue(page, KEY_BITS["d"], tolerance=8)  # lossy video on a flat colour
    page.keyboard.up("d")
    assert debug(page)["errors"] == []

    # A server that cannot encode H.264 refuses that `start`: the page asks again for JPEG.
    page.click("#play")
    wait_state(page, "stopped")
    monkeypatch.setattr(video, "h264_available", lambda: False)
    page.click("#play")
    wait_state(page, "streaming")
    wait_frames_drawn(page, debug(page)["framesDrawn"] + 4)
    assert page.input_value("#codec") == "jpeg"
    assert [error["code"] for error in debug(page)["errors"]] == ["invalid_message"]
    assert "does not send H.264" in (page.text_content("#log") or "")

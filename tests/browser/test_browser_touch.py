"""The demo page on a phone: a 390x844 touch screen in Chromium (Playwright), against a real server.

Touches go through the browser's own input pipeline (CDP ``Input.dispatchTouchEvent``),
so the page sees real pointer events: several fingers on the pad at once, a drag
on the player. Also: the page fits the screen, reduced motion, a gamepad.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from browser_helpers import KEY_BITS, PageErrors, browser_marks, debug, new_page, wait, wait_blue, wait_frames_drawn
from servers import LiveServer, fake_settings, running_server

pytestmark = browser_marks
PHONE = {"width": 390, "height": 844}
# A standard-mapping gamepad with the left stick pushed left (axis 0 = -1).
GAMEPAD_STICK_LEFT = """
    (() => {
        const pad = {connected: true, index: 0, id: 'test pad', mapping: 'standard', axes: [-1, 0, 0, 0],
                     buttons: Array.from({length: 17}, () => ({pressed: false, value: 0}))};
        navigator.getGamepads = () => [window.__testPadOn ? pad : null];
    })();
"""


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server(fake_settings(model_options={"compute_delay_s": 0.01})) as live:
        yield live


def _centre(page: Any, selector: str) -> tuple[float, float]:
    box = page.locator(selector).bounding_box()
    assert box is not None
    return box["x"] + box["width"] / 2, box["y"] + box["height"] / 2


def _touch(cdp: Any, kind: str, points: list[tuple[float, float]]) -> None:
    cdp.send(
        "Input.dispatchTouchEvent",
        {"type": kind, "touchPoints": [{"x": x, "y": y, "id": i + 1} for i, (x, y) in enumerate(points)]},
    )


def test_phone_fits_the_screen_and_steers_by_touch_pad_drag_and_gamepad(server: LiveServer, browser: Any) -> None:
    errors = PageErrors()
    context = browser.new_context(
        viewport=PHONE, is_mobile=True, has_touch=True, device_scale_factor=3, reduced_motion="reduce", bypass_csp=True
    )
    context.add_init_script(GAMEPAD_STICK_LEFT)
    try:
        page = new_page(context, errors)
        page.goto(server.base_url + "/")
        wait_frames_drawn(page, 4)

        # The page is no wider than the phone and the world takes most of its width.
        assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
        canvas = page.locator("#screen").bounding_box()
        assert canvas is not None and 0.6 * PHONE["width"] <= canvas["width"] <= PHONE["width"]
        assert canvas["x"] >= 0 and canvas["x"] + canvas["width"] <= PHONE["width"]
        pad = page.locator("#pad").bounding_box()
        assert pad is not None and pad["y"] + pad["height"] <= PHONE["height"], "the pad is on the first screen"
        assert page.is_hidden("#prompt-form"), "fake-kv's card says it reads no prompt"
        assert page.evaluate("getComputedStyle(document.querySelector('#pad button')).transitionDuration") == "0s"
        # A phone has no W A S D: the first hint talks about what a finger can do.
        hint = page.evaluate("document.getElementById('hint').textContent")
        assert "W A S D" not in hint and "pad" in hint, hint

        # Two fingers on the pad hold two keys at once; lifting them lets go.
        cdp = context.new_cdp_session(page)
        up, right = _centre(page, "#pad [data-key=w]"), _centre(page, "#pad [data-key=d]")
        _touch(cdp, "touchStart", [up])
        _touch(cdp, "touchStart", [up, right])
        wait(page, "window.arstreamDebug.heldKeys.join() === 'd,w'")
        wait_blue(page, KEY_BITS["w"] | KEY_BITS["d"])
        assert page.locator("#pad button.held").count() == 2
        _touch(cdp, "touchEnd", [])
        wait(page, "window.arstreamDebug.heldKeys.length === 0")
        wait_blue(page, 0)

        # A drag on the world steers like a joystick: right of where it began holds d.
        x, y = _centre(page, "#screen")
        _touch(cdp, "touchStart", [(x, y)])
        _touch(cdp, "touchMove", [(x + 30, y + 2)])
        _touch(cdp, "touchMove", [(x + 80, y + 4)])
        wait(page, "window.arstreamDebug.heldKeys.join() === 'd'")
        wait_blue(page, KEY_BITS["d"])
        _touch(cdp, "touchEnd", [])
        wait(page, "window.arstreamDebug.heldKeys.length === 0")
        assert page.evaluate("window.scrollY") == 0, "a drag on the player does not scroll the page"

        # A gamepad's left stick, read once it connects.
        page.evaluate("window.__testPadOn = true; window.dispatchEvent(new Event('gamepadconnected'))")
        wait(page, "window.arstreamDebug.heldKeys.join() === 'a'")
        wait_blue(page, KEY_BITS["a"])
        page.evaluate("window.__testPadOn = false")
        wait(page, "window.arstreamDebug.heldKeys.length === 0")
        assert debug(page)["errors"] == []
    finally:
        context.close()
    errors.check()

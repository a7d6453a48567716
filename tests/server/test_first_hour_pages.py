"""Pages a stranger meets in the first hour, in Chromium at desktop (1280x800) and phone (390x844, touch) size:
a wrong address, the viewer's page."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import httpx

from browser_helpers import PageErrors, browser_marks, new_page, wait, wait_frames_drawn
from servers import LiveServer, fake_settings, running_server

pytestmark = browser_marks

SIZES: dict[str, dict[str, Any]] = {
    "desktop": {"viewport": {"width": 1280, "height": 800}},
    "phone": {"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True, "device_scale_factor": 3},
}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server(fake_settings(model_options={"compute_delay_s": 0.01})) as live:
        yield live


@pytest.fixture(params=sorted(SIZES))
def context(request: pytest.FixtureRequest, browser: Any) -> Iterator[Any]:
    context = browser.new_context(**SIZES[request.param], bypass_csp=True)
    yield context
    context.close()


def test_a_wrong_address_gets_a_page_with_a_way_back(server: LiveServer, context: Any, errors: PageErrors) -> None:
    page = new_page(context, errors)
    response = page.goto(server.base_url + "/no/such/page")
    assert response is not None and response.status == 404
    assert "There is no page at this address" in (page.text_content("body") or "")
    assert "detail" not in (page.text_content("body") or "")
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") != "rgba(0, 0, 0, 0)", "styled"
    page.click("text=Go to the world model demo")
    page.wait_for_url(server.base_url + "/")
    # a script or an API client still gets JSON
    answer = httpx.get(server.base_url + "/no/such/page", headers={"Accept": "application/json"}, timeout=10)
    assert answer.status_code == 404 and answer.json() == {"detail": "Not Found"}


def test_a_viewer_is_not_told_to_steer(server: LiveServer, context: Any, errors: PageErrors) -> None:
    player = new_page(context, errors)
    player.goto(server.base_url + "/")
    wait_frames_drawn(player, 2)
    wait(player, "window.arstreamDebug.shareToken !== null")
    token = player.evaluate("window.arstreamDebug.shareToken")
    viewer = new_page(context, errors)
    viewer.goto(f"{server.base_url}/?watch={token}")
    wait_frames_drawn(viewer, 2)
    assert not viewer.is_visible("#hint"), "a viewer cannot steer: no 'Hold W A S D' hint"
    assert player.is_visible("#hint") or player.evaluate("window.arstreamDebug.heldKeys.length") > 0


def test_the_realtime_video_page_shows_the_video_at_the_models_shape_and_width(
    server: LiveServer, context: Any, errors: PageErrors
) -> None:
    card = httpx.get(server.base_url + "/v1/model", timeout=10).json()
    page = new_page(context, errors)
    page.goto(server.base_url + "/realtime-video.html")
    wait(page, "document.getElementById('video').dataset.modelSize !== undefined")
    box = page.locator("#video").bounding_box()
    viewport = page.viewport_size
    assert box is not None and viewport is not None
    assert box["width"] >= min(4 * card["width"], viewport["width"] - 40), box  # not a 64 px postage stamp
    assert box["x"] + box["width"] <= viewport["width"], "it fits the screen"
    assert abs(box["width"] / box["height"] - card["width"] / card["height"]) < 0.02, box
    assert page.locator("header.top h1").text_content() == "ARStream", "styled like the main page"


def test_on_a_phone_share_does_not_push_the_pad_off_the_screen(server: LiveServer, browser: Any, errors: PageErrors) -> None:
    context = browser.new_context(**SIZES["phone"], bypass_csp=True)
    try:
        page = new_page(context, errors)
        page.goto(server.base_url + "/")
        wait_frames_drawn(page, 2)
        wait(page, "window.arstreamDebug.shareToken !== null")
        page.click("#share")
        wait(page, "!document.getElementById('share-box').hidden")
        pad = page.locator("#pad").bounding_box()
        share = page.locator("#share-box").bounding_box()
        assert pad is not None and share is not None
        assert pad["y"] + pad["height"] <= 844, f"the pad is below the fold: {pad}"
        assert share["y"] > pad["y"], "the links come after the pad"
    finally:
        context.close()

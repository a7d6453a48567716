"""The demo page with LongLive (tiny, random weights) in Debian's Chromium: the prompt box sends an `input` with
the prompt, and the page shows the chunk that applied it; a model steered by prompts alone gets no key pad."""

from collections.abc import Iterator
from typing import Any

import pytest

from browser_helpers import PageErrors, browser_marks, debug, new_page, open_context, wait, wait_frames_drawn
from servers import LiveServer, fake_settings, running_server

pytestmark = browser_marks


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    settings = fake_settings(model="longlive", model_options={"config": "tiny", "random_init": True}, torch_threads=1)
    with running_server(settings) as live:
        yield live


def test_the_prompt_box_switches_the_prompt_and_shows_the_chunk_that_applied_it(server: LiveServer, page: Any) -> None:
    sent: list[str] = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(payload)))
    page.goto(server.base_url + "/")
    wait_frames_drawn(page, 9 + 12)
    assert page.locator("#prompt-form").is_visible()
    page.fill("#prompt", "a city street at night, rain")
    page.press("#prompt", "Enter")
    wait(page, "window.arstreamDebug.promptChunks.length >= 1")
    applied = debug(page)["promptChunks"][0]
    assert applied["prompt"] == "a city street at night, rain" and applied["chunk"] >= 1
    assert any('"type":"input"' in m and '"prompt":"a city street at night, rain"' in m for m in sent), sent
    assert (page.locator("#log").text_content() or "").count(f"prompt applied at chunk {applied['chunk']}") == 1
    assert debug(page)["errors"] == []


SIZES: dict[str, dict[str, Any]] = {
    "desktop": {"viewport": {"width": 1280, "height": 800}},
    "portrait": {"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True},
    "landscape": {"viewport": {"width": 844, "height": 390}, "is_mobile": True, "has_touch": True},
}
SHOWN = """(selector) => {
    const el = document.querySelector(selector);
    const box = el.getBoundingClientRect();
    return !el.hidden && getComputedStyle(el).display !== 'none' && box.width > 0;
}"""
TOP = "(selector) => document.querySelector(selector).getBoundingClientRect().top"


@pytest.mark.parametrize("size", list(SIZES))
def test_a_prompt_only_model_gets_a_prompt_page_not_a_steering_pad(
    server: LiveServer, browser: Any, errors: PageErrors, size: str
) -> None:
    # LongLive's controls take no keys: the page reads that from the model card.
    context = open_context(browser, **SIZES[size])
    try:
        page = new_page(context, errors)
        sent: list[str] = []
        page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(payload)))
        page.goto(server.base_url + "/")
        wait(page, "window.arstreamDebug.steering !== null")
        assert debug(page)["steering"] == "prompt"
        for selector in ("#pad", "#hint", ".howto"):
            assert not page.evaluate(SHOWN, selector), f"{selector} is shown for a model that takes no keys ({size})"
        assert page.evaluate(SHOWN, "#prompt-form")
        # The prompt box comes first in the column: above the explanation and the details.
        assert page.evaluate(TOP, "#prompt-form") < page.evaluate(TOP, "#explain")
        explain = page.locator("#explain").text_content() or ""
        assert "steering" not in explain and "prompting longlive" in explain, explain
        assert "random weights" in explain and "the picture is noise" in explain, explain
        assert page.locator("#hud-action-label").text_content() == "prompt → frame"
        wait_frames_drawn(page, 9)
        # A key pressed on the world sends nothing the model would refuse.
        page.locator("#player").focus()
        page.keyboard.down("w")
        page.fill("#prompt", "a harbour at dawn")
        page.press("#prompt", "Enter")
        wait(page, "window.arstreamDebug.promptChunks.length >= 1")
        wait(page, "/prompt→frame \\d+ ms/.test(document.getElementById('badge').textContent)")
        assert "key→frame" not in (page.locator("#badge").text_content() or "")
        assert not [m for m in sent if '"keys"' in m], sent
        assert debug(page)["errors"] == []
    finally:
        context.close()

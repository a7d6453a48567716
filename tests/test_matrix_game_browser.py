"""The demo page with matrix-game-2 (tiny, random weights) in Debian's Chromium: 9 then 12 frames a chunk, steering."""

from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser_helpers import (  # noqa: F401 (browser is a fixture)
    PageErrors,
    browser,
    browser_marks,
    debug,
    new_page,
    wait,
    wait_frames_drawn,
)
from tests.servers import LiveServer, fake_settings, running_server

pytestmark = browser_marks


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    settings = fake_settings(
        model="matrix-game-2", model_options={"config": "tiny", "random_init": True}, torch_threads=1
    )
    with running_server(settings) as live:
        yield live


def test_the_page_streams_matrix_game_and_a_key_press_is_applied(server: LiveServer, browser: Any) -> None:
    errors = PageErrors()
    context = browser.new_context(viewport={"width": 1280, "height": 800}, bypass_csp=True)
    try:
        page = new_page(context, errors)
        page.goto(server.base_url + "/")
        wait_frames_drawn(page, 9 + 12)  # the first chunk's 9 frames and a whole 12-frame chunk
        size = page.evaluate("() => [document.getElementById('screen').width, document.getElementById('screen').height]")
        assert size == [48, 32]
        page.keyboard.down("w")
        wait(page, "window.arstreamDebug.sentEventIds.length >= 1")
        press = debug(page)["sentEventIds"][0]
        wait(page, f"window.arstreamDebug.appliedEventIds.includes({press})")
        page.keyboard.up("w")
        assert debug(page)["errors"] == []
    finally:
        context.close()
    errors.check()

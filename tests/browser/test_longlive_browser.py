"""The demo page with LongLive (tiny, random weights) in Debian's Chromium: the prompt box sends an `input` with
the prompt, and the page shows the chunk that applied it."""

from collections.abc import Iterator
from typing import Any

import pytest

from browser_helpers import browser_marks, debug, wait, wait_frames_drawn
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

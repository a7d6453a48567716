"""The demo page's start image picker and upload in Debian's Chromium, against a real server.

The server runs the fake-kv pipeline offering two start images; the fake
records the start image every tick carried, so the test sees what a choice on
the page did to the model's input (a fresh session, with that image).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from PIL import Image

from browser_helpers import (
    PageErrors,
    browser_marks,
    debug,
    new_page,
    open_context,
    overlay_text,
    wait,
    wait_frames_drawn,
    wait_state,
)
from arstream.app.start_image import pixels_digest
from arstream.models.fake import FakeKVPipeline
from arstream.runner.types import StartImage
from servers import LiveServer, fake_settings, running_server

pytestmark = browser_marks
OFFERED = ["meadow", "canyon"]


@pytest.fixture(scope="module")
def fake() -> FakeKVPipeline:
    return FakeKVPipeline(start_images=OFFERED, compute_delay_s=0.01)


@pytest.fixture(scope="module")
def server(fake: FakeKVPipeline) -> Iterator[LiveServer]:
    with running_server(fake_settings(max_start_image_bytes=32 * 1024), fake) as live:
        yield live


def images_seen(fake: FakeKVPipeline, session_id: str) -> list[StartImage | None]:
    return [image for seen_id, image in list(fake.start_images_seen) if seen_id == session_id]


def new_session_streaming(page: Any, old_session_id: str | None) -> str:
    """Wait until a session other than ``old_session_id`` streams frames; its id."""
    old = "null" if old_session_id is None else repr(old_session_id)
    wait(page, f"window.arstreamDebug.sessionId !== {old} && window.arstreamDebug.sessionId !== null")
    wait_state(page, "streaming")
    drawn = debug(page)["framesDrawn"]
    wait_frames_drawn(page, drawn + 2)
    return debug(page)["sessionId"]


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_pick_an_offered_image_then_upload_one(server: LiveServer, fake: FakeKVPipeline, page: Any) -> None:
    page.goto(server.base_url + "/")
    first = new_session_streaming(page, None)
    assert page.is_visible("#image-form")
    assert page.eval_on_selector_all("#start-image option", "options => options.map(o => o.value)") == OFFERED
    assert set(images_seen(fake, first)) == {None}, "no choice made: the model's default"

    page.select_option("#start-image", "canyon")
    picked = new_session_streaming(page, first)
    assert debug(page)["startImage"] == {"name": "canyon"}
    assert set(images_seen(fake, picked)) == {StartImage(digest="name:canyon", name="canyon")}

    pixels = np.random.default_rng(5).integers(0, 256, (36, 48, 3), dtype=np.uint8)
    page.set_input_files("#image-file", files=[{"name": "mine.png", "mimeType": "image/png", "buffer": png(pixels)}])
    uploaded = new_session_streaming(page, picked)
    assert debug(page)["startImage"] == {"upload": "mine.png"}
    seen = images_seen(fake, uploaded)
    # What the model uses: the centred 36x36 of the 48x36 picture (its 8x8 frame's aspect), scaled to 8x8.
    fitted = np.asarray(Image.fromarray(pixels).crop((6, 0, 42, 36)).resize((8, 8), Image.Resampling.BILINEAR))
    assert seen and all(image is not None and image.digest == pixels_digest(fitted) for image in seen)
    assert "your picture: mine.png" in page.inner_text("#start-image")

    # Restart world keeps the picture: a reset is a new rollout of the same session.
    page.click("#reset")
    wait(page, f"window.arstreamDebug.chunksReceived > {debug(page)['chunksReceived'] + 2}")
    assert debug(page)["sessionId"] == uploaded
    assert {image.digest for image in images_seen(fake, uploaded) if image} == {pixels_digest(fitted)}


def test_a_refused_upload_is_said_in_plain_words_and_play_starts_from_the_default(
    server: LiveServer, fake: FakeKVPipeline, page: Any
) -> None:
    page.goto(server.base_url + "/")
    first = new_session_streaming(page, None)
    page.set_input_files("#image-file", files=[{"name": "notes.png", "mimeType": "image/png", "buffer": b"not a png"}])
    wait_state(page, "ended")
    assert "could not use that start image" in overlay_text(page)
    assert "not a PNG, JPEG, WEBP file" in overlay_text(page)
    assert debug(page)["lastClose"]["code"] == 4004
    assert debug(page)["startImage"] is None and page.input_value("#start-image") == "meadow"

    page.click("#overlay-action")  # Play
    fresh = new_session_streaming(page, first)
    assert set(images_seen(fake, fresh)) == {None}


def test_a_picture_over_the_servers_limit_is_not_sent(server: LiveServer, page: Any) -> None:
    page.goto(server.base_url + "/")
    first = new_session_streaming(page, None)
    big = np.random.default_rng(1).integers(0, 256, (120, 120, 3), dtype=np.uint8)  # about 43 KiB of PNG
    page.set_input_files("#image-file", files=[{"name": "big.png", "mimeType": "image/png", "buffer": png(big)}])
    wait(page, "/at most 32 KiB/.test(document.getElementById('notice').textContent)")
    assert debug(page)["sessionId"] == first and debug(page)["state"] == "streaming"


def test_no_picker_for_a_model_without_start_images(browser: Any, errors: PageErrors) -> None:
    with running_server(fake_settings()) as plain:
        context = open_context(browser, viewport=None)
        page = new_page(context, errors)
        page.goto(plain.base_url + "/")
        new_session_streaming(page, None)
        assert not page.is_visible("#image-form")
        context.close()

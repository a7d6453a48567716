"""A stranger's first hour, in Chromium: the page opened from another device's point of view.

Chromium maps the host name ``lan-box.test`` to 127.0.0.1, so the page is
served as ``http://lan-box.test:PORT/`` exactly as a phone on the LAN would
see ``http://192.168.1.5:PORT/``: its Origin is that name, not a loopback one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from browser_helpers import (
    CHROMIUM,
    CHROMIUM_ARGS,
    PageErrors,
    browser_marks,
    new_page,
    open_context,
    wait,
    wait_frames_drawn,
)
from arstream.models.fake import FakeKVPipeline
from arstream.runner.types import PendingDecode, TickRequest
from servers import fake_settings, running_server

pytestmark = browser_marks
LAN_NAME = "lan-box.test"


@pytest.fixture(scope="module")
def lan_browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        rules = f"--host-resolver-rules=MAP {LAN_NAME} 127.0.0.1"
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=[*CHROMIUM_ARGS, rules])
        yield chromium
        chromium.close()


def test_a_server_listening_beyond_loopback_serves_the_page_to_another_device(
    lan_browser: Any, errors: PageErrors
) -> None:
    # --host 0.0.0.0 is what a user starts to open the demo from a phone; no token, no --allowed-origins.
    with running_server(fake_settings(host="0.0.0.0", model_options={"compute_delay_s": 0.01})) as server:
        context = open_context(lan_browser, viewport=None)
        try:
            page = new_page(context, errors)
            page.goto(f"http://{LAN_NAME}:{server.port}/")
            wait_frames_drawn(page, 5)
            assert page.evaluate("window.arstreamDebug.state") == "streaming"
        finally:
            context.close()


def test_the_servers_own_page_is_admitted_whatever_allowed_origins_lists(lan_browser: Any, errors: PageErrors) -> None:
    # The operator allowed another site for their own client: the server's own page still plays.
    options = {"compute_delay_s": 0.01}
    settings = fake_settings(host="0.0.0.0", allowed_origins="https://game.example", model_options=options)
    with running_server(settings) as server:
        context = open_context(lan_browser, viewport=None)
        try:
            for base in (f"http://{LAN_NAME}:{server.port}", server.base_url):
                page = new_page(context, errors)
                page.goto(base + "/")
                wait_frames_drawn(page, 3)
                page.close()
        finally:
            context.close()


SIZES: dict[str, dict[str, Any]] = {
    "desktop": {"viewport": {"width": 1280, "height": 800}},
    "portrait": {"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True},
    "landscape": {"viewport": {"width": 844, "height": 390}, "is_mobile": True, "has_touch": True},
}


@pytest.fixture(scope="module")
def slow_server() -> Iterator[Any]:
    # fake-kv plays a chunk of 2 frames in 125 ms at 16 fps; drawing it takes 400 ms: the picture must wait.
    with running_server(fake_settings(model_options={"compute_delay_s": 0.4})) as server:
        yield server


@pytest.mark.parametrize("size", list(SIZES))
def test_a_stalling_stream_says_why_on_the_world(
    slow_server: Any, lan_browser: Any, errors: PageErrors, size: str
) -> None:
    # (this module's Chromium: one Playwright per module)
    context = open_context(lan_browser, **SIZES[size])
    try:
        page = new_page(context, errors)
        page.goto(slow_server.base_url + "/")
        wait(page, "window.arstreamDebug.stallReasons.length > 0")
        said = page.text_content("#notice") or ""
        assert said.startswith("Waiting for frames: the server draws a chunk in "), said
        assert "ms, and it plays for 125 ms: this machine draws the world slower than it plays" in said, said
    finally:
        context.close()


class FreeFirstChunk(FakeKVPipeline):
    """A session's first chunk costs nothing and its second a second, as waypoint's do (its start image is no
    forward; its first generated frame primes the decoder): the page runs dry once while the session starts."""

    def _forward(self, ticks: Sequence[TickRequest]) -> list[PendingDecode]:
        self.compute_delay_s = 1.0 if any(self.bound_state(t.session_id).chunk_index == 1 for t in ticks) else 0.0
        return super()._forward(ticks)


def test_running_dry_while_a_session_starts_is_not_blamed_on_the_network(
    lan_browser: Any, errors: PageErrors
) -> None:
    with running_server(fake_settings(), FreeFirstChunk()) as server:
        context = open_context(lan_browser, viewport={"width": 1280, "height": 800})
        try:
            page = new_page(context, errors)
            page.goto(server.base_url + "/")
            wait(page, "window.arstreamDebug.stallLog.length >= 1")
            # the first stall: chunk 0 played, chunk 1 a second away; the pacer had seen one chunk, so nothing is said
            assert page.evaluate("window.arstreamDebug.stallLog[0]") == {"arrived": 1, "said": ""}
            wait_frames_drawn(page, 8)  # and the world plays on
        finally:
            context.close()

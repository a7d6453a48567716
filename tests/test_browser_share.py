"""Rewind, branch, watch and pass control on the demo page (issue 27), in Debian's Chromium, against a real server.

The server runs the fake-kv pipeline with rewind on: its frames are one flat
colour, G the frame's absolute position in the rollout (so a rewind shows as G
going back) and B a bit per held key (w=1, a=2, s=4, d=8). static/share.js's
plain functions are tested by importing the module in the page.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser_helpers import (  # noqa: F401 (browser and errors are fixtures)
    KEY_BITS,
    PageErrors,
    browser,
    browser_marks,
    debug,
    errors,
    new_page,
    overlay_text,
    wait,
    wait_blue,
    wait_frames_drawn,
    wait_state,
)
from tests.servers import LiveServer, fake_settings, running_server

pytestmark = browser_marks
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server(fake_settings(model_options={"compute_delay_s": 0.01})) as live:
        yield live


@pytest.fixture
def context(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 800}, bypass_csp=True)
    yield context
    context.close()


@pytest.fixture
def page(context: Any, errors: PageErrors) -> Any:
    return new_page(context, errors)


def share_module(page: Any, call: str) -> Any:
    """Evaluate ``call`` with static/share.js imported as ``m``."""
    return page.evaluate(f"import('/share.js').then(m => {call})")


# ---- share.js: what a link asks for, the links, the timeline ---------------------------------


def test_share_mode_reads_watch_and_branch_links(server: LiveServer, page: Any) -> None:
    page.goto(server.base_url + "/?autoconnect=0")

    def mode(query: str) -> dict[str, Any]:
        return share_module(page, f"m.shareMode(new URLSearchParams({query!r}))")

    assert mode("") == {"kind": "play"}
    assert mode("seed=4") == {"kind": "play"}
    assert mode("watch=r0.abc") == {"kind": "watch", "token": "r0.abc"}
    assert mode("branch=r0.abc&chunk=12") == {"kind": "branch", "token": "r0.abc", "chunk": 12}
    assert mode("branch=r0.abc&chunk=0") == {"kind": "branch", "token": "r0.abc", "chunk": 0}
    for bad in ("watch=", "branch=r0.abc", "branch=r0.abc&chunk=-1", "branch=r0.abc&chunk=1.5",
                "branch=r0.abc&chunk=99999999999", "branch=&chunk=2", "watch=a&branch=b&chunk=1"):
        assert mode(bad)["kind"] == "bad", bad


def test_share_links_and_timeline_range(server: LiveServer, page: Any) -> None:
    page.goto(server.base_url + "/?autoconnect=0")
    links = share_module(page, "m.shareLinks('http://h:1/', 'r0.a+b/c', 7)")
    assert links == {"watch": "http://h:1/?watch=r0.a%2Bb%2Fc", "branch": "http://h:1/?branch=r0.a%2Bb%2Fc&chunk=7"}
    assert share_module(page, "m.shareLinks('http://h:1/', 'r0.x', null).branch") is None
    # A link the page builds reads back as what it was built from.
    assert share_module(page, "m.shareMode(new URL(m.shareLinks('http://h:1/', 'r0.a+b', 3).branch).searchParams)") == {
        "kind": "branch", "token": "r0.a+b", "chunk": 3}

    def timeline(points: str) -> Any:
        return share_module(page, f"m.timelineRange({points})")

    assert timeline("[2, 10]") == {"min": 2, "max": 10}
    for nothing in ("undefined", "null", "[5, 5]", "[3]", "[-1, 4]", "[1.5, 4]", "[6, 2]", "'2,10'"):
        assert timeline(nothing) is None, nothing
    targets = share_module(page, "[1, 2, 9, 10, 11, 3.5].map(b => m.rewindTarget({min: 2, max: 10}, b))")
    assert targets == [None, 2, 9, None, None, None], "held points only, and the live end is no rewind"
    ids = share_module(page, "m.raiseIdsPast({tick: 3, event: 9}, 41, [2, 12, 5])")
    assert ids == {"tick": 42, "event": 13}
    assert share_module(page, "m.raiseIdsPast({tick: 50, event: 9}, 41, [])") == {"tick": 50, "event": 9}


def test_a_broken_share_link_says_so_and_connects_nowhere(server: LiveServer, page: Any) -> None:
    page.goto(server.base_url + "/?branch=r0.abc")  # no chunk
    wait_state(page, "ended")
    assert "share link cannot be used" in overlay_text(page)
    assert "chunk" in overlay_text(page)
    assert debug(page)["connects"] == 0
    with page.expect_navigation():
        page.click("#overlay-action")  # Start a world of your own
    assert "branch" not in page.url
    wait(page, "window.arstreamDebug && window.arstreamDebug.framesDrawn > 2")

"""Rewind, branch, watch and pass control on the demo page (issue 27), in Debian's Chromium, against a real server.

The server runs the fake-kv pipeline with rewind on: its frames are one flat
colour, G the frame's absolute position in the rollout (so a rewind shows as G
going back) and B a bit per held key (w=1, a=2, s=4, d=8). static/share.js's
plain functions are tested by importing the module in the page.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import urlencode
from typing import Any

import pytest

from browser_helpers import (
    KEY_BITS,
    PageErrors,
    browser_marks,
    debug,
    new_page,
    open_context,
    overlay_text,
    two_windows,
    wait,
    wait_blue,
    wait_frames_drawn,
    wait_state,
)
from servers import LiveServer, fake_settings, running_server

pytestmark = browser_marks
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server(fake_settings(model_options={"compute_delay_s": 0.01})) as live:
        yield live


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
    for bad in ("watch=", "branch=r0.abc&chunk=", "branch=r0.abc&chunk=-1", "branch=r0.abc&chunk=1.5",
                "branch=r0.abc&chunk=99999999999", "branch=&chunk=2", "watch=a&branch=b&chunk=1"):
        assert mode(bad)["kind"] == "bad", bad
    # A link's parameters: from the fragment (never sent to a server), else from the query (links made before).
    def linked(search: str, fragment: str) -> dict[str, Any]:
        return share_module(page, f"m.shareMode(m.shareParams({search!r}, {fragment!r}))")

    assert linked("", "#watch=r0.new") == {"kind": "watch", "token": "r0.new"}
    assert linked("?watch=r0.old", "") == {"kind": "watch", "token": "r0.old"}
    assert linked("?seed=3", "#branch=r0.new&chunk=2") == {"kind": "branch", "token": "r0.new", "chunk": 2}
    assert linked("?watch=r0.old", "#watch=r0.new") == {"kind": "watch", "token": "r0.new"}
    assert linked("?seed=3", "#anchor") == {"kind": "play"}


def test_share_links_and_timeline_range(server: LiveServer, page: Any) -> None:
    page.goto(server.base_url + "/?autoconnect=0")
    links = share_module(page, "m.shareLinks('http://h:1/', 'r0.a+b/c', 7)")
    # The token is in the fragment: opening the link sends it to no server (issue 31, finding 11).
    assert links == {"watch": "http://h:1/#watch=r0.a%2Bb%2Fc", "branch": "http://h:1/#branch=r0.a%2Bb%2Fc&chunk=7"}
    # no chunk: the branch starts wherever the world is when the link is opened
    assert share_module(page, "m.shareLinks('http://h:1/', 'r0.x').branch") == "http://h:1/#branch=r0.x"
    assert share_module(page, "m.shareMode(new URLSearchParams('branch=r0.x'))") == {
        "kind": "branch", "token": "r0.x", "chunk": None}
    # A link the page builds reads back as what it was built from.
    read_back = "(u => m.shareMode(m.shareParams(u.search, u.hash)))(new URL(m.shareLinks('http://h:1/', 'r0.a+b', 3).branch))"
    assert share_module(page, read_back) == {"kind": "branch", "token": "r0.a+b", "chunk": 3}

    def timeline(points: str) -> Any:
        return share_module(page, f"m.timelineRange({points})")

    assert timeline("[2, 5]") == {"min": 2, "max": 5, "held": [2, 3, 4, 5]}  # an older server holds every one
    assert timeline("[2, 10], [2, 6, 8, 9, 10]") == {"min": 2, "max": 10, "held": [2, 6, 8, 9, 10]}
    for nothing in ("undefined", "null", "[5, 5]", "[3]", "[-1, 4]", "[1.5, 4]", "[6, 2]", "'2,10'"):
        assert timeline(nothing) is None, nothing
    targets = share_module(page, "[1, 2, 9, 10, 11, 3.5].map(b => m.rewindTarget({min: 2, max: 10}, b))")
    assert targets == [None, 2, 9, None, None, None], "held points only, and the live end is no rewind"
    thinned = "{min: 2, max: 10, held: [2, 6, 8, 9, 10]}"
    snapped = share_module(page, f"[2, 3, 5, 6, 7, 9, 10].map(b => m.rewindTarget({thinned}, b))")
    # a scrub between thinned points goes to the nearest held one (halfway: the older), never the live end
    assert snapped == [2, 2, 6, 6, 6, 9, None], snapped
    assert share_module(page, "m.rewindTarget({min: 0, max: 10, held: [0, 4, 10]}, 9)") == 4
    assert share_module(page, f"m.timeBack({thinned}, 2, 8)") == "1.0 s back"
    assert share_module(page, f"m.timeBack({thinned}, 6, 0)") == "4 chunks back"
    ids = share_module(page, "m.raiseIdsPast({tick: 3, event: 9}, 41, [2, 12, 5])")
    assert ids == {"tick": 42, "event": 13}
    assert share_module(page, "m.raiseIdsPast({tick: 50, event: 9}, 41, [])") == {"tick": 50, "event": 9}


def test_a_broken_share_link_says_so_and_connects_nowhere(server: LiveServer, page: Any) -> None:
    page.goto(server.base_url + "/?branch=r0.abc&chunk=x")
    wait_state(page, "ended")
    assert "share link cannot be used" in overlay_text(page)
    assert "chunk" in overlay_text(page)
    assert debug(page)["connects"] == 0
    with page.expect_navigation():
        page.click("#overlay-action")  # Start a world of your own
    assert "branch" not in page.url
    wait(page, "window.arstreamDebug && window.arstreamDebug.framesDrawn > 2")


# ---- against the real server: timeline, watch, branch, pass control -----------------------------

# Enough rewind points that a link made now is still good when a second page opens it (8 chunks
# of fake-kv at 16 fps is one second; 64 is eight).
SHARE_POINTS = 64


@pytest.fixture(scope="module")
def sharing(server: LiveServer) -> Iterator[LiveServer]:
    """A server that keeps many rewind points (the module's ``server`` keeps the default)."""
    options = {"compute_delay_s": 0.01}
    with running_server(fake_settings(model_options=options, rewind_seconds=SHARE_POINTS / 8)) as live:
        yield live


def wait_rewind_span(page: Any, span: int) -> None:
    """Wait until the timeline offers at least ``span`` chunks to go back over."""
    wait(page, f"""() => {{
        const slider = document.getElementById('rewind');
        return !document.getElementById('timeline').hidden && Number(slider.max) - Number(slider.min) >= {span};
    }}""")


def share_link(page: Any, which: str) -> str:
    page.click("#share")
    link = page.input_value(f"#share-{which}")
    assert link, f"no {which} link"
    page.keyboard.press("Escape")  # out of the link's text field (Share selects it): the keys steer again
    return link


def badge(page: Any) -> str:
    return page.evaluate("(b => b.hidden ? '' : b.textContent)(document.getElementById('role-badge'))")


def test_timeline_scrub_rewinds_the_world(sharing: LiveServer, page: Any) -> None:
    page.goto(sharing.base_url + "/")
    wait_rewind_span(page, 4)
    assert debug(page)["restarts"] == []
    newest = int(page.get_attribute("#rewind", "max") or 0)
    target = newest - 3  # still held when the tick runs: at most two ticks are ahead of it
    page.fill("#rewind", str(target))  # the slider let go at that point: input, then change
    wait(page, "window.arstreamDebug.restarts.some(r => r.why === 'rewind')")
    state = debug(page)
    assert state["restarts"] == [{"chunk": target, "why": "rewind"}]
    indexes = state["chunkIndexes"]
    at = indexes.index(target, indexes.index(newest - 1) + 1)  # the chunk after the rewind, past the live end
    assert indexes[at - 1] > target, f"the chunk index drops back: {indexes}"
    assert [tick for tick in state["sentTickIds"] if tick > state["sentTickIds"][0]], "ticks went on"
    wait(page, f"window.arstreamDebug.chunkIndexes.includes({target + 3}) && "
               f"window.arstreamDebug.chunkIndexes.lastIndexOf({target + 3}) > {at}")
    assert "rewound (rewind)" in (page.text_content("#log") or "")
    assert debug(page)["errors"] == []
    # The slider follows the world again: its live end is past the rewind point.
    assert int(page.get_attribute("#rewind", "max") or 0) > target


def test_timeline_says_its_horizon_in_seconds_and_marks_the_thinned_points(sharing: LiveServer, page: Any) -> None:
    page.goto(sharing.base_url + "/")
    # 8 s of fake-kv at 8 chunks a second: every boundary of the last 16 chunks, then every other one
    wait(page, "(window.arstreamDebug.rewindHeld || []).length > 0 && "
               "window.arstreamDebug.rewindHeld.at(-1) - window.arstreamDebug.rewindHeld[0] > 24")
    held = page.evaluate("[...document.querySelectorAll('#rewind-points option')].map(o => Number(o.value))")
    assert held[-1] - held[0] > len(held) - 1, f"older points are thinned out: {held}"
    assert held[0] % 2 == 0
    label = page.text_content("#rewind-label") or ""
    assert label.startswith("live · last 8 s, ") and label.endswith(" points"), label


def test_watch_link_opens_a_viewer_with_frames_a_badge_and_the_viewer_count(
    sharing: LiveServer, browser: Any, errors: PageErrors
) -> None:
    with two_windows(browser, errors) as (player, viewer):
        player.goto(sharing.base_url + "/")
        wait_frames_drawn(player, 2)
        link = share_link(player, "watch")
        token = debug(player)["shareToken"]
        assert token and link == f"{sharing.base_url}/#watch={token}"
        assert badge(player) == "", "nobody watches yet"

        viewer.goto(link)
        wait_frames_drawn(viewer, 6)
        watched = debug(viewer)
        assert watched["role"] == "viewer"
        assert watched["sessionId"] == debug(player)["sessionId"]
        assert watched["sentTickIds"] == [], "a viewer asks for no chunks"
        wait(viewer, "document.getElementById('role-badge').textContent === 'viewing · 1 watching'")
        wait(player, "document.getElementById('role-badge').textContent === '1 watching'")
        for control in ("#pad", "#reset", "#timeline", "#pass-box"):
            assert not viewer.is_visible(control), f"{control} is for the player"
        assert "watching someone steer" in viewer.inner_text("#explain")

        # The viewer's keys steer nothing; the player's show on the viewer's screen.
        viewer.keyboard.down("a")
        player.keyboard.down("d")
        wait_blue(viewer, KEY_BITS["d"])
        viewer.keyboard.up("a")
        assert debug(viewer)["sentEventIds"] == []
        player.keyboard.up("d")

        # The player stops: the watched world has ended, in those words.
        player.click("#play")
        wait_state(viewer, "ended")
        assert "you were watching has ended" in overlay_text(viewer)
        assert debug(viewer)["errors"] == []


def test_branch_link_made_long_ago_starts_a_new_session_where_the_world_is(
    sharing: LiveServer, browser: Any, errors: PageErrors
) -> None:
    context = open_context(browser)
    try:
        player = new_page(context, errors)
        player.goto(sharing.base_url + "/")
        wait_rewind_span(player, 3)
        link = share_link(player, "branch")
        assert "chunk=" not in link, link
        made_at = max(debug(player)["chunkIndexes"])
        # Opened well after it was made (more chunks than the old eight rewind points): still good.
        wait(player, f"Math.max(...window.arstreamDebug.chunkIndexes) > {made_at + 20}")

        brancher = new_page(context, errors)
        brancher.goto(link)
        wait_frames_drawn(brancher, 4)
        branch = debug(brancher)
        chunk = branch["chunkIndexes"][0]
        assert branch["role"] == "controller"
        assert branch["sessionId"] != debug(player)["sessionId"]
        assert chunk > made_at + 20, "the branch starts where the world was when the link was opened"
        assert f"branched from chunk {chunk}" in (brancher.text_content("#log") or "")
        # The source plays on, and the branch is steered by its own page.
        before = debug(player)["chunksReceived"]
        brancher.keyboard.down("s")
        wait_blue(brancher, KEY_BITS["s"])
        brancher.keyboard.up("s")
        wait(player, f"window.arstreamDebug.chunksReceived > {before + 2}")
        assert debug(player)["restarts"] == [] and debug(brancher)["errors"] == []
    finally:
        context.close()


def test_pass_control_makes_the_viewer_the_player(sharing: LiveServer, browser: Any, errors: PageErrors) -> None:
    with two_windows(browser, errors) as (player, viewer):
        player.goto(sharing.base_url + "/")
        wait_frames_drawn(player, 2)
        viewer.goto(share_link(player, "watch"))
        wait_frames_drawn(viewer, 2)
        wait(player, "!document.getElementById('pass-box').hidden")
        options = player.eval_on_selector_all("#pass-to option", "els => els.map(e => e.value)")
        assert len(options) == 1 and options[0].startswith("v")
        # The player steers a little first: the session's event ids move on, and the viewer sees them applied.
        player.keyboard.down("d")
        wait_blue(viewer, KEY_BITS["d"])
        player.keyboard.up("d")
        wait_blue(viewer, 0)

        player.click("#pass")
        wait(viewer, "window.arstreamDebug.role === 'controller'")
        wait(player, "window.arstreamDebug.role === 'viewer'")
        assert "You have the controls" in (viewer.text_content("#notice") or "")
        # the horizon comes with the control (a viewer's `ready` has none): its timeline and branch link are the player's
        assert debug(viewer)["rewindSeconds"] == debug(player)["rewindSeconds"] > 0
        assert viewer.is_visible("#pad") and not player.is_visible("#pad")
        wait(player, "document.getElementById('role-badge').textContent.startsWith('viewing')")

        # The new player steers, and both screens show it; the old one sends nothing more.
        ticks_before = len(debug(player)["sentTickIds"])
        viewer.keyboard.down("s")  # s (4), not w (1): JPEG's tolerance of 3 could take 1 for no key
        wait_blue(viewer, KEY_BITS["s"])
        wait_blue(player, KEY_BITS["s"])
        viewer.keyboard.up("s")
        assert debug(viewer)["sentTickIds"], "the new player asks for the chunks"
        # Its event ids go on past the old player's (a repeated id would be acknowledged as a duplicate, unused).
        assert min(debug(viewer)["sentEventIds"]) > max(debug(player)["sentEventIds"])
        assert len(debug(player)["sentTickIds"]) == ticks_before
        assert debug(viewer)["errors"] == [], "no stale ids: the new player's ticks start past the session's floor"
        # A tick the old player sent while the pass crossed the wire is refused, not fatal: nothing else.
        assert {error["code"] for error in debug(player)["errors"]} <= {"not_controller"}
        assert debug(player)["state"] == "streaming"


def test_a_share_link_the_server_cannot_honour_says_so(sharing: LiveServer, page: Any) -> None:
    page.goto(sharing.base_url + "/?watch=r0.no-such-session&seed=3")  # a link made before the fragment
    wait_state(page, "ended")
    assert "share link no longer works" in overlay_text(page)
    assert page.inner_text("#overlay-action") == "Start a world of your own"
    # Its token moved out of the query: a reload or a bookmark sends it to no server.
    assert page.evaluate("[location.search, location.hash]") == ["?seed=3", "#watch=r0.no-such-session"]


def test_phone_width_player_and_viewer_fit_the_screen(sharing: LiveServer, browser: Any, errors: PageErrors) -> None:
    with two_windows(browser, errors, PHONE) as (player, viewer):
        player.goto(sharing.base_url + "/")
        wait_rewind_span(player, 2)
        viewer.goto(share_link(player, "watch"))
        wait_frames_drawn(viewer, 2)
        wait(player, "!document.getElementById('pass-box').hidden")
        player.click("#share")
        viewer.click("#share")
        for page, shown in ((player, ("#timeline", "#pass-box", "#share-branch")), (viewer, ("#share-watch",))):
            assert page.evaluate("document.scrollingElement.scrollWidth <= window.innerWidth"), "no sideways scroll"
            for selector in shown:
                box = page.locator(selector).bounding_box()
                assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"], selector
        assert viewer.is_visible("#role-badge")


SIZES: dict[str, dict[str, Any]] = {
    "desktop": {"viewport": {"width": 1280, "height": 800}},
    "portrait": {"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True},
    "landscape": {"viewport": {"width": 844, "height": 390}, "is_mobile": True, "has_touch": True},
}


@pytest.mark.parametrize("size", list(SIZES))
def test_a_branch_link_to_a_moment_no_longer_held_offers_a_branch_from_now(
    sharing: LiveServer, browser: Any, errors: PageErrors, size: str
) -> None:
    context = open_context(browser, **SIZES[size])
    try:
        player = new_page(context, errors)
        player.goto(sharing.base_url + "/")
        # Every chunk of the last 2 s is held, every other one behind: odd boundary 1 is thinned out by chunk 18.
        wait(player, "window.arstreamDebug.shareToken && Math.max(...window.arstreamDebug.chunkIndexes) > 20")
        token = debug(player)["shareToken"]
        brancher = new_page(context, errors)
        brancher.goto(f"{sharing.base_url}/#{urlencode({'branch': token, 'chunk': 1})}")
        wait_state(brancher, "ended")
        text = overlay_text(brancher)
        assert "no longer held" in text and "branch from where it is now" in text, text
        assert "ended" not in text and "not held:" not in text, "no raw reason, no world ended: it is live"
        assert brancher.get_attribute("#overlay", "data-tone") == "info"
        assert brancher.inner_text("#overlay-action") == "Branch from now"
        brancher.click("#overlay-action")
        wait_frames_drawn(brancher, 2)
        chunk = debug(brancher)["chunkIndexes"][0]
        assert chunk > 20 and f"branched from chunk {chunk}" in (brancher.text_content("#log") or "")
        assert "chunk=" not in brancher.evaluate("location.hash"), "a reload branches from now too"
        assert debug(brancher)["state"] == "streaming" and debug(brancher)["restarts"] == []
    finally:
        context.close()


@pytest.mark.parametrize("size", list(SIZES))
def test_a_rewind_and_a_branch_say_so_on_the_world(
    sharing: LiveServer, browser: Any, errors: PageErrors, size: str
) -> None:
    context = open_context(browser, **SIZES[size])
    try:
        player = new_page(context, errors)
        player.goto(sharing.base_url + "/")
        wait_rewind_span(player, 12)
        newest = int(player.get_attribute("#rewind", "max") or 0)
        target = newest - 10
        # While the slider is held, the world says where letting go lands.
        player.evaluate(f"(s => {{ s.value = '{target}'; s.dispatchEvent(new Event('input')); }})"
                        "(document.getElementById('rewind'))")
        assert player.evaluate("document.getElementById('notice').hidden") is False
        assert (player.text_content("#notice") or "").startswith("Let go to rewind 1.")  # 10 chunks: 1.2 s or so
        player.evaluate("document.getElementById('rewind').dispatchEvent(new Event('change'))")
        wait(player, "window.arstreamDebug.restarts.some(r => r.why === 'rewind')")
        wait(player, "document.getElementById('notice').textContent.startsWith('Rewound ')")
        said = player.text_content("#notice") or ""
        assert re.fullmatch(r"Rewound \d\.\d s: the world goes on from there\.", said), said

        token = debug(player)["shareToken"]
        chunk = max(debug(player)["rewindHeld"]) - 2  # still held when the branch is made
        brancher = new_page(context, errors)
        brancher.goto(f"{sharing.base_url}/#{urlencode({'branch': token, 'chunk': chunk})}")
        wait_frames_drawn(brancher, 2)
        said = brancher.text_content("#notice") or ""
        assert re.fullmatch(r"You branched this world from \d+(\.\d)? s into its play: it is yours to steer, "
                            r"and the original goes on without you\.", said), said
    finally:
        context.close()

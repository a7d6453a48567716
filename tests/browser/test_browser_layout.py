"""The demo page's layout in Chromium at desktop (1280x800) and phone size, upright (390x844) and on its side
(844x390), with touch: how tall the world is on screen, what covers it, the badges, the pad above the fold, the
share links in sight at desktop size; the badges in fullscreen and after control passes. Against a real server (fake-kv) and a real viewer page.

The world is measured as the canvas's on-screen box; "above the fold" means inside the viewport without scrolling.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from browser_helpers import PageErrors, browser_marks, new_page, open_context, wait, wait_frames_drawn
from servers import LiveServer, fake_settings, running_server

pytestmark = browser_marks

SIZES: dict[str, dict[str, Any]] = {
    "desktop": {"viewport": {"width": 1280, "height": 800}},
    "portrait": {"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True, "device_scale_factor": 3},
    "landscape": {"viewport": {"width": 844, "height": 390}, "is_mobile": True, "has_touch": True, "device_scale_factor": 3},
}
# The least on-screen height of the world at each size, with the controls, the rewind timeline and the pass-control
# row shown: on its side a phone gives the world most of its height (before: 240 px of 390).
WORLD_HEIGHT_AT_LEAST = {"desktop": 480, "portrait": 0.8 * 390, "landscape": 0.8 * 390}
BOXES = """(selectors) => Object.fromEntries(selectors.map((selector) => {
    const el = document.querySelector(selector);
    const box = el.getBoundingClientRect();
    const style = getComputedStyle(el);
    const shown = !el.hidden && style.display !== 'none' && box.width > 0;
    return [selector, {x: box.x, y: box.y, right: box.right, bottom: box.bottom, width: box.width,
                       height: box.height, shown, lineHeight: parseFloat(style.lineHeight), text: el.textContent}];
}))"""


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    # 64x64 frames, as tiny-world's: a whole-number scale of them need not fill the room the layout leaves.
    options = {"compute_delay_s": 0.01, "width": 64, "height": 64}
    with running_server(fake_settings(model_options=options)) as live:
        yield live


def _context(browser: Any, size: str) -> Any:
    return open_context(browser, **SIZES[size])


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The area two boxes share."""
    width = min(a["right"], b["right"]) - max(a["x"], b["x"])
    height = min(a["bottom"], b["bottom"]) - max(a["y"], b["y"])
    return max(0.0, width) * max(0.0, height)


def _inside(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    return (
        inner["x"] >= outer["x"] - 0.5
        and inner["y"] >= outer["y"] - 0.5
        and inner["right"] <= outer["right"] + 0.5
        and inner["bottom"] <= outer["bottom"] + 0.5
    )


@contextmanager
def _player_and_viewer(server: LiveServer, browser: Any, errors: PageErrors, size: str) -> Iterator[tuple[Any, Any]]:
    """A playing page at ``size`` and a page watching it, in a window of its own (a background tab is throttled)."""
    player_context = _context(browser, size)
    viewer_context = _context(browser, "desktop")
    try:
        player = new_page(player_context, errors)
        player.goto(server.base_url + "/")
        wait_frames_drawn(player, 3)
        wait(player, "window.arstreamDebug.shareToken !== null")
        viewer = new_page(viewer_context, errors)
        viewer.goto(f"{server.base_url}/#watch={player.evaluate('window.arstreamDebug.shareToken')}")
        wait_frames_drawn(viewer, 2)
        yield player, viewer
    finally:
        player_context.close()
        viewer_context.close()


def _steer_until_key_to_frame_shows(page: Any) -> None:
    page.keyboard.down("d")
    wait(page, "document.getElementById('badge').textContent.includes('key→frame')")
    page.keyboard.up("d")


@pytest.mark.parametrize("size", sorted(SIZES))
def test_the_world_fills_the_screen_and_nothing_that_matters_covers_it_or_falls_below_the_fold(
    server: LiveServer, browser: Any, errors: PageErrors, size: str
) -> None:
    with _player_and_viewer(server, browser, errors, size) as (page, _viewer):
        # The player's longest badges: fps with key to frame, and the viewer count; the rewind timeline and the
        # pass-control row shown; then Share opens its links and shows its toast.
        wait(page, "!document.getElementById('pass-box').hidden && !document.getElementById('timeline').hidden")
        _steer_until_key_to_frame_shows(page)
        wait(page, "!document.getElementById('role-badge').hidden")
        page.click("#share")
        # (the share's own words: a stall's "Waiting for frames" on a busy machine may already be showing)
        wait(page, "document.getElementById('notice').textContent.startsWith('Link copied')"
                   " && !document.getElementById('notice').hidden && !document.getElementById('share-box').hidden")
        width, height = SIZES[size]["viewport"]["width"], SIZES[size]["viewport"]["height"]
        selectors = ["#screen", "#player", "#notice", "#badge", "#role-badge", "#pad", "#controls-bar", "#timeline"]
        boxes = page.evaluate(BOXES, selectors)
        world = boxes["#screen"]
        assert boxes["#player"]["width"] - world["width"] <= 2.5, f"a black bar beside the picture: {boxes['#player']}"

        assert world["height"] >= WORLD_HEIGHT_AT_LEAST[size], f"the world is {world['height']} px tall at {size}"
        assert world["y"] >= 0 and world["bottom"] <= height and world["right"] <= width, "the whole world is on screen"
        assert page.evaluate("document.scrollingElement.scrollWidth") <= width, "no sideways scroll"

        toast = boxes["#notice"]
        assert toast["shown"] and "Link copied" in toast["text"]
        assert toast["y"] >= 0 and toast["right"] <= width + 0.5, "the toast is on screen"
        covered = _overlap(toast, world) / (world["width"] * world["height"])
        if size == "landscape":
            assert covered == 0, f"on a phone on its side the toast covers the world: {toast} over {world}"
        else:
            # over the top of the picture, one or two lines: a strip, not the world's middle
            assert covered <= 0.15 and toast["bottom"] <= world["y"] + world["height"] / 3, f"the toast covers {covered:.0%}"

        badge, role = boxes["#badge"], boxes["#role-badge"]
        for name, box in (("fps badge", badge), ("role badge", role)):
            assert box["shown"], name
            assert box["height"] < 2 * box["lineHeight"], f"the {name} wraps: {box}"
            assert _inside(box, world), f"the {name} is off the picture: {box} {world}"
        assert "key→frame" in badge["text"] and "watching" in role["text"]
        assert _overlap(badge, role) == 0, f"the badges overlap: {badge} {role}"

        for selector in ("#pad", "#controls-bar", "#timeline"):
            box = boxes[selector]
            assert box["shown"], selector
            assert box["y"] >= 0 and box["bottom"] <= height, f"{selector} is below the fold at {size}: {box}"
            assert _overlap(box, world) == 0, f"{selector} covers the world"
        assert page.evaluate("window.scrollY") == 0


def test_at_desktop_size_share_opens_its_links_in_sight_without_scrolling(
    server: LiveServer, browser: Any, errors: PageErrors
) -> None:
    # At 1280x800 the links once opened under the timeline and the pass-control row, from y 792: below the fold.
    # (A phone's screens have no room for them beside the pad and the rows: there the page scrolls to them.)
    size = "desktop"
    with _player_and_viewer(server, browser, errors, size) as (page, _viewer):
        wait(page, "!document.getElementById('pass-box').hidden && !document.getElementById('timeline').hidden")
        page.click("#share")
        wait(page, "!document.getElementById('share-box').hidden && !document.getElementById('share-watch').hidden")
        width, height = SIZES[size]["viewport"]["width"], SIZES[size]["viewport"]["height"]
        links = ["#share-link", "#share-watch", "#share-branch"]
        boxes = page.evaluate(BOXES, ["#screen", *links])
        for selector in links:
            box = boxes[selector]
            assert box["shown"], selector
            assert box["y"] >= 0 and box["bottom"] <= height and box["right"] <= width, f"{selector} is out of sight: {box}"
            assert _overlap(box, boxes["#screen"]) == 0, f"{selector} covers the world"
        assert page.evaluate("window.scrollY") == 0


def test_in_fullscreen_the_badges_sit_on_the_letterboxed_picture(
    server: LiveServer, browser: Any, errors: PageErrors
) -> None:
    with _player_and_viewer(server, browser, errors, "desktop") as (page, _viewer):
        wait(page, "!document.getElementById('role-badge').hidden")
        page.click("#fullscreen")
        wait(page, "document.fullscreenElement === document.getElementById('player')")
        # The square world in a wide screen: letterboxed, with black bars left and right.
        wait(page, "document.getElementById('screen').getBoundingClientRect().x > 100")
        boxes = page.evaluate(BOXES, ["#screen", "#badge", "#role-badge"])
        for name in ("#badge", "#role-badge"):
            assert boxes[name]["shown"] and _inside(boxes[name], boxes["#screen"]), f"{name} is off the picture: {boxes}"
        page.evaluate("document.exitFullscreen()")
        wait(page, "document.fullscreenElement === null")


def test_after_passing_control_the_badges_show_the_new_roles_figures(
    server: LiveServer, browser: Any, errors: PageErrors
) -> None:
    with _player_and_viewer(server, browser, errors, "desktop") as (player, viewer):
        wait(player, "window.arstreamDebug.viewerIds.length === 1")
        _steer_until_key_to_frame_shows(player)
        player.click("#pass")
        wait(player, "window.arstreamDebug.role === 'viewer'")
        wait(viewer, "window.arstreamDebug.role === 'controller'")
        # The old player watches now: its keys move nothing, so no key-to-frame figure (it stayed at the last one).
        wait_frames_drawn(player, player.evaluate("window.arstreamDebug.framesDrawn") + 3)
        badge = player.text_content("#badge") or ""
        assert "fps" in badge and "key→frame" not in badge, badge
        # the audience figure comes in its own `viewers` message, after the `role` one
        wait(player, "document.getElementById('role-badge').textContent === 'viewing · 1 watching'")
        assert player.evaluate("window.arstreamDebug.viewerIds") == [], "no stale ids to pass to"
        assert player.is_hidden("#pass-box")
        # The new player has the controls and the one viewer (the old player) to pass them back to.
        wait(viewer, "window.arstreamDebug.viewerIds.length === 1")
        assert viewer.text_content("#role-badge") == "1 watching"
        options = viewer.evaluate("[...document.getElementById('pass-to').options].map((o) => o.value)")
        assert options == viewer.evaluate("window.arstreamDebug.viewerIds")
        assert viewer.is_visible("#pass-box")


# Long figures of the kind a loaded machine shows, put in the Details rows, then every row checked to be drawn on
# one line inside the panel: a label may wrap, a figure never.
WORDS_BROKEN = """() => {
    const figures = {'hud-chunk': '1234 ms (median 1187 ms)', 'hud-action': '1234 ms (median 1187 ms)',
                     'hud-flight': '2 ticks / 12 frames', 'hud-target': '1250 ms', 'hud-kv': '1234 / 25000 (5%)',
                     'hud-model': 'matrix-game-2 640×352 @ 12 fps', 'hud-chunk-index': '12345 (tick 12345)',
                     'hud-sessions': '12 connected, capacity 24', 'hud-compute': '1187 ms per chunk'};
    for (const [id, text] of Object.entries(figures)) document.getElementById(id).textContent = text;
    const broken = [];
    const panel = document.getElementById('details').getBoundingClientRect();
    for (const dd of document.querySelectorAll('.hud dd')) {
        const text = dd.firstChild;
        if (!text || text.nodeType !== Node.TEXT_NODE) continue;
        const range = document.createRange();
        range.selectNodeContents(dd);
        const rects = [...range.getClientRects()];
        const lines = new Set(rects.map((r) => Math.round(r.top)));
        const right = Math.max(...rects.map((r) => r.right));
        if (lines.size > 1 || right > panel.right + 0.5) broken.push(`${dd.id}: "${text.textContent}"`);
    }
    return broken;
}"""
# The Details row for what is in flight, rendered for one tick and one frame.
ONE_TICK = """() => import('/hud.js').then(({ Hud }) => {
    const hud = new Hud((id) => document.getElementById(id));
    const session = { live: true, controller: true, ready: { model: { fps: 16 } }, ticksInFlight: new Map([[7, 0]]),
                      player: { queue: [{}] } };
    hud.render(session, { targetLeadMs: () => 250 });
    return document.getElementById('hud-flight').textContent;
})"""


@pytest.mark.parametrize("size", sorted(SIZES))
def test_the_details_figures_stay_on_one_line_and_count_in_words(
    server: LiveServer, browser: Any, errors: PageErrors, size: str
) -> None:
    context = _context(browser, size)
    try:
        page = new_page(context, errors)
        page.goto(server.base_url + "/?autoconnect=0")
        page.click("#details summary")
        assert page.evaluate(WORDS_BROKEN) == []
        assert page.evaluate(ONE_TICK) == "1 tick / 1 frame"
    finally:
        context.close()

"""The demo page with waypoint-1.5 (tiny, random weights) in Debian's Chromium: the card's `inputs` drive it, so
any key is sent as the model's button id and pointer movement as its mouse velocity, with no model named in the
page's code."""

import json
from collections.abc import Iterator
from typing import Any

import pytest

from browser_helpers import browser_marks, debug, wait, wait_frames_drawn
from servers import LiveServer, fake_settings, running_server

pytestmark = browser_marks


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server(fake_settings(model="waypoint-1.5", model_options={"config": "tiny"}, torch_threads=1)) as live:
        yield live


def test_any_key_and_the_pointer_reach_waypoint_as_its_buttons_and_mouse(server: LiveServer, page: Any) -> None:
    sent: list[dict[str, Any]] = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(json.loads(payload))))
    page.goto(server.base_url + "/")
    wait_frames_drawn(page, 2)
    assert debug(page)["looking"] is True
    # any key is its own button here (the arrows are not W A S D), the mouse buttons count, and the drag looks
    howto = page.inner_text(".howto")
    assert howto.startswith("Hold any key (W A S D move) or a mouse button over the world, hold the pad; drag on the "
                            "world to look around."), howto
    assert "arrow keys" not in page.get_attribute("#player", "aria-label")
    ticks = [m for m in sent if m["type"] == "tick"]
    assert ticks and all(t["controls"] == {"mouse": [0, 0], "scroll": 0, "buttons": []} for t in ticks)

    page.keyboard.down("q")  # not a W A S D key: the card maps KeyQ to Owl-Control's 81
    wait(page, "window.arstreamDebug.sentEventIds.length >= 1")
    press = debug(page)["sentEventIds"][0]
    wait(page, f"window.arstreamDebug.appliedEventIds.includes({press})")
    inputs = [m for m in sent if m["type"] == "input"]
    assert inputs[0]["controls"]["buttons"] == [81], inputs

    box = page.locator("#player").bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x + 40, y + 20, steps=8)
    page.mouse.up()
    before = len(debug(page)["sentTickIds"])
    wait(page, f"window.arstreamDebug.sentTickIds.length > {before + 1}")
    moved = [t["controls"]["mouse"] for t in sent if t["type"] == "tick" and t["controls"]["mouse"] != [0, 0]]
    assert moved, "no tick carried the movement"
    # the card's units a pixel, once a chunk (not spread over its frames): the ticks' sum is the whole movement,
    # x right and y down, in Overworld's client's units (1.8 a pixel)
    per_pixel = server.get("/v1/model").json()["inputs"]["mouse"]["per_pixel"]
    assert per_pixel == pytest.approx(1.8)
    assert sum(m[0] for m in moved) == pytest.approx(40 * per_pixel)
    assert sum(m[1] for m in moved) == pytest.approx(20 * per_pixel)
    held = [t["controls"]["buttons"] for t in sent if t["type"] == "tick"][-1]
    assert held == [81]  # the held key goes with every tick beside the mouse

    page.mouse.move(x, y)
    page.mouse.wheel(0, -120)  # rolled away from the user: the published engine's "forward", 1
    before = len(debug(page)["sentTickIds"])
    wait(page, f"window.arstreamDebug.sentTickIds.length > {before + 1}")
    scrolls = [t["controls"]["scroll"] for t in sent if t["type"] == "tick"]
    assert 1 in scrolls and scrolls[-1] == 0 and -1 not in scrolls
    page.keyboard.up("q")
    assert debug(page)["errors"] == []


def test_mouse_buttons_reach_waypoint_as_its_buttons_and_a_drag_still_looks(server: LiveServer, page: Any) -> None:
    """The card's `mouse_buttons` (MouseEvent.button -> button id): unlocked, the right button is pressed and the
    left one is the drag that looks and asks for the lock; locked, the left button is pressed too."""
    sent: list[dict[str, Any]] = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(json.loads(payload))))
    page.goto(server.base_url + "/")
    wait_frames_drawn(page, 2)
    card = page.evaluate("fetch('/v1/model').then((r) => r.json())")
    mouse_ids = card["inputs"]["buttons"]["mouse_buttons"]
    left, right = mouse_ids["0"], mouse_ids["2"]

    def inputs() -> list[list[int]]:
        return [m["controls"]["buttons"] for m in sent if m["type"] == "input"]

    def applied(count: int) -> None:
        """Wait for the page's `count`th input and for the server to apply it to a chunk."""
        wait(page, f"window.arstreamDebug.sentEventIds.length >= {count}")
        wait(page, f"window.arstreamDebug.appliedEventIds.includes(window.arstreamDebug.sentEventIds[{count - 1}])")

    box = page.locator("#player").bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down(button="right")
    applied(1)
    page.mouse.up(button="right")
    applied(2)
    assert inputs() == [[right], []]

    page.mouse.down()  # unlocked: the left button asks for the lock and looks; it is not a press
    page.mouse.move(x + 30, y, steps=4)
    page.mouse.up()
    wait(page, "document.pointerLockElement && document.pointerLockElement.id === 'player'")
    before = len(debug(page)["sentTickIds"])
    wait(page, f"window.arstreamDebug.sentTickIds.length > {before + 1}")
    assert inputs() == [[right], []]
    moved = [t["controls"]["mouse"] for t in sent if t["type"] == "tick" and t["controls"]["mouse"] != [0, 0]]
    assert moved and sum(m[0] for m in moved) == pytest.approx(30 * 1.8)  # the drag looked, as before

    page.mouse.down()  # locked: the left button is the model's
    applied(3)
    page.mouse.up()
    applied(4)
    assert inputs() == [[right], [], [left], []]
    page.evaluate("document.exitPointerLock()")
    assert debug(page)["errors"] == []

"""The demo page with matrix-game-2 (tiny, random weights) in Debian's Chromium: 9 then 12 frames a chunk,
steering with keys, and mouse movement sent as the schema's camera (a fake-kv page, with no camera, sends none)."""

import json
from collections.abc import Iterator
from typing import Any

import pytest

from browser_helpers import browser_marks, debug, wait, wait_frames_drawn
from servers import LiveServer, fake_settings, running_server

pytestmark = browser_marks


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    settings = fake_settings(
        model="matrix-game-2", model_options={"config": "tiny", "random_init": True}, torch_threads=1
    )
    with running_server(settings) as live:
        yield live


def test_the_page_streams_matrix_game_and_a_key_press_is_applied(server: LiveServer, page: Any) -> None:
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


def _record_sent(page: Any) -> list[dict[str, Any]]:
    """Every JSON message the page sends over its WebSockets, as the server receives it."""
    sent: list[dict[str, Any]] = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(json.loads(payload))))
    return sent


def _drag_on_player(page: Any, dx: float, dy: float) -> None:
    box = page.locator("#player").bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x + dx, y + dy, steps=8)
    page.mouse.up()


def _camera_ticks(sent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in sent if m["type"] == "tick" and "camera" in m.get("controls", {})]


def test_mouse_movement_over_the_player_is_sent_as_the_camera(server: LiveServer, page: Any) -> None:
    sent = _record_sent(page)
    page.goto(server.base_url + "/")
    wait_frames_drawn(page, 9)
    assert debug(page)["looking"] is True
    assert "look around" in page.inner_text("#hint") and "Esc releases the mouse" in page.inner_text("#hint")
    # Before any movement every tick carries a still camera (the keys beside it).
    still = _camera_ticks(sent)
    assert still and all(t["controls"]["camera"] == {"pitch": 0, "yaw": 0} for t in still)
    assert all(t["controls"]["keys"] == [] for t in still)

    _drag_on_player(page, 60, -30)  # right and up: yaw > 0, pitch > 0 (Matrix-Game: positive pitch looks up)
    # The click locks the pointer on the player (the usual game UX); the hint has done its job.
    assert page.evaluate("document.pointerLockElement && document.pointerLockElement.id") == "player"
    assert page.locator("#hint").is_hidden()
    # Movement goes with the next tick (or the next two, when one left mid-drag); the one after is still.
    wait(page, f"window.arstreamDebug.sentTickIds.length > {len(debug(page)['sentTickIds']) + 1}")
    after = _camera_ticks(sent)[len(still) :]
    moved = [t["controls"]["camera"] for t in after if t["controls"]["camera"] != {"pitch": 0, "yaw": 0}]
    assert moved, f"no tick carried the movement: {after}"
    assert after[-1]["controls"]["camera"] == {"pitch": 0, "yaw": 0}
    # 0.01 unit a pixel, spread over the 12 frames of a chunk: the ticks' sum is the whole movement.
    assert sum(c["yaw"] for c in moved) == pytest.approx(60 * 0.01 / 12)
    assert sum(c["pitch"] for c in moved) == pytest.approx(30 * 0.01 / 12)

    # A big sweep is clamped to the schema's bounds ([-1, 1]) rather than refused.
    _drag_on_player(page, -2000, 0)
    wait(page, f"window.arstreamDebug.sentTickIds.length > {len(debug(page)['sentTickIds'])}")
    swept = [t for t in _camera_ticks(sent) if t["controls"]["camera"]["yaw"] < 0]
    assert swept and swept[0]["controls"]["camera"]["yaw"] == -1

    # A key press keeps the camera beside the keys (the server replaces the whole controls object).
    page.keyboard.down("w")
    wait(page, "window.arstreamDebug.sentEventIds.length >= 1")
    press = [m for m in sent if m["type"] == "input"][-1]
    assert press["controls"]["keys"] == ["w"] and set(press["controls"]["camera"]) == {"pitch", "yaw"}
    wait(page, f"window.arstreamDebug.appliedEventIds.includes({press['event_id']})")
    page.keyboard.up("w")
    wait(page, f"window.arstreamDebug.chunksReceived > {debug(page)['chunksReceived'] + 1}")
    assert debug(page)["errors"] == [], "the server accepted every camera the page sent"
    page.evaluate("document.exitPointerLock()")  # what Esc does (headless Chromium keeps Esc for the page)
    wait(page, "!document.getElementById('hint').hidden")
    assert "click the world to look around" in page.inner_text("#hint").lower()


@pytest.fixture(scope="module")
def fake_server() -> Iterator[LiveServer]:
    with running_server(fake_settings(model_options={"compute_delay_s": 0.01})) as live:
        yield live


def test_a_model_without_a_camera_gets_no_camera_and_a_drag_still_steers(fake_server: LiveServer, page: Any) -> None:
    sent = _record_sent(page)
    page.goto(fake_server.base_url + "/")
    wait_frames_drawn(page, 4)
    assert debug(page)["looking"] is False
    assert "look around" not in page.inner_text("#hint")
    box = page.locator("#player").bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x + 80, y, steps=8)  # a drag to the right holds D, as before
    wait(page, "window.arstreamDebug.heldKeys.includes('d')")
    page.mouse.up()
    wait(page, "window.arstreamDebug.heldKeys.length === 0")
    wait(page, f"window.arstreamDebug.sentTickIds.length > {len(debug(page)['sentTickIds']) + 1}")
    assert not any("camera" in json.dumps(m) for m in sent)
    assert all("controls" not in m for m in sent if m["type"] == "tick"), "ticks carry no controls, as before"
    assert [m["controls"] for m in sent if m["type"] == "input"] == [{"keys": ["d"]}, {"keys": []}]
    assert page.evaluate("document.pointerLockElement") is None

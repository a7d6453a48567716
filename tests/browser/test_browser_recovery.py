"""The demo page recovers without a click: server restarts, dropped connections, hidden tabs, a full server.

Real servers (in-process, so one can stop and start again on the same port)
and real Chromium pages through Playwright.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from websockets.sync.client import connect

import pytest

from browser_helpers import (
    PageErrors,
    browser_marks,
    debug,
    free_port,
    new_page,
    overlay_text,
    set_hidden,
    wait,
    wait_frames_drawn,
    wait_state,
)
from arstream.models.fake import FakeKVPipeline
from servers import fake_settings, running_server

pytestmark = browser_marks
FAKE = {"compute_delay_s": 0.01}
LOAD_GUARD_S = 300  # a hang guard: the test lets the model finish loading long before
RESUME_GRACE_S = 30.0  # tests/servers.py turns resume off unless asked


@pytest.fixture
def viewport() -> dict[str, int]:
    return {"width": 1100, "height": 760}


def _wait_new_frames(page: Any) -> None:
    wait_frames_drawn(page, debug(page)["framesDrawn"] + 4)


def test_server_restart_under_a_streaming_page_reconnects_by_itself(context: Any, errors: PageErrors) -> None:
    port = free_port()
    page = new_page(context, errors)
    settings = fake_settings(port=port, model_options=FAKE, resume_grace_s=RESUME_GRACE_S)
    with running_server(settings) as first:
        page.goto(first.base_url + "/")
        wait_frames_drawn(page, 4)
        before = debug(page)["sessionId"]
    # The server shut down gracefully (1001, `closed` server_shutdown) and is gone, and the world with it: the
    # page says so in words and keeps trying, for a new world (no resume ticket: nothing is left to resume).
    wait_state(page, "reconnecting")
    text = overlay_text(page)
    assert "The server stopped and could not keep your world" in text and "Reconnecting" in text, text
    assert "pick your world up again" not in text, text
    assert "code" not in text
    with running_server(settings):
        wait_state(page, "streaming")
        _wait_new_frames(page)
        state = debug(page)
        assert state["sessionId"] != before
        assert "could not keep your world" in (page.text_content("#log") or "")
        # A new session straight away: no resume of a world the server said it had ended.
        assert not any(e["code"] == "resume_failed" for e in state["errors"]), state["errors"]


class SlowLoadingFake(FakeKVPipeline):
    """A fake whose warm-up waits for the test: the server is up, its model is not ready yet."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.loaded = threading.Event()

    def warmup_requests(self, session_id: str) -> Any:
        self.loaded.wait(LOAD_GUARD_S)
        return super().warmup_requests(session_id)


def test_a_server_still_loading_its_model_is_not_called_full(context: Any, errors: PageErrors) -> None:
    pipeline = SlowLoadingFake(**FAKE)
    with running_server(fake_settings(), pipeline, wait_ready=False) as server:
        page = new_page(context, errors)
        page.goto(server.base_url + "/")
        wait(page, "/loading its model/.test(document.getElementById('overlay-text').textContent)")
        text = overlay_text(page)
        assert "full" not in text and "slot" not in text, text
        pipeline.loaded.set()
        wait_state(page, "streaming")  # it joins by itself once the model is ready
        _wait_new_frames(page)


def test_a_dropped_connection_and_a_hidden_tab_resume_the_same_world(context: Any, errors: PageErrors) -> None:
    with running_server(fake_settings(model_options=FAKE, resume_grace_s=RESUME_GRACE_S)) as server:
        page = new_page(context, errors)
        page.goto(server.base_url + "/")
        wait_frames_drawn(page, 4)
        session_id = debug(page)["sessionId"]

        # A drop (no `close` message): the server keeps the session, and the page picks it up again.
        page.evaluate("window.arstreamDebug.dropSocket()")
        wait(page, "window.arstreamDebug.resumed === 1 && window.arstreamDebug.state === 'streaming'")
        _wait_new_frames(page)
        assert debug(page)["sessionId"] == session_id
        assert "carried on" in (page.text_content("#log") or "")

        # A hidden tab lets its connection go (the slot is free for others) and resumes when shown.
        set_hidden(page, True)
        wait_state(page, "paused")
        server.wait_for_stats(lambda stats: stats["sessions"]["connected"] == 0)
        set_hidden(page, False)
        wait(page, "window.arstreamDebug.resumed === 2 && window.arstreamDebug.state === 'streaming'")
        _wait_new_frames(page)
        assert debug(page)["sessionId"] == session_id
        assert debug(page)["errors"] == []

        # Another client resumes the same session: this page is taken over, says so, and does not fight back.
        token = page.evaluate("window.arstreamDebug.resumeToken()")
        with connect(f"{server.ws_url}?resume={token}", open_timeout=30) as other:
            other.send(json.dumps({"type": "start", "resume": token}))
            assert json.loads(other.recv(timeout=30))["session_id"] == session_id
            wait_state(page, "taken-over")
        assert "another tab or window" in overlay_text(page)
        assert page.inner_text("#overlay-action") == "Play here"
        assert debug(page)["lastClose"]["code"] == 4003
        page.click("#overlay-action")
        wait_state(page, "streaming")
        _wait_new_frames(page)


def test_one_slot_server_second_page_waits_then_joins_and_a_hidden_tab_gives_way(
    context: Any, errors: PageErrors
) -> None:
    # Resume off here: a hidden tab ends its session with `close`.
    with running_server(fake_settings(model_options={**FAKE, "session_capacity": 1})) as server:
        first = new_page(context, errors)
        first.goto(server.base_url + "/")
        wait_frames_drawn(first, 2)

        second = new_page(context, errors)
        second.goto(server.base_url + "/")
        wait_state(second, "waiting")
        text = overlay_text(second)
        assert "full" in text and "join by yourself" in text and "1013" not in text

        # The first page stops: the second joins by itself.
        first.click("#play")
        wait_state(first, "stopped")
        wait_state(second, "streaming")
        wait_frames_drawn(second, 2)

        # The second tab is hidden: it lets its session go, and the first page gets the slot.
        set_hidden(second, True)
        wait_state(second, "paused")
        server.wait_for_stats(lambda stats: stats["sessions"]["connected"] == 0)
        first.click("#play")
        wait_state(first, "streaming")
        _wait_new_frames(first)
        # Shown again, it starts afresh and finds the server full.
        set_hidden(second, False)
        wait_state(second, "waiting")
        assert [e["code"] for e in debug(second)["errors"]] == ["over_capacity", "over_capacity"]
        assert debug(first)["errors"] == []

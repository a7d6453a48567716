"""Recording on the server from the demo page (PROTOCOL.md, "Recording"), in Debian's Chromium, against a real
server that records (fake-kv, --record-dir).

The page's "Record on server" button turns recording on for the running world (`record`); when the world is
stopped the page lists what the server recorded, as links under the session's share token, and the file one
downloads decodes with PyAV.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from browser_helpers import browser_marks, debug, wait, wait_frames_drawn, wait_state
from servers import LiveServer, fake_settings, running_server

pytestmark = browser_marks
FAKE_FRAMES_PER_CHUNK = 2  # fake-kv's default


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    recordings = tmp_path_factory.mktemp("recordings")
    with running_server(fake_settings(model_options={"compute_delay_s": 0.01}, record_dir=str(recordings))) as live:
        yield live


def test_the_page_records_on_the_server_and_offers_the_download(server: LiveServer, page: Any) -> None:
    page.goto(server.base_url + "/?seed=7")
    wait_frames_drawn(page, 2)
    assert page.is_visible("#server-record") and page.is_hidden("#recordings")  # ready.record is false
    page.click("#server-record")
    # The server's `recording` answer turns the button into its stop and offers the recordings.
    wait(page, "document.getElementById('server-record').getAttribute('aria-pressed') === 'true'")
    assert page.is_visible("#recordings")
    wait_frames_drawn(page, debug(page)["framesDrawn"] + 8)
    page.click("#play")  # Stop: the world ends, and the page lists its recordings
    wait_state(page, "stopped")
    wait(page, "document.querySelectorAll('#recordings-list a').length === 1")
    link = page.locator("#recordings-list a")
    assert "share=" in (link.get_attribute("href") or "")
    with page.expect_download() as download_info:
        link.click()
    download = download_info.value
    assert download.suggested_filename == "part-0000.mp4"
    import av

    with av.open(str(Path(download.path()))) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    # Whole chunks from the one after `record` on (how many depends on how far ahead the player buffered).
    assert len(frames) > 0 and len(frames) % FAKE_FRAMES_PER_CHUNK == 0
    assert debug(page)["recordings"] == ["part-0000.mp4"]

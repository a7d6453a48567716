"""The start-up line for ``--webrtc`` on an install without aiortc (the test extra has aiortc, so its absence is
set on the module flag the server reads)."""

from __future__ import annotations

import logging

import pytest

from arstream.app import server, webrtc_track
from arstream.app.settings import Settings


@pytest.mark.parametrize(("webrtc", "available", "warned"), [(True, False, True), (True, True, False), (False, False, False)])
def test_webrtc_asked_for_without_aiortc_is_said_once_at_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, webrtc: bool, available: bool, warned: bool
) -> None:
    monkeypatch.setattr(webrtc_track, "AVAILABLE", available)
    with caplog.at_level(logging.WARNING, logger=server.log.name):
        server.note_webrtc_unavailable(Settings(model="fake-kv", webrtc=webrtc))
    said = [r.getMessage() for r in caplog.records if "aiortc is not installed" in r.getMessage()]
    assert len(said) == (1 if warned else 0), said
    if warned:
        assert "pip install 'arstream[webrtc]'" in said[0]

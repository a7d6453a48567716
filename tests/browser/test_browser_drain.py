"""The demo page in Chromium across a drain, and across a killed replica, behind the real HAProxy.

scripts/local-cluster.sh runs 2 fake-kv replicas behind HAProxy; the page
streams from one. A drain moves its session to the other: the page follows
``moved`` without a click, keeps the same session (and world, its rewind
timeline included) and shows a brief notice. A SIGTERM alone does the same (the replicas know their peers). A killed
replica cannot move anything: the page starts a new world on the survivor,
says so in plain words, and keeps its seed. A page that plays on a WebRTC track offers again to the replica that
took its session, and plays on there on a new track.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from browser_helpers import (
    PageErrors,
    browser_marks,
    debug,
    new_page,
    overlay_text,
    wait,
    wait_frames_drawn,
    wait_state,
)
from servers import fake_settings, running_server
from test_cluster import Cluster, launch_cluster, wait_until

pytestmark = browser_marks
SECRET = "browser-drain-cluster-secret"


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    options = ["--model", "fake-kv", "--model-options", json.dumps({"compute_delay_s": 0.02, "session_capacity": 4})]
    with launch_cluster([*options, "--resume-grace-s", "30"], {"ARSTREAM_CLUSTER_SECRET": SECRET}) as started:
        yield started


@pytest.fixture
def webrtc_cluster() -> Iterator[Cluster]:
    options = ["--model", "fake-kv", "--model-options", json.dumps({"compute_delay_s": 0.02, "session_capacity": 4})]
    options += ["--webrtc", "--resume-grace-s", "30"]
    with launch_cluster(options, {"ARSTREAM_CLUSTER_SECRET": SECRET}) as started:
        yield started


@pytest.fixture
def viewport() -> dict[str, int]:
    return {"width": 1100, "height": 760}


def _holder(cluster: Cluster) -> str:
    wait_until(lambda: any(cluster.replica_stats(n)["sessions"]["connected"] for n in cluster.replicas), "a session")
    return next(n for n in cluster.replicas if cluster.replica_stats(n)["sessions"]["connected"] == 1)


def _drain(cluster: Cluster, source: str) -> str:
    """Drain ``source`` to the other replica, its one session moved there; that replica's name."""
    peer = next(n for n in cluster.replicas if n != source)
    response = httpx.post(
        cluster.replicas[source][0] + "/v1/cluster/drain",
        json={"peers": [cluster.replicas[peer][0]]},
        headers={"authorization": f"Bearer {SECRET}"},
        timeout=60.0,
    )
    assert response.json()["moved"] == 1, response.text
    return peer


def test_the_page_keeps_streaming_across_a_drain(cluster: Cluster, context: Any, errors: PageErrors) -> None:
    page = new_page(context, errors)
    page.goto(cluster.lb + "/?seed=5")
    wait_frames_drawn(page, 6)
    before = debug(page)
    peer = _drain(cluster, _holder(cluster))
    wait(page, f"window.arstreamDebug.resumed > {before['resumed']}")
    wait_state(page, "streaming")
    wait_frames_drawn(page, debug(page)["framesDrawn"] + 6)
    after = debug(page)
    assert after["sessionId"] == before["sessionId"]  # the same session, now on the peer
    assert after["lastClose"]["code"] == 1001
    log = page.text_content("#log") or ""
    assert f"session moved to replica {peer}" in log
    assert "your world carried on" in log
    # Its rewind points moved with it: the timeline still reaches back to the world's first moment, and no
    # word of a history that starts again.
    assert before["rewindHeld"][0] == 0 and len(before["rewindHeld"]) > 2, before["rewindHeld"]
    assert after["rewindHeld"][0] == 0 and set(before["rewindHeld"][-4:]) <= set(after["rewindHeld"]), after
    assert "starts again" not in log and "stayed with the old server" not in log, log
    assert cluster.replica_stats(peer)["sessions"]["connected"] == 1
    errors.check()


def test_a_page_on_webrtc_offers_again_to_the_replica_its_session_moved_to(
    webrtc_cluster: Cluster, context: Any, errors: PageErrors
) -> None:
    cluster = webrtc_cluster
    page = new_page(context, errors)
    page.goto(cluster.lb + "/?seed=5&delivery=webrtc")
    wait(page, "window.arstreamDebug.delivery === 'webrtc' && window.arstreamDebug.trackFramesShown > 8")
    before = debug(page)
    source = _holder(cluster)
    assert cluster.replica_stats(source)["webrtc"]["peer_connections"] == 1
    peer = _drain(cluster, source)
    wait(page, f"window.arstreamDebug.resumed > {before['resumed']}")
    # The resumed session starts on the WebSocket (its `ready` shows the delivery as such); the page offers again
    # and its frames come on a new track from the peer.
    wait(page, "window.arstreamDebug.delivery === 'webrtc'")
    shown = debug(page)["trackFramesShown"]
    wait(page, f"window.arstreamDebug.trackFramesShown > {shown + 8}")
    assert cluster.replica_stats(peer)["webrtc"]["peer_connections"] == 1
    # Keys still steer, on the new track's data channel.
    wait(page, "window.arstreamDebug.inputChannelOpen()")
    sent, on_channel = len(debug(page)["sentEventIds"]), debug(page)["channelInputs"]
    page.keyboard.down("d")
    wait(page, f"window.arstreamDebug.sentEventIds.length === {sent + 1}")
    press = page.evaluate(f"window.arstreamDebug.sentEventIds[{sent}]")
    wait(page, f"window.arstreamDebug.appliedEventIds.includes({press})")
    page.keyboard.up("d")
    wait(page, f"window.arstreamDebug.sentEventIds.length === {sent + 2}")
    release = page.evaluate(f"window.arstreamDebug.sentEventIds[{sent + 1}]")
    wait(page, f"window.arstreamDebug.appliedEventIds.includes({release})")
    after = debug(page)
    assert after["channelInputs"] == on_channel + 2  # both on the data channel
    assert cluster.replica_stats(peer)["webrtc"]["channel_inputs"] == 2
    assert after["sessionId"] == before["sessionId"] and after["lastClose"]["code"] == 1001
    assert after["delivery"] == "webrtc" and page.text_content("#hud-delivery") == "WebRTC (H264)"
    # The world went on: the chunk indexes received run on across the move, none again and none skipped.
    indexes = after["chunkIndexes"]
    assert indexes == list(range(indexes[0], indexes[0] + len(indexes))), indexes
    assert indexes[-1] > before["chunkIndexes"][-1]
    log = page.text_content("#log") or ""
    assert f"session moved to replica {peer}" in log and "your world carried on" in log, log
    assert "WebRTC could not connect" not in log, log
    errors.check()


def test_a_killed_replica_starts_a_new_world_with_the_same_seed(
    cluster: Cluster, context: Any, errors: PageErrors
) -> None:
    page = new_page(context, errors)
    page.goto(cluster.lb + "/?seed=5")
    wait_frames_drawn(page, 6)
    before = debug(page)
    source = _holder(cluster)
    os.kill(cluster.replicas[source][1], signal.SIGKILL)
    wait(page, f"window.arstreamDebug.sessionId !== {json.dumps(before['sessionId'])}")
    wait_state(page, "streaming")
    wait_frames_drawn(page, debug(page)["framesDrawn"] + 6)
    after = debug(page)
    assert after["seed"] == before["seed"] == 5
    # Its token answered 503 while it was down, or resume_failed once local-cluster.sh had it back: a new world
    # either way, said in words.
    log = page.text_content("#log") or ""
    assert "The server that held your world is gone" in log or "could not be picked up again" in log, log
    errors.check()


def test_the_page_keeps_its_world_across_a_sigterm(cluster: Cluster, context: Any, errors: PageErrors) -> None:
    page = new_page(context, errors)
    page.goto(cluster.lb + "/?seed=5")
    wait_frames_drawn(page, 6)
    before = debug(page)
    source = _holder(cluster)
    os.kill(cluster.replicas[source][1], signal.SIGTERM)  # what an orchestrator sends; no drain command
    wait(page, f"window.arstreamDebug.resumed > {before['resumed']}")
    wait_state(page, "streaming")
    wait_frames_drawn(page, debug(page)["framesDrawn"] + 6)
    after = debug(page)
    assert after["sessionId"] == before["sessionId"] and after["lastClose"]["code"] == 1001
    assert "your world carried on" in (page.text_content("#log") or "")
    errors.check()


def test_a_draining_server_s_refusal_is_met_by_trying_another(context: Any, errors: PageErrors) -> None:
    """A new world refused by a draining server (over_capacity, "draining"): the page says the server is
    restarting and tries again by itself (through a balancer that is another server), instead of waiting for
    a slot of the server that is going away."""
    settings = fake_settings(replica_id="r0", cluster_secret=SECRET, resume_grace_s=30.0)
    with running_server(settings) as server:
        response = httpx.post(  # a drain with nowhere to go and no exit: the server stays up, draining
            server.base_url + "/v1/cluster/drain", json={"peers": ["http://127.0.0.1:9"], "exit": False},
            headers={"authorization": f"Bearer {SECRET}"}, timeout=60.0,
        )
        assert response.status_code == 200 and response.json()["ended"] == 0, response.text
        page = new_page(context, errors)
        page.goto(server.base_url + "/")
        wait_state(page, "reconnecting")
        text = overlay_text(page)
        assert "restarting and takes no new worlds" in text and "Reconnecting" in text, text
        assert "full" not in text and "Waiting for a free slot" not in text, text
        assert debug(page)["errors"][-1]["code"] == "over_capacity"
        errors.check()

"""Hostile clients of the realtime video dialect (``/v1/realtime/video``), against real servers (issue 31).

What the dialect keeps per session for a client's interactions is bounded in
size, not only in count: an ``event_id`` is at most ``MAX_EVENT_ID_BYTES``,
the ids remembered for ``event_id_conflict`` at most
``EVENT_ID_BYTES_REMEMBERED`` in all, and at most ``MAX_PENDING_INTERACTIONS``
wait for a chunk (each is listed in that chunk's metadata). A ``session.start``
whose numbers are too long to parse is ``invalid_message``, not a server fault.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from arstream.app.realtime_video import MAX_PENDING_INTERACTIONS, PATH, RecentIds
from arstream.app.realtime_video_events import MAX_EVENT_ID_BYTES
from raw_clients import rss_bytes
from servers import LiveServer, fake_settings, running_server, server_process, session_client

MB = 2**20
SIZE = {"width": 64, "height": 48}  # fMP4 wants a frame H.264 takes
OPTIONS = {**SIZE, "reads_prompt": True}  # the interactions here change the prompt: a model that reads one
UNTIL_STOPPED = 10**9  # frames: more than a session here makes before session.stop (the default is 81)


def start_message(**fields: Any) -> dict[str, Any]:
    return {"type": "session.start", "prompt": "a test world", **SIZE, "num_frames": UNTIL_STOPPED, **fields}


def interaction(event_id: str, prompt: str = "somewhere else") -> str:
    body = {"event_id": event_id, "event": {"prompt": prompt}}
    return json.dumps({"type": "session.interaction", "interaction": body})


def video_url(live: LiveServer) -> str:
    return live.base_url.replace("http://", "ws://", 1) + PATH


# ---- the remembered ids, as a data structure ---------------------------------------------------------


def test_recent_ids_keep_the_newest_within_a_count_and_a_byte_budget() -> None:
    recent = RecentIds(max_count=3, max_bytes=10)
    for name in ("a", "b", "c", "d"):
        recent.add(name)
    assert "a" not in recent and all(n in recent for n in "bcd") and len(recent) == 3  # the count bound
    recent.add("0123456789")  # 10 bytes: everything older goes to make room
    assert len(recent) == 1 and "0123456789" in recent and recent.bytes == 10
    recent.add("é")  # 2 bytes of UTF-8
    assert "0123456789" not in recent and recent.bytes == 2


# ---- a real server ----------------------------------------------------------------------------------


def test_a_long_event_id_is_invalid_message_and_the_session_goes_on() -> None:
    with running_server(fake_settings(model_options=OPTIONS)) as live:
        blocks_free = live.stats()["kv"]["blocks_free"]

        async def scenario() -> list[dict[str, Any]]:
            events: list[dict[str, Any]] = []
            async with session_client(video_url(live)) as client:
                await client.send(**start_message())
                for event_id in ("x" * (MAX_EVENT_ID_BYTES + 1), "é" * (MAX_EVENT_ID_BYTES // 2 + 1), "y" * 128):
                    await client.send_text(interaction(event_id))
                await client.send(type="session.ping")
                while not events or events[-1]["type"] != "session.pong":
                    message = await client.recv()
                    if isinstance(message, str):
                        events.append(json.loads(message))
                await client.send(type="session.stop")
                await client.closed_by_server()
            return events

        events = asyncio.run(scenario())
        errors = [e for e in events if e["type"] == "error"]
        assert [e["code"] for e in errors] == ["invalid_message", "invalid_message"]
        assert f"at most {MAX_EVENT_ID_BYTES} bytes" in errors[0]["message"]
        assert [e["event_id"] for e in events if e["type"] == "session.interaction.queued"] == ["y" * 128]
        live.settled(blocks_free)


def test_interactions_waiting_for_a_chunk_are_capped_and_each_chunk_lists_at_most_that_many() -> None:
    # Slow chunks: a burst of interactions lands between two chunk boundaries.
    with running_server(fake_settings(model_options={**OPTIONS, "compute_delay_s": 0.5})) as live:
        blocks_free = live.stats()["kv"]["blocks_free"]
        burst = 3 * MAX_PENDING_INTERACTIONS

        async def scenario() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            events: list[dict[str, Any]] = []
            async with session_client(video_url(live)) as client:
                await client.send(**start_message())
                for i in range(burst):
                    await client.send_text(interaction(f"e{i}"))
                while sum(e["type"] in ("session.interaction.queued", "error") for e in events) < burst:
                    message = await client.recv()
                    if isinstance(message, str):
                        events.append(json.loads(message))
                queued = {e["event_id"] for e in events if e["type"] == "session.interaction.queued"}
                started: set[str] = set()
                while not queued <= started:  # every queued interaction is started by some chunk
                    message = await client.recv()
                    if isinstance(message, str):
                        event = json.loads(message)
                        events.append(event)
                        started.update(event.get("started_event_ids", ()))
                await client.send(type="session.stop")
                await client.closed_by_server()
            return events, [e for e in events if e["type"] == "video.chunk_metadata"]

        events, metadata = asyncio.run(scenario())
        refused = [e for e in events if e["type"] == "error"]
        # A burst of 3x the cap spans at most two chunk boundaries here, so at least a third is refused.
        assert len(refused) >= MAX_PENDING_INTERACTIONS
        assert all(e["code"] == "interaction_failed" and "waiting for the next chunk" in e["message"] for e in refused)
        assert max(len(m["started_event_ids"]) for m in metadata) <= MAX_PENDING_INTERACTIONS
        live.settled(blocks_free)


def test_a_client_sending_interactions_with_huge_ids_holds_little_memory() -> None:
    """Before the fix each 60 KB id was remembered (4096 of them a session: 269 MB) and listed in chunk
    metadata; the client here reads everything, as the red team's did."""
    options = json.dumps({**OPTIONS, "compute_delay_s": 0.05})
    with server_process(["--model", "fake-kv", "--model-options", options, "--log-level", "warning"]) as live:
        assert live.process is not None
        pid = live.process.pid
        sent = 800
        huge = "z" * 60_000

        async def scenario() -> tuple[int, int]:
            async with session_client(video_url(live)) as client:
                await client.send(**start_message())
                chunks = 0
                while chunks < 4:  # warm: the encoder and the allocator's pools are set up
                    chunks += isinstance(await client.recv(), bytes)
                before = rss_bytes(pid)
                replies, largest_metadata = 0, 0

                async def read() -> None:
                    nonlocal replies, largest_metadata
                    while replies < sent:
                        message = await client.recv()
                        if isinstance(message, str):
                            event = json.loads(message)
                            replies += event["type"] in ("session.interaction.queued", "error")
                            if event["type"] == "video.chunk_metadata":
                                largest_metadata = max(largest_metadata, len(message))

                reader = asyncio.create_task(read())
                for i in range(sent):
                    await client.send_text(interaction(f"{i}-{huge}"))
                await reader
                grown = rss_bytes(pid) - before
                await client.send(type="session.stop")
                await client.closed_by_server()
            return grown, largest_metadata

        grown, largest_metadata = asyncio.run(scenario())
    assert grown < 16 * MB, f"800 interactions with 60 KB ids grew the server by {grown / MB:.0f} MB"
    assert largest_metadata < 32 * 1024, f"a video.chunk_metadata of {largest_metadata} bytes"


@pytest.mark.parametrize(
    "fields",
    [{"seconds": "9" * 400}, {"size": "9" * 5000 + "x48"}],
    ids=["seconds-past-a-float", "size-past-int-parsing"],
)
def test_a_start_with_numbers_too_long_to_parse_is_invalid_message(fields: dict[str, str]) -> None:
    """Before the fix: close 1011 `internal` and a traceback in the log."""
    with running_server(fake_settings(model_options=OPTIONS)) as live:

        async def scenario() -> tuple[int | None, list[dict[str, Any]]]:
            async with session_client(video_url(live)) as client:
                await client.send(**start_message(**fields))
                closed = await client.closed_by_server()
                return closed.code, closed.messages

        code, messages = asyncio.run(scenario())
        assert code == 1008
        [error] = messages
        assert error["code"] == "invalid_message" and "Invalid session.start" in error["message"]

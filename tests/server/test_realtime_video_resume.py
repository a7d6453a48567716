"""Resume on the realtime video dialect (an ARStream extension, off unless ``session.start`` asks for it).

A real server and a real ``websockets`` client: a session started with
``"resumable": true`` gets a resume ticket in ``video.start``; its connection
dropped, it is detached, and a ``session.start`` with ``"resume": TOKEN`` (and
``?resume=`` for the balancer) resumes it. The rollout goes on from where the
model left it: the frames the model makes are those of the same session
never dropped, bit for bit. Without ``resumable`` nothing changes: no ticket,
and a drop releases the session at once.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np

from arstream.app.realtime_video import PATH
from arstream.models.fake import FakeKVPipeline
from arstream.runner.types import TickRequest
from servers import LiveServer, fake_settings, running_server, session_client

WIDTH, HEIGHT = 64, 48
AFTER = 6  # chunks read after the rollout goes on (the sessions are endless: a finite one could end before its
# drop or move is noticed, its chunks written ahead of what the client read)
DROP_AFTER = 3  # chunks received before the connection drops


class FrameRecordingFakePipeline(FakeKVPipeline):
    """FakeKVPipeline that keeps every chunk it makes, in order, per session."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.made: dict[str, list[np.ndarray]] = {}

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        frames = super().generate_chunk(tick)
        self.made.setdefault(tick.session_id, []).append(frames.copy())
        return frames


def video_url(server: LiveServer, query: str = "") -> str:
    return server.base_url.replace("http://", "ws://", 1) + PATH + query


def start(**fields: Any) -> dict[str, Any]:
    # num_frames far past what a test reads: without one a session is the model's default length (81 frames)
    base = {"type": "session.start", "model": "fake-kv", "prompt": "a test world", "seed": 7, "num_frames": 2**40}
    return {**base, **fields}


async def until_chunk(client: Any, index: int, seen: list[dict[str, Any]]) -> None:
    """Read until the chunk with generation_chunk_index ``index``, then stop the session and read its end."""
    while (await events_until(client, "video.chunk_metadata", seen))["generation_chunk_index"] < index:
        pass
    await client.send(type="session.stop")
    await events_until(client, "session.done", seen)


async def events_until(client: Any, kind: str, seen: list[dict[str, Any]]) -> dict[str, Any]:
    """Read (skipping binaries) until an event of ``kind``; every event read goes to ``seen``."""
    while True:
        message = await client.recv()
        if isinstance(message, bytes):
            continue
        event = json.loads(message)
        seen.append(event)
        if event["type"] == kind:
            return event
        assert event["type"] != "error", (event, seen)


async def stream_a_while(client: Any, seen: list[dict[str, Any]]) -> dict[str, Any]:
    """Start a resumable session and read ``DROP_AFTER`` chunks of it; its video.start."""
    await client.send(**start(resumable=True))
    first = await events_until(client, "video.start", seen)
    for _ in range(DROP_AFTER):
        await events_until(client, "video.chunk_metadata", seen)
    return first


async def resume_and_read(server: LiveServer, token: str, after: list[dict[str, Any]]) -> dict[str, Any]:
    """Resume ``token`` on ``server`` and read ``AFTER`` chunks past where it goes on; its video.start."""
    async with session_client(video_url(server, f"?resume={token}")) as client:
        await client.send(type="session.start", resume=token)
        resumed = await events_until(client, "video.start", after)
        await until_chunk(client, resumed["resume"]["next_chunk_index"] + AFTER - 1, after)
    return resumed


async def plain_session(server: LiveServer, last_index: int) -> str:
    """A session never dropped, read to chunk ``last_index``; its id."""
    async with session_client(video_url(server)) as client:
        await client.send(**start())
        seen: list[dict[str, Any]] = []
        video_start = await events_until(client, "video.start", seen)
        await until_chunk(client, last_index, seen)
        return str(video_start["session_id"])


def same_rollout(plain: list[np.ndarray], other: list[np.ndarray], chunks: int) -> bool:
    return len(plain) >= chunks and len(other) >= chunks and all(
        np.array_equal(a, b) for a, b in zip(plain[:chunks], other[:chunks])
    )


def test_a_dropped_resumable_session_resumes_and_its_rollout_goes_on_bit_identically() -> None:
    pipeline = FrameRecordingFakePipeline(width=WIDTH, height=HEIGHT)
    with running_server(fake_settings(resume_grace_s=30.0), pipeline) as live:
        start_free = int(live.stats()["kv"]["blocks_free"])

        async def dropped_and_resumed() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
            seen: list[dict[str, Any]] = []
            async with session_client(video_url(live)) as client:
                first = await stream_a_while(client, seen)
                client.abort()  # no session.stop, no close frame
            token = first["resume"]["token"]
            await asyncio.to_thread(wait_until_detached, live)
            after: list[dict[str, Any]] = []
            resumed = await resume_and_read(live, token, after)
            return first, resumed, after

        first, resumed, after = asyncio.run(dropped_and_resumed())
        next_index = resumed["resume"]["next_chunk_index"]
        plain_id = asyncio.run(plain_session(live, next_index + AFTER - 1))
        live.settled(start_free)  # every block back once both have ended

    assert first["resume"]["grace_s"] == 30 and "." in first["resume"]["token"]  # <replica>.<random>
    assert resumed["session_id"] == first["session_id"] and resumed["resumed"] is True
    assert resumed["request_id"] == first["request_id"] and resumed["resume"]["token"] != first["resume"]["token"]
    assert next_index >= DROP_AFTER
    chunks_after = [e for e in after if e["type"] == "video.chunk_metadata"]
    assert [m["generation_chunk_index"] for m in chunks_after[:AFTER]] == list(range(next_index, next_index + AFTER))
    assert [m["transport_chunk_index"] for m in chunks_after] == list(range(len(chunks_after)))
    # The model made each chunk once, and made the same frames as for the session that never dropped.
    assert same_rollout(pipeline.made[plain_id], pipeline.made[str(first["session_id"])], next_index + AFTER)


def wait_until_detached(server: LiveServer) -> None:
    from servers import wait_until

    wait_until(lambda: server.stats()["sessions"]["detached"] == 1)


def test_without_resumable_there_is_no_ticket_and_a_drop_releases_the_session() -> None:
    with running_server(fake_settings(resume_grace_s=30.0), FakeKVPipeline(width=WIDTH, height=HEIGHT)) as live:
        start_free = int(live.stats()["kv"]["blocks_free"])

        async def drop() -> dict[str, Any]:
            async with session_client(video_url(live)) as client:
                await client.send(**start())
                seen: list[dict[str, Any]] = []
                video_start = await events_until(client, "video.start", seen)
                await events_until(client, "video.chunk_metadata", seen)
                client.abort()
            return video_start

        video_start = asyncio.run(drop())
        live.settled(start_free)  # released at once, not held for a resume
        assert live.stats()["sessions"]["detached"] == 0
    assert "resume" not in video_start


def test_a_bad_resume_token_is_resume_failed() -> None:
    with running_server(fake_settings(resume_grace_s=30.0), FakeKVPipeline(width=WIDTH, height=HEIGHT)) as live:

        async def bad() -> tuple[list[dict[str, Any]], int | None]:
            async with session_client(video_url(live)) as client:
                await client.send(type="session.start", resume="r0.not-a-token")
                closed = await client.closed_by_server()
                return closed.messages, closed.code

        messages, code = asyncio.run(bad())
    (error,) = messages
    assert (error["type"], error["code"], code) == ("error", "resume_failed", 4002), messages


def test_a_drain_moves_a_resumable_session_to_the_peer_where_it_goes_on_bit_identically() -> None:
    from contextlib import ExitStack

    from test_migration import cluster_settings, drain

    # Both replicas' pipelines record what they make; the short window has slid before the move.
    r0_pipeline, r1_pipeline = (FrameRecordingFakePipeline(window_frames=6) for _ in range(2))
    with ExitStack() as stack:
        r0 = stack.enter_context(running_server(cluster_settings("r0"), r0_pipeline))
        r1 = stack.enter_context(running_server(cluster_settings("r1"), r1_pipeline))

        async def moved_and_resumed() -> tuple[dict[str, Any], dict[str, Any], int | None, dict[str, Any], list[Any]]:
            seen: list[dict[str, Any]] = []
            async with session_client(video_url(r0)) as client:
                first = await stream_a_while(client, seen)
                drained = asyncio.create_task(asyncio.to_thread(drain, r0, [r1.base_url]))
                moved = await events_until(client, "session.moved", seen)
                closed = await client.closed_by_server()
                report = await drained
                assert report.status_code == 200, report.text
            token = str(moved["resume"])
            after: list[dict[str, Any]] = []
            resumed = await resume_and_read(r1, token, after)
            return first, moved, closed.code, resumed, after

        first, moved, close_code, resumed, after = asyncio.run(moved_and_resumed())
        next_index = moved["next_chunk_index"]
        plain_id = asyncio.run(plain_session(r1, next_index + AFTER - 1))  # r0 is drained: it takes no new one
        for server in (r0, r1):
            server.settled(server.stats()["kv"]["blocks_total"])

    session_id = str(first["session_id"])
    assert close_code == 1001 and moved["resume"].startswith("r1.") and moved["request_id"] == first["request_id"]
    assert resumed["session_id"] == session_id and resumed["resumed"] is True
    chunks_after = [e["generation_chunk_index"] for e in after if e["type"] == "video.chunk_metadata"]
    assert chunks_after[:AFTER] == list(range(next_index, next_index + AFTER))
    # The peer made the rest of the rollout: together the two made the uninterrupted session's frames.
    made_here, made_there = r0_pipeline.made[session_id], r1_pipeline.made[session_id]
    assert len(made_here) == next_index and len(made_there) >= AFTER
    assert same_rollout(r1_pipeline.made[plain_id], made_here + made_there, next_index + AFTER)


def test_a_token_resumes_only_on_the_wire_dialect_that_started_its_session() -> None:
    with running_server(fake_settings(resume_grace_s=30.0), FakeKVPipeline(width=WIDTH, height=HEIGHT)) as live:

        async def cross() -> tuple[list[dict[str, Any]], int | None, list[dict[str, Any]], int | None]:
            async with session_client(video_url(live)) as client:
                await client.send(**start(resumable=True))
                video_token = (await events_until(client, "video.start", []))["resume"]["token"]
                async with session_client(live.ws_url, start={}) as protocol1:
                    assert protocol1.ready is not None
                    protocol1_token = protocol1.ready["resume"]["token"]
                    async with session_client(video_url(live)) as other:
                        await other.send(type="session.start", resume=protocol1_token)
                        as_video = await other.closed_by_server()
                async with session_client(live.ws_url) as other:
                    await other.send(type="start", resume=video_token)
                    as_protocol1 = await other.closed_by_server()
                await client.send(type="session.stop")
                await events_until(client, "session.done", [])  # the session itself went on meanwhile
            return as_video.messages, as_video.code, as_protocol1.messages, as_protocol1.code

        video_messages, video_code, protocol1_messages, protocol1_code = asyncio.run(cross())
    assert (video_messages[-1]["code"], video_code) == ("resume_failed", 4002), video_messages
    assert (protocol1_messages[-1]["code"], protocol1_code) == ("resume_failed", 4002), protocol1_messages
    assert "another wire dialect" in video_messages[-1]["message"]

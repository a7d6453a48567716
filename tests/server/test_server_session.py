"""Sessions over a real uvicorn server and a real ``websockets`` client (fake-kv pipeline).

The fake paints each frame R: a value computed from the KV it read, G: the
frame's absolute position in the rollout, B: one bit per held key (w=1, a=2,
s=4, d=8), so frames say which chunk and which controls produced them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from arstream.app.wire import Codec
from arstream.models.fake import controls_code
from servers import LiveServer, ProbeClient, fake_settings, running_server, session_client

FRAMES_PER_CHUNK = 2


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server(fake_settings()) as live:
        yield live


async def expect_error(client: ProbeClient, code: str, *, tick_id: int | None = None) -> dict[str, Any]:
    message = await client.recv_json()
    assert message["type"] == "error", message
    assert message["code"] == code, message
    assert message["fatal"] is False
    assert message["tick_id"] == tick_id
    return message


async def still_usable(client: ProbeClient) -> None:
    await client.send(type="ping", t=42.5)
    pong = await client.recv_json()
    assert pong["type"] == "pong" and pong["t"] == 42.5


# ---- happy path -----------------------------------------------------------------------


def test_ready_describes_session_model_and_limits(server: LiveServer, baseline: int) -> None:
    async def scenario() -> dict[str, Any]:
        async with session_client(server.ws_url, start={}) as client:
            assert client.ready is not None
            return client.ready

    ready = asyncio.run(scenario())
    assert ready["protocol"] == 1
    assert ready["session_id"].startswith("s-")
    assert ready["model"] == server.get("/v1/model").json()
    assert ready["model"]["name"] == "fake-kv"
    assert ready["codec"] == "jpeg"
    assert ready["limits"] == {"max_pending_ticks": 4, "max_message_bytes": 65536, "idle_timeout_s": 60}


@pytest.mark.parametrize("codec", ["raw", "jpeg"])
def test_chunks_carry_exactly_their_frames_with_headers(server: LiveServer, baseline: int, codec: str) -> None:
    async def scenario() -> list[tuple[dict[str, Any], list[Any]]]:
        async with session_client(server.ws_url, start={"codec": codec, "quality": 95}) as client:
            assert client.ready is not None and client.ready["codec"] == codec
            chunks = []
            for tick_id, keys in ((3, ["d"]), (9, ["w", "a"]), (10, [])):
                await client.send(type="tick", tick_id=tick_id, controls={"keys": keys})
                chunks.append(await client.recv_chunk())
            await still_usable(client)  # nothing was left over after the last frame
            return chunks

    chunks = asyncio.run(scenario())
    for chunk_index, ((chunk, frames), (tick_id, keys)) in enumerate(zip(chunks, ((3, ["d"]), (9, ["w", "a"]), (10, [])))):
        assert chunk["tick_id"] == tick_id
        assert chunk["chunk_index"] == chunk_index
        assert chunk["frames"] == FRAMES_PER_CHUNK == len(frames)
        assert chunk["applied_event_ids"] == []
        assert chunk["restarted"] is None
        assert set(chunk["timings"]) == {"queue_ms", "compute_ms", "encode_ms"}
        for frame_index, (header, pixels) in enumerate(frames):
            assert header.codec is Codec.from_name(codec)
            assert header.last_in_chunk is (frame_index == FRAMES_PER_CHUNK - 1)
            assert header.frame_index == frame_index
            assert header.chunk_index == chunk_index
            assert header.tick_id == tick_id
            assert (header.width, header.height) == (8, 8) == (pixels.shape[1], pixels.shape[0])
            position = chunk_index * FRAMES_PER_CHUNK + frame_index
            expected_blue = controls_code({"keys": keys})
            if codec == "raw":
                assert (pixels[:, :, 1] == position).all()
                assert (pixels[:, :, 2] == expected_blue).all()
            else:
                assert abs(int(pixels[:, :, 1].mean()) - position) <= 2
                assert abs(int(pixels[:, :, 2].mean()) - expected_blue) <= 2


def test_input_events_apply_at_next_chunk_latest_wins(server: LiveServer, baseline: int) -> None:
    async def scenario() -> tuple[list[dict[str, Any]], dict[str, Any], Any, dict[str, Any]]:
        async with session_client(server.ws_url, start={"codec": "raw"}) as client:
            acks = []
            for event_id, keys in ((1, ["w"]), (2, ["a"]), (7, ["d"])):
                await client.send(type="input", event_id=event_id, controls={"keys": keys})
                acks.append(await client.recv_json())
            await client.send(type="tick", tick_id=0)
            first, frames = await client.recv_chunk()
            await client.send(type="tick", tick_id=1)
            second, _ = await client.recv_chunk()
            return acks, first, frames, second

    acks, first, frames, second = asyncio.run(scenario())
    assert acks == [
        {"type": "ack", "event_id": 1, "status": "accepted"},
        {"type": "ack", "event_id": 2, "status": "accepted"},
        {"type": "ack", "event_id": 7, "status": "accepted"},
    ]
    assert first["applied_event_ids"] == [1, 2, 7]
    assert all((pixels[:, :, 2] == controls_code({"keys": ["d"]})).all() for _, pixels in frames)
    assert second["applied_event_ids"] == []


def test_duplicate_event_is_acked_again_and_applied_once(server: LiveServer, baseline: int) -> None:
    async def scenario() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        async with session_client(server.ws_url, start={"codec": "raw"}) as client:
            replies = []
            await client.send(type="input", event_id=5, controls={"keys": ["s"]})
            replies.append(await client.recv_json())
            await client.send(type="input", event_id=5, controls={"keys": ["s"]})
            replies.append(await client.recv_json())
            await client.send(type="input", event_id=3, controls={"keys": ["w"]})
            replies.append(await client.recv_json())
            await client.send(type="tick", tick_id=1)
            chunk, _ = await client.recv_chunk()
            return replies, chunk

    replies, chunk = asyncio.run(scenario())
    assert replies[0] == {"type": "ack", "event_id": 5, "status": "accepted"}
    assert replies[1] == {"type": "ack", "event_id": 5, "status": "duplicate"}
    assert replies[2]["type"] == "error" and replies[2]["code"] == "stale_event" and replies[2]["fatal"] is False
    assert chunk["applied_event_ids"] == [5]


def test_stale_tick_is_refused_and_refusals_do_not_move_the_floor(server: LiveServer, baseline: int) -> None:
    async def scenario() -> None:
        async with session_client(server.ws_url, start={"codec": "raw"}) as client:
            await client.send(type="tick", tick_id=5)
            await client.recv_chunk()
            await client.send(type="tick", tick_id=5)
            await expect_error(client, "stale_tick", tick_id=5)
            await client.send(type="tick", tick_id=4)
            await expect_error(client, "stale_tick", tick_id=4)
            await client.send(type="tick", tick_id=20, controls={"keys": ["x"]})
            await expect_error(client, "invalid_controls", tick_id=20)
            await client.send(type="tick", tick_id=6)
            chunk, _ = await client.recv_chunk()
            assert chunk["tick_id"] == 6 and chunk["chunk_index"] == 1

    asyncio.run(scenario())


def test_invalid_controls_on_tick_and_input(server: LiveServer, baseline: int) -> None:
    async def scenario() -> None:
        async with session_client(server.ws_url, start={}) as client:
            await client.send(type="tick", tick_id=1, controls={"keys": ["w", "w"]})
            await expect_error(client, "invalid_controls", tick_id=1)
            await client.send(type="input", event_id=1, controls={"speed": 3})
            await expect_error(client, "invalid_controls")
            await client.send(type="input", event_id=1, controls={"keys": ["w"]})
            assert (await client.recv_json())["status"] == "accepted"

    asyncio.run(scenario())


INVALID_MESSAGES = {
    "not json": "tick 1",
    "not an object": "[1, 2]",
    "unknown type": '{"type": "jump"}',
    "type not a string": '{"type": 3}',
    "tick_id missing": '{"type": "tick"}',
    "tick_id a bool": '{"type": "tick", "tick_id": true}',
    "tick_id negative": '{"type": "tick", "tick_id": -1}',
    "tick_id fractional": '{"type": "tick", "tick_id": 1.5}',
    "tick_id 2^32": '{"type": "tick", "tick_id": 4294967296}',
    "tick_id a string": '{"type": "tick", "tick_id": "7"}',
    "event_id a bool": '{"type": "input", "event_id": false}',
    "NaN": '{"type": "ping", "t": NaN}',
    "Infinity": '{"type": "ping", "t": Infinity}',
    "overflowing float": '{"type": "ping", "t": 1e400}',
    "nesting deeper than 32": '{"type": "input", "event_id": 1, "controls": {"keys": ' + "[" * 32 + "]" * 32 + "}}",
    "prompt a number": '{"type": "tick", "tick_id": 1, "prompt": 5}',
    "reset not a bool": '{"type": "tick", "tick_id": 1, "reset": 1}',
    "controls not an object": '{"type": "tick", "tick_id": 1, "controls": ["w"]}',
    "second start": '{"type": "start"}',
}


@pytest.mark.parametrize("text", list(INVALID_MESSAGES.values()), ids=list(INVALID_MESSAGES))
def test_invalid_message_is_non_fatal(server: LiveServer, baseline: int, text: str) -> None:
    async def scenario() -> dict[str, Any]:
        async with session_client(server.ws_url, start={}) as client:
            await client.send_text(text)
            error = await client.recv_json()
            await still_usable(client)
            return error

    error = asyncio.run(scenario())
    assert error["type"] == "error" and error["code"] == "invalid_message" and error["fatal"] is False
    assert error["message"]


def test_binary_message_from_client_is_invalid_message(server: LiveServer, baseline: int) -> None:
    async def scenario() -> None:
        async with session_client(server.ws_url, start={}) as client:
            await client.ws.send(b"\x00\x01")
            await expect_error(client, "invalid_message")
            await still_usable(client)

    asyncio.run(scenario())


def test_invalid_message_echoes_a_usable_tick_id(server: LiveServer, baseline: int) -> None:
    async def scenario() -> None:
        async with session_client(server.ws_url, start={}) as client:
            await client.send(type="tick", tick_id=8, prompt=["not", "a", "string"])
            await expect_error(client, "invalid_message", tick_id=8)

    asyncio.run(scenario())


def test_immediate_replies_keep_arrival_order(server: LiveServer, baseline: int) -> None:
    async def scenario() -> list[dict[str, Any]]:
        async with session_client(server.ws_url, start={}) as client:
            await client.send(type="input", event_id=1, controls={"keys": ["w"]})
            await client.send(type="ping", t=1.0)
            await client.send_text("{")
            await client.send(type="ping", t=2.0)
            await client.send(type="input", event_id=1)
            return [await client.recv_json() for _ in range(5)]

    replies = asyncio.run(scenario())
    assert [(r["type"], r.get("t"), r.get("status"), r.get("code")) for r in replies] == [
        ("ack", None, "accepted", None),
        ("pong", 1.0, None, None),
        ("error", None, None, "invalid_message"),
        ("pong", 2.0, None, None),
        ("ack", None, "duplicate", None),
    ]
    assert isinstance(replies[1]["server_time"], float)


# ---- reset, close, failure, disconnect (each returns every KV block) -----------------------------


def test_reset_restarts_rollout_and_keeps_controls(server: LiveServer, baseline: int) -> None:
    async def scenario() -> list[Any]:
        async with session_client(server.ws_url, start={"codec": "raw"}) as client:
            results = []
            await client.send(type="tick", tick_id=1, controls={"keys": ["d"]})
            results.append(await client.recv_chunk())
            await client.send(type="tick", tick_id=2)
            results.append(await client.recv_chunk())
            await client.send(type="input", event_id=1, controls={"keys": ["a", "d"]})
            await client.recv_json()
            await client.send(type="tick", tick_id=3, reset=True)
            results.append(await client.recv_chunk())
            await client.send(type="tick", tick_id=4)
            results.append(await client.recv_chunk())
            return results

    results = asyncio.run(scenario())
    assert [c["chunk_index"] for c, _ in results] == [0, 1, 0, 1]
    assert [c["restarted"] for c, _ in results] == [None, None, "reset", None]
    reset_chunk, reset_frames = results[2]
    assert reset_chunk["applied_event_ids"] == [1]  # events pending at the reset go to the reset chunk
    assert (reset_frames[0][1][:, :, 1] == 0).all()  # position 0: a new rollout
    assert (reset_frames[0][1][:, :, 2] == controls_code({"keys": ["a", "d"]})).all()
    assert (results[3][1][0][1][:, :, 2] == controls_code({"keys": ["a", "d"]})).all()


def test_reset_on_the_first_tick_says_reset(server: LiveServer, baseline: int) -> None:
    async def scenario() -> dict[str, Any]:
        async with session_client(server.ws_url, start={}) as client:
            await client.send(type="tick", tick_id=0, reset=True)
            chunk, _ = await client.recv_chunk()
            return chunk

    chunk = asyncio.run(scenario())
    assert chunk["restarted"] == "reset" and chunk["chunk_index"] == 0


def test_close_message_sends_closed_client_and_1000(server: LiveServer, baseline: int) -> None:
    async def scenario() -> Any:
        async with session_client(server.ws_url, start={}) as client:
            await client.send(type="tick", tick_id=1)
            await client.recv_chunk()
            await client.send(type="close")
            return await client.closed_by_server()

    closed = asyncio.run(scenario())
    assert closed.code == 1000
    assert closed.messages == [{"type": "closed", "reason": "client"}]


def test_abrupt_disconnect_releases_the_session(server: LiveServer, baseline: int) -> None:
    async def scenario() -> None:
        async with session_client(server.ws_url, start={}) as client:
            for tick_id in range(4):
                await client.send(type="tick", tick_id=tick_id)
            await client.recv_chunk()
            client.abort()

    asyncio.run(scenario())
    # the baseline fixture polls /v1/stats until every block is back


def test_model_failure_is_non_fatal_and_needs_a_reset(server: LiveServer, baseline: int) -> None:
    failures_before = server.stats()["sessions"]["failures_total"]

    async def scenario() -> list[Any]:
        async with session_client(server.ws_url, start={"codec": "raw"}) as client:
            seen: list[Any] = []
            await client.send(type="tick", tick_id=1, controls={"keys": ["w"]})
            seen.append(await client.recv_chunk())
            await client.send(type="tick", tick_id=2, controls={"keys": ["w"], "fail": True})
            seen.append(await expect_error(client, "session_failed", tick_id=2))
            await client.send(type="tick", tick_id=3, controls={"keys": ["w"]})
            seen.append(await expect_error(client, "session_failed", tick_id=3))
            await client.send(type="tick", tick_id=4, controls={"keys": ["s"]}, reset=True)
            seen.append(await client.recv_chunk())
            await client.send(type="tick", tick_id=5)
            seen.append(await client.recv_chunk())
            return seen

    seen = asyncio.run(scenario())
    recovered, _ = seen[3]
    assert recovered["restarted"] == "reset" and recovered["chunk_index"] == 0 and recovered["tick_id"] == 4
    assert seen[4][0]["chunk_index"] == 1
    assert server.stats()["sessions"]["failures_total"] == failures_before + 1


def test_failure_leaves_other_sessions_alone(server: LiveServer, baseline: int) -> None:
    async def scenario() -> list[dict[str, Any]]:
        async with session_client(server.ws_url, start={}) as healthy, session_client(server.ws_url, start={}) as doomed:
            chunks = []
            for tick_id in range(3):
                await healthy.send(type="tick", tick_id=tick_id)
                await doomed.send(type="tick", tick_id=tick_id, controls={"fail": tick_id == 1})
                chunks.append((await healthy.recv_chunk())[0])
            await doomed.recv_chunk()
            await expect_error(doomed, "session_failed", tick_id=1)
            await expect_error(doomed, "session_failed", tick_id=2)
            return chunks

    chunks = asyncio.run(scenario())
    assert [c["chunk_index"] for c in chunks] == [0, 1, 2]
    assert all(c["restarted"] is None for c in chunks)


def test_session_failed_after_failure_until_reset_even_when_queued(server: LiveServer, baseline: int) -> None:
    """Ticks after a failed one are not run (refused, or skipped if already queued) until a reset."""

    async def scenario() -> list[dict[str, Any]]:
        async with session_client(server.ws_url, start={}) as client:
            await client.send(type="tick", tick_id=1, controls={"fail": True})
            await client.send(type="tick", tick_id=2, controls={})
            await client.send(type="tick", tick_id=3, controls={}, reset=True)
            replies = [await client.recv_json() for _ in range(2)]
            chunk, _ = await client.recv_chunk()
            return [*replies, chunk]

    first, second, chunk = asyncio.run(scenario())
    assert (first["code"], first["tick_id"]) == ("session_failed", 1)
    assert (second["code"], second["tick_id"]) == ("session_failed", 2)
    assert chunk["tick_id"] == 3 and chunk["restarted"] == "reset"


def test_pending_ticks_and_stats_while_connected(server: LiveServer, baseline: int) -> None:
    async def scenario() -> dict[str, Any]:
        async with session_client(server.ws_url, start={}) as client:
            await client.send(type="tick", tick_id=1)
            await client.recv_chunk()
            return server.wait_for_stats(lambda s: s["sessions"]["connected"] == 1)

    stats = asyncio.run(scenario())
    assert stats["kv"]["sessions_resident"] == 1
    assert stats["kv"]["blocks_free"] < baseline
    assert stats["kv"]["blocks_used"] + stats["kv"]["blocks_free"] == stats["kv"]["blocks_total"]
    assert stats["chunks"]["total"] >= 1 and stats["chunks"]["compute_ms_p50"] is not None
    assert json.dumps(stats)  # plain JSON


def test_the_runtime_in_use_shows_in_stats_metrics_and_the_model_card() -> None:
    """``arstream`` here; the vLLM-Omni lane runs this with ARSTREAM_RUNTIME=vllm-omni and sees that name."""
    settings = fake_settings()
    with running_server(settings) as server:
        assert server.stats()["runtime"] == settings.runtime
        assert server.get("/v1/model").json()["runtime"] == settings.runtime
        exposition = server.get("/metrics").text
        assert f'arstream_runtime_info{{runtime="{settings.runtime}"}} 1.0' in exposition

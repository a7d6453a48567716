"""Scheduling, flow control, eviction, server faults and shutdown, over a real server.

Most tests use :class:`GatedFakePipeline`, a fake whose forwards wait for the
test to open a gate, so ticks can be queued deterministically (no sleeps).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from arstream.app import wire
from arstream.app.outbox import REPLY_BACKLOG_LIMIT
from arstream.models.fake import controls_code
from servers import (
    GatedFakePipeline,
    LiveServer,
    ProbeClient,
    fake_settings,
    running_server,
    session_client,
)


@pytest.fixture
def gated() -> Iterator[tuple[LiveServer, GatedFakePipeline]]:
    pipeline = GatedFakePipeline()
    with running_server(fake_settings(max_pending_ticks=4), pipeline) as live:
        try:
            yield live, pipeline
        finally:
            pipeline.gate.set()


async def wait_until(predicate: Any, attempts: int = 2000) -> None:
    """Yield to the event loop until ``predicate()`` holds (a hang guard bounds the attempts)."""
    for _ in range(attempts):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


async def wait_stats(server: LiveServer, predicate: Any) -> dict[str, Any]:
    return await asyncio.to_thread(server.wait_for_stats, predicate)


def test_too_many_ticks_then_credit_returns_after_the_chunk(gated: tuple[LiveServer, GatedFakePipeline]) -> None:
    server, pipeline = gated
    start_free = server.stats()["kv"]["blocks_free"]

    async def scenario() -> None:
        async with session_client(server.ws_url, start={}) as client:
            for tick_id in range(1, 5):
                await client.send(type="tick", tick_id=tick_id)
            await client.send(type="tick", tick_id=5)
            refusal = await client.recv_json()
            assert refusal["code"] == "too_many_ticks" and refusal["tick_id"] == 5 and refusal["fatal"] is False
            stats = await wait_stats(server, lambda s: s["queue"]["depth"] == 3)
            assert stats["sessions"]["pending_ticks"] == 4
            pipeline.gate.set()
            for tick_id in range(1, 5):
                chunk, _ = await client.recv_chunk()
                assert chunk["tick_id"] == tick_id
            # the refused id did not move the floor, and credits are back
            await client.send(type="tick", tick_id=5)
            chunk, _ = await client.recv_chunk()
            assert chunk["tick_id"] == 5 and chunk["chunk_index"] == 4

    asyncio.run(scenario())
    server.settled(start_free)


def test_tick_with_close_flag_sends_its_chunk_then_closes(gated: tuple[LiveServer, GatedFakePipeline]) -> None:
    server, pipeline = gated
    start_free = server.stats()["kv"]["blocks_free"]

    async def scenario() -> Any:
        async with session_client(server.ws_url, start={}) as client:
            await client.send(type="tick", tick_id=1)
            await client.send(type="tick", tick_id=2, close=True)
            await client.send(type="tick", tick_id=3)
            # the gate holds the forwards, so tick 3 surely arrives before the session closes
            refusal = await client.recv_json()
            assert (refusal["type"], refusal["code"], refusal["tick_id"]) == ("error", "invalid_message", 3)
            pipeline.gate.set()
            return await client.closed_by_server()

    closed = asyncio.run(scenario())
    assert [m["tick_id"] for m in closed.messages if m["type"] == "chunk"] == [1, 2]
    assert not [m for m in closed.messages if m["type"] == "error"]
    assert closed.messages[-1] == {"type": "closed", "reason": "tick_close"}
    assert closed.code == 1000
    server.settled(start_free)


def test_two_sessions_are_served_round_robin(gated: tuple[LiveServer, GatedFakePipeline]) -> None:
    server, pipeline = gated

    async def scenario() -> tuple[str, str, list[str]]:
        async with session_client(server.ws_url, start={}) as a, session_client(server.ws_url, start={}) as b:
            assert a.ready and b.ready
            for tick_id in range(4):
                await a.send(type="tick", tick_id=tick_id)
            await wait_until(pipeline.waiting.is_set)  # a's first tick is running, the rest queued
            for tick_id in range(4):
                await b.send(type="tick", tick_id=tick_id)
            await wait_stats(server, lambda s: s["queue"]["depth"] == 7)
            pipeline.gate.set()
            for _ in range(4):
                await a.recv_chunk()
                await b.recv_chunk()
            return a.ready["session_id"], b.ready["session_id"], list(pipeline.order)

    a_id, b_id, order = asyncio.run(scenario())
    assert order[0] == a_id
    queued = order[1:]
    assert sorted(queued) == sorted([a_id] * 3 + [b_id] * 4)
    for index in range(1, len(queued)):
        if queued[index] == queued[index - 1]:
            other = b_id if queued[index] == a_id else a_id
            assert other not in queued[index:], f"{queued[index]} ran twice in a row while the other waited: {queued}"


def test_queued_input_wins_over_an_earlier_ticks_controls(gated: tuple[LiveServer, GatedFakePipeline]) -> None:
    """Latest wins at the chunk boundary: an input sent after a queued tick overrides the tick's controls."""
    server, pipeline = gated

    async def scenario() -> list[Any]:
        async with session_client(server.ws_url, start={"codec": "raw"}) as client:
            await client.send(type="tick", tick_id=1, controls={"keys": ["w"]})
            await wait_until(pipeline.waiting.is_set)
            await client.send(type="tick", tick_id=2, controls={"keys": ["a"]})
            await client.send(type="input", event_id=1, controls={"keys": ["s"]})
            assert (await client.recv_json())["status"] == "accepted"
            pipeline.gate.set()
            return [await client.recv_chunk(), await client.recv_chunk()]

    (first, first_frames), (second, second_frames) = asyncio.run(scenario())
    assert (first_frames[0][1][:, :, 2] == controls_code({"keys": ["w"]})).all()
    assert second["applied_event_ids"] == [1]
    assert (second_frames[0][1][:, :, 2] == controls_code({"keys": ["s"]})).all()


def test_close_drops_queued_ticks_and_releases(gated: tuple[LiveServer, GatedFakePipeline]) -> None:
    server, pipeline = gated
    start_free = server.stats()["kv"]["blocks_free"]

    async def scenario() -> Any:
        async with session_client(server.ws_url, start={}) as client:
            for tick_id in range(3):
                await client.send(type="tick", tick_id=tick_id)
            await wait_until(pipeline.waiting.is_set)
            await client.send(type="close")
            closed = await client.closed_by_server()
            pipeline.gate.set()
            return closed

    closed = asyncio.run(scenario())
    assert closed.code == 1000
    assert closed.messages == [{"type": "closed", "reason": "client"}]
    stats = server.settled(start_free)
    assert stats["queue"]["depth"] == 0
    assert len(pipeline.order) == 1  # the two queued ticks never ran


def test_disconnected_but_resident_session_is_reclaimed_without_touching_connected_ones() -> None:
    """Capacity 2: A stays, B disconnects while its chunk runs (still resident), C is admitted and runs."""
    pipeline = GatedFakePipeline(session_capacity=2)
    with running_server(fake_settings(), pipeline) as server:
        start_free = server.stats()["kv"]["blocks_free"]

        async def scenario() -> list[dict[str, Any]]:
            chunks_of_a: list[dict[str, Any]] = []
            async with session_client(server.ws_url, start={}) as a:
                pipeline.gate.set()
                for tick_id in range(2):
                    await a.send(type="tick", tick_id=tick_id)
                    chunks_of_a.append((await a.recv_chunk())[0])
                async with session_client(server.ws_url, start={}) as b:
                    await b.send(type="tick", tick_id=0)
                    await b.recv_chunk()
                    pipeline.gate.clear()
                    await b.send(type="tick", tick_id=1)
                    await wait_until(pipeline.waiting.is_set)
                    b.abort()
                stats = await wait_stats(server, lambda s: s["sessions"]["connected"] == 1)
                assert stats["kv"]["sessions_resident"] == 2  # B is gone but its chunk still holds KV
                async with session_client(server.ws_url, start={}) as c:
                    stats = await wait_stats(server, lambda s: s["sessions"]["connected"] == 2)
                    assert stats["kv"]["sessions_resident"] == 2
                    await c.send(type="tick", tick_id=0)
                    pipeline.gate.set()
                    chunk_of_c, _ = await c.recv_chunk()
                    assert chunk_of_c["chunk_index"] == 0 and chunk_of_c["restarted"] is None
                    await a.send(type="tick", tick_id=2)
                    chunks_of_a.append((await a.recv_chunk())[0])
                    stats = await wait_stats(server, lambda s: s["kv"]["sessions_resident"] == 2)
                    assert stats["sessions"]["connected"] == 2
            return chunks_of_a

        try:
            chunks_of_a = asyncio.run(scenario())
        finally:
            pipeline.gate.set()
        assert [c["chunk_index"] for c in chunks_of_a] == [0, 1, 2]
        assert all(c["restarted"] is None for c in chunks_of_a)
        server.settled(start_free)


STALLING_SETTINGS = {
    "codec": "raw",
    "max_pending_ticks": 4,
    "model_options": {"width": 256, "height": 256},  # big frames fill the socket buffers quickly
    "shutdown_grace_s": 0.5,
}


async def stall_writes(server: LiveServer, client: ProbeClient) -> int:
    """Send ticks from a client that never reads until the server holds all its credits; returns the last tick id."""
    for tick_id in range(2000):
        await client.send(type="tick", tick_id=tick_id)
        await asyncio.sleep(0.002)
        if tick_id % 10 == 9:
            stats = await asyncio.to_thread(server.stats)
            if stats["sessions"]["pending_ticks"] == 4 and stats["queue"]["depth"] == 0:
                return tick_id
    raise AssertionError("the slow client's writes never blocked")


def test_a_client_that_stops_reading_does_not_stall_another() -> None:
    """The slow client never reads: its credits stay held (writes block) while the other keeps streaming."""
    with running_server(fake_settings(**STALLING_SETTINGS)) as server:
        start_free = server.stats()["kv"]["blocks_free"]

        async def scenario() -> int:
            async with session_client(server.ws_url, start={"codec": "raw"}, max_queue=1) as slow:
                tick_id = await stall_writes(server, slow)
                async with session_client(server.ws_url, start={"codec": "raw"}) as fast:
                    for tick_id in range(12):
                        await fast.send(type="tick", tick_id=tick_id)
                        chunk, frames = await fast.recv_chunk()
                        assert chunk["tick_id"] == tick_id and len(frames) == 2
                    # the slow session still holds all its credits: its chunks are stuck in the socket
                    stats = await asyncio.to_thread(server.stats)
                    assert stats["sessions"]["pending_ticks"] == 4
                    assert stats["sessions"]["active"] == 1
                # replies back up behind the stuck frames until the receive loop waits; a disconnect still ends it
                for _ in range(REPLY_BACKLOG_LIMIT + 10):
                    await slow.send(type="ping", t=0)
                await wait_stats(server, lambda s: s["sessions"]["replies_queued"] == REPLY_BACKLOG_LIMIT)
                slow.abort()
                return tick_id

        asyncio.run(scenario())
        server.settled(start_free)


def test_server_fault_is_internal_1011_and_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_encoder(*args: Any, **kwargs: Any) -> list[bytes]:
        raise RuntimeError("encoder fault injected by the test")

    with running_server(fake_settings()) as server:
        start_free = server.stats()["kv"]["blocks_free"]
        monkeypatch.setattr(wire, "encode_chunk", broken_encoder)

        async def scenario() -> Any:
            async with session_client(server.ws_url, start={}) as client:
                await client.send(type="tick", tick_id=7)
                return await client.closed_by_server()

        closed = asyncio.run(scenario())
        assert closed.code == 1011
        error, farewell = closed.messages
        assert error["type"] == "error" and error["code"] == "internal" and error["fatal"] is True
        assert error["tick_id"] == 7
        assert farewell == {"type": "closed", "reason": "error"}
        server.settled(start_free)


def test_graceful_shutdown_sends_closed_server_shutdown() -> None:
    pipeline = GatedFakePipeline()
    with running_server(fake_settings(), pipeline) as server:

        async def scenario() -> list[Any]:
            async with session_client(server.ws_url, start={}) as busy, session_client(server.ws_url, start={}) as idle:
                for tick_id in range(3):
                    await busy.send(type="tick", tick_id=tick_id)
                await wait_stats(server, lambda s: s["sessions"]["connected"] == 2 and s["queue"]["depth"] == 2)
                assert server.server is not None
                server.server.should_exit = True  # what SIGINT/SIGTERM do
                results = [await busy.closed_by_server(), await idle.closed_by_server()]
                pipeline.gate.set()
                return results

        closed_results = asyncio.run(scenario())
        assert server.thread is not None
        server.thread.join(30)
        assert not server.thread.is_alive()

    for closed in closed_results:
        assert closed.messages == [{"type": "closed", "reason": "server_shutdown"}]
        assert closed.code == 1001


def test_shutdown_does_not_hang_on_a_client_that_stops_reading() -> None:
    with running_server(fake_settings(**STALLING_SETTINGS)) as server:

        async def scenario() -> None:
            async with session_client(server.ws_url, start={"codec": "raw"}, max_queue=1) as slow:
                await stall_writes(server, slow)
                assert server.server is not None and server.thread is not None
                server.server.should_exit = True
                await asyncio.to_thread(server.thread.join, 60)  # a hang guard, not a timing assertion
                assert not server.thread.is_alive()
                slow.abort()

        asyncio.run(scenario())


def test_a_round_of_sessions_runs_as_one_batch_and_a_failing_one_fails_alone() -> None:
    """Three sessions queue ticks behind a held forward; the next round batches them; one of them fails."""
    pipeline = GatedFakePipeline()
    with running_server(fake_settings(max_batch_sessions=4), pipeline) as server:
        start_free = server.stats()["kv"]["blocks_free"]
        failures_before = server.stats()["sessions"]["failures_total"]
        pipeline.gate.set()

        async def scenario() -> dict[str, list[Any]]:
            raw = {"codec": "raw"}
            async with (
                session_client(server.ws_url, start=raw) as a,
                session_client(server.ws_url, start=raw) as doomed,
                session_client(server.ws_url, start=raw) as c,
                session_client(server.ws_url, start=raw) as blocker,
            ):
                for client in (a, doomed, c):
                    await client.send(type="tick", tick_id=0)
                    await client.recv_chunk()
                pipeline.gate.clear()
                await blocker.send(type="tick", tick_id=0)
                await wait_until(pipeline.waiting.is_set)  # the blocker's forward holds the worker
                await a.send(type="tick", tick_id=1, controls={"keys": ["d"]})
                await doomed.send(type="tick", tick_id=1, controls={"fail": True})
                await c.send(type="tick", tick_id=1)
                await wait_stats(server, lambda s: s["queue"]["depth"] == 3)
                pipeline.gate.set()
                await blocker.recv_chunk()
                seen: dict[str, list[Any]] = {"a": [await a.recv_chunk()], "c": [await c.recv_chunk()]}
                seen["doomed"] = [await doomed.recv_json()]
                await doomed.send(type="tick", tick_id=2)
                seen["doomed"].append(await doomed.recv_json())
                for name, client in (("a", a), ("c", c)):
                    await client.send(type="tick", tick_id=2)
                    seen[name].append(await client.recv_chunk())
                ids = [client.ready["session_id"] for client in (a, doomed, c) if client.ready]
                seen["ids"] = ids
                return seen

        seen = asyncio.run(scenario())
        a_id, doomed_id, c_id = seen["ids"]
        assert [a_id, doomed_id, c_id] in pipeline.batches
        for name in ("a", "c"):
            chunks = [chunk for chunk, _ in seen[name]]
            assert [(m["tick_id"], m["chunk_index"], m["restarted"]) for m in chunks] == [(1, 1, None), (2, 2, None)]
            # G is the frame's absolute position: the sessions' chunks follow on from their histories
            positions = [int(pixels[0, 0, 1]) for _, frames in seen[name] for _, pixels in frames]
            assert positions == [2, 3, 4, 5]
        a_keys = [int(pixels[0, 0, 2]) for _, pixels in seen["a"][0][1]]
        assert a_keys == [controls_code({"keys": ["d"]})] * 2
        failed, skipped = seen["doomed"]
        assert (failed["type"], failed["code"], failed["tick_id"]) == ("error", "session_failed", 1)
        assert (skipped["code"], skipped["tick_id"]) == ("session_failed", 2)
        stats = server.stats()
        assert stats["sessions"]["failures_total"] == failures_before + 1
        server.settled(start_free)

"""Resume after a dropped connection (PROTOCOL.md), over a real server and real ``websockets`` clients.

fake-kv is deterministic and each frame's value depends on every frame its
rollout has seen and on the controls, so a resumed rollout that continues
the pre-drop one paints exactly the frames an uninterrupted session paints
at the same chunk indexes. A drop is ``transport.abort()``: TCP goes away
without a close frame.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import ClientConnection, connect

from arstream.programs.client import RunResult, run_script
from arstream.programs.client_lib import ConnectionDropped
from arstream.models.fake import FakeKVPipeline, controls_code
from arstream.runner.runner import WARMUP_SESSION_ID
from arstream.runner.types import TickRequest
from servers import GatedFakePipeline, LiveServer, ProbeClient, fake_settings, running_server, session_client

GRACE_S = 30.0
SEED = 7
HELD = {"keys": ["d"]}


def resume_settings(**overrides: Any) -> Any:
    values: dict[str, Any] = {"replica_id": "r0", "resume_grace_s": GRACE_S}
    values.update(overrides)
    return fake_settings(**values)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server(resume_settings()) as live:
        yield live


def resume_url(server: LiveServer, token: str) -> str:
    return f"{server.ws_url}?resume={token}"


async def connect_resume(server: LiveServer, token: str) -> ClientConnection:
    return await connect(resume_url(server, token), compression=None, max_size=None, proxy=None)


async def chunk_frames(client: ProbeClient) -> tuple[dict[str, Any], list[np.ndarray]]:
    chunk, frames = await client.recv_chunk()
    return chunk, [pixels for _header, pixels in frames]


async def reference_rollout(server: LiveServer, chunks: int) -> list[list[np.ndarray]]:
    """The frames of an uninterrupted session holding ``HELD``, by chunk index."""
    async with session_client(server.ws_url, start={"codec": "raw", "seed": SEED}) as client:
        frames = []
        for tick_id in range(chunks):
            await client.send(type="tick", tick_id=tick_id, controls=HELD if tick_id == 0 else None)
            chunk, pixels = await chunk_frames(client)
            assert chunk["chunk_index"] == tick_id
            frames.append(pixels)
        await client.send(type="close")
        await client.closed_by_server()
    return frames


async def expect_fatal(client: ProbeClient, code: str, close_code: int) -> dict[str, Any]:
    closed = await client.closed_by_server()
    assert closed.code == close_code, closed
    errors = [m for m in closed.messages if m["type"] == "error"]
    assert len(errors) == 1 and errors[0]["code"] == code and errors[0]["fatal"] is True, closed.messages
    return errors[0]


async def try_resume(server: LiveServer, token: str, *, url_token: str | None = None) -> dict[str, Any]:
    """Resume with ``token`` and expect resume_failed (4002); returns the error message."""
    async with session_client(resume_url(server, url_token or token)) as client:
        await client.send(type="start", resume=token)
        return await expect_fatal(client, "resume_failed", 4002)


async def detached_session(server: LiveServer, chunks: int) -> tuple[str, str]:
    """A session that ran ``chunks`` chunks holding ``HELD`` and then lost its TCP connection."""
    async with session_client(server.ws_url, start={"codec": "raw", "seed": SEED}) as client:
        assert client.ready is not None
        for tick_id in range(chunks):
            await client.send(type="tick", tick_id=tick_id, controls=HELD if tick_id == 0 else None)
            await client.recv_chunk()
        client.abort()
    await asyncio.to_thread(server.wait_for_stats, lambda s: s["sessions"]["detached"] == 1)
    return client.ready["session_id"], client.ready["resume"]["token"]


# ---- resuming -----------------------------------------------------------------------------


def test_ready_carries_a_ticket_and_stats_count_detached(server: LiveServer, baseline: int) -> None:
    async def scenario() -> None:
        async with session_client(server.ws_url, start={}) as client:
            assert client.ready is not None
            ticket = client.ready["resume"]
            assert ticket["grace_s"] == GRACE_S and ticket["next_chunk_index"] == 0
            token = ticket["token"]
            assert token.startswith("r0.") and len(token) >= len("r0.") + 43  # 32 random bytes, base64
            assert "resumed" not in client.ready
            client.abort()
        stats = await asyncio.to_thread(server.wait_for_stats, lambda s: s["sessions"]["detached"] == 1)
        assert stats["sessions"]["connected"] == 0
        assert "arstream_sessions_detached 1.0" in server.get("/metrics").text
        async with session_client(resume_url(server, token), start={"resume": token}) as client:
            await client.send(type="close")
            await client.closed_by_server()

    asyncio.run(scenario())


def test_drop_and_resume_continues_the_same_rollout(server: LiveServer, baseline: int) -> None:
    k, total = 3, 6

    async def scenario() -> None:
        reference = await reference_rollout(server, total)
        async with session_client(server.ws_url, start={"codec": "raw", "seed": SEED}) as client:
            assert client.ready is not None
            session_id, token = client.ready["session_id"], client.ready["resume"]["token"]
            await client.send(type="input", event_id=5, controls=HELD)
            assert (await client.recv_json())["type"] == "ack"
            for tick_id in range(k):
                await client.send(type="tick", tick_id=tick_id)
                chunk, frames = await chunk_frames(client)
                assert np.array_equal(np.stack(frames), np.stack(reference[tick_id]))
            client.abort()
        await asyncio.to_thread(server.wait_for_stats, lambda s: s["sessions"]["detached"] == 1)

        async with session_client(resume_url(server, token), start={"resume": token, "codec": "raw"}) as client:
            ready = client.ready
            assert ready is not None
            assert ready["session_id"] == session_id and ready["resumed"] is True
            assert ready["resume"]["next_chunk_index"] == k
            assert ready["resume"]["token"] != token and ready["resume"]["token"].startswith("r0.")
            # The floors stayed: ids must keep increasing past them.
            await client.send(type="tick", tick_id=k - 1)
            stale = await client.recv_json()
            assert stale["code"] == "stale_tick", stale
            await client.send(type="input", event_id=5)
            assert (await client.recv_json()) == {"type": "ack", "event_id": 5, "status": "duplicate"}
            for tick_id in range(k, total):
                await client.send(type="tick", tick_id=tick_id)  # no controls: the held "d" must still apply
                chunk, frames = await chunk_frames(client)
                assert chunk["chunk_index"] == tick_id and chunk["restarted"] is None, chunk
                assert np.array_equal(np.stack(frames), np.stack(reference[tick_id])), f"chunk {tick_id} differs"
            await client.send(type="close")
            closed = await client.closed_by_server()
            assert closed.messages[-1] == {"type": "closed", "reason": "client"}

    asyncio.run(scenario())


def test_ticks_in_flight_at_the_drop_are_dropped_and_the_ticket_says_where_it_continues() -> None:
    pipeline = GatedFakePipeline()
    with running_server(resume_settings(), pipeline) as server:
        start_free = server.stats()["kv"]["blocks_free"]

        async def scenario() -> list[np.ndarray]:
            async with session_client(server.ws_url, start={"codec": "raw", "seed": SEED}) as client:
                assert client.ready is not None
                token = client.ready["resume"]["token"]
                for tick_id in range(3):
                    await client.send(type="tick", tick_id=tick_id, controls=HELD if tick_id == 0 else None)
                await asyncio.to_thread(pipeline.waiting.wait, 30)  # tick 0 runs; ticks 1 and 2 are queued
                client.abort()
            await asyncio.to_thread(server.wait_for_stats, lambda s: s["sessions"]["detached"] == 1)
            pipeline.gate.set()  # tick 0 completes (the rollout moves on), its chunk goes nowhere
            async with session_client(resume_url(server, token), start={"resume": token, "codec": "raw"}) as client:
                assert client.ready is not None and client.ready["resume"]["next_chunk_index"] == 1
                await client.send(type="tick", tick_id=3)
                chunk, frames = await chunk_frames(client)
                assert (chunk["tick_id"], chunk["chunk_index"], chunk["restarted"]) == (3, 1, None)
                await client.send(type="close")
                await client.closed_by_server()
            return frames

        frames = asyncio.run(scenario())
        reference = asyncio.run(reference_rollout(server, 2))
        assert np.array_equal(np.stack(frames), np.stack(reference[1]))
        server.settled(start_free)


def test_controls_of_a_dropped_tick_and_a_pending_input_event_survive_the_drop() -> None:
    pipeline = GatedFakePipeline()
    with running_server(resume_settings(), pipeline) as server:
        start_free = server.stats()["kv"]["blocks_free"]

        async def resumed(token: str) -> ProbeClient:
            client = ProbeClient(await connect_resume(server, token))
            await client.start(resume=token, codec="raw")
            return client

        async def scenario() -> None:
            async with session_client(server.ws_url, start={"codec": "raw"}) as client:
                assert client.ready is not None
                token = client.ready["resume"]["token"]
                await client.send(type="tick", tick_id=0, controls=HELD)
                await asyncio.to_thread(pipeline.waiting.wait, 30)  # tick 0 runs
                await client.send(type="tick", tick_id=1, controls={"keys": ["w"]})  # queued: dropped, controls kept
                client.abort()
            await asyncio.to_thread(server.wait_for_stats, lambda s: s["sessions"]["detached"] == 1)
            pipeline.gate.set()
            client = await resumed(token)
            try:
                await client.send(type="tick", tick_id=2)
                chunk, frames = await chunk_frames(client)
                assert chunk["applied_event_ids"] == [] and chunk["chunk_index"] == 1
                assert all((pixels[:, :, 2] == controls_code({"keys": ["w"]})).all() for pixels in frames)
                # An input event that arrived but had not been applied when the connection dropped ...
                await client.send(type="input", event_id=5, controls={"keys": ["s"]})
                assert (await client.recv_json())["status"] == "accepted"
                assert client.ready is not None
                token = client.ready["resume"]["token"]
                client.abort()
            finally:
                await client.ws.close()
            await asyncio.to_thread(server.wait_for_stats, lambda s: s["sessions"]["detached"] == 1)
            client = await resumed(token)
            try:
                # ... is applied by the next chunk after the resume, and listed there.
                await client.send(type="tick", tick_id=3)
                chunk, frames = await chunk_frames(client)
                assert chunk["applied_event_ids"] == [5] and chunk["chunk_index"] == 2
                assert all((pixels[:, :, 2] == controls_code({"keys": ["s"]})).all() for pixels in frames)
                await client.send(type="close")
                await client.closed_by_server()
            finally:
                await client.ws.close()

        asyncio.run(scenario())
        server.settled(start_free)


def test_resume_by_url_alone_and_a_new_codec() -> None:
    with running_server(resume_settings()) as server:
        start_free = server.stats()["kv"]["blocks_free"]

        async def scenario() -> None:
            session_id, token = await detached_session(server, 1)
            async with session_client(resume_url(server, token), start={"codec": "jpeg"}) as client:
                assert client.ready is not None
                assert client.ready["session_id"] == session_id and client.ready["codec"] == "jpeg"
                await client.send(type="tick", tick_id=1)
                chunk, _ = await client.recv_chunk()
                assert chunk["chunk_index"] == 1
                await client.send(type="close")
                await client.closed_by_server()

        asyncio.run(scenario())
        server.settled(start_free)


# ---- refusals -------------------------------------------------------------------------------


def test_forged_malformed_and_other_replica_tokens_fail_and_spend_nothing(server: LiveServer, baseline: int) -> None:
    async def scenario() -> None:
        session_id, token = await detached_session(server, 2)
        random_part = token.split(".", 1)[1]
        refusals = [
            await try_resume(server, "r0." + secrets.token_urlsafe(32)),  # forged
            await try_resume(server, "not-a-token"),  # malformed
            await try_resume(server, "r1." + random_part),  # another replica's prefix
            await try_resume(server, "r0." + random_part[:-1]),  # one character short
            await try_resume(server, token, url_token="r0." + secrets.token_urlsafe(32)),  # URL and start disagree
        ]
        assert "replica 'r1'" in refusals[2]["message"]
        assert server.stats()["sessions"]["detached"] == 1
        # None of that spent the real ticket (a negative control for the refusals above).
        async with session_client(resume_url(server, token), start={"resume": token}) as client:
            assert client.ready is not None and client.ready["session_id"] == session_id
            await client.send(type="close")
            await client.closed_by_server()

    asyncio.run(scenario())


def test_a_token_is_good_for_one_resume(server: LiveServer, baseline: int) -> None:
    async def scenario() -> None:
        session_id, first = await detached_session(server, 1)
        async with session_client(resume_url(server, first), start={"resume": first}) as client:
            assert client.ready is not None
            second = client.ready["resume"]["token"]
            client.abort()
        await asyncio.to_thread(server.wait_for_stats, lambda s: s["sessions"]["detached"] == 1)
        await try_resume(server, first)
        async with session_client(resume_url(server, second), start={"resume": second}) as client:
            assert client.ready is not None and client.ready["session_id"] == session_id
            await client.send(type="close")
            await client.closed_by_server()
        # Closed on purpose: the last ticket died with it.
        await try_resume(server, client.ready["resume"]["token"])

    asyncio.run(scenario())


def test_resume_after_the_grace_period_fails_and_the_kv_is_back() -> None:
    with running_server(resume_settings(resume_grace_s=0.2)) as server:
        start_free = server.stats()["kv"]["blocks_free"]

        async def scenario() -> None:
            async with session_client(server.ws_url, start={}) as client:
                assert client.ready is not None
                token = client.ready["resume"]["token"]
                await client.send(type="tick", tick_id=0)
                await client.recv_chunk()
                client.abort()
            # Detached, then released when the grace period ends.
            await asyncio.to_thread(server.settled, start_free)
            error = await try_resume(server, token)
            assert "unknown resume token" in error["message"]

        asyncio.run(scenario())
        server.settled(start_free)


def test_resume_disabled_releases_on_drop_and_refuses_tokens() -> None:
    with running_server(resume_settings(resume_grace_s=0)) as server:
        start_free = server.stats()["kv"]["blocks_free"]

        async def scenario() -> None:
            async with session_client(server.ws_url, start={}) as client:
                assert client.ready is not None and "resume" not in client.ready
                await client.send(type="tick", tick_id=0)
                await client.recv_chunk()
                client.abort()
            await asyncio.to_thread(server.settled, start_free)
            error = await try_resume(server, "r0." + secrets.token_urlsafe(32))
            assert "disabled" in error["message"]

        asyncio.run(scenario())
        server.settled(start_free)


def test_a_session_that_closed_or_is_closing_cannot_be_resumed(server: LiveServer, baseline: int) -> None:
    async def scenario() -> None:
        async with session_client(server.ws_url, start={}) as client:
            assert client.ready is not None
            token = client.ready["resume"]["token"]
            await client.send(type="tick", tick_id=0, close=True)
            await client.recv_chunk()
            client.abort()  # dropped after a close: true tick: ended, not detached
        await asyncio.to_thread(server.wait_for_stats, lambda s: s["sessions"]["connected"] == 0)
        assert server.stats()["sessions"]["detached"] == 0
        await try_resume(server, token)

    asyncio.run(scenario())


def test_a_resume_needs_the_auth_token_when_one_is_configured() -> None:
    with running_server(resume_settings(auth_token="s3cret")) as server:
        start_free = server.stats()["kv"]["blocks_free"]
        authorized = [("Authorization", "Bearer s3cret")]

        async def scenario() -> None:
            async with session_client(server.ws_url, start={}, headers=authorized) as client:
                assert client.ready is not None
                session_id, token = client.ready["session_id"], client.ready["resume"]["token"]
                client.abort()
            await asyncio.to_thread(server.wait_for_stats, lambda s: s["sessions"]["detached"] == 1)
            async with session_client(resume_url(server, token)) as stranger:  # refused before any start
                await expect_fatal(stranger, "unauthorized", 1008)
            # The refused attempt did not spend the ticket.
            async with session_client(resume_url(server, token), start={"resume": token}, headers=authorized) as client:
                assert client.ready is not None and client.ready["session_id"] == session_id
                await client.send(type="close")
                await client.closed_by_server()

        asyncio.run(scenario())
        server.settled(start_free)


# ---- takeover and capacity ------------------------------------------------------------------


def test_resuming_a_live_session_takes_it_over(server: LiveServer, baseline: int) -> None:
    async def scenario() -> None:
        reference = await reference_rollout(server, 3)
        async with session_client(server.ws_url, start={"codec": "raw", "seed": SEED}) as old:
            assert old.ready is not None
            token = old.ready["resume"]["token"]
            await old.send(type="tick", tick_id=0, controls=HELD)
            await old.recv_chunk()
            # The old socket looks alive to the server (half-open from the client's side).
            async with session_client(resume_url(server, token), start={"resume": token, "codec": "raw"}) as new:
                assert new.ready is not None and new.ready["resumed"] is True
                assert new.ready["session_id"] == old.ready["session_id"]
                assert new.ready["resume"]["next_chunk_index"] == 1
                closed = await old.closed_by_server()
                assert closed.code == 4003
                assert [m["type"] for m in closed.messages] == ["error", "closed"]
                assert closed.messages[0]["code"] == "taken_over" and closed.messages[0]["fatal"] is True
                assert closed.messages[1] == {"type": "closed", "reason": "taken_over"}
                stats = server.stats()["sessions"]
                assert (stats["connected"], stats["detached"]) == (1, 0)
                for tick_id in (1, 2):
                    await new.send(type="tick", tick_id=tick_id)
                    chunk, frames = await chunk_frames(new)
                    assert chunk["chunk_index"] == tick_id and chunk["restarted"] is None
                    assert np.array_equal(np.stack(frames), np.stack(reference[tick_id]))
                await new.send(type="close")
                await new.closed_by_server()

    asyncio.run(scenario())


def test_detached_session_gives_its_slot_to_a_new_session() -> None:
    with running_server(resume_settings(model_options={"session_capacity": 2})) as server:
        start_free = server.stats()["kv"]["blocks_free"]

        async def scenario() -> None:
            _, token = await detached_session(server, 2)
            async with session_client(server.ws_url, start={}) as b:
                await b.send(type="tick", tick_id=0)
                await b.recv_chunk()
                assert server.stats()["sessions"]["detached"] == 1  # a free slot: nobody had to give way
                async with session_client(server.ws_url, start={}) as c:
                    await c.send(type="tick", tick_id=0)
                    await c.recv_chunk()
                    stats = server.stats()
                    assert (stats["sessions"]["connected"], stats["sessions"]["detached"]) == (2, 0)
                    assert stats["sessions"]["evictions_total"] == 0  # released, not LRU-evicted
                    error = await try_resume(server, token)
                    assert "unknown resume token" in error["message"]
                    async with session_client(server.ws_url) as d:
                        await d.send(type="start")
                        await expect_fatal(d, "over_capacity", 1013)
                    for client in (b, c):
                        await client.send(type="close")
                        await client.closed_by_server()

        asyncio.run(scenario())
        server.settled(start_free)


def test_shutdown_releases_detached_sessions() -> None:
    with running_server(resume_settings()) as server:
        start_free = server.stats()["kv"]["blocks_free"]
        asyncio.run(detached_session(server, 2))
        assert server.server is not None
        hub = server.server.hub
        worker = hub.worker
        assert worker is not None
    # The server has stopped: the worker ran the release before it ended.
    assert hub.resume.detached_count == 0
    assert worker.runtime is not None and worker.runtime.stats().blocks_free == start_free


def test_tokens_are_never_logged_whole(server: LiveServer, baseline: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="arstream")
    caplog.set_level(logging.INFO, logger="uvicorn.error")  # uvicorn logs every WebSocket's path and query

    async def scenario() -> list[str]:
        _, first = await detached_session(server, 1)
        await try_resume(server, "r0." + first.split(".", 1)[1][::-1])
        async with session_client(resume_url(server, first), start={"resume": first}) as client:
            assert client.ready is not None
            second = client.ready["resume"]["token"]
            await client.send(type="close")
            await client.closed_by_server()
        return [first, second]

    tokens = asyncio.run(scenario())
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "resumed with token r0." in logged  # the hints are there ...
    assert '"WebSocket /v1/sessions?resume=' in logged  # uvicorn's line, its query redacted
    for token in tokens:
        assert token.split(".", 1)[1][:12] not in logged  # ... the tokens are not


# ---- the example client ---------------------------------------------------------------------


class PausingFakePipeline(FakeKVPipeline):
    """fake-kv that holds the forward of tick ``pause_at`` until the test lets it go (once)."""

    def __init__(self, pause_at: int) -> None:
        super().__init__()
        self.pause_at = pause_at
        self.paused = threading.Event()
        self.proceed = threading.Event()

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        if tick.session_id != WARMUP_SESSION_ID and tick.request_id == self.pause_at and not self.paused.is_set():
            self.paused.set()
            if not self.proceed.wait(30):
                raise RuntimeError("the test never let the paused forward go")
        return super().generate_chunk(tick)


def drop_every_connection(server: LiveServer) -> None:
    """Abort each TCP connection on the server's side: the client sees a drop, no close frame."""
    assert server.server is not None
    for protocol in list(server.server.server_state.connections):
        protocol.loop.call_soon_threadsafe(protocol.transport.abort)


def test_client_resume_on_drop_prints_the_gap_and_keeps_the_world(capsys: pytest.CaptureFixture[str]) -> None:
    k, total = 3, 8
    pipeline = PausingFakePipeline(pause_at=k)
    with running_server(resume_settings(max_batch_sessions=1), pipeline) as server:
        start_free = server.stats()["kv"]["blocks_free"]

        async def dropped_run() -> RunResult:
            plan = [("d",)] * total
            run = asyncio.create_task(run_script(server.ws_url, plan, codec="raw", seed=SEED, resume_on_drop=True))
            await asyncio.to_thread(pipeline.paused.wait, 30)  # tick k runs; chunks before it are sent or on the way
            drop_every_connection(server)
            # The client resumes at once; the resume waits for the paused forward, so nobody is connected.
            await asyncio.to_thread(server.wait_for_stats, lambda s: s["sessions"]["connected"] == 0)
            pipeline.proceed.set()  # chunk k runs to the end and is never received
            return await run

        result = asyncio.run(dropped_run())
        gap = re.search(
            r"connection dropped after chunk (\d+); resumed session s-\w+ in \d+ ms at chunk (\d+) "
            r"\((\d+) chunk\(s\) generated but never received\)",
            capsys.readouterr().out,
        )
        assert gap is not None
        last, resumed_at, lost = map(int, gap.groups())
        assert last < k and resumed_at == k + 1 and lost == resumed_at - last - 1
        # The same world: chunks 0..last, then the chunks from resumed_at on, as an uninterrupted session paints them.
        indexes = [*range(last + 1), *range(resumed_at, resumed_at + total - last - 1)]
        reference = asyncio.run(run_script(server.ws_url, [("d",)] * (indexes[-1] + 1), codec="raw", seed=SEED))
        fpc = len(reference.frames) // (indexes[-1] + 1)
        expected = [frame for index in indexes for frame in reference.frames[index * fpc : (index + 1) * fpc]]
        assert result.closed_reason == "client"
        assert all(np.array_equal(got, want) for got, want in zip(result.frames, expected, strict=True))
        server.settled(start_free)


def test_client_without_resume_on_drop_reports_the_drop() -> None:
    pipeline = PausingFakePipeline(pause_at=1)
    with running_server(resume_settings(), pipeline) as server:

        async def dropped_run() -> None:
            run = asyncio.create_task(run_script(server.ws_url, [()] * 4, codec="raw"))
            await asyncio.to_thread(pipeline.paused.wait, 30)
            drop_every_connection(server)
            pipeline.proceed.set()
            with pytest.raises(ConnectionDropped):
                await run

        asyncio.run(dropped_run())

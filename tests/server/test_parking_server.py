"""Parking over a real server (uvicorn in-process, fake-kv, real WebSocket clients).

A pool of N resident slots serves 10N sessions that take turns: every chunk
equals an uninterrupted session's, none ends, /v1/stats and /metrics count
resident and parked sessions, and closing them all leaves the pool and the
lot empty. A replica holding parked (and detached) sessions drains to a peer:
each continues there bit-identically.
"""

from __future__ import annotations

import asyncio
import re
from contextlib import AsyncExitStack
from typing import Any

import numpy as np

from arstream.models.fake import FakeKVPipeline
from arstream.runner.pool import budget_for_sessions
from arstream.runner.runner import rewind_for
from servers import running_server, session_client, wait_until
from test_balancer import agent_line
from test_drain_sessions import continue_on_peer, detach, moved_message, tick_through
from test_migration import KEYS, MOVE_AT, SEED, cluster_settings, drain, frames_of, reference

SLOTS = 2
PARK_BUDGET_BYTES = 64 * 2**20
# one client address opens every session here
OPEN_CAPS: dict[str, Any] = {
    "max_sessions_per_client": None,
    "max_unstarted_connections_per_client": None,
    "max_connections_per_client": None,
    "connection_rate_per_client": None,
}


def pool_budget(settings: Any, slots: int) -> int:
    """The KV budget whose pool holds exactly ``slots`` sessions with the server's rewind schedule."""
    pipeline = FakeKVPipeline(**settings.model_options)
    rewind = rewind_for(pipeline, seconds=settings.rewind_seconds, budget_bytes=settings.rewind_budget_bytes())
    return budget_for_sessions(pipeline.kv_cache_spec(), slots, max_batch_sessions=1, rewind=rewind)


def parking_settings(replica: str, slots: int) -> Any:
    probe = cluster_settings(replica)
    return cluster_settings(
        replica,
        kv_budget_bytes=pool_budget(probe, slots),
        park_budget_bytes=PARK_BUDGET_BYTES,
        agent_port=0,
        **OPEN_CAPS,
    )


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


def test_n_slots_serve_10n_sessions_taking_turns_and_none_ends() -> None:
    with running_server(parking_settings("r0", SLOTS)) as server:
        blocks_free = server.stats()["kv"]["blocks_free"]

        async def scenario() -> None:
            want = await reference(server)
            async with AsyncExitStack() as stack:
                start = {"codec": "raw", "seed": SEED}
                clients = [
                    await stack.enter_async_context(session_client(server.ws_url, start=start)) for _ in range(10 * SLOTS)
                ]
                for tick_id in range(MOVE_AT + 2):
                    for client in clients:  # every session's next chunk in turn: each restore parks another
                        await client.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
                        chunk, got = await frames_of(client)
                        assert chunk["chunk_index"] == tick_id and chunk["restarted"] is None, chunk
                        assert np.array_equal(got, want[tick_id])
                stats = server.stats()
                parking = stats["parking"]
                assert parking["resident_capacity"] == SLOTS and parking["sessions_resident"] == SLOTS
                assert parking["sessions_parked"] == 10 * SLOTS - SLOTS and parking["parked_bytes"] > 0
                assert parking["restores_total"] > 0 and parking["restore_failures_total"] == 0
                assert stats["kv"]["session_capacity"] == SLOTS + parking["park_capacity"] >= 10 * SLOTS
                assert stats["sessions"]["evictions_total"] == 0 and stats["sessions"]["connected"] == 10 * SLOTS
                # the HAProxy agent offers the slots parking makes: more sessions than the pool holds are admitted
                free = stats["kv"]["session_capacity"] - 10 * SLOTS
                assert agent_line(server) == f"up 100% maxconn:{free}\n"
                text = server.get("/metrics").text
                assert metric(text, "arstream_sessions_parked") == 10 * SLOTS - SLOTS
                assert metric(text, "arstream_resident_capacity") == SLOTS
                for client in clients:
                    await client.send(type="close")
                    await client.closed_by_server()

        asyncio.run(scenario())
        server.settled(blocks_free)
        assert server.stats()["parking"]["sessions_parked"] == 0


def test_a_replica_holding_parked_sessions_drains_them_all_to_a_peer() -> None:
    with running_server(parking_settings("r0", 1)) as r0, running_server(cluster_settings("r1")) as r1:

        async def scenario() -> None:
            want = await reference(r1)
            async with AsyncExitStack() as stack:
                start = {"codec": "raw", "seed": SEED}
                live = [await stack.enter_async_context(session_client(r0.ws_url, start=start)) for _ in range(3)]
                dropped = await stack.enter_async_context(session_client(r0.ws_url, start=start))
                for client in live:
                    await tick_through(client, range(MOVE_AT), want)
                old_token = await detach(r0, dropped, MOVE_AT, want)
                # one slot, four sessions: the three live ones took turns (two parked), the detached one is parked too
                await asyncio.to_thread(wait_until, lambda: r0.stats()["parking"]["sessions_parked"] == 4)
                assert r0.stats()["parking"]["sessions_resident"] == 0
                ids = [c.ready["session_id"] for c in (*live, dropped) if c.ready]

                response = await asyncio.to_thread(drain, r0, [r1.base_url])
                assert response.status_code == 200, response.text
                report = response.json()
                assert report["moved"] == 4 and report["ended"] == 0, report
                for index, client in enumerate(live):
                    moved = await moved_message(client)
                    assert moved["next_chunk_index"] == MOVE_AT
                    await continue_on_peer(r1, moved, ids[index], want)
                # the detached one, parked when the drain began, comes back to r0 and is sent on to r1
                async with session_client(f"{r0.ws_url}?resume={old_token}") as late:
                    await late.send(type="start", resume=old_token, codec="raw")
                    moved = await moved_message(late)
                assert moved["next_chunk_index"] == MOVE_AT
                await continue_on_peer(r1, moved, ids[3], want)

        asyncio.run(scenario())
        assert r0.stats()["parking"]["sessions_parked"] == 0


def test_a_detached_session_is_parked_and_its_resume_restores_it_bit_identically() -> None:
    with running_server(parking_settings("r0", 1)) as server:
        blocks_free = server.stats()["kv"]["blocks_free"]

        async def scenario() -> None:
            want = await reference(server)
            async with session_client(server.ws_url, start={"codec": "raw", "seed": SEED}) as dropped:
                token = await detach(server, dropped, MOVE_AT, want)
            await asyncio.to_thread(wait_until, lambda: server.stats()["parking"]["sessions_parked"] == 1)
            assert server.stats()["parking"]["sessions_resident"] == 0
            async with session_client(f"{server.ws_url}?resume={token}", start={"resume": token, "codec": "raw"}) as back:
                assert back.ready is not None and back.ready["resumed"] is True
                assert back.ready["resume"]["next_chunk_index"] == MOVE_AT
                await tick_through(back, range(MOVE_AT, len(KEYS)), want)
                assert server.stats()["parking"]["restores_total"] == 1
                await back.send(type="close")
                await back.closed_by_server()

        asyncio.run(scenario())
        server.settled(blocks_free)


def test_a_quiet_server_parks_a_session_idle_past_park_after_s() -> None:
    """No tick, no other session, no job at all: the idle session still goes to host memory, and its next tick
    restores it (the worker alone checks only after a job)."""
    with running_server(cluster_settings("r0", park_budget_bytes=PARK_BUDGET_BYTES, park_after_s=0.2)) as server:
        blocks_free = server.stats()["kv"]["blocks_free"]

        async def scenario() -> None:
            want = await reference(server)
            async with session_client(server.ws_url, start={"codec": "raw", "seed": SEED}) as idle:
                await tick_through(idle, range(MOVE_AT), want)
                await asyncio.to_thread(wait_until, lambda: server.stats()["parking"]["sessions_parked"] == 1)
                assert server.stats()["parking"]["restores_total"] == 0
                await tick_through(idle, range(MOVE_AT, len(KEYS)), want)  # restored, frames as if never parked
                assert server.stats()["parking"]["restores_total"] == 1
                await idle.send(type="close")
                await idle.closed_by_server()

        asyncio.run(scenario())
        server.settled(blocks_free)

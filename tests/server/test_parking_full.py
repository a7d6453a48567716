"""Parking with every slot and every park place held (uvicorn in-process, fake-kv, real WebSocket clients).

Two resident slots and room to park nine: eleven sessions, each held by its
connection, tick at once. A parked session's tick swaps with the least
recently used resident one (that one is parked, this one restored): no
session is evicted, every chunk equals an uninterrupted session's, and a
twelfth session is refused while the eleven hold every place.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any

import numpy as np

from servers import ProbeClient, running_server, session_client
from test_admission import refusal_of_one_more
from test_migration import KEYS, SEED, frames_of, reference
from test_parking_server import parking_settings, pool_budget

SLOTS = 2
PARKED = 9


def full_lot_settings() -> Any:
    """A pool of SLOTS sessions and a host park budget of exactly PARKED sessions' worst case."""
    probe = parking_settings("r0", SLOTS)
    per_session = pool_budget(probe, SLOTS + 1) - pool_budget(probe, SLOTS)
    return probe.model_copy(update={"park_budget_bytes": PARKED * per_session})


async def play(client: ProbeClient, want: list[np.ndarray]) -> list[str | None]:
    """Every tick of the test's controls, one at a time; each chunk's ``restarted``."""
    restarted = []
    for tick_id, keys in enumerate(KEYS):
        await client.send(type="tick", tick_id=tick_id, controls={"keys": keys})
        chunk, got = await frames_of(client)
        restarted.append(chunk["restarted"])
        if restarted == [None] * len(restarted):  # an evicted world starts over: counted by the caller
            assert chunk["chunk_index"] == tick_id and np.array_equal(got, want[tick_id]), chunk
    return restarted


def test_a_parked_sessions_tick_swaps_with_a_resident_one_when_every_place_is_held() -> None:
    with running_server(full_lot_settings()) as server:
        blocks_free = server.stats()["kv"]["blocks_free"]
        assert server.stats()["parking"]["park_capacity"] == PARKED

        async def scenario() -> tuple[list[str | None], dict[str, Any]]:
            want = await reference(server)
            async with AsyncExitStack() as stack:
                start = {"codec": "raw", "seed": SEED}
                clients = [
                    await stack.enter_async_context(session_client(server.ws_url, start=start))
                    for _ in range(SLOTS + PARKED)
                ]
                await refusal_of_one_more(server.ws_url)  # every place is held
                played = await asyncio.gather(*(play(client, want) for client in clients))
                stats = server.stats()
                for client in clients:
                    await client.send(type="close")
                    await client.closed_by_server()
            return [reason for chunks in played for reason in chunks], stats

        restarted, stats = asyncio.run(scenario())
        assert restarted.count("evicted") == 0 and stats["sessions"]["evictions_total"] == 0
        assert restarted == [None] * len(restarted)
        assert stats["parking"]["sessions_parked"] == PARKED and stats["parking"]["restores_total"] > 0
        server.settled(blocks_free)
        assert server.stats()["parking"]["sessions_parked"] == 0

"""Parking under pressure: every slot and park place held, and spill files a killed process left.

Two resident slots and room to park nine (uvicorn in-process, fake-kv, real
WebSocket clients): eleven sessions, each held by its connection, tick at
once. A parked session's tick swaps with the least recently used resident one
(that one is parked, this one restored): no session is evicted, every chunk
equals an uninterrupted session's, and a twelfth session is refused while the
eleven hold every place.

A server process that spilled parked sessions to disk is SIGKILLed: its files
stay; the next server started on the directory removes them (files counted).
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import numpy as np

from servers import LiveServer, ProbeClient, running_server, server_process, session_client
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


def spill_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("parked-*.safetensors"))


async def spill_and_count(server: LiveServer, spill: Path, sessions: int, *, kill: bool = False) -> int:
    """SESSIONS sessions that each run one chunk and stay connected (so spilled: --park-after-s 0); the spill
    files counted while they are held. With ``kill`` the server is SIGKILLed while they are."""
    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(session_client(server.ws_url, start={})) for _ in range(sessions)]
        for client in clients:
            await client.send(type="tick", tick_id=0)
            await frames_of(client)
        await asyncio.to_thread(server.wait_for_stats, lambda s: s["parking"]["sessions_spilled"] == sessions)
        spilled = len(spill_files(spill))
        if kill:
            assert server.process is not None
            server.process.kill()  # SIGKILL: nothing of the server runs after it
            server.process.wait()
        for client in clients:
            client.abort()
    return spilled


def test_spill_files_a_killed_server_left_are_removed_when_the_next_one_starts(tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    not_ours = spill / "operator-notes.txt"  # a file of another naming stays
    not_ours.write_text("kept")
    args = ["--park-after-s", "0", "--park-spill-dir", str(spill), "--park-spill-budget-bytes", str(256 * 2**20)]
    with server_process(args) as first:
        assert asyncio.run(spill_and_count(first, spill, 3, kill=True)) == 3
    assert len(spill_files(spill)) == 3  # what the killed process left
    with server_process(args) as second:
        second.wait_ready()
        assert spill_files(spill) == [] and not_ours.read_text() == "kept"
        assert asyncio.run(spill_and_count(second, spill, 2)) == 2  # and it spills as before

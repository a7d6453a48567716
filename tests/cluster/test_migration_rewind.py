"""A moved session keeps its rewind points: after a drain, a rewind to a moment from before the move lands there.

Two real servers on loopback (tests/cluster/test_migration.py's): a session
plays on r0 past its live window, is drained to r1 (the streamed move:
app/migration.py, runner/snapshot_stream.py, runner/snapshot_rewind.py),
resumes there and rewinds to a boundary it held before the move, whose blocks
had slid out of the live window (so they travelled as the snapshot's
``rewind/kv``). Its frames equal those of the same rewind on a session that
never moved. A detached session parked in host memory moves from its parked
copy (runner/snapshot.py's ``export_parked``) with its points too.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from servers import LiveServer, ProbeClient, session_client, wait_until
from test_migration import SEED, drain, frames_of, two_replicas

KEYS = [["d"], ["w"], ["a"], [], ["s"], ["d", "w"], ["a"], ["w"], ["s", "d"], ["a"], ["d"], ["w"]]
PLAYED = 8  # chunks before the move: 16 frames, well past fake-kv's window of 6 (3 chunks)
BACK_TO = 2  # a boundary whose window had slid out of the live one before the move
AFTER = [["w", "a"], ["d"]]  # the controls after the rewind
PARKING = {"park_budget_bytes": 64 * 2**20, "park_after_s": 0.2}


async def play(client: ProbeClient, ticks: range) -> tuple[list[np.ndarray], dict[str, Any]]:
    frames: list[np.ndarray] = []
    chunk: dict[str, Any] = {}
    for tick_id in ticks:
        await client.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
        chunk, got = await frames_of(client)
        assert chunk["chunk_index"] == tick_id and chunk["restarted"] is None, chunk
        frames.append(got)
    return frames, chunk


async def rewind_and_play(client: ProbeClient, first_tick: int) -> list[np.ndarray]:
    """Rewind to BACK_TO, then one more chunk: the frames of both."""
    out = []
    for offset, keys in enumerate(AFTER):
        fields: dict[str, Any] = {"rewind_to": BACK_TO} if offset == 0 else {}
        await client.send(type="tick", tick_id=first_tick + offset, controls={"keys": keys}, **fields)
        chunk, got = await frames_of(client)
        assert chunk.get("type") == "chunk", chunk
        assert chunk["chunk_index"] == BACK_TO + offset, chunk
        assert chunk["restarted"] == ("rewind" if offset == 0 else None), chunk
        out.append(got)
    return out


async def unmoved(server: LiveServer) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The same session, never moved: its chunks and the same rewind's."""
    async with session_client(server.ws_url, start={"codec": "raw", "seed": SEED}) as client:
        played, _ = await play(client, range(PLAYED + 1))
        back = await rewind_and_play(client, PLAYED + 1)
        await client.send(type="close")
        await client.closed_by_server()
    return played, back


@pytest.mark.parametrize("how", ["live", "parked"])
def test_a_rewind_after_a_move_lands_on_a_point_held_before_it(how: str) -> None:
    both = PARKING if how == "parked" else None
    with two_replicas(both=both) as (r0, r1):

        async def scenario() -> None:
            want, want_back = await unmoved(r1)
            async with session_client(r0.ws_url, start={"codec": "raw", "seed": SEED}) as client:
                assert client.ready is not None
                played, chunk = await play(client, range(PLAYED))
                assert all(np.array_equal(a, b) for a, b in zip(played, want))
                held_before = chunk["rewind_held"]
                assert BACK_TO in held_before and held_before[0] < BACK_TO, chunk
                if how == "parked":
                    token = str(client.ready["resume"]["token"])
                    client.abort()
                    await asyncio.to_thread(wait_until, lambda: r0.stats()["parking"]["sessions_parked"] == 1)
                response = await asyncio.to_thread(drain, r0, [r1.base_url])
                assert response.status_code == 200 and response.json()["moved"] == 1, response.text
                if how == "live":
                    moved = (await client.closed_by_server()).messages[-2]
            if how == "parked":  # the dropped client comes back to r0 and is told where its world went
                async with session_client(f"{r0.ws_url}?resume={token}") as late:
                    await late.send(type="start", resume=token, codec="raw")
                    moved = (await late.closed_by_server()).messages[-2]
            assert moved["type"] == "moved" and moved["next_chunk_index"] == PLAYED, moved
            ticket = moved["resume"]
            async with session_client(f"{r1.ws_url}?resume={ticket}", start={"resume": ticket, "codec": "raw"}) as c:
                after, chunk = await play(c, range(PLAYED, PLAYED + 1))
                assert np.array_equal(after[0], want[PLAYED])
                # every point held before the move is held after it, and the one it moved from besides
                assert set(held_before) <= set(chunk["rewind_held"]), (held_before, chunk["rewind_held"])
                back = await rewind_and_play(c, PLAYED + 1)
                for got, expected in zip(back, want_back):
                    assert np.array_equal(got, expected), "the rewind after the move differs from the unmoved one"
                await c.send(type="close")
                await c.closed_by_server()

        asyncio.run(scenario())
        r0.settled(r0.stats()["kv"]["blocks_total"])
        r1.settled(r1.stats()["kv"]["blocks_total"])

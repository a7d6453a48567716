"""Rewind and branch over the wire (PROTOCOL.md, "Rewind, branch and watch"): a real server, real clients.

A reference session takes controls ``KEYS`` uninterrupted. A rewound session
takes other controls from chunk ``B`` on, then a tick with ``rewind_to: B``
and ``KEYS`` again: every chunk from ``B`` must carry the reference's frames
(raw codec: bit for bit). A branch from the reference's boundary ``B`` must
too, and the reference must go on as if nobody had branched. After every
session closes, the KV pool is back where it started.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from arstream.app.wire import decode_frame
from servers import LiveServer, ProbeClient, fake_settings, running_server, session_client


KEYS = [["d"], ["d"], ["w"], [], ["a", "s"], ["d"], ["w", "d"]]
OTHER = [["s", "a"], ["w"], ["a"], ["d", "w"], [], ["s"], ["a"]]
SEED = 1234
K = 4
# fake-kv and tiny-world play 8 chunks a second: a horizon of 3 chunks keeps exactly the last K boundaries
SECONDS = (K - 1) / 8
B = 3
MODELS = {"fake-kv": {"sink_frames": 1, "window_frames": 6, "frames_per_chunk": 2}, "tiny-world": {}}


@pytest.fixture(scope="module", params=sorted(MODELS))
def server(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    settings = fake_settings(
        model=request.param, model_options=MODELS[request.param], replica_id="r0", rewind_seconds=SECONDS
    )
    with running_server(settings) as live:
        yield live


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def chunk(client: ProbeClient, tick_id: int, keys: list[str], **fields: Any) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Send one tick and read its chunk (``viewers`` counts before it are passed over)."""
    await client.send(type="tick", tick_id=tick_id, controls={"keys": keys}, **fields)
    return await client_chunk(client)


async def client_chunk(client: ProbeClient) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The next chunk and its pixels, or an `error` (and no pixels)."""
    while True:
        message = await client.recv_json()
        if message["type"] == "error":
            return message, []
        if message["type"] != "chunk":
            continue
        pixels = []
        for _ in range(message["frames"]):
            raw = await client.recv()
            assert isinstance(raw, bytes)
            pixels.append(decode_frame(raw)[1])
        return message, pixels


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


async def reference(server: LiveServer, chunks: int) -> list[list[np.ndarray]]:
    async with session_client(server.ws_url, start={"seed": SEED, "codec": "raw"}) as client:
        frames = [(await chunk(client, i, KEYS[i]))[1] for i in range(chunks)]
        await client.send(type="close")
        await client.closed_by_server()
    return frames


def test_a_rewound_session_paints_the_uninterrupted_frames(server: LiveServer) -> None:
    async def scenario() -> None:
        baseline = server.stats()["kv"]["blocks_free"]
        expected = await reference(server, len(KEYS))
        async with session_client(server.ws_url, start={"seed": SEED, "codec": "raw"}) as client:
            assert client.ready is not None and client.ready["rewind_points"] == K
            tick_id = 0
            for index in range(B):
                header, frames = await chunk(client, tick_id, KEYS[index])
                tick_id += 1
                assert same(frames, expected[index]) and header["rewind_points"] == [max(0, index + 1 - K), index + 1]
            for index in range(B, B + 2):  # another way from B on
                header, frames = await chunk(client, tick_id, OTHER[index])
                tick_id += 1
                assert not same(frames, expected[index])
            header, frames = await chunk(client, tick_id, KEYS[B], rewind_to=B)
            tick_id += 1
            assert (header["chunk_index"], header["restarted"]) == (B, "rewind")
            assert same(frames, expected[B])
            for index in range(B + 1, len(KEYS)):
                header, frames = await chunk(client, tick_id, KEYS[index])
                tick_id += 1
                assert header["chunk_index"] == index and header["restarted"] is None
                assert same(frames, expected[index])
            # a boundary it no longer holds: refused for that tick only, the session goes on
            error, _ = await chunk(client, tick_id, KEYS[0], rewind_to=0)
            assert (error["type"], error["code"], error["fatal"], error["tick_id"]) == (
                "error", "rewind_unavailable", False, tick_id
            )
            header, _ = await chunk(client, tick_id + 1, KEYS[0])
            assert header["chunk_index"] == len(KEYS)
            await client.send(type="close")
            await client.closed_by_server()
        await asyncio.to_thread(server.settled, baseline)
        assert "arstream_rewinds_total 1.0" in server.get("/metrics").text

    run(scenario())


def test_a_branch_continues_from_the_boundary_and_the_source_goes_on_unaffected(server: LiveServer) -> None:
    async def scenario() -> None:
        baseline = server.stats()["kv"]["blocks_free"]
        expected = await reference(server, len(KEYS))
        async with session_client(server.ws_url, start={"seed": SEED, "codec": "raw"}) as source:
            assert source.ready is not None
            token = source.ready["share"]["token"]
            for index in range(B + 2):
                await chunk(source, index, KEYS[index])
            url = f"{server.ws_url}?share={token}"
            async with session_client(url, start={"branch": {"share": token, "chunk": B}, "codec": "raw"}) as branch:
                ready = branch.ready
                assert ready is not None and ready["branched_from"] == {"chunk": B}
                assert ready["session_id"] != source.ready["session_id"] and ready["share"]["token"] != token
                assert server.stats()["sessions"]["connected"] == 2
                for index in range(B, len(KEYS)):
                    header, frames = await chunk(branch, index, KEYS[index])
                    assert header["chunk_index"] == index and header["restarted"] is None
                    assert same(frames, expected[index])
                await branch.send(type="close")
                await branch.closed_by_server()
            for index in range(B + 2, len(KEYS)):  # the source, after its branch came and went
                header, frames = await chunk(source, index, KEYS[index])
                assert same(frames, expected[index])
            # a boundary the source does not hold: share_failed, and nothing is held for it
            async with session_client(url) as refused:
                await refused.send(type="start", branch={"share": token, "chunk": 0})
                closed = await refused.closed_by_server()
                assert closed.code == 4005 and closed.messages[0]["code"] == "share_failed"
                assert "chunk boundary 0 is not held" in closed.messages[0]["message"]
            await source.send(type="close")
            await source.closed_by_server()
        await asyncio.to_thread(server.settled, baseline)
        assert "arstream_branches_total 1.0" in server.get("/metrics").text

    run(scenario())


def test_a_branch_from_chunk_0_continues_the_rollout_and_is_no_restart(server: LiveServer) -> None:
    # `restarted` "evicted" means KV lost without being asked: a branch from the first boundary lost nothing.
    async def scenario() -> None:
        baseline = server.stats()["kv"]["blocks_free"]
        expected = await reference(server, 3)
        async with session_client(server.ws_url, start={"seed": SEED, "codec": "raw"}) as source:
            assert source.ready is not None
            token = source.ready["share"]["token"]
            for index in range(2):  # boundaries 0, 1 and 2 held
                await chunk(source, index, KEYS[index])
            url = f"{server.ws_url}?share={token}"
            async with session_client(url, start={"branch": {"share": token, "chunk": 0}, "codec": "raw"}) as branch:
                assert branch.ready is not None and branch.ready["branched_from"] == {"chunk": 0}
                for index in range(3):
                    header, frames = await chunk(branch, index, KEYS[index])
                    assert (header["chunk_index"], header["restarted"]) == (index, None)
                    assert same(frames, expected[index])
                await branch.send(type="close")
                await branch.closed_by_server()
            await source.send(type="close")
            await source.closed_by_server()
        await asyncio.to_thread(server.settled, baseline)

    run(scenario())


def test_a_branch_that_does_not_fit_is_over_capacity_and_holds_nothing() -> None:
    settings = fake_settings(model_options=MODELS["fake-kv"], replica_id="r0", rewind_seconds=SECONDS, max_sessions=1)
    with running_server(settings) as live:

        async def scenario() -> None:
            baseline = live.stats()["kv"]["blocks_free"]
            async with session_client(live.ws_url, start={"seed": SEED, "codec": "raw"}) as source:
                token = source.ready["share"]["token"]  # type: ignore[index]
                for index in range(B + 1):
                    await chunk(source, index, KEYS[index])
                async with session_client(f"{live.ws_url}?share={token}") as branch:
                    await branch.send(type="start", branch={"share": token, "chunk": B})
                    closed = await branch.closed_by_server()
                    assert closed.code == 1013 and closed.messages[0]["code"] == "over_capacity"
                assert live.stats()["kv"]["sessions_resident"] == 1
                await source.send(type="close")
                await source.closed_by_server()
            await asyncio.to_thread(live.settled, baseline)

        run(scenario())

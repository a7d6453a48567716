"""Moved sessions streaming in are bounded in number and pace (app/import_limits.py), against real servers.

A peer that sends its snapshot a byte at a time (never silent, never done)
is cut at ``import_piece_timeout_s`` with a 408, and the pool is back at its
baseline while its connection is still open. With ``max_parallel_imports``
uploads under way, one more is answered 503 with ``Retry-After`` before a
byte of it is read, and leaves the pool as it was; a draining replica that
meets that answer tries again and moves every session. Raw sockets play the
slow senders (httpx would send the body whole).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import AsyncExitStack, ExitStack
from typing import Any

import pytest

from arstream.models.fake import FakeKVPipeline
from arstream.runner.snapshot_stream import parse_snapshot, snapshot_bytes
from servers import LiveServer, running_server, session_client
from test_migration import SEED, _post_import, _snapshot_bytes, cluster_settings, drain
from test_migration_cut_short import at_baseline, blocks_taken_mid_stream, free_blocks, upload_head

PARALLEL = 2
PIECE_TIMEOUT_S = 1.0
# The slow sender dribbles what it kept back, a byte per DRIBBLE_S (6 s in all, 6 deadlines), never its last.
DRIBBLE_S = 0.1


@pytest.fixture(scope="module")
def peer() -> Iterator[LiveServer]:
    settings = cluster_settings(
        "r1", resume_grace_s=1.0, max_parallel_imports=PARALLEL, import_piece_timeout_s=PIECE_TIMEOUT_S
    )
    with running_server(settings) as server:
        yield server


def snapshot_of(session_id: str) -> bytes:
    """A fake-kv session's snapshot (the peer's config) under ``session_id``."""
    snapshot = parse_snapshot(_snapshot_bytes(FakeKVPipeline(window_frames=6)))
    snapshot.header["session"]["id"] = session_id
    return snapshot_bytes(snapshot)


# Bytes a held upload keeps back: its digest and a little KV (the header and most of the KV are sent).
KEPT_BACK = 64


def held_upload(server: LiveServer, data: bytes) -> socket.socket:
    """An upload that sends all but its last KEPT_BACK bytes, then waits (its import under way)."""
    sender = socket.create_connection(("127.0.0.1", server.port))
    sender.sendall(upload_head(data) + data[:-KEPT_BACK])
    return sender


def importing_now(server: LiveServer) -> int:
    assert server.server is not None and server.server.migration is not None
    return server.server.migration.import_slots.streaming


def test_a_sender_that_dribbles_its_snapshot_is_cut_at_the_piece_deadline(peer: LiveServer) -> None:
    """Old code reset a 30 s silence timer on every read: a byte every 100 ms held the blocks for as long as the
    sender liked (here: no answer while it dribbled). Now the piece's bytes must all come within
    import_piece_timeout_s."""
    free = free_blocks(peer)
    data = snapshot_of("s-00000000000000d1")
    with held_upload(peer, data) as sender:
        blocks_taken_mid_stream(peer, free)
        sender.setblocking(False)
        answer = b""
        for position in range(len(data) - KEPT_BACK, len(data) - 1):
            sender.send(data[position : position + 1])
            threading.Event().wait(DRIBBLE_S)
            try:
                answer = sender.recv(65536)
                break
            except BlockingIOError:
                continue
        assert answer.decode(errors="replace").startswith("HTTP/1.1 408"), answer
        at_baseline(peer, free)  # while the sender still holds its connection open
    assert _post_import(peer, data).status_code == 200  # the same snapshot, sent at once, is taken
    at_baseline(peer, free)


def test_one_import_past_the_cap_is_refused_with_retry_after_and_the_pool_stays(peer: LiveServer) -> None:
    free = free_blocks(peer)
    with ExitStack() as stack:
        for index in range(PARALLEL):
            stack.enter_context(held_upload(peer, snapshot_of(f"s-00000000000000a{index}")))
        peer.wait_for_stats(lambda _s: importing_now(peer) == PARALLEL)
        blocks_taken_mid_stream(peer, free)
        held = free_blocks(peer)
        one_more = snapshot_of("s-00000000000000b0")
        refused = _post_import(peer, one_more)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        assert "max_parallel_imports" in refused.json()["detail"]
        assert free_blocks(peer) == held and importing_now(peer) == PARALLEL
    at_baseline(peer, free)  # the held uploads' connections closed: their blocks are back
    assert _post_import(peer, one_more).status_code == 200  # tried again, it is taken
    at_baseline(peer, free)


def test_a_drain_meeting_a_full_peer_tries_again_and_moves_every_session() -> None:
    sessions = 3
    r1_settings = cluster_settings("r1", max_parallel_imports=1)
    with running_server(cluster_settings("r0")) as r0, running_server(r1_settings) as r1:
        assert r1.server is not None and r1.server.migration is not None
        slots = r1.server.migration.import_slots

        async def scenario() -> dict[str, Any]:
            async with AsyncExitStack() as stack:
                clients = [
                    await stack.enter_async_context(session_client(r0.ws_url, start={"codec": "raw", "seed": SEED}))
                    for _ in range(sessions)
                ]
                for client in clients:
                    await client.send(type="tick", tick_id=0)
                    await client.recv_chunk()
                holder = held_upload(r1, snapshot_of("s-00000000000000c0"))  # r1's one import slot is taken
                draining = asyncio.ensure_future(asyncio.to_thread(drain, r0, [r1.base_url]))
                await asyncio.to_thread(r1.wait_for_stats, lambda _s: slots.refused_total >= 1)
                holder.close()  # the slot comes free: the drain's next try is taken
                response = await draining
                assert response.status_code == 200, response.text
                for client in clients:
                    await client.closed_by_server()
                return dict(response.json())

        report = asyncio.run(scenario())
        assert report["moved"] == sessions and report["ended"] == 0, report
        assert slots.refused_total >= 1

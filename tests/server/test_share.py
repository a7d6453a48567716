"""Watch a session and pass its controller (PROTOCOL.md, "Rewind, branch and watch"), over a real server
and real ``websockets`` clients.

fake-kv paints each frame from everything its rollout has seen, so a viewer that gets the same pixels as the
player has been sent the player's chunks, not something like them.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from arstream.app.live_session import LiveSession
from arstream.app.outbox import VIEWER_CHUNK_BACKLOG
from arstream.app.protocol import (
    ErrorCode,
    PassControlMessage,
    ProtocolError,
    StartMessage,
    TickMessage,
    parse_client_message,
)
from arstream.app.codecs import FrameDecoder
from arstream.app.wire import decode_frame
from servers import (
    LiveServer,
    ProbeClient,
    fake_settings,
    next_of,
    running_server,
    session_client,
    share_url,
    wait_until,
)

SEED = 3
HELD = {"keys": ["d"]}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server(fake_settings(replica_id="r0", max_viewers_per_session=3)) as live:
        yield live


def run(coro: Any) -> Any:
    return asyncio.run(coro)




async def viewer_chunk(client: ProbeClient) -> tuple[dict[str, Any], list[np.ndarray]]:
    """A viewer's next chunk and its pixels (``viewers`` messages before it are passed over)."""
    header = await next_of(client, "chunk")
    frames = []
    for _ in range(header["frames"]):
        message = await client.recv()
        assert isinstance(message, bytes)
        frames.append(decode_frame(message)[1])
    return header, frames


async def tick(client: ProbeClient, tick_id: int) -> tuple[dict[str, Any], list[np.ndarray]]:
    await client.send(type="tick", tick_id=tick_id, controls=HELD)
    header = await next_of(client, "chunk")
    frames = []
    for _ in range(header["frames"]):
        message = await client.recv()
        assert isinstance(message, bytes)
        frames.append(decode_frame(message)[1])
    return header, frames


def test_a_viewer_gets_the_players_chunks_in_its_own_codec_and_the_count(server: LiveServer) -> None:
    async def scenario() -> None:
        async with session_client(server.ws_url, start={"seed": SEED, "codec": "raw"}) as player:
            ready = player.ready
            assert ready is not None and ready["role"] == "controller"
            token = ready["share"]["token"]
            assert token.startswith("r0.")
            async with session_client(share_url(server, token), start={"watch": token, "codec": "raw"}) as same, \
                    session_client(share_url(server, token), start={"watch": token, "codec": "jpeg"}) as other:
                for viewer in (same, other):
                    assert viewer.ready is not None
                    assert viewer.ready["role"] == "viewer" and viewer.ready["session_id"] == ready["session_id"]
                    assert viewer.ready["viewer_id"].startswith("v") and "share" not in viewer.ready
                assert same.ready["codec"] == "raw" and other.ready["codec"] == "jpeg"  # type: ignore[index]
                counted = await next_of(player, "viewers")
                while counted["count"] < 2:
                    counted = await next_of(player, "viewers")
                assert sorted(counted["ids"]) == sorted([same.ready["viewer_id"], other.ready["viewer_id"]])  # type: ignore[index]
                assert server.stats()["sessions"]["viewers"] == 2
                for tick_id in range(1, 4):
                    header, frames = await tick(player, tick_id)
                    same_header, same_frames = await viewer_chunk(same)
                    other_header, other_frames = await viewer_chunk(other)
                    for seen in (same_header, other_header):
                        assert seen["tick_id"] == tick_id and seen["chunk_index"] == header["chunk_index"]
                        assert seen["skipped_before"] == 0
                    assert all(np.array_equal(a, b) for a, b in zip(frames, same_frames, strict=True))
                    # JPEG is lossy: near the raw pixels, encoded once for that viewer's format
                    assert all(np.abs(a.astype(int) - b).mean() < 8 for a, b in zip(frames, other_frames, strict=True))
            counted = await next_of(player, "viewers")
            while counted["count"] > 0:
                counted = await next_of(player, "viewers")
            assert counted["ids"] == []

    run(scenario())


def test_a_viewer_may_not_tick_and_is_closed_when_the_session_ends(server: LiveServer) -> None:
    async def scenario() -> None:
        async with session_client(server.ws_url, start={"seed": SEED}) as player:
            token = player.ready["share"]["token"]  # type: ignore[index]
            async with session_client(share_url(server, token), start={"watch": token}) as viewer:
                await viewer.send(type="tick", tick_id=1, controls=HELD)
                error = await next_of(viewer, "error")
                assert (error["code"], error["fatal"], error["tick_id"]) == ("not_controller", False, 1)
                await viewer.send(type="pass_control", to="v00")
                assert (await next_of(viewer, "error"))["code"] == "not_controller"
                await viewer.send(type="ping", t=5)
                assert (await next_of(viewer, "pong"))["t"] == 5
                await player.send(type="close")
                closed = await viewer.closed_by_server()
                assert closed.code == 1000
                assert {"type": "closed", "reason": "session_ended"} in closed.messages
            async with session_client(share_url(server, token)) as late:
                await late.send(type="start", watch=token)
                refused = await late.closed_by_server()
                assert refused.code == 4005 and refused.messages[0]["code"] == "share_failed"

    run(scenario())


@pytest.mark.parametrize(
    "token, why",
    [("r0.not-a-token", "unknown share token"), ("r9.abcd", "belongs to replica 'r9'"), ("nodot", "malformed")],
)
def test_a_share_token_the_server_cannot_honour_is_share_failed(server: LiveServer, token: str, why: str) -> None:
    async def scenario() -> None:
        async with session_client(server.ws_url) as client:
            await client.send(type="start", watch=token)
            refused = await client.closed_by_server()
            assert refused.code == 4005
            assert refused.messages[0]["code"] == "share_failed" and why in refused.messages[0]["message"]

    run(scenario())


def test_viewers_past_max_viewers_per_session_are_refused(server: LiveServer) -> None:
    async def scenario() -> None:
        async with session_client(server.ws_url, start={"seed": SEED}) as player:
            token = player.ready["share"]["token"]  # type: ignore[index]
            url = share_url(server, token)
            async with session_client(url, start={"watch": token}), session_client(url, start={"watch": token}), \
                    session_client(url, start={"watch": token}):
                async with session_client(url) as fourth:
                    await fourth.send(type="start", watch=token)
                    refused = await fourth.closed_by_server()
                    assert refused.code == 1013 and "max_viewers_per_session 3" in refused.messages[0]["message"]

    run(scenario())


def test_control_passes_to_a_viewer_and_back(server: LiveServer) -> None:
    async def scenario() -> None:
        async with session_client(server.ws_url, start={"seed": SEED}) as player:
            token = player.ready["share"]["token"]  # type: ignore[index]
            async with session_client(share_url(server, token), start={"watch": token}) as viewer:
                viewer_id = viewer.ready["viewer_id"]  # type: ignore[index]
                await tick(player, 1)
                await viewer_chunk(viewer)
                await player.send(type="pass_control", to="vnobody")
                error = await next_of(player, "error")
                assert (error["code"], error["fatal"]) == ("unknown_viewer", False)
                await player.send(type="pass_control", to=viewer_id)
                became = await next_of(viewer, "role")
                assert became["role"] == "controller" and became["last_tick_id"] == 1
                # the horizon `ready` gave the first controller: the new one's timeline and branch link need it
                assert became["rewind_seconds"] == player.ready["rewind_seconds"] > 0  # type: ignore[index]
                assert "resume" not in became  # resume is off here (test_resume.py: the ticket follows control)
                left = await next_of(player, "role")
                assert left["role"] == "viewer" and left["viewer_id"].startswith("v")
                # the old controller may not tick now; the new one does, and the old one watches it
                await player.send(type="tick", tick_id=2, controls=HELD)
                assert (await next_of(player, "error"))["code"] == "not_controller"
                header, frames = await tick(viewer, 2)
                assert header["chunk_index"] == 1
                seen_header, seen_frames = await viewer_chunk(player)
                assert seen_header["tick_id"] == 2
                assert all(np.array_equal(a, b) for a, b in zip(frames, seen_frames, strict=True))
                # and back
                await viewer.send(type="pass_control", to=left["viewer_id"])
                assert (await next_of(player, "role"))["role"] == "controller"
                assert (await next_of(viewer, "role"))["role"] == "viewer"
                header, _ = await tick(player, 3)
                assert header["chunk_index"] == 2

    run(scenario())


def test_a_viewer_that_never_reads_skips_whole_chunks_and_never_holds_the_player_back() -> None:
    """256x256 raw frames (half a megabyte a chunk) to a viewer whose socket takes 4 KB and who reads nothing:
    the player gets every chunk, the viewer's queue never holds more than its bound, and when it reads again
    it is told how many chunks it missed."""
    big = fake_settings(replica_id="r0", model_options={"width": 256, "height": 256})
    chunks = 40
    with running_server(big) as live:

        async def scenario() -> None:
            async with session_client(live.ws_url, start={"seed": SEED, "codec": "raw"}) as player:
                token = player.ready["share"]["token"]  # type: ignore[index]
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", live.port))
                async with connect(share_url(live, token), sock=sock, max_queue=1, max_size=None, proxy=None,
                                   compression=None) as ws:
                    viewer = ProbeClient(ws)
                    await viewer.start(watch=token, codec="raw")
                    hub = live.server.hub  # type: ignore[union-attr]
                    session_id = player.ready["session_id"]  # type: ignore[index]
                    (role,) = hub.shares.viewers(session_id).values()
                    watcher = role.socket
                    assert isinstance(watcher, LiveSession) and watcher.watch is role
                    most_queued = 0
                    for tick_id in range(1, chunks + 1):
                        header, _ = await tick(player, tick_id)
                        assert header["tick_id"] == tick_id
                        most_queued = max(most_queued, watcher.outbox._viewer_chunks)
                    assert most_queued <= VIEWER_CHUNK_BACKLOG
                    # what waits for it, queued and in the socket, is a few chunks, not the forty sent
                    chunk_bytes = 2 * 256 * 256 * 3
                    assert watcher.outbox.bytes_queued <= VIEWER_CHUNK_BACKLOG * (chunk_bytes + 1024)
                    skipped = 0
                    last_index = -1
                    while last_index < chunks - 1:
                        header, _ = await viewer_chunk(viewer)
                        skipped += header["skipped_before"]
                        assert header["chunk_index"] > last_index
                        last_index = header["chunk_index"]
                    assert skipped > 0
                    assert last_index == chunks - 1  # it ends with the latest chunk

        run(scenario())


def test_share_tokens_are_never_logged_whole(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="arstream")
    caplog.set_level(logging.INFO, logger="uvicorn.error")  # uvicorn logs every WebSocket's path and query

    async def scenario() -> str:
        async with session_client(server.ws_url, start={"seed": SEED}) as player:
            token = player.ready["share"]["token"]  # type: ignore[index]
            async with session_client(share_url(server, token), start={"watch": token}):
                pass
            async with session_client(share_url(server, token)) as refused:
                await refused.send(type="start", watch=token[:-1])  # not the URL's token: refused, with a hint
                await refused.closed_by_server()
            await player.send(type="close")
            await player.closed_by_server()
        return str(token)

    token = run(scenario())
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "share token r0." in logged  # the hint is there ...
    assert '"WebSocket /v1/sessions?share=' in logged  # uvicorn's line, its query redacted
    assert token.split(".", 1)[1][:12] not in logged  # ... the token is not


def test_metrics_count_viewers(server: LiveServer) -> None:
    async def scenario() -> None:
        async with session_client(server.ws_url, start={"seed": SEED}) as player:
            token = player.ready["share"]["token"]  # type: ignore[index]
            async with session_client(share_url(server, token), start={"watch": token}):
                metrics = server.get("/metrics").text
                assert "arstream_viewers 1.0" in metrics
        await asyncio.to_thread(wait_until, lambda: "arstream_viewers 0.0" in server.get("/metrics").text)

    run(scenario())


@pytest.mark.parametrize(
    "text, why",
    [
        ('{"type": "start", "watch": "r0.a", "resume": "r0.b"}', "at most one of resume, watch and branch"),
        ('{"type": "start", "watch": "r0.a", "branch": {"share": "r0.a", "chunk": 1}}', "at most one"),
        ('{"type": "start", "branch": {"share": "r0.a", "chunk": "5"}}', "branch.chunk"),
        ('{"type": "start", "branch": {"share": "r0.a", "chunk": -1}}', "branch.chunk"),
        ('{"type": "start", "watch": ""}', "watch"),
        ('{"type": "tick", "tick_id": 1, "rewind_to": -2}', "rewind_to"),
        ('{"type": "tick", "tick_id": 1, "rewind_to": true}', "rewind_to"),
        ('{"type": "pass_control"}', "to"),
        ('{"type": "pass_control", "to": 7}', "to"),
    ],
)
def test_the_new_fields_are_checked(text: str, why: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        parse_client_message(text)
    assert refused.value.code is ErrorCode.INVALID_MESSAGE and why in refused.value.message


def test_the_new_messages_parse() -> None:
    tick = parse_client_message('{"type": "tick", "tick_id": 3, "rewind_to": 2}')
    assert isinstance(tick, TickMessage) and tick.rewind_to == 2
    passed = parse_client_message('{"type": "pass_control", "to": "v1a2b"}')
    assert isinstance(passed, PassControlMessage) and passed.to == "v1a2b"
    start = parse_client_message('{"type": "start", "branch": {"share": "r0.x", "chunk": 4}}')
    assert isinstance(start, StartMessage) and start.branch is not None and start.branch.chunk == 4
    latest = parse_client_message('{"type": "start", "branch": {"share": "r0.x"}}')  # no chunk: the latest boundary
    assert isinstance(latest, StartMessage) and latest.branch is not None and latest.branch.chunk is None


def test_viewers_end_with_the_players_dropped_connection_and_an_h264_viewer_decodes_every_chunk_alone(
    server: LiveServer,
) -> None:
    """An H.264 viewer's chunks each start a stream (a keyframe first): a fresh decoder takes any of them."""

    async def scenario() -> None:
        async with session_client(server.ws_url, start={"seed": SEED, "codec": "raw"}) as player:
            token = player.ready["share"]["token"]  # type: ignore[index]
            async with session_client(share_url(server, token), start={"watch": token, "codec": "h264"}) as viewer:
                for tick_id in range(1, 4):
                    _, frames = await tick(player, tick_id)
                    header = await next_of(viewer, "chunk")
                    decoder = FrameDecoder()
                    for index in range(header["frames"]):
                        message = await viewer.recv()
                        assert isinstance(message, bytes)
                        frame_header, pixels = decoder.decode_frame(message)
                        assert frame_header.keyframe == (index == 0)
                        assert np.abs(pixels.astype(int) - frames[index]).mean() < 8
                player.abort()
                closed = await viewer.closed_by_server()
                assert {"type": "closed", "reason": "session_ended"} in closed.messages

    run(scenario())


def test_viewers_hear_server_shutdown_and_count_in_the_connection_caps() -> None:
    with running_server(fake_settings(replica_id="r0", max_connections_per_client=3, forwarded_allow_ips="")) as live:

        async def scenario() -> list[Any]:
            async with session_client(live.ws_url, start={"seed": SEED}) as player:
                token = player.ready["share"]["token"]  # type: ignore[index]
                url = share_url(live, token)
                async with session_client(url, start={"watch": token}) as viewer, \
                        session_client(url, start={"watch": token}):
                    # a fourth connection from this address is one too many, viewers included
                    with pytest.raises((ConnectionClosed, InvalidHandshake, OSError)):
                        async with session_client(url, start={"watch": token}):
                            pass
                    assert live.server is not None
                    live.server.should_exit = True  # what SIGINT/SIGTERM do
                    return [await viewer.closed_by_server(), await player.closed_by_server()]

        watched, played = run(scenario())
    assert watched.messages[-1] == {"type": "closed", "reason": "server_shutdown"} and watched.code == 1001
    assert played.messages[-1] == {"type": "closed", "reason": "server_shutdown"} and played.code == 1001


def test_the_resume_ticket_follows_control() -> None:
    """The new controller's `role` carries the session's resume ticket; the old controller's token is void."""
    with running_server(fake_settings(replica_id="r0", resume_grace_s=30.0)) as live:

        async def scenario() -> None:
            async with session_client(live.ws_url, start={"seed": SEED}) as player:
                old_token = player.ready["resume"]["token"]  # type: ignore[index]
                share = player.ready["share"]["token"]  # type: ignore[index]
                async with session_client(share_url(live, share), start={"watch": share}) as viewer:
                    await tick(player, 1)
                    await player.send(type="pass_control", to=viewer.ready["viewer_id"])  # type: ignore[index]
                    became = await next_of(viewer, "role")
                    ticket = became["resume"]
                    assert ticket["next_chunk_index"] == 1
                    viewer.abort()  # the new controller's connection drops: the session detaches
                    closed = await player.closed_by_server()
                    assert {"type": "closed", "reason": "session_ended"} in closed.messages
                await asyncio.to_thread(live.wait_for_stats, lambda s: s["sessions"]["detached"] == 1)
                async with session_client(f"{live.ws_url}?resume={old_token}") as stale:
                    await stale.send(type="start", resume=old_token)
                    assert (await stale.closed_by_server()).code == 4002
                token = ticket["token"]
                async with session_client(f"{live.ws_url}?resume={token}", start={"resume": token}) as resumed:
                    assert resumed.ready is not None and resumed.ready["resumed"] is True
                    assert resumed.ready["share"]["token"] == share  # the same share token after a resume
                    header, _ = await tick(resumed, 2)
                    assert header["chunk_index"] == 1
                    await resumed.send(type="close")
                    await resumed.closed_by_server()

        run(scenario())

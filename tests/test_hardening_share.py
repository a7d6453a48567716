"""Hostile clients of branch, watch and pass_control (issue 31, findings 2, 4, 6, 7; issue 36, item 9).

Each test attacks a real server with real clients (``websockets``, or raw sockets where the attack needs a
client that never reads) and checks the bound docs/public.md names ("Watching, branching and passing
control"); every session's KV blocks are back when it ends. The policy choosing a viewer's format is also
tested alone, on chosen audiences of fake viewers.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from typing import Any

import pytest
from websockets.asyncio.client import connect

from arstream.app.viewers import ShareRegistry
from raw_clients import RawWebSocket, close_code, closed_by_server, open_files
from servers import (
    ProbeClient,
    fake_settings,
    next_of,
    running_server,
    server_process,
    session_client,
    share_url,
    wait_until,
)

SEED = 5


def run(coro: Any) -> Any:
    return asyncio.run(coro)




async def tick(client: ProbeClient, tick_id: int, **fields: Any) -> dict[str, Any]:
    """One tick and its chunk's header (its frames read); an `error` about it is returned instead."""
    await client.send(type="tick", tick_id=tick_id, **fields)
    while True:
        message = await client.recv()
        if isinstance(message, bytes):
            continue
        parsed = json.loads(message)
        if parsed["type"] == "error":
            return parsed
        if parsed["type"] == "chunk":
            for _ in range(parsed["frames"]):
                assert isinstance(await client.recv(), bytes)
            return parsed


# ---- finding 2: a branch burst ------------------------------------------------------------------------


def test_a_branch_burst_never_evicts_a_session_a_connection_holds() -> None:
    """Two honest sessions and the attacker's source hold 3 of 4 slots; 3 branches sent at once get one slot
    between them and the other two `over_capacity` (1013). Before, each branch was made before its slot was
    claimed, and the runner made room for it by evicting the least recently used sessions: the honest ones
    (their next chunk said ``restarted: "evicted"`` at chunk 0)."""
    settings = fake_settings(replica_id="r0", model_options={"session_capacity": 4})
    with running_server(settings) as live:

        async def scenario() -> None:
            baseline = live.stats()["kv"]["blocks_free"]
            async with session_client(live.ws_url, start={"seed": 1}) as first, \
                    session_client(live.ws_url, start={"seed": 2}) as second, \
                    session_client(live.ws_url, start={"seed": SEED}) as source:
                for honest in (first, second):
                    assert (await tick(honest, 0))["chunk_index"] == 0
                for tick_id in range(3):
                    await tick(source, tick_id)
                token = source.ready["share"]["token"]  # type: ignore[index]

                answered = asyncio.Barrier(3)  # the admitted branch stays until every branch has its answer

                async def branch() -> tuple[str, int | None]:
                    async with session_client(share_url(live, token)) as client:
                        await client.send(type="start", branch={"share": token, "chunk": 1})
                        message = await client.recv_json()
                        await answered.wait()
                        if message["type"] == "ready":
                            await tick(client, 0)
                            await client.send(type="close")
                        return message["type"], (await client.closed_by_server()).code

                outcomes = await asyncio.gather(*(branch() for _ in range(3)))
                assert sorted(outcomes) == [("error", 1013), ("error", 1013), ("ready", 1000)]
                for honest in (first, second):
                    header = await tick(honest, 1)
                    assert header["type"] == "chunk" and header["restarted"] is None
                    assert header["chunk_index"] == 1  # its rollout went on
                assert live.stats()["sessions"]["evictions_total"] == 0
                for client in (first, second, source):
                    await client.send(type="close")
                    await client.closed_by_server()
            await asyncio.to_thread(live.settled, baseline)

        run(scenario())


# ---- finding 6: pass_control and the session caps --------------------------------------------------------


@asynccontextmanager
async def client_from(host: str, url: str, *, start: dict[str, Any] | None = None) -> AsyncIterator[ProbeClient]:
    """A ``websockets`` client from loopback address ``host`` (another client for the per-address caps)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.connect(("127.0.0.1", int(url.split(":")[2].split("/")[0])))
    async with connect(url, sock=sock, compression=None, proxy=None, max_size=None, open_timeout=30) as ws:
        client = ProbeClient(ws)
        if start is not None:
            await client.start(**start)
        yield client


def test_pass_control_to_a_viewer_whose_address_is_at_its_cap_is_refused() -> None:
    """Address B holds its one session (max_sessions_per_client 1) and watches A's: A's pass_control to B's
    viewer is `control_refused` (non-fatal) and A keeps control. Before, the pass went through and B controlled
    two sessions; cooperating addresses could pile any number onto one."""
    settings = fake_settings(replica_id="r0", max_sessions_per_client=1, forwarded_allow_ips="")
    with running_server(settings) as live:

        async def scenario() -> None:
            baseline = live.stats()["kv"]["blocks_free"]
            async with session_client(live.ws_url, start={"seed": SEED}) as player, \
                    client_from("127.0.0.2", live.ws_url, start={"seed": 1}) as own:
                token = player.ready["share"]["token"]  # type: ignore[index]
                async with client_from("127.0.0.2", share_url(live, token), start={"watch": token}) as viewer:
                    await tick(player, 0)
                    await player.send(type="pass_control", to=viewer.ready["viewer_id"])  # type: ignore[index]
                    refused = await next_of(player, "error")
                    assert refused["code"] == "control_refused"
                    assert "max_sessions_per_client 1" in refused["message"]
                    assert (await tick(player, 1))["chunk_index"] == 1  # still the controller
                    await viewer.send(type="tick", tick_id=5)
                    assert (await next_of(viewer, "error"))["code"] == "not_controller"
                    # with room (its own session closed) the same pass goes through
                    await own.send(type="close")
                    await own.closed_by_server()
                    await asyncio.to_thread(live.wait_for_stats, lambda s: s["sessions"]["connected"] == 1)
                    await player.send(type="pass_control", to=viewer.ready["viewer_id"])  # type: ignore[index]
                    assert (await next_of(viewer, "role"))["role"] == "controller"
                    assert (await tick(viewer, 5))["chunk_index"] == 2
                    await viewer.send(type="close")
                    await viewer.closed_by_server()
            await asyncio.to_thread(live.settled, baseline)

        run(scenario())


def test_pass_control_keeps_the_per_token_cap() -> None:
    """The same with one auth token per tenant: tenant B at max_sessions_per_token cannot be handed A's."""
    settings = fake_settings(replica_id="r0", auth_token="ta,tb", max_sessions_per_token=1)
    with running_server(settings) as live:

        async def scenario() -> None:
            url_a, url_b = f"{live.ws_url}?token=ta", f"{live.ws_url}?token=tb"
            async with session_client(url_a, start={"seed": SEED}) as player, \
                    session_client(url_b, start={"seed": 1}):
                token = player.ready["share"]["token"]  # type: ignore[index]
                async with session_client(f"{url_b}&share={token}", start={"watch": token}) as viewer:
                    await player.send(type="pass_control", to=viewer.ready["viewer_id"])  # type: ignore[index]
                    refused = await next_of(player, "error")
                    assert refused["code"] == "control_refused" and "max_sessions_per_token 1" in refused["message"]
                    assert (await tick(player, 0))["chunk_index"] == 0

        run(scenario())


# ---- finding 4 and issue 36 item 9: viewers that do not read ------------------------------------------


def frames_until_close(viewer: RawWebSocket) -> tuple[list[dict[str, Any]], int | None, str]:
    """Everything a raw viewer was sent, read now: its text messages, then the close frame's code and reason."""
    texts: list[dict[str, Any]] = []
    while True:
        opcode, payload = viewer.read_frame()
        if opcode == 0x1:
            texts.append(json.loads(payload))
        elif opcode == 0x8:
            return texts, close_code(payload), payload[2:].decode()


def raw_viewer(port: int, token: str, codec: str = "raw") -> RawWebSocket:
    """A viewer over a raw socket with a 4 KB receive buffer; it reads nothing unless told to."""
    viewer = RawWebSocket(port, f"/v1/sessions?share={token}")
    assert viewer.status == 101
    viewer.send_text(json.dumps({"type": "start", "watch": token, "codec": codec}))
    return viewer


def test_viewers_that_never_read_end_with_their_session() -> None:
    """20 viewers that never read a byte watch a session that sends 256x256 raw chunks; the player closes.
    Every viewer's connection is gone ``close_timeout_s`` later (the server's open files from /proc are back
    where they were). Before, all 20 stayed connected for as long as their peers kept the sockets, invisible
    in /v1/stats, and 39 of them filled a 40-connection server."""
    options = json.dumps({"width": 256, "height": 256})
    args = ["--model", "fake-kv", "--model-options", options, "--replica-id", "r0", "--close-timeout-s", "1",
            "--max-connections-per-client", "64"]
    with server_process(args) as live, ExitStack() as sockets:
        pid = live.process.pid  # type: ignore[union-attr]
        player = RawWebSocket(live.port)
        sockets.callback(player.close)
        player.send_text(json.dumps({"type": "start", "codec": "raw"}))
        token = json.loads(player.read_text())["share"]["token"]
        files_before = open_files(pid)
        viewers = []
        for _ in range(20):
            viewers.append(raw_viewer(live.port, token))
            sockets.callback(viewers[-1].close)
        live.wait_for_stats(lambda s: s["sessions"]["viewers"] == 20)
        assert open_files(pid) >= files_before + 20  # (an HTTP stats request may still hold one more)
        for tick_id in range(8):  # the player reads its chunks; its viewers' sockets fill up
            player.send_text(json.dumps({"type": "tick", "tick_id": tick_id}))
            while json.loads(player.read_text())["type"] != "chunk":
                pass
            for _ in range(2):
                player.read_frame()
        player.send_text(json.dumps({"type": "close"}))
        assert closed_by_server(player.sock)
        wait_until(lambda: open_files(pid) <= files_before - 1, attempts=400)  # the player's socket gone too
        sessions = live.stats()["sessions"]
        assert (sessions["viewers"], sessions["closing"], sessions["connected"]) == (0, 0, 0)
        for viewer in viewers:
            viewer.sock.settimeout(0.5)
            assert closed_by_server(viewer.sock)  # dropped: reset, or closed after what it was sent


def test_a_viewer_that_stops_reading_is_closed_not_reading_and_the_player_goes_on() -> None:
    """A viewer reads its `ready`, then stops reading 256x256 raw chunks. After ``viewer_stall_timeout_s``
    without taking anything it leaves the audience, shows in /v1/stats as closing, and when it reads again it
    finds the chunks it was sent, then `closed` (not_reading) and close 1008 with that reason; the player
    never missed a chunk. Before, nothing ended it but the transport's keepalive, with no `closed` at all."""
    settings = fake_settings(replica_id="r0", model_options={"width": 256, "height": 256},
                             viewer_stall_timeout_s=0.5, close_timeout_s=20.0)
    with running_server(settings) as live, ExitStack() as sockets:

        async def scenario() -> None:
            baseline = live.stats()["kv"]["blocks_free"]
            async with session_client(live.ws_url, start={"seed": SEED, "codec": "raw"}) as player:
                token = player.ready["share"]["token"]  # type: ignore[index]
                viewer = await asyncio.to_thread(raw_viewer, live.port, token)
                sockets.callback(viewer.close)
                assert json.loads(await asyncio.to_thread(viewer.read_text))["type"] == "ready"
                tick_id = 0
                while live.stats()["sessions"]["viewers"] == 1 and tick_id < 2000:
                    assert (await tick(player, tick_id))["tick_id"] == tick_id
                    tick_id += 1
                stats = live.stats()["sessions"]
                assert stats["viewers"] == 0 and stats["closing"] == 1  # gone from the audience, still counted
                texts, code, reason = await asyncio.to_thread(frames_until_close, viewer)
                assert texts[-1] == {"type": "closed", "reason": "not_reading"}
                assert code == 1008 and reason == "not_reading"
                assert any(t["type"] == "chunk" for t in texts)
                assert (await tick(player, tick_id))["chunk_index"] == tick_id  # the player went on, unskipped
                await player.send(type="close")
                await player.closed_by_server()
            await asyncio.to_thread(live.settled, baseline)

        run(scenario())


# ---- issue 36 item 9: rewind edges (PROTOCOL.md is the contract) -----------------------------------------


def test_rewind_to_where_the_session_is_is_a_plain_tick_and_a_refused_rewind_does_not_close() -> None:
    """``rewind_to`` equal to the current position: a plain chunk (``restarted`` null; before, "rewind").
    A refused rewind on a tick with ``close: true``: `rewind_unavailable`, no chunk, and the session stays
    open (before, it was closed with tick_close though no chunk was sent)."""
    settings = fake_settings(replica_id="r0")
    with running_server(settings) as live:

        async def scenario() -> None:
            baseline = live.stats()["kv"]["blocks_free"]
            async with session_client(live.ws_url, start={"seed": SEED}) as client:
                for tick_id in range(3):
                    await tick(client, tick_id)
                plain = await tick(client, 3, rewind_to=3)
                assert (plain["chunk_index"], plain["restarted"]) == (3, None)
                back = await tick(client, 4, rewind_to=2)
                assert (back["chunk_index"], back["restarted"]) == (2, "rewind")
                refused = await tick(client, 5, rewind_to=99, close=True)
                assert (refused["code"], refused["tick_id"]) == ("rewind_unavailable", 5)
                after = await tick(client, 6)  # still open, unchanged
                assert after["type"] == "chunk", after
                assert (after["chunk_index"], after["restarted"]) == (3, None)
                last = await tick(client, 7, close=True)
                assert last["chunk_index"] == 4
                closed = await client.closed_by_server()
                assert closed.code == 1000 and closed.messages[-1] == {"type": "closed", "reason": "tick_close"}
            await asyncio.to_thread(live.settled, baseline)

        run(scenario())


# ---- finding 7: viewer encode amplification -----------------------------------------------------------


def test_viewers_get_at_most_max_viewer_encodings_formats_and_the_rest_the_nearest() -> None:
    """A JPEG q80 player; viewers ask for JPEG q10, q20, q30 and raw. With ``max_viewer_encodings`` 2 the
    session's chunks are encoded for viewers in q10 and q20 only: q30 is served q20 (the same codec, nearest
    quality) and raw the player's own JPEG frames (``ready.codec`` says so). Before, each distinct format was
    one more encode per chunk, whether or not its viewers read."""
    with running_server(fake_settings(replica_id="r0", max_viewer_encodings=2)) as live:

        async def scenario() -> None:
            async with session_client(live.ws_url, start={"seed": SEED, "codec": "jpeg", "quality": 80}) as player:
                token = player.ready["share"]["token"]  # type: ignore[index]
                url = share_url(live, token)
                asked = [("jpeg", 10), ("jpeg", 20), ("jpeg", 30), ("raw", 80)]
                async with AsyncExitStack() as stack:
                    viewers = [
                        await stack.enter_async_context(
                            session_client(url, start={"watch": token, "codec": codec, "quality": quality})
                        )
                        for codec, quality in asked
                    ]
                    served_ready = [(v.ready["codec"], v.ready["quality"]) for v in viewers]  # type: ignore[index]
                    assert served_ready == [("jpeg", 10), ("jpeg", 20), ("jpeg", 20), ("jpeg", 80)]
                    hub = live.server.hub  # type: ignore[union-attr]
                    session_id = player.ready["session_id"]  # type: ignore[index]
                    served = sorted(v.watch_format for v in hub.shares.viewers(session_id).values())
                    assert served == [("jpeg", 10), ("jpeg", 20), ("jpeg", 20), ("jpeg", 80)]
                    assert hub.shares.formats_needed(session_id, ("jpeg", 80)) == {("jpeg", 10), ("jpeg", 20)}
                    await tick(player, 0)
                    for viewer in viewers:  # every viewer gets the chunk, in the format it was served
                        header = await next_of(viewer, "chunk")
                        assert header["chunk_index"] == 0
                        assert isinstance(await viewer.recv(), bytes)

        run(scenario())


def test_with_no_viewer_encodings_a_viewer_of_an_h264_player_is_refused() -> None:
    """``max_viewer_encodings`` 0 and a player whose frames cannot be shared (an H.264 stream of its own):
    a viewer has nothing to be served and gets `over_capacity` (1013), naming the setting."""
    pytest.importorskip("av")
    with running_server(fake_settings(replica_id="r0", max_viewer_encodings=0)) as live:

        async def scenario() -> None:
            async with session_client(live.ws_url, start={"seed": SEED, "codec": "h264"}) as player:
                token = player.ready["share"]["token"]  # type: ignore[index]
                async with session_client(share_url(live, token)) as viewer:
                    await viewer.send(type="start", watch=token, codec="jpeg")
                    closed = await viewer.closed_by_server()
                    assert closed.code == 1013 and "max_viewer_encodings 0" in closed.messages[0]["message"]

        run(scenario())


class FakeViewer:
    """A fake watching connection for ShareRegistry's unit tests: it only has a format."""

    viewer_id: str | None = None

    def __init__(self, codec: str, quality: int) -> None:
        self.watch_format = (codec, quality)

    def offer_chunk(self, chunk: Any) -> None: ...

    def skip_chunk(self) -> None: ...

    def notify(self, message: dict[str, Any], *, latest_of: str | None = None) -> None: ...

    def end_watching(self, reason: Any) -> None: ...


@pytest.mark.parametrize(
    ("controller", "asked", "served"),
    [
        (("jpeg", 80), ("jpeg", 80), ("jpeg", 80)),  # the player's own frames: never an encode
        (("jpeg", 80), ("jpeg", 10), ("jpeg", 10)),  # an encoding already there
        (("jpeg", 80), ("jpeg", 45), ("jpeg", 30)),  # past the cap: same codec, nearest quality (30 of 10/30)
        (("jpeg", 80), ("raw", 80), ("jpeg", 80)),  # no raw encoded: the player's own frames
        (("h264", 80), ("raw", 80), ("jpeg", 10)),  # h264 frames cannot be shared: the first of the rest
    ],
)
def test_the_format_a_viewer_is_served_past_max_viewer_encodings(
    controller: tuple[str, int], asked: tuple[str, int], served: tuple[str, int]
) -> None:
    shares = ShareRegistry[FakeViewer](replica_id="r0", max_viewers_per_session=8, max_viewer_encodings=2)
    shares.token("s")
    for codec, quality in (("jpeg", 10), ("jpeg", 30)):
        if (codec, quality) != controller:
            shares.join("s", FakeViewer(codec, quality))
    assert shares.served_format("s", asked, controller) == served

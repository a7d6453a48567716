"""``arstream client``'s rewind, branch and watch verbs (issue 27).

Unit tests of the client's side: option checks, and its message handling
against :class:`FakeShareServer`, a fake WebSocket server that speaks only the
messages the contract gives (docs/PROTOCOL.md, "Rewind, branch and watch") and
records what the client sent; then the same verbs against the real server
(fake-kv, whose raw frames are exact: G is the frame's absolute position, R
comes from the KV cache, B has a bit per held key).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest
from websockets.asyncio.server import ServerConnection, serve

from arstream.app import wire
from arstream.programs import client, client_lib
from servers import LiveServer, fake_settings, running_server

MODEL: dict[str, Any] = {"name": "fake-share", "width": 4, "height": 2, "fps": 16, "frames_per_chunk": 2}
LIMITS = {"max_pending_ticks": 3, "max_message_bytes": 65536, "idle_timeout_s": 60}


def frames_for(chunk_index: int) -> np.ndarray:
    """A chunk's two frames, each one flat value: 10 * chunk_index + frame (so a test sees which chunk came)."""
    values = [10 * chunk_index + frame for frame in range(MODEL["frames_per_chunk"])]
    return np.stack([np.full((MODEL["height"], MODEL["width"], 3), value, np.uint8) for value in values])


@dataclass
class FakeShareServer:
    """A fake session server: ``ready`` with a share token, chunks that honour ``rewind_to``, viewers.

    A controller gets one chunk per tick (``rewind_to`` sets its chunk_index and ``restarted: "rewind"``),
    with a ``viewers`` message before the first chunk (as when someone starts watching). A viewer gets
    ``viewer_chunks`` chunks, the second with ``skipped_before: 2``, then ``closed: session_ended``.
    """

    viewer_chunks: int = 3
    received: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)

    async def handle(self, ws: ServerConnection) -> None:
        self.paths.append(ws.request.path if ws.request else "")
        start = json.loads(await ws.recv())
        self.received.append(start)
        ready = {"type": "ready", "protocol": 1, "session_id": "s1", "model": MODEL, "limits": LIMITS, "codec": "raw"}
        if "watch" in start:
            await ws.send(json.dumps({**ready, "role": "viewer", "viewer_id": "v1"}))
            await ws.send(json.dumps({"type": "viewers", "count": 1}))
            for index in range(self.viewer_chunks):
                skipped = 2 if index == 1 else 0
                chunk_index = 10 + index + (2 if index else 0)  # two chunks skipped before the second
                await self.send_chunk(ws, chunk_index=chunk_index, tick_id=100 + index, skipped=skipped)
            await ws.send(json.dumps({"type": "closed", "reason": "session_ended"}))
            return
        first = start["branch"]["chunk"] if "branch" in start else 0
        extra = {"branched_from": {"chunk": first}} if "branch" in start else {}
        share = {"share": {"token": "r0.share"}, "rewind_points": 8}
        await ws.send(json.dumps({**ready, "role": "controller", **share, **extra}))
        next_index = first
        async for text in ws:
            message = json.loads(text)
            self.received.append(message)
            if message["type"] == "close":
                await ws.send(json.dumps({"type": "closed", "reason": "client"}))
                return
            if message["type"] != "tick":
                continue
            if next_index == first:
                await ws.send(json.dumps({"type": "viewers", "count": 1, "ids": ["v9"]}))
            restarted = None
            if "rewind_to" in message:
                next_index, restarted = message["rewind_to"], "rewind"
            await self.send_chunk(ws, chunk_index=next_index, tick_id=message["tick_id"], restarted=restarted)
            next_index += 1

    async def send_chunk(
        self, ws: ServerConnection, *, chunk_index: int, tick_id: int, restarted: str | None = None, skipped: int = 0
    ) -> None:
        frames = frames_for(chunk_index)
        message: dict[str, Any] = {
            "type": "chunk", "tick_id": tick_id, "chunk_index": chunk_index, "frames": len(frames),
            "applied_event_ids": [], "restarted": restarted, "rewind_points": [max(0, chunk_index - 7), chunk_index + 1],
            "timings": {"queue_ms": 0.0, "compute_ms": 0.0, "encode_ms": 0.0},
        }
        if skipped:
            message["skipped_before"] = skipped
        await ws.send(json.dumps(message))
        encoded = wire.encode_chunk(frames, codec=wire.Codec.RAW, quality=0, chunk_index=chunk_index, tick_id=tick_id)
        for data in encoded:
            await ws.send(data)


@asynccontextmanager
async def fake_share_server(fake: FakeShareServer) -> AsyncIterator[str]:
    async with serve(fake.handle, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"http://127.0.0.1:{port}"


def chunk_values(frames: list[np.ndarray]) -> list[int]:
    return [int(frame[0, 0, 0]) for frame in frames]


# ---- options ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("to", "after", "ticks", "expected"),
    [
        (None, None, 6, None),
        (2, None, 6, client.Rewind(to=2, after=3)),
        (0, 5, 6, client.Rewind(to=0, after=5)),
        (4, 4, 6, client.Rewind(to=4, after=4)),
    ],
)
def test_rewind_plan(to: int | None, after: int | None, ticks: int, expected: client.Rewind | None) -> None:
    assert client.rewind_plan(to, after, ticks) == expected


@pytest.mark.parametrize(
    ("to", "after", "ticks", "complaint"),
    [
        (None, 2, 6, "needs --rewind-to"),
        (-1, 2, 6, "at least 0"),
        (2, 6, 6, "past the key script"),
        (4, None, 6, "has not reached"),
    ],
)
def test_rewind_plan_rejects(to: int | None, after: int | None, ticks: int, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        client.rewind_plan(to, after, ticks)


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--watch", "r0.x", "--rewind-to", "1"], "takes no --branch or --rewind-to"),
        (["--watch", "r0.x", "--seed", "3"], "takes no --seed"),
        (["--watch", "r0.x", "--chunks", "0"], "at least 1"),
        (["--chunks", "3"], "is for --watch"),
        (["--chunk", "2"], "is for --branch"),
        (["--branch", "r0.x", "--chunk", "-1"], "at least 0"),
    ],
)
def test_share_options_are_checked_before_connecting(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Port 9 (discard) is never contacted: the option error comes first.
    assert client.main(["ws://127.0.0.1:9/v1/sessions", "--out", "/nonexistent", *argv]) == 2
    assert complaint in capsys.readouterr().err


def test_share_session_url_adds_the_share_token_beside_the_access_token() -> None:
    url = client_lib.session_url("http://h:1", token="t0ken", share="r0.abc")
    assert parse_qs(urlsplit(url).query) == {"token": ["t0ken"], "share": ["r0.abc"]}
    assert client_lib.session_url("http://h:1") == "ws://h:1/v1/sessions"


def test_compact_ranges_shows_a_jump_back() -> None:
    assert client.compact_ranges([0, 1, 2, 3, 1, 2]) == "0-3, 1-2"
    assert client.compact_ranges([5]) == "5"


# ---- message handling against the fake server -----------------------------------------------


def test_rewind_tick_goes_out_at_its_place_and_the_jump_back_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeShareServer()

    async def scenario() -> client.RunResult:
        async with fake_share_server(fake) as url:
            plan = client.keys_per_tick(client.parse_key_script("d*6"))
            return await client.run_script(url, plan, codec="raw", rewind=client.Rewind(to=1, after=4))

    result = asyncio.run(scenario())
    ticks = [message for message in fake.received if message["type"] == "tick"]
    assert [tick.get("rewind_to") for tick in ticks] == [None, None, None, None, 1, None]
    assert result.chunk_indexes == [0, 1, 2, 3, 1, 2]
    assert result.restarts == [(1, "rewind")]
    assert chunk_values(result.frames)[8:10] == [10, 11], "the rewound chunk's frames are chunk 1's"
    assert result.viewers == 1, "a viewers message between chunks is kept, not taken for a chunk"
    output = capsys.readouterr().out
    assert "share token r0.share" in output and "within the last 8 chunks" in output
    assert "chunk 1 again" in output


def test_branch_starts_through_the_share_url_from_its_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeShareServer()

    async def scenario() -> client.RunResult:
        async with fake_share_server(fake) as url:
            plan = client.keys_per_tick(client.parse_key_script("-*3"))
            return await client.run_script(url, plan, codec="raw", seed=7, branch=("r0.src", 5))

    result = asyncio.run(scenario())
    assert fake.received[0]["branch"] == {"share": "r0.src", "chunk": 5}
    assert parse_qs(urlsplit(fake.paths[0]).query) == {"share": ["r0.src"]}
    assert result.chunk_indexes == [5, 6, 7]
    assert "branched from chunk 5" in capsys.readouterr().out


def test_watch_takes_chunks_without_ticking_counts_skips_and_stops_when_the_session_ends(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake = FakeShareServer(viewer_chunks=3)

    async def scenario() -> client.RunResult:
        async with fake_share_server(fake) as url:
            return await client.run_watch(url, "r0.watched", chunks=10, codec="raw")

    result = asyncio.run(scenario())
    assert [message["type"] for message in fake.received] == ["start"], "a viewer sends no ticks"
    assert fake.received[0]["watch"] == "r0.watched"
    assert "seed" not in fake.received[0]
    assert parse_qs(urlsplit(fake.paths[0]).query) == {"share": ["r0.watched"]}
    assert result.chunk_indexes == [10, 13, 14]
    assert result.skipped_chunks == 2
    assert result.viewers == 1
    assert "session_ended" in result.closed_reason
    assert chunk_values(result.frames) == [100, 101, 130, 131, 140, 141]
    assert "as viewer v1" in capsys.readouterr().out


# ---- against the real server ----------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server(fake_settings(model_options={"compute_delay_s": 0.005})) as live:
        yield live


def saved_frames(out: Path) -> list[np.ndarray]:
    from PIL import Image

    return [np.asarray(Image.open(path).convert("RGB")) for path in sorted(out.glob("frame_*.png"))]


def test_rewind_to_replays_that_chunk_exactly(
    server: LiveServer, baseline: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    per_chunk = server.get("/v1/model").json()["frames_per_chunk"]
    argv = [server.base_url, "--codec", "raw", "--keys", "d*6", "--rewind-to", "2", "--rewind-after", "4"]
    assert client.main([*argv, "--out", str(tmp_path)]) == 0
    output = capsys.readouterr().out
    assert "chunk indexes: 0-3, 2-3" in output and "rewound to chunk 2" in output
    frames = saved_frames(tmp_path)
    assert len(frames) == 6 * per_chunk
    chunk = [frames[i * per_chunk:(i + 1) * per_chunk] for i in range(6)]
    # Chunk 4 went back to boundary 2 with the same keys: it is chunk 2 again, pixel for pixel (and 5 is 3).
    assert all(np.array_equal(a, b) for a, b in zip(chunk[4] + chunk[5], chunk[2] + chunk[3], strict=True))
    assert not np.array_equal(chunk[4][0], chunk[3][0]), "and not merely the chunk before it"
    server.settled(baseline)


def test_a_rewind_past_the_held_points_is_refused_clearly(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The server keeps every boundary of the last 2 s (16 chunks of fake-kv), then every other one:
    # boundary 1 is thinned out 20 chunks later.
    ticks = 20
    argv = ["--keys", f"-*{ticks}", "--rewind-to", "1", "--rewind-after", str(ticks - 1)]
    assert client.main([server.base_url, *argv, "--out", str(tmp_path)]) == 1
    assert "rewind_unavailable" in capsys.readouterr().err


async def watch_and_branch(url: str, tmp_path: Path) -> tuple[list[client_lib.Chunk], int, int, int]:
    """A player holding d; while it plays, a viewer (``--watch``); then a branch (``--branch``) from two chunks
    back (a boundary the server still holds). Returns the player's chunks, both exit codes and the branch point."""
    player = client_lib.Session(await client_lib.connect(client_lib.session_url(url)))
    try:
        await player.start(codec="raw", seed=11)
        token = player.share_token
        assert token, "the server offers a share token"
        await player.send_input(controls={"keys": ["d"]})
        played: list[client_lib.Chunk] = []
        watch_argv = [url, "--watch", token, "--chunks", "3", "--codec", "raw", "--out", str(tmp_path / "watched")]
        watching = asyncio.create_task(asyncio.to_thread(client.main, watch_argv))
        while not watching.done():  # the player plays on while the viewer watches
            await player.send_tick()
            played.append(await player.receive_chunk())
        watch_code = watching.result()
        boundary = len(played) - 2
        branch_argv = [url, "--branch", token, "--chunk", str(boundary), "--keys", "d*2", "--codec", "raw"]
        branch_code = await asyncio.to_thread(client.main, [*branch_argv, "--out", str(tmp_path / "branch")])
        for _ in range(2):  # the source plays on after the branch
            await player.send_tick()
            played.append(await player.receive_chunk())
        await player.close()
    finally:
        await player.ws.close()
    return played, watch_code, branch_code, boundary


def test_watch_and_branch_a_live_session(
    server: LiveServer, baseline: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    played, watch_code, branch_code, boundary = asyncio.run(watch_and_branch(server.base_url, tmp_path))
    output = capsys.readouterr().out
    assert watch_code == 0 and branch_code == 0, output
    by_index = {int(chunk.message["chunk_index"]): chunk.frames for chunk in played}

    # The viewer saved three consecutive chunks of the player's session, exactly as the player got them.
    watched = saved_frames(tmp_path / "watched")
    per_chunk = len(played[0].frames)
    assert len(watched) == 3 * per_chunk
    first = int(watched[0][0, 0, 1]) // per_chunk  # G is the frame's absolute position
    expected = [frame for index in range(first, first + 3) for frame in by_index[index]]
    assert all(np.array_equal(a, b) for a, b in zip(watched, expected, strict=True))
    assert "as viewer v" in output and "viewers at the end: 1; chunks skipped for this viewer: 0" in output

    # The branch from that boundary, with d held as the source had it, plays its next two chunks as the source did.
    branch = saved_frames(tmp_path / "branch")
    assert f"branched from chunk {boundary}" in output and f"chunk indexes: {boundary}-{boundary + 1}" in output
    source = by_index[boundary] + by_index[boundary + 1]
    assert len(branch) == len(source)
    assert all(np.array_equal(a, b) for a, b in zip(branch, source, strict=True))
    assert [int(chunk.message["chunk_index"]) for chunk in played] == list(range(len(played))), "the source went on"
    server.settled(baseline)


async def branch_from_now(url: str, tmp_path: Path) -> int:
    """A player plays three chunks, then ``--branch TOKEN`` with no ``--chunk``; returns its exit code."""
    player = client_lib.Session(await client_lib.connect(client_lib.session_url(url)))
    try:
        await player.start(codec="raw", seed=5)
        assert player.share_token
        for _ in range(3):
            await player.send_tick()
            await player.receive_chunk()
        argv = [url, "--branch", player.share_token, "--keys", "-*2", "--codec", "raw", "--out", str(tmp_path)]
        code = await asyncio.to_thread(client.main, argv)
        await player.close()
    finally:
        await player.ws.close()
    return code


def test_a_branch_without_a_chunk_starts_where_the_session_is_now(
    server: LiveServer, baseline: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert asyncio.run(branch_from_now(server.base_url, tmp_path)) == 0
    output = capsys.readouterr().out
    assert "branched from chunk 3" in output and "chunk indexes: 3-4" in output
    server.settled(baseline)


def test_a_share_token_the_server_cannot_honour(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert client.main([server.base_url, "--watch", "r0.no-such-session", "--out", str(tmp_path / "w")]) == 1
    assert "share_failed" in capsys.readouterr().err
    argv = ["--branch", "r0.no-such-session", "--chunk", "0", "--keys", "-*2"]
    assert client.main([server.base_url, *argv, "--out", str(tmp_path / "b")]) == 1
    assert "share_failed" in capsys.readouterr().err


async def watch_then_take_control(url: str, out: Path) -> tuple[int, list[int]]:
    """A player; a ``--watch`` client; once it watches, the player passes it the controls and watches."""
    player = client_lib.Session(await client_lib.connect(client_lib.session_url(url)))
    try:
        await player.start(codec="raw")
        token = player.share_token
        assert token
        argv = [url, "--watch", token, "--chunks", "6", "--codec", "raw", "--out", str(out)]
        watching = asyncio.create_task(asyncio.to_thread(client.main, argv))
        while not player.viewers.get("ids"):  # tick until the viewer shows in a viewers message
            await player.send_tick()
            await player.receive_chunk()
        await player.pass_control(player.viewers["ids"][0])
        seen: list[int] = []
        while not watching.done():  # now a viewer itself: it gets the chunks the new controller asks for
            try:
                seen.append(int((await player.receive_chunk()).message["chunk_index"]))
            except client_lib.SessionClosed:
                break
        return await watching, seen
    finally:
        await player.ws.close()


def test_a_watching_client_handed_the_controls_asks_for_its_chunks(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, seen = asyncio.run(watch_then_take_control(server.base_url, tmp_path))
    output = capsys.readouterr().out
    assert code == 0, output
    assert "passed control to this client" in output
    assert len(saved_frames(tmp_path)) == 6 * 2, "all six chunks came, most of them asked for by the watcher"
    assert seen, "the old player, a viewer now, saw the chunks the new controller asked for"

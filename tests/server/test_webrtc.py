"""WebRTC video for protocol-1 sessions (PROTOCOL.md, "WebRTC video"): a real server, an aiortc client.

The client offers (non-trickle) on the session's WebSocket, reads the answer, and plays the track while the
`chunk` messages go on arriving on the WebSocket. Each decoded frame maps back to its chunk by its RTP
timestamp (track frame number times the step); fake-kv paints a frame's absolute position into its green
channel, so the mapping is checked against the picture too.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from arstream.app import webrtc_track
from arstream.app.wire import parse_frame
from arstream.models.fake import FakeKVPipeline
from arstream.programs import client
from servers import REPO_ROOT, LiveServer, ProbeClient, fake_settings, running_server, session_client, wait_until
from webrtc_clients import connect_video, next_of, offer_sdp, play_on_a_new_track

aiortc = pytest.importorskip("aiortc")

GUARD_S = 30.0  # hang guard only
FPS = 16  # fake-kv's model card
STEP = webrtc_track.frame_step(FPS)
CHUNKS = 6
# Chunks played on the WebSocket before the offer: the video path starts mid-session, and fake-kv's green
# has grown past the near-black values that YUV's limited range clips.
CHUNKS_BEFORE = 20


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server(fake_settings(webrtc=True), FakeKVPipeline(width=64, height=64)) as live:
        yield live


def test_a_session_plays_on_the_track_and_each_frame_maps_to_its_chunk(server: LiveServer) -> None:
    async def scenario() -> tuple[list[dict[str, Any]], list[tuple[int, int]], str]:
        async with session_client(server.ws_url, start={"seed": 3}) as client:
            for tick_id in range(CHUNKS_BEFORE):
                await client.send(type="tick", tick_id=tick_id)
                await client.recv_chunk()
            pc, track_future, answer = await connect_video(client)
            try:
                chunks = []
                for tick_id in range(CHUNKS_BEFORE, CHUNKS_BEFORE + CHUNKS):
                    await client.send(type="tick", tick_id=tick_id, controls={"keys": []})
                    chunk = await next_of(client, "chunk")
                    assert chunk["tick_id"] == tick_id
                    chunks.append(chunk)
                track = await asyncio.wait_for(track_future, GUARD_S)
                # The receiver lets a frame out once the next one begins: every chunk's but the last's.
                wanted = sum(c["frames"] for c in chunks[:-1])
                decoded = []
                for _ in range(wanted):
                    frame = await asyncio.wait_for(track.recv(), GUARD_S)
                    green = int(frame.to_ndarray(format="rgb24")[..., 1].mean().round())
                    decoded.append((frame.pts // STEP, green))
            finally:
                await pc.close()
            await client.send(type="close")
            await next_of(client, "closed")
            return chunks, decoded, answer["codec"]

    chunks, decoded, codec = asyncio.run(scenario())
    assert codec in ("H264", "VP8")
    assert all(c["delivery"] == "webrtc" for c in chunks)
    # consecutive chunks hold consecutive track frames, from frame 0 on
    assert [c["track_frame"] for c in chunks] == [2 * i for i in range(CHUNKS)]
    # the chunk messages' RTP timestamps follow the track frame numbers (the browser test maps frames by them)
    origin = chunks[0]["rtp_timestamp"]
    assert [(c["rtp_timestamp"] - origin) % 2**32 for c in chunks] == [c["track_frame"] * STEP for c in chunks]
    # every frame decoded once, in order, and numbered as its chunk message says
    assert [number for number, _ in decoded] == list(range(2 * (CHUNKS - 1)))
    # the picture agrees: fake-kv's green is the frame's position in the rollout, chunk_index * 2 + frame
    by_number = {c["track_frame"] + i: c["chunk_index"] * 2 + i for c in chunks for i in range(c["frames"])}
    for number, green in decoded:
        assert abs(green - by_number[number] % 256) <= 3, (number, green)
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)
    wait_until(lambda: server.stats()["kv"]["sessions_resident"] == 0)


def test_a_dropped_connection_closes_its_peer_connection_and_returns_its_kv(server: LiveServer) -> None:
    async def scenario() -> int:
        async with session_client(server.ws_url, start={}) as client:
            pc, _, _ = await connect_video(client)
            await client.send(type="tick", tick_id=0)
            assert (await next_of(client, "chunk"))["delivery"] == "webrtc"
            held = webrtc_track.open_peer_connections()
            client.abort()
        await pc.close()
        return held

    assert asyncio.run(scenario()) == 1
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)
    stats = server.stats()
    wait_until(lambda: server.stats()["kv"]["blocks_used"] == 0)
    assert stats["webrtc"]["available"] is True


def test_a_bad_offer_is_refused_and_the_session_goes_on_over_the_websocket(server: LiveServer) -> None:
    async def scenario() -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
        async with session_client(server.ws_url, start={}) as client:
            await client.send(type="webrtc_offer", sdp="v=0\r\nthis is not SDP\r\n")
            refused = await next_of(client, "error")
            await client.send(type="tick", tick_id=0)
            chunk, frames = await client.recv_chunk()
            return refused, chunk, [f[0].codec for f in frames]

    refused, chunk, codecs = asyncio.run(scenario())
    assert refused["code"] == "webrtc_failed" and refused["fatal"] is False
    assert "delivery" not in chunk and len(codecs) == chunk["frames"]
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)


def test_a_second_offer_is_refused(server: LiveServer) -> None:
    async def scenario() -> dict[str, Any]:
        async with session_client(server.ws_url, start={}) as client:
            pc, _, _ = await connect_video(client)
            another = aiortc.RTCPeerConnection()
            try:
                await client.send(type="webrtc_offer", sdp=await offer_sdp(another))
                return await next_of(client, "error")
            finally:
                await another.close()
                await pc.close()

    refused = asyncio.run(scenario())
    assert refused["code"] == "webrtc_failed" and "already" in refused["message"]
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)


def test_an_offer_before_start_is_start_required(server: LiveServer) -> None:
    async def scenario() -> tuple[int | None, list[dict[str, Any]]]:
        async with session_client(server.ws_url) as client:
            await client.send(type="webrtc_offer", sdp="v=0\r\n")
            closed = await client.closed_by_server()
            return closed.code, closed.messages

    code, messages = asyncio.run(scenario())
    assert code == 1008 and messages[0]["code"] == "start_required"
    assert webrtc_track.open_peer_connections() == 0


def test_a_controller_on_webrtc_that_passes_control_watches_in_its_own_codec(server: LiveServer) -> None:
    async def scenario() -> tuple[dict[str, Any], list[Any], dict[str, Any], list[Any]]:
        async with session_client(server.ws_url, start={"codec": "jpeg"}) as player:
            token = player.ready["share"]["token"]  # type: ignore[index]
            async with session_client(f"{server.ws_url}?share={token}", start={"watch": token}) as viewer:
                pc, _, _ = await connect_video(player)
                try:
                    await player.send(type="tick", tick_id=0)
                    assert (await next_of(player, "chunk"))["delivery"] == "webrtc"
                    await player.send(type="pass_control", to=viewer.ready["viewer_id"])  # type: ignore[index]
                    assert (await next_of(viewer, "role"))["role"] == "controller"
                    assert (await next_of(player, "role"))["role"] == "viewer"
                    await viewer.send(type="tick", tick_id=1)
                    own, own_frames = await chunk_after(viewer, 1)
                    watched, watched_frames = await chunk_after(player, 1)
                finally:
                    await pc.close()
            return own, own_frames, watched, watched_frames

    async def chunk_after(client: ProbeClient, tick_id: int) -> tuple[dict[str, Any], list[Any]]:
        """The chunk of ``tick_id`` and its frames' headers (earlier chunks and other messages passed over)."""
        while True:
            chunk = await next_of(client, "chunk")
            if chunk["tick_id"] != tick_id:
                continue
            headers = []
            for _ in range(chunk["frames"]):
                message = await client.recv()
                assert isinstance(message, bytes), message
                headers.append(parse_frame(message)[0])
            return chunk, headers

    own, own_frames, watched, watched_frames = asyncio.run(scenario())
    # the new controller's chunk and the old one's copy are JPEG on the WebSocket, not raw pixels
    assert "delivery" not in own and "delivery" not in watched
    assert {header.codec.name for header in own_frames + watched_frames} == {"JPEG"}
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)


def test_a_peer_that_goes_away_sends_the_session_back_to_the_websocket(server: LiveServer) -> None:
    async def scenario() -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
        async with session_client(server.ws_url, start={"codec": "jpeg"}) as client:
            pc, _, _ = await connect_video(client)
            await client.send(type="tick", tick_id=0)
            assert (await next_of(client, "chunk"))["delivery"] == "webrtc"
            await pc.close()  # the client's side ends (DTLS close): the server's connection ends too
            state = await next_of(client, "webrtc_state")
            await client.send(type="tick", tick_id=1)
            chunk, frames = await client.recv_chunk()
            return state, chunk, [header.codec.name for header, _ in frames]

    state, chunk, codecs = asyncio.run(scenario())
    assert state["state"] in ("closed", "failed"), state
    assert "delivery" not in chunk and codecs == ["JPEG"] * chunk["frames"]
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)


def test_a_server_without_webrtc_refuses_the_offer_and_plays_on() -> None:
    async def scenario(server: LiveServer) -> tuple[dict[str, Any], dict[str, Any]]:
        async with session_client(server.ws_url, start={}) as client:
            await client.send(type="webrtc_offer", sdp="v=0\r\n")
            refused = await next_of(client, "error")
            await client.send(type="tick", tick_id=0)
            chunk, _ = await client.recv_chunk()
            return refused, chunk

    with running_server(fake_settings()) as off:
        refused, chunk = asyncio.run(scenario(off))
        webrtc = off.stats()["webrtc"]
        assert (webrtc["available"], webrtc["peer_connections"]) == (False, 0)
    assert (refused["code"], refused["fatal"]) == ("webrtc_failed", False) and "--webrtc" in refused["message"]
    assert "delivery" not in chunk


def test_a_viewer_of_a_controller_on_webrtc_gets_every_chunk_on_its_websocket(server: LiveServer) -> None:
    async def scenario() -> list[tuple[dict[str, Any], list[Any]]]:
        async with session_client(server.ws_url, start={"codec": "jpeg"}) as player:
            token = player.ready["share"]["token"]  # type: ignore[index]
            async with session_client(f"{server.ws_url}?share={token}", start={"watch": token}) as viewer:
                pc, _, _ = await connect_video(player)
                seen = []
                try:
                    for tick_id in range(3):
                        await player.send(type="tick", tick_id=tick_id)
                        assert (await next_of(player, "chunk"))["delivery"] == "webrtc"
                        chunk = await next_of(viewer, "chunk")
                        headers = [parse_frame(await viewer.recv())[0] for _ in range(chunk["frames"])]  # type: ignore[arg-type]
                        seen.append((chunk, headers))
                finally:
                    await pc.close()
            return seen

    seen = asyncio.run(scenario())
    assert [chunk["tick_id"] for chunk, _ in seen] == [0, 1, 2]
    assert all("delivery" not in chunk for chunk, _ in seen)
    assert {header.codec.name for _, headers in seen for header in headers} == {"JPEG"}


def test_a_viewer_takes_webrtc_on_a_track_of_its_own() -> None:
    """A viewer's frames on its own track, its chunk messages on its WebSocket: raw pixels encoded apart while its
    controller plays JPEG, the controller's own pixels once it is on a track too; its peer counts in the cap."""

    async def scenario(server: LiveServer) -> tuple[list[dict[str, Any]], list[tuple[int, int]], dict[str, Any], Any]:
        async with session_client(server.ws_url, start={"codec": "jpeg", "seed": 3}) as player:
            for tick_id in range(CHUNKS_BEFORE):
                await player.send(type="tick", tick_id=tick_id)
                await player.recv_chunk()
            token = player.ready["share"]["token"]  # type: ignore[index]
            watch_url = f"{server.ws_url}?share={token}"
            async with session_client(watch_url, start={"watch": token}) as viewer:
                pc = aiortc.RTCPeerConnection()
                inputs = InputChannel(pc)
                pc, track_future, _ = await connect_video(viewer, pc)
                player_pc: Any = None
                try:
                    await asyncio.wait_for(inputs.opened.wait(), GUARD_S)
                    inputs.input(1, ["w"])
                    await inputs.taken(1)  # a viewer's channel answers pings; its inputs are not the session's
                    not_controller = await next_of(viewer, "error")
                    chunks = []
                    for tick_id in range(CHUNKS_BEFORE, CHUNKS_BEFORE + CHUNKS):
                        if tick_id == CHUNKS_BEFORE + CHUNKS // 2:
                            player_pc, _, _ = await connect_video(player)  # from now on the viewer shares its pixels
                        await player.send(type="tick", tick_id=tick_id)
                        await next_of(player, "chunk")
                        chunks.append(await next_of(viewer, "chunk"))
                    async with session_client(watch_url, start={"watch": token}) as another:
                        third = aiortc.RTCPeerConnection()
                        try:
                            await another.send(type="webrtc_offer", sdp=await offer_sdp(third))
                            refused = await next_of(another, "error")  # the player and the viewer hold both slots
                        finally:
                            await third.close()
                    track = await asyncio.wait_for(track_future, GUARD_S)
                    decoded = []
                    for _ in range(sum(c["frames"] for c in chunks[:-1])):  # the last chunk's last frame is held
                        frame = await asyncio.wait_for(track.recv(), GUARD_S)
                        decoded.append((frame.pts // STEP, int(frame.to_ndarray(format="rgb24")[..., 1].mean().round())))
                finally:
                    await pc.close()
            # the viewer left: its peer connection is closed, the player's holds on
            wait_until(lambda: webrtc_track.open_peer_connections() == 1)
            await player_pc.close()
            return chunks, decoded, refused, not_controller

    settings = fake_settings(webrtc=True, webrtc_max_peers=2)
    with running_server(settings, FakeKVPipeline(width=64, height=64)) as server:
        chunks, decoded, refused, not_controller = asyncio.run(scenario(server))
        wait_until(lambda: webrtc_track.open_peer_connections() == 0)
    assert [c["tick_id"] for c in chunks] == list(range(CHUNKS_BEFORE, CHUNKS_BEFORE + CHUNKS))
    assert all(c["delivery"] == "webrtc" and c["skipped_before"] == 0 for c in chunks)
    assert [c["track_frame"] for c in chunks] == [2 * i for i in range(CHUNKS)] and "rtp_timestamp" in chunks[-1]
    assert [number for number, _ in decoded] == list(range(2 * (CHUNKS - 1)))
    by_number = {c["track_frame"] + i: c["chunk_index"] * 2 + i for c in chunks for i in range(c["frames"])}
    for number, green in decoded:  # fake-kv's green is the frame's position in the rollout
        assert abs(green - by_number[number] % 256) <= 3, (number, green)
    assert (refused["code"], refused["fatal"]) == ("webrtc_failed", False) and "2 WebRTC peer" in refused["message"]
    assert (not_controller["code"], not_controller["fatal"]) == ("not_controller", False)
    assert all(chunk["applied_event_ids"] == [] for chunk in chunks)


def test_a_refused_pass_leaves_the_controller_on_the_track(server: LiveServer) -> None:
    async def scenario() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        async with session_client(server.ws_url, start={"codec": "jpeg"}) as client:
            pc, _, _ = await connect_video(client)
            try:
                await client.send(type="tick", tick_id=0)
                assert (await next_of(client, "chunk"))["delivery"] == "webrtc"
                await client.send(type="pass_control", to="v-nobody")
                refused = await next_of(client, "error")
                chunks = []
                for tick_id in (1, 2):
                    await client.send(type="tick", tick_id=tick_id)
                    chunks.append(await next_of(client, "chunk"))
            finally:
                await pc.close()
            return refused, chunks

    refused, chunks = asyncio.run(scenario())
    assert refused["code"] == "unknown_viewer" and refused["fatal"] is False
    # control stayed, and so did the track: the next chunks are on it, not JPEG on the WebSocket
    assert [(c["tick_id"], c["delivery"]) for c in chunks] == [(1, "webrtc"), (2, "webrtc")]
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)


class InputChannel:
    """The client's `inputs` data channel, ordered and reliable here: a pong then says every input sent before
    its ping was taken (the protocol lets a client choose; a browser would send unordered, unreliable)."""

    def __init__(self, pc: Any) -> None:
        self.channel = pc.createDataChannel("inputs")
        self.opened = asyncio.Event()
        self.received: asyncio.Queue[Any] = asyncio.Queue()
        self.channel.on("open", self.opened.set)
        self.channel.on("message", self.received.put_nowait)

    def input(self, event_id: int, keys: list[str]) -> None:
        self.channel.send(json.dumps({"type": "input", "event_id": event_id, "controls": {"keys": keys}}))

    async def taken(self, t: int) -> None:
        """Ping, and wait for its pong: the server has taken everything sent before."""
        self.channel.send(json.dumps({"type": "ping", "t": t}))
        pong = json.loads(await asyncio.wait_for(self.received.get(), GUARD_S))
        assert (pong["type"], pong["t"]) == ("pong", t), pong


def test_inputs_on_the_data_channel_latest_wins(server: LiveServer) -> None:
    async def scenario() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with session_client(server.ws_url, start={}) as client:
            pc = aiortc.RTCPeerConnection()
            inputs = InputChannel(pc)
            await connect_video(client, pc)
            try:
                await asyncio.wait_for(inputs.opened.wait(), GUARD_S)
                await client.send(type="input", event_id=1, controls={"keys": ["a"]})  # the WebSocket's: kept
                ack = await next_of(client, "ack")
                for event_id, keys in ((2, ["w"]), (3, ["w", "a"]), (4, ["w", "d"])):
                    inputs.input(event_id, keys)
                await inputs.taken(1)
                await client.send(type="tick", tick_id=0)
                early: list[dict[str, Any]] = []
                first = await next_of(client, "chunk", early)
                assert early == []
                inputs.input(3, ["s"])  # overtaken: dropped without a word
                inputs.channel.send("not json")
                inputs.channel.send(json.dumps({"type": "tick", "tick_id": 9}))
                inputs.input(5, ["d"])
                await inputs.taken(2)
                await client.send(type="tick", tick_id=1)
                refusals: list[dict[str, Any]] = []
                second = await next_of(client, "chunk", refusals)
            finally:
                await pc.close()
            return ack, first, second, refusals[0], refusals[1]

    ack, first, second, not_json, not_input = asyncio.run(scenario())
    assert ack["event_id"] == 1
    # the newest channel input replaced the two pending before it; the WebSocket's input is never replaced
    assert first["applied_event_ids"] == [1, 4]
    assert second["applied_event_ids"] == [5]
    for refusal in (not_json, not_input):
        assert (refusal["type"], refusal["code"], refusal["fatal"]) == ("error", "invalid_message", False), refusal
    assert "input and ping" in not_input["message"]
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)


def test_the_client_program_receives_on_the_track(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = client.main([server.base_url, "--webrtc", "--keys", "d*3,w*3", "--out", str(tmp_path / "out")])
    output = capsys.readouterr().out
    assert code == 0, output
    assert "frames by WebRTC (H264)" in output
    # every chunk after the track connected came on it; a receiver holds back the last frame sent
    assert "delivery: WebRTC (H264), 11 frames on the track" in output, output
    assert len(list((tmp_path / "out").glob("frame_*.png"))) == 11
    assert "action-to-frame" in output and "n=2" in output
    # the first frame counted on the track too (it printed n/a when every frame came on the track)
    assert re.search(r"^time to first frame: [0-9.]+ ms", output, re.MULTILINE), output
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)


def test_the_copyable_example_saves_the_frames_the_track_showed(server: LiveServer, tmp_path: Path) -> None:
    example = REPO_ROOT / "docs" / "examples" / "client_webrtc.py"
    result = subprocess.run(
        [sys.executable, str(example), server.ws_url, "d", "5", str(tmp_path)],
        capture_output=True, text=True, timeout=120,  # hang guard only
    )
    assert result.returncode == 0, result.stderr
    assert "delivery: connected H264" in result.stdout
    # five chunks of two frames on the track; the receiver holds back the last one
    assert "9 frames saved" in result.stdout and "(9 from the track)" in result.stdout, result.stdout
    assert len(list(tmp_path.glob("*.png"))) == 9
    wait_until(lambda: server.stats()["kv"]["sessions_resident"] == 0)


def without_candidates(sdp: str) -> str:
    """An offer whose ICE can never complete: no candidates, and more promised (no end-of-candidates)."""
    kept = [line for line in sdp.split("\r\n") if not line.startswith(("a=candidate", "a=end-of-candidates"))]
    return "\r\n".join(kept)


def test_a_peer_that_never_connects_is_dropped_at_the_deadline_and_its_slot_returned() -> None:
    async def scenario(server: LiveServer) -> tuple[dict[str, Any], dict[str, Any], int, dict[str, Any]]:
        async with session_client(server.ws_url, start={}) as stuck, session_client(server.ws_url, start={}) as other:
            silent, pc = aiortc.RTCPeerConnection(), aiortc.RTCPeerConnection()
            try:
                await stuck.send(type="webrtc_offer", sdp=without_candidates(await offer_sdp(silent)))
                await next_of(stuck, "webrtc_answer")  # never applied: this client sends no ICE check
                await other.send(type="webrtc_offer", sdp=await offer_sdp(pc))
                refused = await next_of(other, "error")  # the one slot is held
                state = await next_of(stuck, "webrtc_state")  # the deadline
                wait_until(lambda: webrtc_track.open_peer_connections() == 0)
                await stuck.send(type="tick", tick_id=0)
                chunk, _ = await stuck.recv_chunk()  # the session plays on, over the WebSocket
                await pc.close()
                pc = aiortc.RTCPeerConnection()
                await connect_video(other, pc)  # the slot came back: the other session's offer is answered
                await other.send(type="tick", tick_id=0)
                on_track = await next_of(other, "chunk")
                return refused, state, chunk["frames"], on_track
            finally:
                await silent.close()
                await pc.close()

    settings = fake_settings(webrtc=True, webrtc_max_peers=1, webrtc_connect_timeout_s=1.0)
    with running_server(settings, FakeKVPipeline(width=64, height=64)) as bounded:
        refused, state, frames, on_track = asyncio.run(scenario(bounded))
        wait_until(lambda: webrtc_track.open_peer_connections() == 0)
    assert (refused["code"], refused["fatal"]) == ("webrtc_failed", False) and "1 WebRTC peer" in refused["message"]
    assert state == {"type": "webrtc_state", "state": "failed"}
    assert frames == 2 and on_track["delivery"] == "webrtc"


def test_a_resumed_session_offers_again_and_plays_on_a_new_track() -> None:
    async def scenario(server: LiveServer) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]], list[int]]:
        async with session_client(server.ws_url, start={}) as first:
            token = first.ready["resume"]["token"]  # type: ignore[index]
            pc, _, _ = await connect_video(first)
            await first.send(type="tick", tick_id=0)
            before = await next_of(first, "chunk")
            first.abort()  # the connection drops: the server closes its peer connection, the session waits
        await pc.close()
        await asyncio.to_thread(
            server.wait_for_stats, lambda s: s["sessions"]["detached"] == 1 and s["webrtc"]["peer_connections"] == 0
        )
        async with session_client(f"{server.ws_url}?resume={token}", start={"resume": token}) as second:
            chunks, greens = await play_on_a_new_track(second, (1, 2))  # the client renegotiates on the new socket
            return second.ready, before, chunks, greens  # type: ignore[return-value]

    settings = fake_settings(webrtc=True, replica_id="r0", resume_grace_s=30.0)
    with running_server(settings, FakeKVPipeline(width=64, height=64)) as server:
        ready, before, chunks, greens = asyncio.run(scenario(server))
        wait_until(lambda: webrtc_track.open_peer_connections() == 0)
    assert before["delivery"] == "webrtc" and ready["resumed"]
    # the world goes on where it was (chunk 1, 2), on a new track numbered from 0
    assert [(c["chunk_index"], c["delivery"], c["track_frame"]) for c in chunks] == [(1, "webrtc", 0), (2, "webrtc", 2)]
    assert all(abs(green - (2 + i)) <= 3 for i, green in enumerate(greens)), greens  # frames 2 and 3 of the rollout


def sent_counters(server: LiveServer) -> dict[str, float]:
    """The server's sent-frame counters from /metrics."""
    names = ("arstream_frames_sent_total", "arstream_bytes_sent_total", "arstream_webrtc_frames_sent_total")
    found = {}
    for line in server.get("/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            found[name] = float(value)
    return found


def test_track_frames_are_counted_apart_from_websocket_bytes(server: LiveServer) -> None:
    async def scenario() -> int:
        async with session_client(server.ws_url, start={"codec": "jpeg"}) as client:
            await client.send(type="tick", tick_id=0)
            chunk = await next_of(client, "chunk")  # on the WebSocket: JPEG frames as binary messages
            messages = [await client.recv() for _ in range(chunk["frames"])]
            websocket_bytes = sum(len(message) for message in messages)
            pc, _, _ = await connect_video(client)
            try:
                for tick_id in (1, 2, 3):
                    await client.send(type="tick", tick_id=tick_id)
                    assert (await next_of(client, "chunk"))["delivery"] == "webrtc"
            finally:
                await pc.close()
            return websocket_bytes

    before = sent_counters(server)
    websocket_bytes = asyncio.run(scenario())
    after = sent_counters(server)
    change = {name: after[name] - before.get(name, 0.0) for name in after}
    assert change == {
        "arstream_frames_sent_total": 2,  # binary frame messages: the first chunk's
        "arstream_bytes_sent_total": websocket_bytes,  # their bytes only, not the track's raw pixels
        "arstream_webrtc_frames_sent_total": 6,
    }
    wait_until(lambda: webrtc_track.open_peer_connections() == 0)

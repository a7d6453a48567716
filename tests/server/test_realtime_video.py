"""vLLM-Omni's realtime video dialect, ``WS /v1/realtime/video``: conformance per event, against a real server.

Each test talks to a real uvicorn server with a real ``websockets`` client:
``session.start`` -> ``video.start``, ``video.chunk_metadata`` + one fMP4
binary per chunk, ``session.done``; ``session.ping`` -> ``session.pong``;
``session.interaction`` -> ``session.interaction.queued`` and the model's
controls; ``session.stop``; every bad event gets vLLM-Omni's error shape and
ends nothing else. vLLM-Omni's own example client runs unchanged against
``arstream serve``. The fake-kv model paints a chunk's blue channel with the
code of its held keys, so a camera event that reached the model shows in the
decoded pixels.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import torch
from PIL import Image

from arstream.app.prompts import MAX_PROMPT_CHARS, MAX_PROMPT_LINES
from arstream.app.realtime_video import PATH
from arstream.app.realtime_video_events import (
    MAX_CONTROL_MESSAGE_BYTES,
    SEED_WRAP,
    camera_move,
    camera_to_controls,
    chunks_for_frames,
)
from arstream.models.fake import FakeKVPipeline, controls_code
from arstream.runner.contract import DEFAULT_NUM_FRAMES
from servers import (
    RECEIVE_GUARD_S,
    REPO_ROOT,
    LiveServer,
    ProbeClient,
    fake_settings,
    running_server,
    server_process,
    session_client,
)

WIDTH, HEIGHT = 64, 48
MODEL = "fake-kv"
FRAMES_PER_CHUNK = 2  # fake-kv's default spec
OUTSIDE_CLIENT = Path(__file__).resolve().parents[1] / "realtime_video_client.py"  # our own, from PROTOCOL.md
ERROR_FIELDS = {"type", "message", "code", "request_id", "event_id"}
# A start without num_frames gets the model's default length (81 frames: 41 chunks, which fake-kv makes in a
# blink); a session a test ends with session.stop asks for more than it will ever make.
UNTIL_STOPPED = {"num_frames": 10**9}


def start_message(**fields: Any) -> dict[str, Any]:
    base = {"type": "session.start", "model": MODEL, "prompt": "a test world", "width": WIDTH, "height": HEIGHT}
    return {**base, **fields}


def camera(translation: list[float], rotation: list[float] | None = None, mode: str = "velocity") -> dict[str, Any]:
    return {"mode": mode, "data": {"translation": translation, "rotation": rotation or [0.0, 0.0, 0.0, 1.0]}}


def interaction(event: dict[str, Any], event_id: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"event": event, **extra}
    if event_id is not None:
        body["event_id"] = event_id
    return {"type": "session.interaction", "interaction": body}


def decode_fmp4(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data), mode="r", format="mp4") as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    # reads_prompt: the fake's card says it blends prompt changes (a model that reads none refuses them)
    options = {"width": WIDTH, "height": HEIGHT, "reads_prompt": True}
    with running_server(fake_settings(model_options=options)) as live:
        yield live


def video_url(server: LiveServer) -> str:
    return server.base_url.replace("http://", "ws://", 1) + PATH


class Stream:
    """What a dialect session received: events by type, chunk metadata, and the binary messages."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.metadata: list[dict[str, Any]] = []
        self.payloads: list[bytes] = []
        self.pending: dict[str, Any] | None = None  # chunk metadata whose binary has not come yet

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    @property
    def data(self) -> bytes:
        return b"".join(self.payloads)


async def read_until_done(client: ProbeClient, stream: Stream, *, until: str = "session.done") -> Stream:
    """Read events and binaries until ``until`` arrives; each binary must follow its chunk metadata at once."""
    while True:
        message = await client.recv()
        if isinstance(message, bytes):
            assert stream.pending is not None, "a binary message came without video.chunk_metadata before it"
            assert stream.pending["byte_length"] == len(message)
            stream.payloads.append(message)
            stream.pending = None
            continue
        assert stream.pending is None, f"video.chunk_metadata was not followed by its binary, but by {message[:200]}"
        event = json.loads(message)
        stream.events.append(event)
        if event["type"] == "video.chunk_metadata":
            stream.metadata.append(event)
            stream.pending = event
        if event["type"] == until:
            return stream


async def run_session(
    server: LiveServer, start: dict[str, Any], *sends: dict[str, Any] | str, chunks_after: int = 0
) -> tuple[Stream, int]:
    """Start, send ``sends`` right after video.start, read to session.done; the stream and the close code.

    With ``chunks_after``, the session is endless: after ``sends`` a ping's pong proves they were all handled
    (replies keep their order), then ``chunks_after`` more chunks must come before ``session.stop`` ends it.
    """
    async with session_client(video_url(server)) as client:
        await client.send(**start)
        stream = Stream()
        await read_until_done(client, stream, until="video.start")
        for message in sends:
            await client.send_text(message if isinstance(message, str) else json.dumps(message))
        if chunks_after:
            await client.send(type="session.ping")
            await read_until_done(client, stream, until="session.pong")
            for _ in range(chunks_after):
                await read_until_done(client, stream, until="video.chunk_metadata")
            await client.send(type="session.stop")
        await read_until_done(client, stream)
        closed = await client.closed_by_server()
        return stream, closed.code or 0


async def until_started(client: ProbeClient, stream: Stream, event_id: str) -> dict[str, Any]:
    """Read until the chunk that starts ``event_id``; its metadata."""
    while not any(m["started_event_ids"] == [event_id] for m in stream.metadata):
        await read_until_done(client, stream, until="video.chunk_metadata")
    return stream.metadata[-1]


async def run_interaction(server: LiveServer, message: dict[str, Any], event_id: str, *, chunks_after: int) -> Stream:
    """A session that sends ``message`` at once, reads to the chunk that starts ``event_id`` and ``chunks_after``
    more, then stops."""
    async with session_client(video_url(server)) as client:
        await client.send(**start_message(**UNTIL_STOPPED))
        stream = Stream()
        await read_until_done(client, stream, until="video.start")
        await client.send(**message)
        await until_started(client, stream, event_id)
        for _ in range(chunks_after):
            await read_until_done(client, stream, until="video.chunk_metadata")
        await client.send(type="session.stop")
        await read_until_done(client, stream)
        return stream


# ---- session.start, video.start, video.chunk_metadata, binary, session.done ---------------------------


def test_a_session_streams_one_fmp4_fragment_per_chunk_that_decodes(server: LiveServer, baseline: int) -> None:
    stream, close_code = asyncio.run(run_session(server, start_message(num_frames=10, seed=3)))

    (start,) = stream.of_type("video.start")
    assert start["request_id"].startswith("video_stream-") and start["format"] == "m4s"
    assert start["config"]["prompt"] == "a test world" and start["config"]["num_frames"] == 10
    assert (start["config"]["width"], start["config"]["height"], start["config"]["fps"]) == (WIDTH, HEIGHT, 16)
    chunks = chunks_for_frames(10, {"frames_per_chunk": FRAMES_PER_CHUNK})
    assert chunks == 5
    assert [m["transport_chunk_index"] for m in stream.metadata] == list(range(chunks))
    assert [m["generation_chunk_index"] for m in stream.metadata] == list(range(chunks))
    for metadata in stream.metadata:
        assert metadata["request_id"] == start["request_id"] and metadata["kind"] == "media"
        assert metadata["num_frames"] == FRAMES_PER_CHUNK
        assert metadata["started_event_ids"] == metadata["active_event_ids"] == metadata["completed_event_ids"] == []
    # An init segment first, then a fragment per chunk: every chunk is whole the moment it arrives.
    assert stream.payloads[0][4:8] == b"ftyp" and b"moov" in stream.payloads[0][:2000]
    assert all(payload[4:8] == b"moof" for payload in stream.payloads[1:])
    for received in range(1, chunks + 1):
        frames = decode_fmp4(b"".join(stream.payloads[:received]))
        assert len(frames) == received * FRAMES_PER_CHUNK
    assert frames[0].shape == (HEIGHT, WIDTH, 3)
    assert stream.of_type("session.done") == [
        {"type": "session.done", "request_id": start["request_id"], "chunks": chunks, "stopped": False}
    ]
    assert close_code == 1000


def test_the_frames_are_the_models_frames(server: LiveServer, baseline: int) -> None:
    """The same rollout as protocol 1 with raw frames gives the same pixels, within H.264's loss."""
    stream, _ = asyncio.run(run_session(server, start_message(num_frames=6, seed=5)))

    async def raw_rollout() -> list[np.ndarray]:
        async with session_client(server.ws_url, start={"codec": "raw", "seed": 5, "prompt": "a test world"}) as client:
            frames: list[np.ndarray] = []
            for _ in range(3):
                await client.send(type="tick", tick_id=len(frames))
                _, received = await client.recv_chunk()
                frames += [pixels for _, pixels in received]
            await client.send(type="close")
            await client.closed_by_server()
            return frames

    expected = asyncio.run(raw_rollout())
    decoded = decode_fmp4(stream.data)
    assert len(decoded) == len(expected) == 6
    for got, want in zip(decoded, expected):
        assert np.abs(got.astype(int) - want.astype(int)).mean() < 3.0


# ---- session.ping, session.stop ------------------------------------------------------------------


def test_ping_gets_pong(server: LiveServer, baseline: int) -> None:
    stream, _ = asyncio.run(run_session(server, start_message(**UNTIL_STOPPED), chunks_after=1))
    assert stream.of_type("session.pong") == [{"type": "session.pong"}]


def test_stop_ends_the_session_with_done_stopped_and_returns_its_kv(server: LiveServer, baseline: int) -> None:
    async def stop_after_one_chunk() -> tuple[Stream, int]:
        async with session_client(video_url(server)) as client:
            await client.send(**start_message(**UNTIL_STOPPED))  # more frames than it makes before session.stop
            stream = Stream()
            await read_until_done(client, stream, until="video.chunk_metadata")
            await client.send(type="session.stop")
            await read_until_done(client, stream)
            return stream, (await client.closed_by_server()).code or 0

    stream, close_code = asyncio.run(stop_after_one_chunk())
    (done,) = stream.of_type("session.done")
    assert done["stopped"] is True and done["chunks"] >= 1
    assert close_code == 1000


def test_a_dropped_connection_returns_the_sessions_kv(server: LiveServer, baseline: int) -> None:
    async def drop_mid_stream() -> None:
        async with session_client(video_url(server)) as client:
            await client.send(**start_message(**UNTIL_STOPPED))
            await read_until_done(client, Stream(), until="video.chunk_metadata")
            client.abort()  # no session.stop, no close frame

    asyncio.run(drop_mid_stream())  # the baseline fixture then waits for every block to come back


# ---- session.interaction -------------------------------------------------------------------------


def test_a_camera_velocity_reaches_the_model_as_keys_and_is_reported_per_chunk(
    server: LiveServer, baseline: int
) -> None:
    move = interaction({"multi_modal_data": {"camera": camera([0.05, 0.0, 0.05])}}, "fwd-right")
    stream = asyncio.run(run_interaction(server, move, "fwd-right", chunks_after=2))

    request_id = stream.of_type("video.start")[0]["request_id"]
    assert stream.of_type("session.interaction.queued") == [
        {"type": "session.interaction.queued", "request_id": request_id, "event_id": "fwd-right"}
    ]
    (applied,) = [i for i, m in enumerate(stream.metadata) if m["started_event_ids"] == ["fwd-right"]]
    assert all(m["active_event_ids"] == ["fwd-right"] for m in stream.metadata[applied:])  # velocity holds
    assert all(m["active_event_ids"] == [] for m in stream.metadata[:applied])
    blue = [frame[..., 2].mean() for frame in decode_fmp4(stream.data)]
    code = controls_code({"keys": ["w", "d"]})
    assert code != 0
    before, after = blue[: applied * FRAMES_PER_CHUNK], blue[applied * FRAMES_PER_CHUNK :]
    # H.264 (4:2:0, limited range) blurs so dark a blue by a level or two; the two sides stay far apart.
    assert all(b < code / 2 for b in before) and all(b > code / 2 for b in after), (applied, blue)


def test_a_later_interaction_completes_the_one_it_replaces(server: LiveServer, baseline: int) -> None:
    async def three_interactions() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with session_client(video_url(server)) as client:
            await client.send(**start_message(**UNTIL_STOPPED))
            stream = Stream()
            await read_until_done(client, stream, until="video.start")
            await client.send(**interaction({"multi_modal_data": {"camera": camera([0.0, 0.0, 0.05])}}, "first"))
            first = await until_started(client, stream, "first")
            await client.send(**interaction({"prompt": "a second world"}, "second", transition_chunks=2))
            second = await until_started(client, stream, "second")
            await client.send(**interaction({"multi_modal_data": {"camera": camera([0.0, 0.0, -0.05])}}, "third"))
            third = await until_started(client, stream, "third")
            await client.send(type="session.stop")
            await read_until_done(client, stream)
            return first, second, third

    first, second, third = asyncio.run(three_interactions())
    assert (first["active_event_ids"], first["completed_event_ids"]) == (["first"], [])
    # A prompt holds beside a camera motion (different fields); a new motion replaces the old one.
    assert (second["active_event_ids"], second["completed_event_ids"]) == (["first", "second"], [])
    assert (third["active_event_ids"], third["completed_event_ids"]) == (["second", "third"], ["first"])


def test_camera_mapping_follows_the_schema() -> None:
    card = FakeKVPipeline(width=8, height=8).model_card()
    assert camera_to_controls(camera([0.0, 0.0, -0.05]), card) == {"keys": ["s"]}
    assert camera_to_controls(camera([-0.05, 0.0, 0.0]), card) == {"keys": ["a"]}
    assert camera_to_controls(camera([0.0, 0.0, 0.0]), card) == {"keys": []}
    with pytest.raises(ValueError, match="cannot turn"):
        camera_to_controls(camera([0.0, 0.0, 0.0], [0.0, 0.0523, 0.0, 0.9986]), card)  # a 6 degree yaw, no camera
    matrix_game_card = {
        "controls": {
            "properties": {
                "keys": {"items": {"enum": ["w", "s", "a", "d"]}},
                "camera": {"properties": {axis: {"minimum": -1, "maximum": 1} for axis in ("pitch", "yaw")}},
            }
        },
        "mouse": "camera",
    }
    # vLLM-Omni's helper turns 6 degrees for its look-right key: Matrix-Game's 0.1 a frame.
    turned = camera_to_controls(camera([0.0, 0.0, 0.05], [0.0, 0.05233596, 0.0, 0.99862953]), matrix_game_card)
    assert turned["keys"] == ["w"]
    assert turned["camera"] == {"yaw": pytest.approx(0.1), "pitch": pytest.approx(0.0, abs=1e-9)}
    looked_up = camera_to_controls(camera([0.0, 0.0, 0.0], [0.0348995, 0.0, 0.0, 0.99939083]), matrix_game_card)
    assert looked_up["camera"] == {"pitch": pytest.approx(0.4 / 6), "yaw": pytest.approx(0.0, abs=1e-9)}


# ---- bad events: vLLM-Omni's error shape, and nothing else ends --------------------------------------

STILL = camera([0.0, 0.0, 0.0])
KEY_TOKENS = {"actions": ["w"]}  # what vLLM-Omni's helper sends as SE3 instead; servers refuse tokens
BAD_EVENTS: list[tuple[str, str | dict[str, Any], str]] = [
    ("not json", "{nope", "Invalid JSON message"),
    # vLLM-Omni answers any message its transport reads; past the limit's 4 KiB of frame slack it was closed 1009.
    ("far over the size limit", json.dumps({"type": "session.ping", "pad": "x" * (3 * 65536)}), "too large"),
    ("not an object", "[1, 2]", "WebSocket messages must be JSON objects"),
    ("unknown type", {"type": "session.rewind"}, "Unknown message type: session.rewind"),
    ("no interaction object", {"type": "session.interaction"}, "requires an interaction object"),
    ("empty event_id", interaction({"prompt": "x"}, ""), "event_id must be a non-empty string"),
    ("no event", {"type": "session.interaction", "interaction": {"event_id": "e"}}, "requires event object"),
    ("empty event", interaction({}, "e"), "requires a non-empty event.prompt and/or"),
    ("blank prompt", interaction({"prompt": " ", "multi_modal_data": {"camera": STILL}}), "non-empty string"),
    ("negative prompt", interaction({"prompt": "x", "negative_prompt": "y"}, "e"), "negative_prompt is not supported"),
    ("fractional transition", interaction({"prompt": "x"}, "e", transition_chunks=1.5), "must be an integer"),
    ("negative transition", interaction({"prompt": "x"}, "e", transition_chunks=-1), "must be >= 0"),
    ("unknown camera mode", interaction({"multi_modal_data": {"camera": camera([0, 0, 1], mode="orbit")}}), "'orbit'"),
    ("key tokens", interaction({"multi_modal_data": {"camera": {"mode": "velocity", "data": KEY_TOKENS}}}), "act"),
    ("short translation", interaction({"multi_modal_data": {"camera": camera([0, 1])}}, "s"), "3 finite numbers"),
    ("unknown modality", interaction({"multi_modal_data": {"image": {"url": "x"}}}, "i"), "only camera"),
    ("controls off schema", interaction({"controls": {"keys": ["q"]}}, "c"), "keys/0"),
    # Bounded as protocol 1's prompts (docs/public.md): before, any length the message size allowed.
    ("long prompt", interaction({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "p"), "at most 2000 characters, got 2001"),
    ("many lines", interaction({"prompt": "x\n" * MAX_PROMPT_LINES}, "l"), "at most 64 lines, got 65"),
]


@pytest.mark.parametrize("message, expected", [(m, e) for _, m, e in BAD_EVENTS], ids=[n for n, _, _ in BAD_EVENTS])
def test_a_bad_event_gets_an_error_and_the_session_goes_on(
    server: LiveServer, baseline: int, message: str | dict[str, Any], expected: str
) -> None:
    stream, close_code = asyncio.run(run_session(server, start_message(**UNTIL_STOPPED), message, chunks_after=2))
    (error,) = stream.of_type("error")
    assert set(error) <= ERROR_FIELDS and error["type"] == "error"
    assert expected in error["message"], error
    assert error["request_id"] == stream.of_type("video.start")[0]["request_id"]
    after_error = stream.events[stream.events.index(error) :]
    assert sum(e["type"] == "video.chunk_metadata" for e in after_error) >= 2  # chunks go on coming
    assert stream.of_type("session.done")[0]["stopped"] is True and close_code == 1000


def test_a_reused_event_id_is_an_event_id_conflict(server: LiveServer, baseline: int) -> None:
    again = interaction({"prompt": "again"}, "same")
    stream, _ = asyncio.run(run_session(server, start_message(**UNTIL_STOPPED), again, again, chunks_after=1))
    assert [e["event_id"] for e in stream.of_type("session.interaction.queued")] == ["same"]
    (error,) = stream.of_type("error")
    assert (error["code"], error["event_id"], error["message"]) == ("event_id_conflict", "same", "event_id_conflict")


def test_a_bad_session_does_not_disturb_another(server: LiveServer, baseline: int) -> None:
    async def both() -> tuple[Stream, Stream]:
        noisy = run_session(server, start_message(**UNTIL_STOPPED), *(m for _, m, _ in BAD_EVENTS), chunks_after=1)
        quiet = run_session(server, start_message(num_frames=8))
        return tuple(s for s, _ in await asyncio.gather(noisy, quiet))  # type: ignore[return-value]

    noisy, quiet = asyncio.run(both())
    assert len(noisy.of_type("error")) == len(BAD_EVENTS)
    assert quiet.of_type("error") == [] and len(decode_fmp4(quiet.data)) == 8
    assert len(decode_fmp4(noisy.data)) == FRAMES_PER_CHUNK * len(noisy.metadata)


# ---- refused starts ----------------------------------------------------------------------------------

BAD_STARTS: list[tuple[str, dict[str, Any] | str, str]] = [
    ("not start", {"type": "session.ping"}, "Expected session.start, got: session.ping"),
    ("not json", "{", "Invalid JSON in session.start"),
    ("format", start_message(format="mp4"), "Invalid session.start format: expected 'm4s'."),
    ("model", start_message(model="BestWishYsh/Helios-Distilled"), "Model mismatch"),
    ("no prompt", {"type": "session.start", "model": MODEL}, "Invalid session.start"),
    ("size", start_message(size="640x384"), "makes 64x48 video"),
    ("fps", start_message(fps=24), "at 16 fps"),
    ("image", start_message(image_reference={"image_url": "data:image/png;base64,AAAA"}), "takes no start image"),
    ("image url", start_message(image_reference={"image_url": "https://example.com/a.png"}), "are not fetched"),
    ("image list", start_message(image_reference=[{"file_id": "a"}]), "a single image reference"),
    ("seconds", start_message(seconds="0"), "Invalid session.start"),
    ("controls", start_message(extra_params={"controls": {"keys": ["q"]}}), "keys/0"),
    ("long prompt", start_message(prompt="x" * (MAX_PROMPT_CHARS + 1)), "at most 2000 characters, got 2001"),
]


@pytest.mark.parametrize("message, expected", [(m, e) for _, m, e in BAD_STARTS], ids=[n for n, _, _ in BAD_STARTS])
def test_a_bad_start_is_refused_with_the_error_shape(
    server: LiveServer, baseline: int, message: dict[str, Any] | str, expected: str
) -> None:
    async def refused() -> tuple[dict[str, Any], int | None]:
        async with session_client(video_url(server)) as client:
            await client.send_text(message if isinstance(message, str) else json.dumps(message))
            closed = await client.closed_by_server()
            (error,) = closed.messages
            return error, closed.code

    error, code = asyncio.run(refused())
    assert set(error) <= ERROR_FIELDS and error["type"] == "error" and expected in error["message"], error
    assert code is not None and code >= 1008


def test_seconds_sets_the_frame_budget(server: LiveServer, baseline: int) -> None:
    stream, _ = asyncio.run(run_session(server, start_message(seconds="1")))
    assert len(decode_fmp4(stream.data)) == 16  # 1 s at the model's 16 fps


# ---- vLLM-Omni's example client, unchanged -----------------------------------------------------------


def test_a_separate_client_process_streams_switches_the_prompt_and_finishes(tmp_path: Path) -> None:
    output = tmp_path / "stream.mp4"
    picture = tmp_path / "first_frame.png"
    Image.fromarray(np.full((24, 32, 3), 90, dtype=np.uint8)).save(picture)
    updates = [
        {"at": 0.0, "actions": ["w", "d"]},  # keys, turned into a velocity as vLLM-Omni's helper turns them
        {"at": 0.0, "camera": {"data": {"translation": [0.0, 0.0, 1.0]}}, "transition_chunks": 1},  # a target
    ]
    options = json.dumps({"width": WIDTH, "height": HEIGHT, "reads_prompt": True, "start_images": ["meadow"]})
    with server_process(["--model", MODEL, "--model-options", options]) as live:
        command = [
            sys.executable, str(OUTSIDE_CLIENT), f"ws://127.0.0.1:{live.port}{PATH}", "--model", MODEL,
            "--width", str(WIDTH), "--height", str(HEIGHT), "--fps", "16", "--num-frames", "12",
            "--prompt-after-first-chunk", "a sunlit valley", "--output", str(output),
            "--image-reference", str(picture), "--camera-updates", json.dumps(updates), "--seed", "-7",
        ]  # fmt: skip
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=RECEIVE_GUARD_S * 4)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Session complete" in result.stdout and "ERROR" not in result.stdout, result.stdout
    for event_id in ("prompt-1", "camera-0", "camera-1"):
        assert f"Interaction queued by server: {event_id}" in result.stdout, result.stdout
    started = [line.split("started=")[1].split(" active=")[0] for line in result.stdout.splitlines() if "[chunk " in line]
    assert any("'camera-1'" in ids for ids in started), result.stdout  # the target reached a chunk
    assert result.stdout.count("[chunk ") == 6, result.stdout
    frames = decode_fmp4(output.read_bytes())  # the client's fragmented MP4
    assert len(frames) == 12 and frames[0].shape == (HEIGHT, WIDTH, 3)


# ---- the same worker: this dialect batches with protocol 1 -------------------------------------------


def test_two_dialect_sessions_batch_with_one_protocol_1_session() -> None:
    options = {"width": WIDTH, "height": HEIGHT, "compute_delay_s": 0.02}
    settings = fake_settings(max_batch_sessions=3, model_options=options)
    with running_server(settings) as live:
        start_free = int(live.stats()["kv"]["blocks_free"])
        before = live.stats()["chunks"]
        chunks = 24

        async def protocol_1_session() -> None:
            async with session_client(live.ws_url, start={"codec": "jpeg"}) as client:
                # Every credit busy, as the dialect keeps them.
                assert client.ready is not None
                in_flight = int(client.ready["limits"]["max_pending_ticks"])
                for tick_id in range(min(in_flight, chunks)):
                    await client.send(type="tick", tick_id=tick_id)
                for received in range(chunks):
                    await client.recv_chunk()
                    if received + in_flight < chunks:
                        await client.send(type="tick", tick_id=received + in_flight)
                await client.send(type="close")
                await client.closed_by_server()

        async def all_three() -> None:
            await asyncio.gather(
                run_session(live, start_message(num_frames=chunks * FRAMES_PER_CHUNK)),
                run_session(live, start_message(num_frames=chunks * FRAMES_PER_CHUNK)),
                protocol_1_session(),
            )

        asyncio.run(all_three())
        after = live.settled(start_free)["chunks"]
    rounds = after["rounds_total"] - before["rounds_total"]
    sessions = after["round_sessions_total"] - before["round_sessions_total"]
    assert sessions == 3 * chunks
    # More than two sessions a round on average: rounds of all three, a protocol 1 session among them.
    assert sessions / rounds > 2.0, (sessions, rounds)


# ---- how a session ends on the server's side ---------------------------------------------------------


def test_a_model_failure_ends_the_session_with_session_failed(server: LiveServer, baseline: int) -> None:
    fail = interaction({"controls": {"fail": True}}, "boom")  # ARStream's event.controls; the fake raises on it

    async def failing() -> tuple[list[dict[str, Any]], int | None]:
        async with session_client(video_url(server)) as client:
            await client.send(**start_message())
            await client.send(**fail)
            closed = await client.closed_by_server()
            return closed.messages, closed.code

    messages, code = asyncio.run(failing())
    (error,) = [m for m in messages if m["type"] == "error"]
    assert error["code"] == "session_failed" and "generation failed" in error["message"] and code == 1011


def test_no_progress_and_no_ping_is_a_stall() -> None:
    slow = FakeKVPipeline(width=WIDTH, height=HEIGHT, compute_delay_s=1.0)
    with running_server(fake_settings(idle_timeout_s=0.2), slow) as live:
        start_free = int(live.stats()["kv"]["blocks_free"])

        async def stalled() -> tuple[list[dict[str, Any]], int | None]:
            async with session_client(video_url(live)) as client:
                await client.send(**start_message())
                closed = await client.closed_by_server()
                return closed.messages, closed.code

        messages, code = asyncio.run(stalled())
        live.settled(start_free)
    # As vLLM-Omni's stall: its error, then session.done (stopped), and its handler's normal close.
    error, done = messages[-2:]
    assert error["type"] == "error" and error["code"] == "idle_timeout", messages
    assert "Stall timeout" in error["message"]
    assert (done["type"], done["stopped"], code) == ("session.done", True, 1000), messages


def test_a_start_past_capacity_is_refused_as_protocol_1_is() -> None:
    """The same admission: a protocol 1 session holding the one slot refuses a dialect session (over_capacity)."""
    with running_server(fake_settings(max_sessions=1, model_options={"width": WIDTH, "height": HEIGHT})) as live:

        async def refused_while_held() -> tuple[list[dict[str, Any]], int | None]:
            async with session_client(live.ws_url, start={"codec": "jpeg"}):
                async with session_client(video_url(live)) as client:
                    await client.send(**start_message())
                    closed = await client.closed_by_server()
                    return closed.messages, closed.code

        messages, code = asyncio.run(refused_while_held())
    (error,) = messages
    assert set(error) <= ERROR_FIELDS and error["code"] == "over_capacity" and "slots" in error["message"]
    assert code == 1013


# ---- bench serve over this dialect -------------------------------------------------------------------


def test_bench_serve_runs_over_the_dialect(capsys: pytest.CaptureFixture[str]) -> None:
    from arstream.programs import bench

    options = json.dumps({"compute_delay_s": 0.005, "width": WIDTH, "height": HEIGHT})
    argv = ["--model", MODEL, "--sessions", "2", "--max-batch-sessions", "2", "--chunks", "8", "--repeat", "1"]
    extra = ["--dialect", "realtime-video", "--input-every", "2", "--model-options", options]
    assert bench.main([*argv, *extra, "--kv-budget-bytes", "4194304"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["dialect"], summary["codec"]) == ("realtime-video", "fmp4")
    assert 0 < summary["bytes_per_frame"] < WIDTH * HEIGHT * 3 / 4 and summary["encode_ms_per_frame"] > 0
    assert summary["action_to_frame_ms_p50"] is not None  # camera interactions came back as started chunks
    assert 1 <= summary["server_sessions_per_round"] <= summary["full_round_sessions"] == 2


# ---- image_reference: ARStream's start images ----------------------------------------------------------


def test_image_reference_starts_the_session_from_a_start_image() -> None:
    """``{"file_id": name}`` names one of the card's start_images; a data: URL uploads a picture (start.image)."""
    fake = FakeKVPipeline(width=WIDTH, height=HEIGHT, start_images=("meadow", "canyon"))
    pixels = np.random.default_rng(3).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    with running_server(fake_settings(model_options={}), fake) as live:
        named, _ = asyncio.run(run_session(live, start_message(num_frames=4, image_reference={"file_id": "canyon"})))
        upload = start_message(num_frames=4, image_reference={"image_url": data_url})
        uploaded, _ = asyncio.run(run_session(live, upload))
    seen: dict[str, list[Any]] = {}
    for session_id, image in fake.start_images_seen:
        seen.setdefault(session_id, []).append(image)
    named_id, uploaded_id = (s.of_type("video.start")[0]["session_id"] for s in (named, uploaded))
    assert named.of_type("video.start")[0]["config"]["image_reference"] == {"file_id": "canyon"}
    assert [image.name for image in seen[named_id]] == ["canyon", "canyon"]
    assert "image_reference" not in uploaded.of_type("video.start")[0]["config"]  # no megabytes echoed back
    assert len(seen[uploaded_id]) == 2
    for image in seen[uploaded_id]:
        assert image.name is None
        # What the model uses: the centred 26x20 of the 30x20 picture (its 64x48 frame's aspect), at 64x48.
        fitted = Image.fromarray(pixels).crop((2, 0, 28, 20)).resize((WIDTH, HEIGHT), Image.Resampling.BILINEAR)
        np.testing.assert_array_equal(image.pixels, np.asarray(fitted))


def test_shutdown_ends_a_streaming_session_with_server_shutdown() -> None:
    with running_server(fake_settings(model_options={"width": WIDTH, "height": HEIGHT})) as live:

        async def streaming_when_stopped() -> tuple[list[dict[str, Any]], int | None]:
            async with session_client(video_url(live)) as client:
                await client.send(**start_message(**UNTIL_STOPPED))
                await read_until_done(client, Stream(), until="video.chunk_metadata")
                assert live.server is not None
                live.server.should_exit = True  # what SIGINT/SIGTERM do
                closed = await client.closed_by_server()
                return closed.messages, closed.code

        messages, code = asyncio.run(streaming_when_stopped())
        assert live.thread is not None
        live.thread.join(30)
    last = messages[-1]
    assert (last["type"], last["code"], code) == ("error", "server_shutdown", 1001), messages


def test_without_pyav_the_start_is_refused_naming_the_extra_and_nothing_is_held(
    server: LiveServer, baseline: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from arstream.app import video

    monkeypatch.setattr(video, "h264_available", lambda: False)  # a machine installed without the video extra

    async def refused() -> tuple[dict[str, Any], int | None]:
        async with session_client(video_url(server)) as client:
            await client.send_text(json.dumps(start_message()))
            closed = await client.closed_by_server()
            (error,) = closed.messages
            return error, closed.code

    error, code = asyncio.run(refused())
    assert set(error) <= ERROR_FIELDS and error["type"] == "error", error
    assert "cannot stream realtime video" in error["message"] and "pip install 'arstream[video]'" in error["message"]
    assert code is not None and code >= 1008
    server.settled(baseline)


# ---- round two (issue 37): what vLLM-Omni does that this dialect did not ---------------------------------


def blue_per_chunk(stream: Stream) -> list[float]:
    """The mean blue of each chunk's frames: fake-kv paints the code of the keys the chunk was made with."""
    frames = decode_fmp4(stream.data)
    return [float(np.mean([f[..., 2].mean() for f in frames[i : i + FRAMES_PER_CHUNK]]))
            for i in range(0, len(frames), FRAMES_PER_CHUNK)]  # fmt: skip


def test_a_camera_without_mode_is_a_target_held_for_its_chunks_then_released(server: LiveServer, baseline: int) -> None:
    """vLLM-Omni defaults a camera event to ``target``: a pose reached over ``transition_chunks`` chunks."""
    target = {"data": {"translation": [1.0, 0.0, 1.0], "rotation": [0.0, 0.0, 0.0, 1.0]}}  # no mode

    reach = interaction({"multi_modal_data": {"camera": target}}, "there", transition_chunks=2)
    stream = asyncio.run(run_interaction(server, reach, "there", chunks_after=4))
    assert stream.of_type("error") == []
    (applied,) = [i for i, m in enumerate(stream.metadata) if m["started_event_ids"] == ["there"]]
    code = controls_code({"keys": ["w", "d"]})  # forward and right: the target's direction
    blue = blue_per_chunk(stream)
    moving = [b > code / 2 for b in blue]
    assert moving[:applied] == [False] * applied, blue
    assert moving[applied : applied + 2] == [True, True], blue  # its two chunks
    assert not any(moving[applied + 2 :]) and len(moving) > applied + 2, blue  # then released


def test_a_target_is_the_velocity_that_reaches_it_over_its_chunks() -> None:
    card = {
        "frames_per_chunk": 2,
        "controls": {
            "properties": {
                "keys": {"items": {"enum": ["w", "s", "a", "d"]}},
                "camera": {"properties": {axis: {"minimum": -1, "maximum": 1} for axis in ("pitch", "yaw")}},
            }
        },
        "mouse": "camera",
    }
    turn_12_degrees = [0.0, 0.10452846, 0.0, 0.9945219]  # about +Y
    target = {"data": {"translation": [0.0, 0.0, 2.0], "rotation": turn_12_degrees}}
    one = camera_move(target, card)  # default: one chunk (vLLM-Omni's camera default), two frames of 6 degrees
    assert one.controls["keys"] == ["w"] and one.controls["camera"]["yaw"] == pytest.approx(0.1)
    assert (one.hold_chunks, one.release) == (1, {"keys": [], "camera": {"pitch": 0.0, "yaw": 0.0}})
    three = camera_move(target, card, transition_chunks=3)
    assert three.hold_chunks == 3 and three.controls["camera"]["yaw"] == pytest.approx(0.1 / 3)
    assert camera_move(target, card, transition_chunks=0).hold_chunks == 1  # a model cannot jump: one chunk
    velocity = camera_move({**target, "mode": "velocity"}, card)
    assert velocity.hold_chunks is None and velocity.controls["camera"]["yaw"] == pytest.approx(0.2)


def test_a_control_message_up_to_128_kib_is_taken(server: LiveServer, baseline: int) -> None:
    """vLLM-Omni's control messages may be 128 KiB; one more byte is message_too_large and the session goes on."""
    padding = MAX_CONTROL_MESSAGE_BYTES - 100
    near_limit = json.dumps({"type": "session.ping", "padding": "x" * padding})
    over = json.dumps({"type": "session.ping", "padding": "x" * (MAX_CONTROL_MESSAGE_BYTES + 1)})
    assert 64 * 1024 < len(near_limit) <= MAX_CONTROL_MESSAGE_BYTES < len(over)
    stream, close_code = asyncio.run(run_session(server, start_message(**UNTIL_STOPPED), near_limit, over,
                                                 chunks_after=1))  # fmt: skip
    (error,) = stream.of_type("error")
    assert error["code"] == "message_too_large"
    assert len(stream.of_type("session.pong")) == 2 and close_code == 1000  # the large ping and run_session's


class SeedRecordingFake(FakeKVPipeline):
    """A test fake: fake-kv that remembers the seed each closed session had."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.closed_seeds: dict[str, int | None] = {}

    def close_session(self, session_id: str) -> None:
        self.closed_seeds[session_id] = self.sessions.get(session_id, {}).get("seed")
        super().close_session(session_id)


def test_a_negative_seed_is_taken_as_torch_takes_it() -> None:
    """vLLM-Omni takes any int64 seed; torch seeds from a negative one as from it plus 2**64, so does the model here."""
    fake = SeedRecordingFake(width=WIDTH, height=HEIGHT)
    with running_server(fake_settings(), fake) as live:
        stream, close_code = asyncio.run(run_session(live, start_message(num_frames=2, seed=-5)))
        live.settled(int(live.stats()["kv"]["blocks_free"]))
    (start,) = stream.of_type("video.start")
    assert start["config"]["seed"] == -5 and close_code == 1000
    assert fake.closed_seeds[start["session_id"]] == SEED_WRAP - 5
    assert torch.Generator().manual_seed(-5).initial_seed() == SEED_WRAP - 5


def test_a_start_without_num_frames_makes_the_models_default_length(server: LiveServer, baseline: int) -> None:
    stream, close_code = asyncio.run(run_session(server, start_message()))
    (start,) = stream.of_type("video.start")
    assert start["config"]["num_frames"] == DEFAULT_NUM_FRAMES == 81
    chunks = chunks_for_frames(DEFAULT_NUM_FRAMES, {"frames_per_chunk": FRAMES_PER_CHUNK})
    assert len(stream.metadata) == chunks == 41
    assert stream.of_type("session.done")[0]["stopped"] is False and close_code == 1000


def test_a_prompt_change_for_a_model_that_reads_none_is_interaction_failed() -> None:
    with running_server(fake_settings(model_options={"width": WIDTH, "height": HEIGHT})) as live:
        start_free = int(live.stats()["kv"]["blocks_free"])
        change = interaction({"prompt": "a new world"}, "p")
        stream, close_code = asyncio.run(run_session(live, start_message(**UNTIL_STOPPED), change, chunks_after=2))
        live.settled(start_free)
    (error,) = stream.of_type("error")
    assert (error["code"], error["event_id"]) == ("interaction_failed", "p") and "reads no prompt" in error["message"]
    assert stream.of_type("session.interaction.queued") == [] and close_code == 1000


def test_a_prompt_change_blends_over_transition_chunks_as_vllm_omni() -> None:
    """vLLM-Omni lerps the prompt embedding from where it is: 1/N of the way at the change's first chunk."""
    fake = FakeKVPipeline(width=WIDTH, height=HEIGHT, reads_prompt=True)

    async def two_changes() -> Stream:
        async with session_client(video_url(live)) as client:
            await client.send(**start_message(prompt="a", **UNTIL_STOPPED))
            stream = Stream()
            await read_until_done(client, stream, until="video.start")
            # chunk 0 is out under "a" first (a change that reaches the rollout's first chunk is its prompt, unblended)
            await read_until_done(client, stream, until="video.chunk_metadata")
            await client.send(**interaction({"prompt": "b"}, "to-b", transition_chunks=2))
            await until_started(client, stream, "to-b")
            # the blend to b (2 chunks) has its second chunk out before c is asked: c starts after it, however loaded
            await read_until_done(client, stream, until="video.chunk_metadata")
            await client.send(**interaction({"prompt": "c"}, "to-c"))  # vLLM-Omni's default: 3 chunks
            await until_started(client, stream, "to-c")
            for _ in range(3):
                await read_until_done(client, stream, until="video.chunk_metadata")
            await client.send(type="session.stop")
            await read_until_done(client, stream)
            return stream

    with running_server(fake_settings(), fake) as live:
        stream = asyncio.run(two_changes())
    session_id = stream.of_type("video.start")[0]["session_id"]
    weights = {index: dict(mix) for sid, index, mix in fake.prompt_weights_seen if sid == session_id}
    to_b = next(m["generation_chunk_index"] for m in stream.metadata if m["started_event_ids"] == ["to-b"])
    to_c = next(m["generation_chunk_index"] for m in stream.metadata if m["started_event_ids"] == ["to-c"])
    assert all(weights[i] == {"a": 1.0} for i in range(to_b))
    assert weights[to_b] == {"a": 0.5, "b": 0.5} and weights[to_b + 1] == {"b": 1.0}, (to_b, fake.prompt_weights_seen)
    assert all(weights[i] == {"b": 1.0} for i in range(to_b + 1, to_c))
    thirds = [weights[to_c + step] for step in range(3)]
    assert [mix.get("c") for mix in thirds] == [pytest.approx(1 / 3), pytest.approx(2 / 3), 1.0]
    assert weights[to_c + 3] == {"c": 1.0}


def test_v1_models_lists_the_served_model_as_openai_does(server: LiveServer) -> None:
    response = server.get("/v1/models")
    assert response.status_code == 200
    listing = response.json()
    assert listing["object"] == "list" and len(listing["data"]) == 1
    (entry,) = listing["data"]
    assert (entry["id"], entry["object"], entry["owned_by"]) == (MODEL, "model", "arstream")
    assert isinstance(entry["created"], int)


def test_a_page_from_another_local_port_is_told_the_flag_that_admits_it(server: LiveServer) -> None:
    """vLLM-Omni's demo page is served on its own port (Gradio, 7860): the refusal names --allowed-origins."""
    page = "http://127.0.0.1:7860"

    async def refused() -> tuple[dict[str, Any], int | None]:
        async with session_client(video_url(server), headers=[("Origin", page)]) as client:
            closed = await client.closed_by_server()
            (error,) = closed.messages
            return error, closed.code

    error, code = asyncio.run(refused())
    assert error["code"] == "unauthorized" and code is not None and code >= 1008
    assert f"--allowed-origins {page}" in error["message"] and "another port" in error["message"], error


def test_a_held_update_is_released_after_its_chunks_and_a_later_change_cancels_the_hold() -> None:
    """The session side of a camera target: counted at chunk boundaries, not at submission."""
    from arstream.app.protocol import InputMessage, TickMessage
    from arstream.app.session import Session, SessionState

    session = Session("s", codec="fmp4", quality=80, seed=None, prompt=None, max_pending_ticks=8)
    session.transition(SessionState.ACTIVE)
    ticks = [session.accept_tick(TickMessage(type="tick", tick_id=i)) for i in range(6)]  # all queued first
    session.accept_event(
        InputMessage(type="input", event_id=1, controls={"keys": ["w"]}), hold_chunks=2, release={"keys": []}
    )
    seen = [session.take_chunk_inputs(ticks[i]).controls for i in range(3)]
    assert seen == [{"keys": ["w"]}, {"keys": ["w"]}, {"keys": []}]
    session.accept_event(InputMessage(type="input", event_id=2, controls={"keys": ["s"]}), hold_chunks=1,
                         release={"keys": []})  # fmt: skip
    session.accept_event(InputMessage(type="input", event_id=3, controls={"keys": ["d"]}))  # replaces it, unheld
    assert [session.take_chunk_inputs(ticks[i]).controls for i in range(3, 6)] == [{"keys": ["d"]}] * 3

"""The typed client library and the protocol's JSON Schema, against a real server (uvicorn, fake-kv model).

Every text message either side sends in these sessions is kept and validated against the schema the server
serves at ``/v1/protocol.schema.json``; the schema committed under docs/ must be that same document, and every
field of the JSON examples in docs/PROTOCOL.md must be a field of its message's model.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import jsonschema
import numpy as np
import pytest

from arstream.app.protocol import (
    MESSAGE_TYPES,
    CloseReason,
    SERVER_MESSAGE_TYPES,
    ErrorCode,
    ReadyMessage,
    ack_message,
    chunk_message,
    closed_message,
    error_message,
    moved_message,
    pong_message,
    ready_message,
    recording_message,
    role_message,
    viewers_message,
)
from arstream.app.protocol_schema import SCHEMA_PATH, protocol_schema, schema_text
from arstream.programs import client_lib
from arstream.programs.client_lib import ServerError, Session
from servers import REPO_ROOT, LiveServer, fake_settings, running_server

DOCS = REPO_ROOT / "docs"


class TrafficLog:
    """A WebSocket that keeps every text message it sends and receives (the session's own socket inside)."""

    def __init__(self, ws: Any, log: list[dict[str, Any]]) -> None:
        self.ws = ws
        self.log = log

    async def send(self, data: str | bytes) -> None:
        if isinstance(data, str):
            self.log.append(json.loads(data))
        await self.ws.send(data)

    async def recv(self) -> str | bytes:
        data = await self.ws.recv()
        if isinstance(data, str):
            self.log.append(json.loads(data))
        return data

    async def close(self) -> None:
        await self.ws.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    recordings = tmp_path_factory.mktemp("recordings")
    settings = fake_settings(model_options={"compute_delay_s": 0.002}, record_dir=str(recordings))
    with running_server(settings) as live:
        yield live


@pytest.fixture(scope="module")
def traffic() -> list[dict[str, Any]]:
    """Every text message of this module's sessions, both ways (validated at the end of the module)."""
    return []


async def logged_session(url: str, log: list[dict[str, Any]], *, share: str | None = None) -> Session:
    session = await Session.connect(url, share=share)
    session.ws = TrafficLog(session.ws, log)
    return session


def test_the_committed_schema_is_the_models_schema() -> None:
    """docs/protocol.schema.json drifts from the models: regenerate it (python -m arstream.app.protocol_schema)."""
    assert (DOCS / "protocol.schema.json").read_text() == schema_text()
    jsonschema.Draft202012Validator.check_schema(protocol_schema())


def test_the_server_serves_the_schema(server: LiveServer) -> None:
    response = server.get(SCHEMA_PATH)
    assert response.status_code == 200
    assert response.json() == json.loads(schema_text())


def test_the_schema_names_every_message_both_ways() -> None:
    definitions = protocol_schema()["$defs"]
    client = definitions["ClientMessage"]["discriminator"]["mapping"]
    server = definitions["ServerMessage"]["discriminator"]["mapping"]
    assert set(client) == set(MESSAGE_TYPES)
    assert set(client) == {"start", "tick", "input", "close", "ping", "pass_control", "webrtc_offer", "record"}
    assert set(server) == set(SERVER_MESSAGE_TYPES)
    assert set(server) == {
        "ready", "chunk", "ack", "pong", "error", "moved", "closed", "role", "viewers", "webrtc_answer", "webrtc_state",
        "recording",
    }


def test_every_server_builder_makes_a_message_the_schema_accepts() -> None:
    validator = jsonschema.Draft202012Validator(protocol_schema())
    card = {"name": "m", "width": 4, "height": 2, "fps": 16, "frames_per_chunk": 2, "controls": {}, "extra": 1}
    built = [
        ready_message(
            session_id="s", model_card=card, codec="jpeg", max_pending_ticks=3, max_message_bytes=100,
            idle_timeout_s=2.5, resume={"token": "r0.t", "grace_s": 5, "next_chunk_index": 0}, share="r0.s",
            rewind_points=4, rewind_seconds=1.5, branched_from=2, record=True,
        ),
        chunk_message(
            tick_id=1, chunk_index=2, frames=2, applied_event_ids=[0], restarted=None, queue_ms=1, compute_ms=2,
            encode_ms=3, rewind_points=[0, 2, 3],
        ),
        role_message("controller", last_tick_id=4, resume=None),
        role_message("viewer", viewer_id="v1"),
        viewers_message(2, ["v1", "v2"]),
        ack_message(3, duplicate=True),
        pong_message(None),
        error_message(ErrorCode.TAKEN_OVER, "x" * 2000, tick_id=None),
        moved_message(resume="r1.t", next_chunk_index=3),
        closed_message(CloseReason.MOVED),
        recording_message(True),
    ]
    for message in built:
        assert list(validator.iter_errors(message)) == [], message
    # What the server sends as null stays on the wire as null (clients rely on chunk.restarted and error.tick_id).
    assert built[1]["restarted"] is None and built[7]["tick_id"] is None and "t" in built[6]
    assert built[0]["model"]["extra"] == 1  # a model card's additive field goes out as given
    # and a message that breaks its model does not validate
    assert list(validator.iter_errors({**built[5], "status": "maybe"}))
    assert list(validator.iter_errors({**built[1], "tick_id": "7"}))


def json_examples(markdown: str) -> list[dict[str, Any]]:
    """The JSON objects PROTOCOL.md shows for protocol 1's messages (fenced blocks and inline ``{"type": ...}``)."""
    protocol1 = markdown.split("## vLLM-Omni realtime video dialect")[0]
    candidates = re.findall(r"```json\n(.*?)```", protocol1, re.S) + re.findall(r"`(\{\"type\": [^`]*\})`", protocol1)
    examples = []
    for text in candidates:
        try:
            example = json.loads(text)
        except json.JSONDecodeError:
            continue  # an example with "…" elisions or alternatives ("a" | "b")
        if isinstance(example, dict) and example.get("type") in {*MESSAGE_TYPES, *SERVER_MESSAGE_TYPES}:
            example.pop("…", None)  # `"…": "…"` stands for the fields an example leaves out
            examples.append(example)
    return examples


def test_every_documented_field_is_in_its_message_model() -> None:
    examples = json_examples((DOCS / "PROTOCOL.md").read_text())
    kinds = {example["type"] for example in examples}
    assert {"start", "tick", "chunk", "error", "ack", "pong", "role", "pass_control"} <= kinds, kinds
    for example in examples:
        model = {**MESSAGE_TYPES, **SERVER_MESSAGE_TYPES}[example["type"]]
        assert set(example) <= set(model.model_fields), (example["type"], set(example) - set(model.model_fields))


def test_the_library_imports_without_torch_or_the_server() -> None:
    code = (
        "import sys, arstream.programs.client_lib; "
        "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn') if m in sys.modules))"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "[]"


def test_messages_out_are_checked_by_the_servers_models() -> None:
    with pytest.raises(ValueError, match="tick_id"):
        client_lib.tick_message(-1)
    with pytest.raises(ValueError, match="rewind_to"):
        client_lib.tick_message(1, rewind_to=2**32)
    with pytest.raises(ValueError, match="watch"):
        client_lib.start_message(watch="r0.a", branch=("r0.a", None))
    with pytest.raises(ValueError, match="to"):
        client_lib.pass_control_message("")
    with pytest.raises(ValueError, match="on"):
        client_lib.record_message("yes")  # type: ignore[arg-type]


async def play(url: str, log: list[dict[str, Any]]) -> None:
    """A player: start, ticks with keys and a prompt, an input, a rewind, a branch and a viewer of it, close."""
    async with await logged_session(url, log) as player:
        ready = await player.start(codec="raw", seed=3)
        assert isinstance(ready, ReadyMessage) and ready.role == "controller" and ready.model.frames_per_chunk == 2
        assert ready.share is not None and player.share_token == ready.share.token
        await player.send_input(controls={"keys": ["w"]})
        for keys in (["d"], ["w", "d"], [], ["a"]):
            await player.tick(keys=keys, prompt="a road")
        played = [chunk async for chunk in player.chunks()]
        assert [chunk.chunk_index for chunk in played] == [0, 1, 2, 3]
        assert [chunk.tick_id for chunk in played] == [0, 1, 2, 3]
        assert player.recording is False
        await player.record()
        size = (ready.model.height, ready.model.width, 3)
        assert [[frame.shape for frame in chunk.frames] for chunk in played] == [[size, size]] * 4
        await player.rewind(1, keys=["w", "d"])
        [again] = [chunk async for chunk in player.chunks()]
        assert (again.chunk_index, again.restarted) == (1, "rewind")
        assert player.recording is True  # answered by `recording` before the chunk after it
        assert [np.array_equal(a, b) for a, b in zip(again.frames, played[1].frames, strict=True)] == [True, True]

        with pytest.raises(ServerError) as refused:
            await player.rewind(1000)
            [_ async for _ in player.chunks()]
        assert refused.value.code is ErrorCode.REWIND_UNAVAILABLE and not refused.value.fatal
        player.tick_sent_at.clear()  # the refused tick's credit came back: nothing is in flight
        with pytest.raises(ServerError) as bad_keys:
            await player.tick(keys=["no-such-key"])
            [_ async for _ in player.chunks()]
        assert bad_keys.value.code is ErrorCode.INVALID_CONTROLS
        player.tick_sent_at.clear()

        token = player.share_token
        assert token is not None
        async with await logged_session(url, log, share=token) as viewer:
            watching = await viewer.start(watch=token, codec="raw")
            assert watching.role == "viewer" and watching.viewer_id
            async with await logged_session(url, log, share=token) as branch:
                branched = await branch.start(branch=(token, 2), codec="raw")
                assert branched.branched_from is not None and branched.branched_from.chunk == 2
                await branch.tick(keys=["w", "d"])
                [first] = [chunk async for chunk in branch.chunks()]
                assert first.chunk_index == 2
                assert await branch.close() == "client"
            await player.tick(keys=["s"])
            [mine] = [chunk async for chunk in player.chunks()]
            seen = await viewer.receive_chunk()
            assert seen.chunk_index == mine.chunk_index
            assert [np.array_equal(a, b) for a, b in zip(seen.frames, mine.frames, strict=True)] == [True, True]
            assert await player.close() == "client"
            assert [_ async for _ in viewer.chunks()] == []  # the session ended: the viewer's chunks stop


def test_the_library_drives_a_real_server_and_all_its_traffic_validates(
    server: LiveServer, traffic: list[dict[str, Any]]
) -> None:
    asyncio.run(play(server.ws_url, traffic))
    kinds = {message["type"] for message in traffic}
    assert {"start", "tick", "input", "close", "ready", "chunk", "ack", "error", "closed", "viewers"} <= kinds, kinds
    assert {"record", "recording"} <= kinds, kinds
    served = server.get(SCHEMA_PATH).json()
    validator = jsonschema.Draft202012Validator(served)
    for message in traffic:
        assert [error.message for error in validator.iter_errors(message)] == [], message


def test_a_refused_start_raises_its_code(server: LiveServer) -> None:
    async def watch_nothing() -> ErrorCode:
        async with await Session.connect(server.ws_url) as viewer:
            with pytest.raises(ServerError) as refused:
                await viewer.start(watch="r0.nothing")
            assert refused.value.fatal
            return refused.value.code

    assert asyncio.run(watch_nothing()) is ErrorCode.SHARE_FAILED

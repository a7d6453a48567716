"""A third wire dialect, written here in one class and added to the table by path, served by a real server.

It shows what a new dialect costs: this one module (a ``Dialect`` subclass, reading app/dialect.py: its start
talks to an ``OpeningPort``, its other hooks to a ``SessionPort``) and one line in app/dialects.py (here: ``add_dialect``, as a test must not edit the
table for everyone). Everything else, admission, the worker, credits, the writer, release, is the live session's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.asyncio.client import connect

from arstream.app.dialect import ChunkSent, Dialect, Gate, OpeningPort, SessionPort, Started
from arstream.app.dialects import DIALECTS, add_dialect, remove_dialect
from arstream.app.outbox import QueuedChunk
from arstream.app.protocol import CLOSE_NORMAL, CloseReason, ErrorCode, TickMessage, dumps
from arstream.app.session import Session, SessionState
from arstream.app.worker import OutcomeKind, TickOutcome
from servers import LiveServer, fake_settings, running_server

ECHO_PATH = "/v1/test/echo"


class EchoDialect(Dialect):
    """A tiny wire: "start" then "tick" (one chunk: a `frames` line and its frames) and "bye"; errors say "oops"."""

    def __init__(self) -> None:
        super().__init__()
        self.session_id = f"e-{id(self):x}"
        self.ticks = 0

    async def start(self, live: OpeningPort) -> Started | None:
        if not await live.accept():
            return None
        message = await live.ws.receive()
        if message.get("text") != "start":
            await live.refuse(ErrorCode.START_REQUIRED, "say start first")
            return None
        refusal = live.gate.admit(live)
        if refusal is not None:
            await live.refuse(ErrorCode.OVER_CAPACITY, refusal)
            return None
        session = Session(self.session_id, codec="raw", quality=80, seed=1, prompt=None, max_pending_ticks=2)
        session.transition(SessionState.ACTIVE)
        return Started(session)

    def ready(self, live: SessionPort, started: Started) -> None:
        live.outbox.push_reply(dumps({"type": "hello", "session_id": started.session.id}))

    def text_in(self, live: SessionPort, text: str | None) -> None:
        assert live.session is not None
        if text == "tick":
            live.submit(live.session.accept_tick(TickMessage(type="tick", tick_id=self.ticks)))
            self.ticks += 1
        elif text == "bye":
            live.close(CLOSE_NORMAL, CloseReason.CLIENT)
        else:
            live.outbox.push_reply(dumps(self.error(ErrorCode.INVALID_MESSAGE, f"unknown: {text!r}")))

    def outcome(self, live: SessionPort, outcome: TickOutcome) -> None:
        if outcome.kind is OutcomeKind.CHUNK:
            live.outbox.push(QueuedChunk(outcome))
        else:
            live.fatal(ErrorCode.INTERNAL, "the model failed", close_code=1011)

    async def send_chunk(self, live: SessionPort, outcome: TickOutcome) -> ChunkSent:
        await live.ws.send_text(dumps({"type": "frames", "count": len(outcome.frame_messages)}))
        for frame in outcome.frame_messages:
            await live.ws.send_bytes(frame)
        return ChunkSent(len(outcome.frame_messages), sum(len(frame) for frame in outcome.frame_messages))

    def error(self, code: str, message: str, *, tick_id: int | None = None) -> dict[str, Any]:
        return {"type": "oops", "code": code, "message": message}

    def closed(self, gate: Gate, reason: CloseReason) -> str | None:
        return dumps({"type": "bye", "reason": str(reason)})


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    add_dialect(ECHO_PATH, EchoDialect)
    try:
        with running_server(fake_settings()) as live:
            yield live
    finally:
        remove_dialect(ECHO_PATH)


def echo_url(server: LiveServer) -> str:
    return server.base_url.replace("http://", "ws://", 1) + ECHO_PATH


async def read_json(ws: Any) -> dict[str, Any]:
    message = await asyncio.wait_for(ws.recv(), 10)
    assert isinstance(message, str), f"expected a text message, got {len(message)} bytes"
    decoded: dict[str, Any] = json.loads(message)
    return decoded


def test_a_dialect_added_by_path_serves_a_session_end_to_end(server: LiveServer) -> None:
    blocks_free = server.stats()["kv"]["blocks_free"]

    async def scenario() -> None:
        async with connect(echo_url(server), proxy=None) as ws:
            await ws.send("start")
            hello = await read_json(ws)
            assert hello["type"] == "hello" and hello["session_id"].startswith("e-")
            assert server.stats()["sessions"]["connected"] == 1  # admitted and registered like any session
            await ws.send("what")
            assert (await read_json(ws))["type"] == "oops"  # a bad message costs its error, the session goes on
            for _ in range(2):
                await ws.send("tick")
                frames = await read_json(ws)
                assert frames["type"] == "frames" and frames["count"] >= 1
                for _ in range(frames["count"]):
                    assert isinstance(await asyncio.wait_for(ws.recv(), 10), bytes)
            await ws.send("bye")
            assert await read_json(ws) == {"type": "bye", "reason": "client"}
            await asyncio.wait_for(ws.wait_closed(), 10)
            assert ws.close_code == CLOSE_NORMAL and ws.close_reason == "client"

    asyncio.run(scenario())
    server.settled(blocks_free)  # its KV came back through the one release path


def test_a_dialect_refusal_uses_its_own_error_shape(server: LiveServer) -> None:
    async def scenario() -> None:
        async with connect(echo_url(server), proxy=None) as ws:
            await ws.send("hi")
            refusal = await read_json(ws)
            assert refusal == {"type": "oops", "code": "start_required", "message": "say start first"}
            await asyncio.wait_for(ws.wait_closed(), 10)
            assert ws.close_code == 1008

    asyncio.run(scenario())


def test_the_table_holds_both_built_in_dialects_by_path() -> None:
    from arstream.app.protocol1 import Protocol1
    from arstream.app.realtime_video import RealtimeVideo

    assert DIALECTS["/v1/sessions"] is Protocol1 and DIALECTS["/v1/realtime/video"] is RealtimeVideo
    with pytest.raises(ValueError, match="already served"):
        add_dialect("/v1/sessions", EchoDialect)

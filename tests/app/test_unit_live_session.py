"""The live session on its own: a fake dialect, a fake socket and a fake gate (no server, no sleeps).

What is checked is the lifecycle every dialect shares: refusals, registration, the writer's order, ticks to
the worker and their outcomes back, credits, the one release, finish, take-over and server faults.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gate_fakes import FakeGate, chunk_outcome, fake_socket, live_session, until

from arstream.app.dialect import ChunkSent, Dialect, Gate, OpeningPort, SessionPort, Started
from arstream.app.live_session import PHASES, Phase
from arstream.app.outbox import QueuedChunk
from arstream.app.protocol import CLOSE_NORMAL, CloseReason, ErrorCode, TickMessage, dumps
from arstream.app.session import Session, SessionState
from arstream.app.worker import OutcomeKind, TickOutcome


class FakeDialect(Dialect):
    """A dialect that says what happened in plain words: "go" starts, "tick" ticks, "stop" closes, "boom" faults."""

    def __init__(self) -> None:
        super().__init__()
        self.session_id = "fake-1"
        self.ticks = 0
        self.texts: list[str | None] = []

    async def start(self, live: OpeningPort) -> Started | None:
        if not await live.accept():
            return None
        first = await live.ws.receive()
        if first.get("text") != "go":
            await live.refuse(ErrorCode.START_REQUIRED, "say go")
            return None
        refusal = live.gate.admit(live)
        if refusal is not None:
            await live.refuse(ErrorCode.OVER_CAPACITY, refusal)
            return None
        session = Session(self.session_id, codec="raw", quality=80, seed=None, prompt=None, max_pending_ticks=2)
        session.transition(SessionState.ACTIVE)
        return Started(session)

    def ready(self, live: SessionPort, started: Started) -> None:
        live.outbox.push_reply("ready")

    def text_in(self, live: SessionPort, text: str | None) -> None:
        self.texts.append(text)
        assert live.session is not None
        if text == "tick":
            live.submit(live.session.accept_tick(TickMessage(type="tick", tick_id=self.ticks)))
            self.ticks += 1
        elif text == "stop":
            live.close(CLOSE_NORMAL, CloseReason.CLIENT)
        elif text == "boom":
            raise RuntimeError("a bug in the dialect")

    def outcome(self, live: SessionPort, outcome: TickOutcome) -> None:
        if outcome.kind is OutcomeKind.CHUNK:
            live.outbox.push(QueuedChunk(outcome))
        else:
            live.fatal(ErrorCode.INTERNAL, "failed", close_code=1011)

    async def send_chunk(self, live: SessionPort, outcome: TickOutcome) -> ChunkSent:
        await live.ws.send_text(f"chunk {outcome.job.tick_id}")
        for frame in outcome.frame_messages:
            await live.ws.send_bytes(frame)
        return ChunkSent(len(outcome.frame_messages), sum(len(frame) for frame in outcome.frame_messages))

    def error(self, code: str, message: str, *, tick_id: int | None = None) -> dict[str, Any]:
        return {"type": "error", "code": code, "message": message}

    def closed(self, gate: Gate, reason: CloseReason) -> str | None:
        return dumps({"type": "closed", "reason": str(reason)})


def test_a_refused_start_sends_the_dialects_error_and_leaves_nothing_behind() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        live = live_session(gate, FakeDialect())
        socket = fake_socket(live)
        socket.say("hello")
        await live.run()
        assert socket.accepted and [json.loads(t)["code"] for t in socket.texts] == ["start_required"]
        assert socket.close_frame == (1008, "")
        assert gate.unstarted.count == 0 and gate.live == {} and gate.fake_worker.dropped_sessions == []

    asyncio.run(scenario())


def test_a_session_without_room_is_refused_over_capacity() -> None:
    async def scenario() -> None:
        gate = FakeGate(capacity=0)
        live = live_session(gate, FakeDialect())
        socket = fake_socket(live)
        socket.say("go")
        await live.run()
        assert json.loads(socket.texts[0])["code"] == "over_capacity" and socket.close_frame == (1013, "")

    asyncio.run(scenario())


def test_a_tick_goes_to_the_worker_and_its_chunk_comes_back_to_the_session_with_its_credit() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        dialect = FakeDialect()
        live = live_session(gate, dialect)
        socket, worker = fake_socket(live), gate.fake_worker
        running = asyncio.create_task(live.run())
        socket.say("go")
        socket.say("tick")
        await until(lambda: len(worker.submitted) == 1)
        assert gate.controller("fake-1") is live and gate.unstarted.count == 0
        job = worker.submitted[0]
        assert job.session is live.session and live.session.pending_ticks == 1
        worker.run(job, chunk_outcome(job))  # delivered through Session.deliver, not through the gate
        await until(lambda: live.session is not None and live.session.pending_ticks == 0)
        assert socket.sent == ["ready", "chunk 0", b"f0", b"f1"]  # replies and the chunk whole, in order
        assert live.session.next_chunk_index == 1
        socket.say("stop")
        await running
        assert socket.texts[-1] == '{"type":"closed","reason":"client"}' and socket.close_frame == (1000, "client")
        assert worker.dropped_sessions == ["fake-1"]  # released once
        assert gate.live == {} and live.session.state is SessionState.CLOSED and gate.closing == set()

    asyncio.run(scenario())


def test_a_disconnect_with_a_tick_out_releases_the_session_once_and_ignores_the_late_outcome() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        live = live_session(gate, FakeDialect())
        socket, worker = fake_socket(live), gate.fake_worker
        running = asyncio.create_task(live.run())
        socket.say("go")
        socket.say("tick")
        await until(lambda: len(worker.submitted) == 1)
        job = worker.submitted[0]
        worker.queued.remove(job)  # "running" on the worker when the client goes
        socket.hang_up()
        await running
        assert worker.dropped_sessions == ["fake-1"] and gate.live == {}
        sent = list(socket.sent)
        assert job.session.deliver is not None
        job.session.deliver(chunk_outcome(job))  # the running tick's outcome, after the end: nothing goes out
        await asyncio.sleep(0)
        assert socket.sent == sent

    asyncio.run(scenario())


def test_a_server_fault_while_serving_ends_the_session_with_internal_and_releases_it() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        live = live_session(gate, FakeDialect())
        socket = fake_socket(live)
        socket.say("go")
        socket.say("boom")
        await live.run()
        error = json.loads(socket.texts[-2])
        assert error["code"] == "internal" and socket.close_frame == (1011, "error")
        assert gate.fake_worker.dropped_sessions == ["fake-1"] and gate.live == {}

    asyncio.run(scenario())


def test_a_taken_over_session_is_closed_taken_over_and_keeps_its_kv() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        live = live_session(gate, FakeDialect())
        socket = fake_socket(live)
        running = asyncio.create_task(live.run())
        socket.say("go")
        await until(lambda: gate.controller("fake-1") is live)
        live.take_over()
        await until(lambda: socket.close_frame is not None)
        assert json.loads(socket.texts[-2])["code"] == "taken_over" and socket.close_frame == (4003, "taken_over")
        socket.hang_up()
        await running
        assert gate.fake_worker.dropped_sessions == []  # the resuming socket holds the KV now

    asyncio.run(scenario())


def test_a_binary_message_reaches_the_dialect_as_none() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        dialect = FakeDialect()
        live = live_session(gate, dialect)
        socket = fake_socket(live)
        socket.say("go")
        socket.say_bytes(b"\x00")
        socket.say("stop")
        await live.run()
        assert dialect.texts == [None, "stop"]

    asyncio.run(scenario())


def test_a_live_session_goes_through_its_phases_and_refuses_a_move_the_table_does_not_allow() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        live = live_session(gate, FakeDialect())
        assert live.phase is Phase.OPENING
        running = asyncio.create_task(live.run())
        fake_socket(live).say("go")
        await until(lambda: live.phase is Phase.CONTROLLING)
        fake_socket(live).say("stop")
        await until(lambda: live.phase is not Phase.CONTROLLING)
        assert live.phase in (Phase.CLOSING, Phase.CLOSED)
        await running
        assert live.phase is Phase.CLOSED and PHASES[Phase.CLOSED] == frozenset()
        with pytest.raises(RuntimeError, match="cannot go from"):
            live._enter(Phase.CONTROLLING)

    asyncio.run(scenario())

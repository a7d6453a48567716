"""Protocol 1's dialect against a fake gate: start and ready, ticks, errors, viewers and passing control."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gate_fakes import FakeGate, chunk_outcome, fake_socket, live_session, until

from arstream.app.live_session import LiveSession, Phase
from arstream.app.protocol1 import Protocol1
from arstream.app.session import SessionState


def message(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind, **fields})


def received(live: LiveSession) -> list[dict[str, Any]]:
    return [json.loads(t) for t in fake_socket(live).texts]


def start(gate: FakeGate, **fields: Any) -> tuple[LiveSession, asyncio.Task[None]]:
    live = live_session(gate, Protocol1())
    fake_socket(live).say(message("start", codec="raw", **fields))
    return live, asyncio.create_task(live.run())


def test_start_then_a_tick_makes_ready_then_a_chunk_with_its_frames() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        live, running = start(gate, seed=3)
        socket, worker = fake_socket(live), gate.fake_worker
        await until(lambda: bool(socket.texts))
        ready = received(live)[0]
        assert ready["type"] == "ready" and ready["session_id"] == live.session_id and ready["codec"] == "raw"
        assert ready["share"]["token"].startswith("r0.") and "resume" not in ready  # resume is off here
        socket.say(message("tick", tick_id=1, controls={"x": 1.5}))
        await until(lambda: len(worker.submitted) == 1)
        job = worker.submitted[0]
        assert job.tick_id == 1 and job.update.controls == {"x": 1.5}
        worker.run(job, chunk_outcome(job, chunk_index=0))
        await until(lambda: len(socket.sent) == 4)
        chunk = received(live)[1]
        assert chunk["type"] == "chunk" and chunk["tick_id"] == 1 and chunk["frames"] == 2
        assert socket.sent[2:] == [b"f0", b"f1"]
        socket.say(message("close"))
        await running
        assert received(live)[-1] == {"type": "closed", "reason": "client"}
        assert worker.dropped_sessions == [live.session_id]

    asyncio.run(scenario())


def test_bad_messages_get_their_error_and_the_session_goes_on() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        live, running = start(gate)
        socket = fake_socket(live)
        socket.say(message("tick", tick_id=1, controls={"y": 1}))  # not the card's schema
        socket.say_bytes(b"\x01")
        socket.say(message("ping", t=5))
        await until(lambda: len(socket.texts) == 4)
        ready, controls, binary, pong = received(live)
        assert controls["code"] == "invalid_controls" and controls["tick_id"] == 1 and not controls["fatal"]
        assert binary["code"] == "invalid_message" and pong["type"] == "pong"
        assert gate.fake_worker.submitted == []
        socket.say(message("close"))
        await running

    asyncio.run(scenario())


def test_a_message_over_the_size_limit_ends_the_session_1009() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        live, running = start(gate)
        fake_socket(live).say("x" * (gate.settings.max_message_bytes + 1))
        await running
        error = received(live)[1]
        assert error["code"] == "message_too_large" and fake_socket(live).close_frame == (1009, "error")

    asyncio.run(scenario())


def test_passing_control_swaps_the_roles_and_the_outcomes_follow_the_new_controller() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        player, playing = start(gate)
        await until(lambda: bool(fake_socket(player).texts))
        token = received(player)[0]["share"]["token"]
        viewer = live_session(gate, Protocol1())
        fake_socket(viewer).say(message("start", watch=token, codec="raw"))
        watching = asyncio.create_task(viewer.run())
        await until(lambda: viewer.watch is not None and bool(fake_socket(viewer).texts))
        viewer_ready = received(viewer)[0]
        assert viewer_ready["role"] == "viewer" and viewer.watch is not None
        viewer_id = viewer.watch.viewer_id
        fake_socket(viewer).say(message("tick", tick_id=1))  # a viewer may not tick
        await until(lambda: any(m.get("code") == "not_controller" for m in received(viewer)))

        fake_socket(player).say(message("tick", tick_id=1))
        await until(lambda: len(gate.fake_worker.queued) == 1)
        job = gate.fake_worker.queued[0]
        gate.fake_worker.queued.remove(job)  # running on the worker while control passes
        fake_socket(player).say(message("pass_control", to=viewer_id))
        await until(lambda: gate.controller(player.session_id) is viewer)
        assert viewer.watch is None and player.watch is not None  # the roles swapped
        assert viewer.phase is Phase.CONTROLLING and player.phase is Phase.WATCHING
        session = viewer.session
        assert session is not None and session is player.session and session.deliver == viewer.on_outcome
        await until(lambda: any(m["type"] == "role" for m in received(viewer)))
        assert [m for m in received(viewer) if m["type"] == "role"][0]["role"] == "controller"
        assert [m for m in received(player) if m["type"] == "role"][0]["role"] == "viewer"
        session.deliver(chunk_outcome(job))  # the running tick's chunk goes to the new controller, with its credit
        await until(lambda: session.pending_ticks == 0)
        assert any(m["type"] == "chunk" and m["tick_id"] == 1 for m in received(viewer))

        fake_socket(viewer).say(message("close"))  # the controller's close ends the session and its viewers
        await asyncio.wait_for(asyncio.gather(playing, watching), 5)
        assert session.state is SessionState.CLOSED
        assert received(player)[-1] == {"type": "closed", "reason": "session_ended"}
        assert gate.fake_worker.dropped_sessions == [session.id] and gate.live == {}

    asyncio.run(scenario())

"""vLLM-Omni's realtime video dialect against a fake gate: the server ticks for the client, interactions are
named by the client's ids, a finite session ends with session.done, and errors take vLLM-Omni's shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gate_fakes import FakeGate, chunk_outcome, fake_socket, live_session, until

from arstream.app.live_session import LiveSession
from arstream.app.realtime_video import RealtimeVideo
from arstream.app.session import SessionState
from arstream.app.worker import OutcomeKind, TickOutcome


def events(live: LiveSession) -> list[dict[str, Any]]:
    return [json.loads(t) for t in fake_socket(live).texts]


def start(gate: FakeGate, **fields: Any) -> tuple[LiveSession, RealtimeVideo, asyncio.Task[None]]:
    dialect = RealtimeVideo()
    live = live_session(gate, dialect)
    fake_socket(live).say(json.dumps({"type": "session.start", "prompt": "a forest", **fields}))
    return live, dialect, asyncio.create_task(live.run())


def test_the_server_keeps_the_credits_in_flight_and_a_finite_session_ends_with_done() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        live, dialect, running = start(gate, num_frames=4)  # two chunks of two frames
        socket, worker = fake_socket(live), gate.fake_worker
        # max_pending_ticks of them, with no tick from the client
        await until(lambda: len(worker.submitted) == 2 and bool(socket.texts))
        video_start = events(live)[0]
        assert video_start["type"] == "video.start" and video_start["request_id"] == dialect.request_id
        for index, job in enumerate(list(worker.submitted)):
            worker.run(job, chunk_outcome(job, frames=(b"mp4-%d" % index,), chunk_index=index))
        await running
        metadata = [e for e in events(live) if e["type"] == "video.chunk_metadata"]
        assert [m["generation_chunk_index"] for m in metadata] == [0, 1] and metadata[0]["byte_length"] == 5
        assert events(live)[-1] == {"type": "session.done", "request_id": dialect.request_id, "chunks": 2,
                                    "stopped": False}
        assert socket.close_frame == (1000, "")  # vLLM-Omni's close carries no reason
        assert len(worker.submitted) == 2 and worker.dropped_sessions == [live.session_id]

    asyncio.run(scenario())


def test_an_interaction_is_queued_by_its_own_id_and_a_repeat_is_a_conflict() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        live, dialect, running = start(gate)
        socket = fake_socket(live)
        interaction = {"type": "session.interaction", "interaction": {"event_id": "e1", "event": {"prompt": "a lake"}}}
        socket.say(json.dumps(interaction))
        socket.say(json.dumps(interaction))
        socket.say("[1]")
        await until(lambda: len(socket.texts) == 4)
        _, queued, conflict, not_object = events(live)
        assert queued == {"type": "session.interaction.queued", "request_id": dialect.request_id, "event_id": "e1"}
        assert conflict["type"] == "error" and conflict["code"] == "event_id_conflict" and conflict["event_id"] == "e1"
        assert not_object["code"] == "invalid_message"  # a bad control message costs only its error
        socket.say(json.dumps({"type": "session.stop"}))
        await running
        assert events(live)[-1]["stopped"] is True

    asyncio.run(scenario())


def test_a_failed_generation_ends_the_session_1011_in_vllm_omnis_error_shape() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        live, dialect, running = start(gate)
        worker = gate.fake_worker
        await until(lambda: len(worker.submitted) == gate.settings.max_pending_ticks)  # endless: every credit
        job = worker.submitted[0]
        worker.run(job, TickOutcome(job, OutcomeKind.MODEL_FAILED, error="out of memory"))
        await running
        error = events(live)[-1]
        assert error == {"type": "error", "message": "generation failed: out of memory", "code": "session_failed",
                         "request_id": dialect.request_id}
        assert fake_socket(live).close_frame == (1011, "")
        assert live.session is not None and live.session.state is SessionState.CLOSED

    asyncio.run(scenario())


def test_a_start_for_another_model_is_refused_before_admission() -> None:
    async def scenario() -> None:
        gate = FakeGate()
        live, _, running = start(gate, model="some-other-model")
        await running
        (error,) = events(live)
        assert error["type"] == "error" and "Model mismatch" in error["message"] and "request_id" not in error
        assert gate.admitted == [] and gate.fake_worker.submitted == []

    asyncio.run(scenario())

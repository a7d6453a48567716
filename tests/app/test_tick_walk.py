"""A protocol-1 tick's walk through the transport, file by file (docs/architecture.md, "A tick's walk").

A real hub with its real worker (model thread, encoder lanes) on the fake-kv model serves one live session on a
fake socket. A tracer on the event loop's thread lists the app/ files the session's second tick enters, in
order, from the moment its message is read to the moment its chunk's frames are written: a file is entered
when code in another file calls into it (a call within a file, or a file entered again at once, is no new
step). What runs on the model thread and the encoder threads lies behind the worker (``worker.py``), as the
runtime and the model do: the walk reaches the worker and comes back from it with the chunk to deliver.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import FrameType
from typing import Any, cast

from starlette.websockets import WebSocket

from arstream.app.hub import SessionHub
from arstream.app.live_session import LiveSession
from arstream.app.protocol1 import Protocol1
from arstream.app.settings import Settings
from gate_fakes import FakeWebSocket, until

APP = Path(__file__).resolve().parents[2] / "app"
MOST_FILES = 10


def app_file(frame: FrameType | None) -> str | None:
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename).resolve()
    return path.name if path.parent == APP else None


class Walk:
    """The app/ files entered on the loop's thread, in order."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.on = False

    def trace(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.on and event == "call":
            callee = app_file(frame)
            if callee is not None and callee != app_file(frame.f_back) and self.steps[-1:] != [callee]:
                self.steps.append(callee)
        return None


def walk_of_one_tick() -> list[str]:
    walk = Walk()

    def frames_sent(socket: FakeWebSocket) -> int:
        return sum(isinstance(m, bytes) for m in socket.sent)

    async def scenario() -> None:
        hub = SessionHub(Settings(model="fake-kv", resume_grace_s=0.0, log_level="warning"))
        await hub.start()
        await hub.wait_loaded()
        socket = FakeWebSocket()
        live = LiveSession(cast(WebSocket, socket), hub, Protocol1())
        running = asyncio.create_task(live.run())
        socket.say(json.dumps({"type": "start", "codec": "raw"}))
        socket.say(json.dumps({"type": "tick", "tick_id": 0}))
        await until(lambda: frames_sent(socket) > 0, rounds=100_000)
        # The second tick is the one traced: the session, the worker and the encoder are warm.
        frames = frames_sent(socket)
        walk.on = True
        socket.say(json.dumps({"type": "tick", "tick_id": 1, "controls": {}}))
        await until(lambda: frames_sent(socket) >= 2 * frames, rounds=100_000)
        walk.on = False
        socket.say(json.dumps({"type": "close"}))
        await running
        await hub.stop()

    sys.settrace(walk.trace)
    try:
        asyncio.run(scenario())
    finally:
        sys.settrace(None)
    return walk.steps


def test_a_protocol1_tick_enters_few_files_and_never_goes_back_before_it_delivers() -> None:
    steps = walk_of_one_tick()
    assert "worker.py" in steps, steps
    to_worker = steps[: steps.index("worker.py") + 1]
    # From the socket to the worker, each file once (live_session -> protocol1 -> protocol -> ... -> worker).
    assert len(to_worker) == len(set(to_worker)), to_worker
    assert to_worker[0] == "live_session.py", to_worker
    # Back from the worker, the chunk is delivered to the live session that serves the session.
    assert "live_session.py" in steps[len(to_worker) :], steps
    assert len(set(steps)) <= MOST_FILES, (sorted(set(steps)), steps)


if __name__ == "__main__":
    walked = walk_of_one_tick()
    print(len(set(walked)), sorted(set(walked)))
    print(walked)

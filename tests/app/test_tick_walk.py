"""A protocol-1 tick's walk through the app layer, file by file (docs/architecture.md, "A tick's walk").

A real hub with its real worker (model thread, encoder lanes) on the fake-kv model serves one live session on a
fake socket; a tracer on every thread lists the app/ files a tick enters, in order, from the moment its message
is read to the moment its chunk is written. The walk is counted as the architecture document counts it: every
app/ file entered, a file entered again after leaving it counting again.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
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


class Walk:
    """The app/ files entered, in order (a file entered again right after itself is not a new step)."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.on = False
        self._lock = threading.Lock()

    def trace(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return None
        path = Path(frame.f_code.co_filename).resolve()
        if path.parent == APP:
            with self._lock:
                if not self.steps or self.steps[-1] != path.name:
                    self.steps.append(path.name)
        return None


def walk_of_one_tick() -> list[str]:
    walk = Walk()

    async def scenario() -> None:
        hub = SessionHub(Settings(model="fake-kv", resume_grace_s=0.0, log_level="warning"))
        await hub.start()
        await hub.wait_loaded()
        socket = FakeWebSocket()
        live = LiveSession(cast(WebSocket, socket), hub, Protocol1())
        running = asyncio.create_task(live.run())
        socket.say(json.dumps({"type": "start", "codec": "raw"}))
        socket.say(json.dumps({"type": "tick", "tick_id": 0}))
        await until(lambda: sum(isinstance(m, bytes) for m in socket.sent) > 0, rounds=100_000)
        # The second tick is the one traced: the session, the worker and the encoder are warm.
        frames = sum(isinstance(m, bytes) for m in socket.sent)
        walk.on = True
        socket.say(json.dumps({"type": "tick", "tick_id": 1}))
        await until(lambda: sum(isinstance(m, bytes) for m in socket.sent) >= 2 * frames, rounds=100_000)
        walk.on = False
        socket.say(json.dumps({"type": "close"}))
        await running
        await hub.stop()

    sys.settrace(walk.trace)
    threading.settrace(walk.trace)
    try:
        asyncio.run(scenario())
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
    return walk.steps


# The app/ files a protocol-1 tick enters today (docs/architecture.md lists them); a change that adds one to
# the walk fails here, and one that takes one out lowers the figure.
MOST_FILES = 15


def test_a_protocol1_tick_enters_few_app_files() -> None:
    steps = walk_of_one_tick()
    files = sorted(set(steps))
    assert {"live_session.py", "protocol1.py", "session.py", "worker.py"} <= set(files), steps
    assert len(files) <= MOST_FILES, (files, steps)


if __name__ == "__main__":
    walked = walk_of_one_tick()
    print(len(set(walked)), sorted(set(walked)))
    print(walked)

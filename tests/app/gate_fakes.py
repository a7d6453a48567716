"""Fakes for the transport's unit tests: a socket, a worker and a gate, so a live session runs with no server.

The registries are the real ones (they are plain event-loop objects); only what would need a server, a model
thread or a network is faked, and each fake says so in its name. Nothing here sleeps: a test drives the
fake socket's messages and the fake worker's outcomes by hand and awaits the live session's own tasks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from starlette.datastructures import Address, Headers, QueryParams
from starlette.websockets import WebSocket

from arstream.app.dialect import Dialect
from arstream.app.guard import FloodBans, RefusalLog, TrustedProxies
from arstream.app.live_session import LiveSession
from arstream.app.metrics import ServerMetrics
from arstream.app.resume import Holder, ResumeRegistry
from arstream.app.session import TickJob
from arstream.app.settings import Settings
from arstream.app.prompts import PromptPreparer
from arstream.app.start_image import StartImageResolver
from arstream.app.unstarted import UnstartedConnections
from arstream.app.viewers import ShareRegistry, ViewerRole
from arstream.app.worker import OnWorkerThread, OutcomeKind, TickOutcome

FAKE_CARD: dict[str, Any] = {
    "name": "fake-card",
    "frames_per_chunk": 2,
    "width": 8,
    "height": 8,
    "fps": 8,
    "reads_prompt": True,  # a prompt change is taken (at once), as the dialect tests send one
    "controls": {"type": "object", "properties": {"x": {"type": "number"}}, "additionalProperties": False},
}


class FakeWebSocket:
    """A socket the test talks through: ``say`` queues a client message, ``sent`` holds what the server sent."""

    def __init__(self, headers: dict[str, str] | None = None, query: str = "") -> None:
        self.client = Address("127.0.0.1", 40000)
        self.headers = Headers(headers or {})
        self.query_params = QueryParams(query)
        self.scope: dict[str, Any] = {"type": "websocket", "server": ("127.0.0.1", 8000)}
        self.incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent: list[str | bytes] = []
        self.accepted = False
        self.close_frame: tuple[int, str] | None = None
        self.denial: Any = None

    def say(self, text: str) -> None:
        self.incoming.put_nowait({"type": "websocket.receive", "text": text})

    def say_bytes(self, data: bytes) -> None:
        self.incoming.put_nowait({"type": "websocket.receive", "bytes": data})

    def hang_up(self) -> None:
        self.incoming.put_nowait({"type": "websocket.disconnect", "code": 1006})

    async def accept(self) -> None:
        self.accepted = True

    async def receive(self) -> dict[str, Any]:
        return await self.incoming.get()

    async def send_text(self, text: str) -> None:
        self.sent.append(text)

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.close_frame = (code, reason or "")
        self.hang_up()  # the peer answers the close frame, as a real client does

    async def send_denial_response(self, response: Any) -> None:
        self.denial = response

    @property
    def texts(self) -> list[str]:
        return [m for m in self.sent if isinstance(m, str)]


class FakeWorker:
    """Records what a live session asks of the worker; outcomes are made by the test (:func:`chunk_outcome`)."""

    def __init__(self) -> None:
        self.submitted: list[TickJob] = []
        self.queued: list[TickJob] = []  # submitted and not taken back or "run" yet
        self.dropped_sessions: list[str] = []

    def submit(self, job: TickJob) -> None:
        self.submitted.append(job)
        self.queued.append(job)

    def drop_session(self, session_id: str) -> int:
        self.dropped_sessions.append(session_id)
        return len(self.drop_ticks(session_id))

    def drop_ticks(self, session_id: str) -> tuple[TickJob, ...]:
        taken = tuple(j for j in self.queued if j.session.id == session_id)
        self.queued = [j for j in self.queued if j.session.id != session_id]
        return taken

    def run(self, job: TickJob, outcome: TickOutcome) -> None:
        """The worker ran ``job``: hand its outcome to whoever serves the session now, as the real one does."""
        self.queued.remove(job)
        deliver = job.session.deliver
        assert deliver is not None, "nobody serves the session's outcomes"
        deliver(outcome)

    def call(self, function: Callable[[OnWorkerThread], Any], *, lane: str | None = None) -> asyncio.Future[Any]:
        raise AssertionError("no call on the worker thread (a branch) in these tests")

    def encode_for_viewers(
        self,
        session_id: str,
        frames: np.ndarray,
        formats: frozenset[tuple[str, int]],
        *,
        chunk_index: int,
        tick_id: int,
        deliver: Callable[[dict[tuple[str, int], tuple[bytes, ...]]], None],
    ) -> None:
        raise AssertionError("no viewer encodes in these tests")

    def recording_pauses(self, session_id: str) -> None:
        raise AssertionError("no recordings in these tests")


def chunk_outcome(job: TickJob, *, frames: tuple[bytes, ...] = (b"f0", b"f1"), chunk_index: int = 0) -> TickOutcome:
    return TickOutcome(job, OutcomeKind.CHUNK, chunk_index=chunk_index, frame_messages=frames, codec="raw", quality=80)


class FakeGate:
    """The gate a live session sees, without a hub: real registries and admission by a plain slot count."""

    def __init__(self, settings: Settings | None = None, *, capacity: int = 4) -> None:
        self.settings = settings or Settings(model="fake-kv", resume_grace_s=0.0)
        self.capacity = capacity
        self.worker: FakeWorker | None = FakeWorker()
        self.ready = True
        self.not_ready_reason = ""
        self.draining = False
        self.model_card = dict(FAKE_CARD)
        import jsonschema

        self.controls_validator = jsonschema.Draft202012Validator(FAKE_CARD["controls"])
        self.start_image_names: tuple[str, ...] = ()
        self.start_images = StartImageResolver(max_bytes=1, max_pixels=1, max_jpeg_scans=1, timeout_s=1.0, nice=0)
        self.prompts = PromptPreparer()
        refusals = RefusalLog()
        self.unstarted = UnstartedConnections(self.settings, FloodBans(0.0, TrustedProxies("")), refusals)
        self.closing: set[LiveSession] = set()
        self.resume = ResumeRegistry(replica_id="r0", grace_s=0.0, worker=lambda: None)
        self.shares: ShareRegistry[ViewerRole] = ShareRegistry(
            replica_id="r0", max_viewers_per_session=4, max_viewer_encodings=1
        )
        self.live: dict[str, LiveSession] = {}
        self.metrics = ServerMetrics(stats=lambda: None, connected=lambda: len(self.live), detached=lambda: 0)
        self.admitted: list[str] = []

    @property
    def fake_worker(self) -> FakeWorker:
        assert self.worker is not None
        return self.worker

    start_message_bytes = 4096
    rewind_points = 0
    rewind_seconds = 0.0

    def admission_refusal(self, resuming: str | None = None) -> str | None:
        held = len([sid for sid in self.live if sid != resuming])
        return f"all {self.capacity} slots are held" if held >= self.capacity else None

    def client_cap_refusal(self, holder: Holder, resuming: str | None = None) -> str | None:
        return None

    def admit(self, holder: Holder, resuming: str | None = None) -> str | None:
        refusal = self.admission_refusal(resuming)
        if refusal is None:
            self.admitted.append(holder.session_id)
        return refusal

    def claim(self, holder: Holder) -> str | None:
        return self.admit(holder)

    def drop_claim(self, holder: Holder) -> None:
        pass

    def transfer_refusal(self, holder: Holder, session_id: str) -> str | None:
        return None

    def register(self, live: LiveSession) -> None:
        self.unstarted.discard(live.opening)
        self.live[live.session_id] = live

    def unregister(self, live: LiveSession) -> None:
        if self.live.get(live.session_id) is live:
            del self.live[live.session_id]

    def controller(self, session_id: str) -> LiveSession | None:
        return self.live.get(session_id)

    def live_or_detached_session(self, session_id: str) -> Any:
        live = self.live.get(session_id)
        return live.session if live is not None else None


def live_session(gate: FakeGate, dialect: Dialect, socket: FakeWebSocket | None = None) -> LiveSession:
    """A live session on a fake socket (the cast: a fake socket stands where starlette's WebSocket goes)."""
    return LiveSession(cast(WebSocket, socket or FakeWebSocket()), gate, dialect)


def fake_socket(live: LiveSession) -> FakeWebSocket:
    socket = live.ws
    assert isinstance(socket, FakeWebSocket)
    return socket


async def until(predicate: Callable[[], bool], *, rounds: int = 200) -> None:
    """Let the loop run (no sleeping on a clock) until ``predicate`` holds; a hang guard of ``rounds`` turns."""
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")

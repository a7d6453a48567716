"""vLLM-Omni's realtime video API, ``WS /v1/realtime/video``, over ARStream's own sessions.

A second dialect on the same server: a connection here becomes an ordinary
:class:`~arstream.app.session.Session`, admitted by the hub like any other,
fed to the same worker (batched with protocol 1 sessions), encoded on the
same encoder lanes, counted in the same stats and metrics. Only the wire
differs (PROTOCOL.md, "vLLM-Omni realtime video dialect"):

- the client sends ``session.start`` once, then nothing is required: the
  server generates on its own, keeping the session's tick credits
  (``max_pending_ticks``) in flight until ``num_frames`` are made or the
  client sends ``session.stop``;
- ``session.interaction`` becomes an input event: ``event.prompt`` the
  prompt, ``event.multi_modal_data.camera`` (structural SE3) the model's
  keys and camera controls
  (:func:`~arstream.app.realtime_video_events.camera_to_controls`), applied by the
  next chunk that starts (the worker runs at most ``CHUNKS_AHEAD`` of the session's
  chunks ahead of its socket) and acknowledged with ``session.interaction.queued``;
- each chunk goes out as ``video.chunk_metadata`` then one binary message of
  fragmented MP4 (:mod:`arstream.app.fmp4`), the first one opening with the
  init segment;
- refusals and bad messages get vLLM-Omni's error shape,
  ``{"type": "error", "message": ..., "code"?, "request_id"?, "event_id"?}``;
  a bad control message costs only its error, the session goes on, and a stall
  ends as vLLM-Omni's (its error, ``session.done``, close 1000);
- ARStream's extension, off unless ``session.start`` has ``"resumable": true``:
  a resume ticket in ``video.start``, a resume with ``session.start``'s
  ``resume``, and ``session.moved`` when a drain moves the session
  (:class:`VideoStreamState` is what the dialect keeps on the session for that).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .codecs import FMP4
from .dialect import ChunkSent, Dialect, Gate, OpeningPort, SessionPort, Started
from .fmp4 import fmp4_codec
from .handshake import Handshake
from .outbox import QueuedChunk
from .prompts import PromptRateExceeded
from .protocol import CLOSE_NORMAL, ERROR_CLOSE_CODES, CloseReason, ErrorCode, InputMessage, ProtocolError
from .protocol import MAX_RESUME_TOKEN_CHARS, StartMessage, TickMessage, controls_problem, dumps, loads_strict
from .protocol import too_large
from .realtime_video_events import (
    MAX_CONTROL_MESSAGE_BYTES,
    MAX_EVENT_ID_BYTES,
    OUTPUT_FORMAT,
    RealtimeVideoError,
    StartRequest,
    chunks_for_frames,
    error_event,
    parse_interaction,
    parse_start,
)
from .session import CHUNKS_AHEAD, Session, SessionState
from .worker import OutcomeKind, TickOutcome

log = logging.getLogger("arstream.realtime_video")

PATH = "/v1/realtime/video"
CLOSE_INTERNAL = ERROR_CLOSE_CODES[ErrorCode.INTERNAL]  # 1011
SERVER_SHUTDOWN = "server_shutdown"  # the error code of a session ended by shutdown (protocol 1's `closed` reason)
# Interaction event_ids remembered for event_id_conflict (vLLM-Omni remembers all; a session here may be endless),
# at most this many and this many bytes of them (each is at most MAX_EVENT_ID_BYTES).
EVENT_IDS_REMEMBERED = 4096
EVENT_ID_BYTES_REMEMBERED = 256 * 1024
# Interactions queued and not yet started by a chunk: each is listed in the next chunk's metadata, so this
# (with MAX_EVENT_ID_BYTES) bounds a video.chunk_metadata to a few tens of KB.
MAX_PENDING_INTERACTIONS = 64


class RecentIds:
    """The last ids seen, at most ``max_count`` of them and ``max_bytes`` of their UTF-8 in all; oldest go first."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._order: deque[str] = deque()
        self._ids: set[str] = set()
        self.bytes = 0

    def __contains__(self, name: object) -> bool:
        return name in self._ids

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[str]:
        """Oldest first."""
        return iter(self._order)

    def add(self, name: str) -> None:
        size = len(name.encode())
        while self._order and (len(self._order) >= self.max_count or self.bytes + size > self.max_bytes):
            oldest = self._order.popleft()
            self._ids.discard(oldest)
            self.bytes -= len(oldest.encode())
        self._order.append(name)
        self._ids.add(name)
        self.bytes += size


@dataclass
class VideoStreamState:
    """What a session of this dialect is beyond its :class:`Session`, kept on it (``Session.dialect_state``) so
    that a resume (PROTOCOL.md, the dialect's "Resume") goes on with it: the request, the frame budget, and the
    interactions (their names, which wait for a chunk, which hold)."""

    request_id: str
    config: dict[str, Any]
    chunks_target: int | None  # None: until session.stop
    resumable: bool  # the client asked for a resume ticket (`"resumable": true`)
    # Interaction ids: ARStream's event ids are integers, vLLM-Omni's are strings.
    event_names: dict[int, str] = field(default_factory=dict)
    names_seen: RecentIds = field(default_factory=lambda: RecentIds(EVENT_IDS_REMEMBERED, EVENT_ID_BYTES_REMEMBERED))
    # field (controls, prompt) -> (start order, event_id) of the interaction whose value holds now
    active: dict[str, tuple[int, str]] = field(default_factory=dict)
    started_count: int = 0
    event_fields: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def portable(self) -> dict[str, Any]:
        """As JSON, for a move to a peer (``Session.portable_state``); :meth:`from_portable` reads it back."""
        return {
            "dialect": PATH,
            "request_id": self.request_id,
            "config": self.config,
            "chunks_target": self.chunks_target,
            "resumable": self.resumable,
            "event_names": [[i, name] for i, name in self.event_names.items()],
            "names_seen": list(self.names_seen),
            "active": [[changed, order, name] for changed, (order, name) in self.active.items()],
            "started_count": self.started_count,
            "event_fields": [[name, list(fields)] for name, fields in self.event_fields.items()],
        }

    @classmethod
    def from_portable(cls, value: dict[str, Any]) -> VideoStreamState:
        """The state :meth:`portable` wrote (raises KeyError, TypeError or ValueError on anything else)."""
        if value.get("dialect") != PATH:
            raise ValueError(f"not a {PATH} session's state")
        # Held to what a session of this dialect can hold (a move's snapshot comes over the network).
        names = [name for _, name in value["event_names"]] + list(value["names_seen"])
        if len(value["event_names"]) > MAX_PENDING_INTERACTIONS or len(value["names_seen"]) > EVENT_IDS_REMEMBERED:
            raise ValueError("more interactions than a session keeps")
        if any(not isinstance(name, str) or len(name.encode()) > MAX_EVENT_ID_BYTES for name in names):
            raise ValueError(f"an event_id that is not a string of at most {MAX_EVENT_ID_BYTES} bytes")
        target = value["chunks_target"]
        state = cls(
            str(value["request_id"]),
            dict(value["config"]),
            None if target is None else int(target),
            bool(value["resumable"]),
            event_names={int(i): str(name) for i, name in value["event_names"]},
            active={str(changed): (int(order), str(name)) for changed, order, name in value["active"]},
            started_count=int(value["started_count"]),
            event_fields={str(name): tuple(str(f) for f in fields) for name, fields in value["event_fields"]},
        )
        for name in value["names_seen"]:
            state.names_seen.add(str(name))
        return state


def limit_control_messages(live: OpeningPort) -> None:
    """The transport's message limit once a session started (or resumed) here.

    vLLM-Omni reads a control message of any size its transport takes (uvicorn's 16 MiB) and answers one over
    its 128 KiB with an error, the session going on; here the transport keeps what every connection opens with
    (room for the largest start), so only a message past that is closed 1009 by the transport.
    """
    live.limit_messages(max(MAX_CONTROL_MESSAGE_BYTES, live.gate.settings.max_start_message_bytes))


def resume_token_of(message: Any) -> str | None:
    """The token a ``session.start`` resumes with (ARStream's ``resume``), or None; raises RealtimeVideoError."""
    if not isinstance(message, dict) or message.get("type") != "session.start" or message.get("resume") is None:
        return None
    token = message["resume"]
    if not isinstance(token, str) or not 0 < len(token) <= MAX_RESUME_TOKEN_CHARS:
        raise RealtimeVideoError(
            f"session.start resume must be a resume token (a string of at most {MAX_RESUME_TOKEN_CHARS} characters)",
            ErrorCode.INVALID_MESSAGE,
        )
    return token


def asks_resumable(message: dict[str, Any]) -> bool:
    """ARStream's ``"resumable": true`` in a ``session.start``; raises RealtimeVideoError on another value."""
    resumable = message.get("resumable", False)
    if not isinstance(resumable, bool):
        raise RealtimeVideoError("session.start resumable must be true or false", ErrorCode.INVALID_MESSAGE)
    return resumable


def _controls_problem(gate: Gate, controls: dict[str, Any]) -> str | None:
    return controls_problem(controls, gate.settings.max_control_items, gate.controls_validator)


# ---- the dialect -------------------------------------------------------------------------------


class RealtimeVideo(Dialect):
    """vLLM-Omni's realtime video on one socket (the module docstring says what differs from protocol 1)."""

    idle_detail = "Stall timeout: no generation progress and no session.ping for {seconds:g} s"
    # vLLM-Omni's stall: its error, then session.done (stopped), then its handler returns (close 1000).
    idle_close_code = CLOSE_NORMAL
    # The server ticks with all the session's credits: an interaction binds to the next chunk that starts, so
    # no more than this are made ahead of the socket (the worker holds the rest of its ticks in line).
    chunks_ahead = CHUNKS_AHEAD
    reason_in_close_frame = False

    def __init__(self) -> None:
        super().__init__()
        token = secrets.token_hex(16)
        self.session_id = "v-" + token
        self.request_id = "video_stream-" + token  # a resumed session's is its first connection's
        self._started = False  # errors carry the request id once the session started
        self._state: VideoStreamState | None = None  # set once the session started (or resumed)
        self._chunks_planned = 0  # chunks made or asked for (a tick submitted), against the frame budget
        self._chunks_sent = 0  # on this connection (transport_chunk_index)
        self._last_sent_index = -1  # the generation_chunk_index of the last chunk sent
        self._first_controls: dict[str, Any] | None = None
        self._resumable = False  # its session.start asked for resume tickets

    @property
    def state(self) -> VideoStreamState:
        assert self._state is not None, "the session has not started"
        return self._state

    @property
    def can_move(self) -> bool:  # type: ignore[override]
        """A session whose client asked for resume tickets follows a drain to a peer (its client knows how)."""
        return self._state is not None and self._state.resumable

    # ---- start ----------------------------------------------------------------------------------

    async def start(self, live: OpeningPort) -> Started | None:
        if not await live.accept():
            return None
        request = await self._await_start(live)
        if request is None or isinstance(request, Started):
            return request
        no_video = FMP4.unavailable_reason()  # said before admission, not as a failure at every tick
        if no_video is not None:
            await live.refuse(ErrorCode.INVALID_MESSAGE, f"this server cannot stream realtime video: {no_video}")
            return None
        limit_control_messages(live)
        gate = live.gate
        start_image = None
        if request.image is not None:
            # Admission is asked before a decode (a session that cannot start is not worth one), claimed after it.
            refusal = gate.admission_refusal() or gate.client_cap_refusal(live)
            if refusal is not None:
                await live.refuse(ErrorCode.OVER_CAPACITY, refusal)
                return None
            start_image = await live.start_image(*request.image)
            if start_image is None:
                return None
        # Admitted, the session counts as live; it is registered with no await in between (SessionHub.admit).
        refusal = gate.admit(live)
        if refusal is not None:
            log.info("session=%s not admitted: %s", self.session_id, refusal)
            await live.refuse(ErrorCode.OVER_CAPACITY, refusal)
            return None
        card = gate.model_card
        session = Session(
            self.session_id,
            codec=fmp4_codec(request.fps),
            quality=gate.settings.default_jpeg_quality(card),
            seed=request.seed,
            prompt=gate.prompts.prepare(request.start.prompt),
            max_pending_ticks=gate.settings.max_pending_ticks,
            start_image=start_image,
        )
        session.transition(SessionState.ACTIVE)
        target = None if request.num_frames is None else chunks_for_frames(request.num_frames, card)
        self._state = VideoStreamState(self.request_id, request.config(), target, self._resumable)
        session.dialect_state = self._state
        self._first_controls = request.controls
        return Started(session, resumable=self._state.resumable)

    async def _resume(self, live: OpeningPort, token: str) -> Started | None:
        """Adopt the detached (or still attached) session ``token`` names, as protocol 1's resume does."""
        limit_control_messages(live)
        resumed = await Handshake(live, self).adopt(token, StartMessage(type="start", resume=token))
        if resumed is None:
            return None
        state = resumed.session.dialect_state
        if isinstance(state, dict):  # moved here from a peer: its state came as JSON (Session.portable_state)
            state = resumed.session.dialect_state = VideoStreamState.from_portable(state)
        assert isinstance(state, VideoStreamState)  # the resume checked its dialect (owns)
        # Events applied by chunks that ran and never reached the client are done: only the waiting keep names.
        waiting = set(resumed.session.pending_event_ids())
        state.event_names = {i: name for i, name in state.event_names.items() if i in waiting}
        self._state, self.request_id, self.session_id = state, state.request_id, resumed.session.id
        self._chunks_planned = resumed.next_chunk_index  # the dropped ticks never ran; the rest made chunks
        return Started(resumed.session, resumed.next_chunk_index, resumed=True, resumable=state.resumable)

    async def _await_start(self, live: OpeningPort) -> StartRequest | Started | None:
        """The accepted ``session.start`` (or, for a resume, the session it resumed), or None after refusing
        (vLLM-Omni ends the connection on a bad one)."""
        gate = live.gate
        try:
            message = await asyncio.wait_for(live.ws.receive(), gate.settings.start_timeout_s)
        except TimeoutError:
            await live.refuse(ErrorCode.START_REQUIRED, "Timeout waiting for session.start")
            return None
        if message["type"] == "websocket.disconnect":
            live.disconnected = True
            return None
        text = message.get("text")
        if text is None:
            await live.refuse(ErrorCode.START_REQUIRED, "the first message must be session.start, as JSON text")
            return None
        if too_large(text, gate.start_message_bytes):
            await live.refuse(ErrorCode.MESSAGE_TOO_LARGE, "session.start message too large")
            return None
        try:
            parsed = loads_strict(text)
        except ValueError:
            await live.refuse(ErrorCode.START_REQUIRED, "Invalid JSON in session.start")
            return None
        if not gate.ready:
            await live.refuse(ErrorCode.OVER_CAPACITY, gate.not_ready_reason)
            return None
        try:
            token = resume_token_of(parsed)
        except RealtimeVideoError as exc:
            await live.refuse(ErrorCode.INVALID_MESSAGE, exc.message)
            return None
        if token is not None:
            return await self._resume(live, token)  # the rest of a resume's start is ignored, as protocol 1's
        try:
            request = parse_start(parsed, gate.model_card)
            self._resumable = asks_resumable(parsed)
            problem = None if request.controls is None else _controls_problem(gate, request.controls)
            if problem is not None:
                raise RealtimeVideoError(problem, ErrorCode.INVALID_CONTROLS)
        except RealtimeVideoError as exc:
            await live.refuse(ErrorCode(exc.code) if exc.code else ErrorCode.INVALID_MESSAGE, exc.message)
            return None
        return request

    def ready(self, live: SessionPort, started: Started) -> None:
        self._started = True
        state, card = self.state, live.gate.model_card
        start_event: dict[str, Any] = {"type": "video.start", "request_id": self.request_id, "format": OUTPUT_FORMAT}
        # ARStream's additions: the session id (as in /v1/stats and the logs) and the chunk size; a resume
        # ticket when the client asked for one, and whether this start resumed the session.
        start_event.update(
            config=state.config, session_id=self.session_id, frames_per_chunk=int(card["frames_per_chunk"])
        )
        if state.resumable:
            start_event["resume"] = started.ticket
        if started.resumed:
            start_event["resumed"] = True
        live.outbox.push_reply(dumps(start_event))
        how = "resumed" if started.resumed else "started"
        log.info("session=%s %s (realtime video, %s chunks)", self.session_id, how, state.chunks_target or "endless")
        self._submit_ticks(live, started.session)

    # ---- generation: the server ticks on the client's behalf ------------------------------------

    def _submit_ticks(self, live: SessionPort, session: Session) -> None:
        """Keep the session's credits in flight until the frame budget is covered."""
        target = self.state.chunks_target
        while (
            session.state is SessionState.ACTIVE
            and not live.moving  # its state is on its way to a peer (app/migration.py): nothing more runs here
            and session.pending_ticks < session.max_pending_ticks
            and (target is None or self._chunks_planned < target)
        ):
            # Tick ids go on past a resumed session's (its dropped ticks had ids too).
            tick_id = 0 if session.last_tick_id is None else session.last_tick_id + 1
            tick = TickMessage(type="tick", tick_id=tick_id, controls=self._first_controls)
            self._first_controls = None
            # Nobody waits on these but the server: only a chunk out (or a ping) is progress.
            live.submit(session.accept_tick(tick), client_waits=False)
            self._chunks_planned += 1

    def outcome(self, live: SessionPort, outcome: TickOutcome) -> None:
        if outcome.kind is OutcomeKind.CHUNK:
            live.outbox.push(QueuedChunk(outcome))
            return
        job = outcome.job
        log.warning("session=%s tick=%d %s: %s", self.session_id, job.tick_id, outcome.kind.value, outcome.error)
        if outcome.kind is OutcomeKind.INTERNAL:
            live.fatal(ErrorCode.INTERNAL, "internal server error", close_code=CLOSE_INTERNAL)
        else:
            # vLLM-Omni ends a request whose generation failed; so does this dialect (its KV is already released).
            message = f"generation failed: {outcome.error}"
            live.fatal(ErrorCode.SESSION_FAILED, message, close_code=CLOSE_INTERNAL)

    async def send_chunk(self, live: SessionPort, outcome: TickOutcome) -> ChunkSent:
        (payload,) = outcome.frame_messages  # the fMP4 encoder makes one message per chunk
        await live.ws.send_text(dumps(self._chunk_metadata(live.gate, outcome, payload)))
        await live.ws.send_bytes(payload)
        sent_at = time.perf_counter()
        for event in outcome.events:
            live.gate.metrics.action_to_frame_seconds.observe(sent_at - event.arrived_at)
        self._chunks_sent += 1
        self._last_sent_index = outcome.chunk_index
        live.touch()
        return ChunkSent(self._frames_in(live.gate, outcome), len(payload))

    def chunk_sent(self, live: SessionPort) -> None:
        session = live.session
        if session is None or not session.live:
            return
        target = self.state.chunks_target
        # Counted in chunks made, so that a resumed session ends where the one never dropped would have.
        if target is not None and self._last_sent_index + 1 >= target:
            log.info("session=%s done after %d chunk(s)", self.session_id, self._chunks_sent)
            live.close(CLOSE_NORMAL, CloseReason.TICK_CLOSE)
            return
        self._submit_ticks(live, session)

    def _chunk_metadata(self, gate: Gate, outcome: TickOutcome, payload: bytes) -> dict[str, Any]:
        """``video.chunk_metadata``, with the interactions this chunk started, holds and ended."""
        state = self.state
        started = [state.event_names.pop(i) for i in outcome.applied_event_ids if i in state.event_names]
        before = [name for _, name in sorted(set(state.active.values()))]
        for name in started:
            state.started_count += 1
            for changed in state.event_fields.pop(name, ()):
                state.active[changed] = (state.started_count, name)
        active = [name for _, name in sorted(set(state.active.values()))]  # in the order they started
        completed = [n for n in dict.fromkeys([*before, *started]) if n not in active]
        return {
            "type": "video.chunk_metadata",
            "request_id": self.request_id,
            "kind": "media",
            "num_frames": self._frames_in(gate, outcome),
            "byte_length": len(payload),
            "generation_chunk_index": outcome.chunk_index,
            "started_event_ids": started,
            "active_event_ids": active,
            "completed_event_ids": completed,
            "transport_chunk_index": self._chunks_sent,
            # ARStream's additions: the chunk's timings, as protocol 1's `chunk` reports them.
            "timings": {
                "queue_ms": round(outcome.queue_s * 1e3, 3),
                "compute_ms": round(outcome.compute_s * 1e3, 3),
                "encode_ms": round(outcome.encode_s * 1e3, 3),
            },
        }

    @staticmethod
    def _frames_in(gate: Gate, outcome: TickOutcome) -> int:
        card = gate.model_card
        if outcome.chunk_index == 0 and "first_chunk_frames" in card:
            return int(card["first_chunk_frames"])
        return int(card["frames_per_chunk"])

    # ---- messages in ----------------------------------------------------------------------------

    def text_in(self, live: SessionPort, text: str | None) -> None:
        session = live.session
        assert session is not None
        try:
            if text is None:
                raise RealtimeVideoError(
                    "binary messages from the client are not part of this API", ErrorCode.INVALID_MESSAGE
                )
            if too_large(text, MAX_CONTROL_MESSAGE_BYTES):
                raise RealtimeVideoError("control message too large", ErrorCode.MESSAGE_TOO_LARGE)
            try:
                parsed = loads_strict(text)
            except ValueError:
                raise RealtimeVideoError("Invalid JSON message", ErrorCode.INVALID_MESSAGE) from None
            if not isinstance(parsed, dict):
                raise RealtimeVideoError("WebSocket messages must be JSON objects", ErrorCode.INVALID_MESSAGE)
            kind = parsed.get("type")
            if kind == "session.stop":
                log.info("session=%s stopped by the client", self.session_id)
                live.close(CLOSE_NORMAL, CloseReason.CLIENT)
            elif kind == "session.ping":
                live.touch()
                live.outbox.push_reply(dumps({"type": "session.pong"}))
            elif kind == "session.interaction":
                self._interact(live, session, parsed)
            else:
                raise RealtimeVideoError(f"Unknown message type: {kind}", ErrorCode.INVALID_MESSAGE)
        except RealtimeVideoError as exc:
            live.gate.metrics.errors.labels(code=str(exc.code)).inc()
            event = error_event(exc.message, exc.code, request_id=self.request_id, event_id=exc.event_id)
            live.outbox.push_reply(dumps(event))

    def _interact(self, live: SessionPort, session: Session, message: dict[str, Any]) -> None:
        interaction = parse_interaction(message, live.gate.model_card)
        name, state = interaction.event_id, self.state
        if name in state.names_seen:
            raise RealtimeVideoError("event_id_conflict", "event_id_conflict", event_id=name)
        if len(state.event_names) >= MAX_PENDING_INTERACTIONS:
            raise RealtimeVideoError(
                f"{len(state.event_names)} interactions are already waiting for the next chunk "
                f"(at most {MAX_PENDING_INTERACTIONS}); send this one after video.chunk_metadata starts them",
                "interaction_failed",
                event_id=name,
            )
        problem = None if interaction.controls is None else _controls_problem(live.gate, interaction.controls)
        if problem is not None:
            raise RealtimeVideoError(problem, "interaction_failed", event_id=name)
        event_id = (session.event_floor or 0) + 1
        try:
            # The prompt was bounded when the interaction was parsed; what the model makes of it may be longer.
            prepared = live.gate.prompts.prepare(interaction.prompt, session.prompt_allowance)
            session.accept_event(
                InputMessage(type="input", event_id=event_id, controls=interaction.controls).model_copy(
                    update={"prompt": prepared}
                ),
                hold_chunks=interaction.hold_chunks,
                release=interaction.release,
                prompt_transition_chunks=interaction.prompt_transition_chunks,
            )
        except (ProtocolError, PromptRateExceeded) as exc:
            raise RealtimeVideoError(str(exc), "interaction_failed", event_id=name) from None
        state.names_seen.add(name)
        state.event_names[event_id] = name
        fields = ("controls",) * (interaction.controls is not None) + ("prompt",) * (interaction.prompt is not None)
        state.event_fields[name] = fields
        live.outbox.push_reply(
            dumps({"type": "session.interaction.queued", "request_id": self.request_id, "event_id": name})
        )

    # ---- errors and the last words ----------------------------------------------------------------

    def owns(self, session: Session) -> bool:
        state = session.dialect_state  # a moved session's is still JSON until its resume
        return isinstance(state, VideoStreamState) or (isinstance(state, dict) and state.get("dialect") == PATH)

    def moved(self, resume: str, next_chunk_index: int) -> str:
        """ARStream's ``session.moved``: the session goes on on a peer; resume it with this token there."""
        moved = {"type": "session.moved", "request_id": self.request_id, "resume": resume}
        return dumps({**moved, "next_chunk_index": next_chunk_index})

    def error(self, code: str, message: str, *, tick_id: int | None = None) -> dict[str, Any]:
        return error_event(message, code, request_id=self.request_id if self._started else None)

    def closed(self, gate: Gate, reason: CloseReason) -> str | None:
        if reason in (CloseReason.CLIENT, CloseReason.TICK_CLOSE, CloseReason.IDLE_TIMEOUT):
            # A stall ends as vLLM-Omni's does: its error is queued already, session.done (stopped) follows.
            done = {
                "type": "session.done",
                "request_id": self.request_id,
                "chunks": self._chunks_sent,
                "stopped": reason is not CloseReason.TICK_CLOSE,
            }
            return dumps(done)
        if reason is CloseReason.SERVER_SHUTDOWN:
            gate.metrics.errors.labels(code=SERVER_SHUTDOWN).inc()
            return dumps(error_event("the server is shutting down", SERVER_SHUTDOWN, request_id=self.request_id))
        return None  # its error is queued already

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
  (:func:`~arstream.app.realtime_video_events.camera_to_controls`), applied at the next
  chunk boundary and acknowledged with ``session.interaction.queued``;
- each chunk goes out as ``video.chunk_metadata`` then one binary message of
  fragmented MP4 (:mod:`arstream.app.fmp4`), the first one opening with the
  init segment;
- refusals and bad messages get vLLM-Omni's error shape,
  ``{"type": "error", "message": ..., "code"?, "request_id"?, "event_id"?}``;
  a bad control message costs only its error, the session goes on.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from arstream.app import auth
from arstream.app.outbox import Outbox, QueuedText
from arstream.app.fmp4 import fmp4_codec
from arstream.app.codecs import FMP4
from arstream.app.guard import limit_messages, transport_control
from arstream.app.limits import MessageBudget, count_exceeds
from arstream.app.protocol import CLOSE_NORMAL, ERROR_CLOSE_CODES, ErrorCode, InputMessage, ProtocolError, TickMessage
from arstream.app.protocol import CLOSE_GOING_AWAY, dumps, loads_strict
from arstream.app.realtime_video_events import (
    MAX_CONTROL_MESSAGE_BYTES,
    OUTPUT_FORMAT,
    RealtimeVideoError,
    StartRequest,
    chunks_for_frames,
    error_event,
    parse_interaction,
    parse_start,
)
from arstream.app.session import Session, SessionState
from arstream.app.start_image import ClientGone, StartImageBusy, StartImageRefused
from arstream.runner.types import StartImage
from arstream.app.worker import OutcomeKind, TickOutcome

if TYPE_CHECKING:
    from arstream.app.hub import SessionHub

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

    def add(self, name: str) -> None:
        size = len(name.encode())
        while self._order and (len(self._order) >= self.max_count or self.bytes + size > self.max_bytes):
            oldest = self._order.popleft()
            self._ids.discard(oldest)
            self.bytes -= len(oldest.encode())
        self._order.append(name)
        self._ids.add(name)
        self.bytes += size


# ---- the connection ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Media:
    """A chunk outcome for the writer: metadata then its fMP4 bytes."""

    outcome: TickOutcome


@dataclass(frozen=True)
class _End:
    """The last things the writer sends: an optional event (session.done or an error), then the close frame."""

    code: int
    text: str | None = None


class RealtimeVideoConnection:
    """Serves one ``/v1/realtime/video`` WebSocket; duck-types what the hub needs of a connection."""

    def __init__(self, websocket: WebSocket, hub: SessionHub) -> None:
        self.ws = websocket
        self.hub = hub
        self.settings = hub.settings
        self.metrics = hub.metrics
        self.session: Session | None = None
        token = secrets.token_hex(16)
        self.session_id = "v-" + token
        self.request_id = "video_stream-" + token
        self.outbox = Outbox()
        self.client_host = websocket.client.host if websocket.client else ""
        self.token_key = auth.token_key(auth.offered_token(websocket.headers, websocket.query_params))
        self._writer: asyncio.Task[None] | None = None
        self._budget = MessageBudget(
            self.settings.max_messages_per_s, self.settings.message_burst, asyncio.get_running_loop().time()
        )
        self._released = False
        self._ticks_submitted = 0
        self._chunks_target: int | None = None
        self._chunks_sent = 0
        self._progress_at = 0.0
        # Interaction ids: ARStream's event ids are integers, vLLM-Omni's are strings.
        self._event_names: dict[int, str] = {}
        self._names_seen = RecentIds(EVENT_IDS_REMEMBERED, EVENT_ID_BYTES_REMEMBERED)
        # field (controls, prompt) -> (start order, event_id) of the interaction whose value holds now
        self._active: dict[str, tuple[int, str]] = {}
        self._started_count = 0
        self._event_fields: dict[str, tuple[str, ...]] = {}

    # ---- entry point -----------------------------------------------------------------

    async def run(self) -> None:
        self.metrics.websocket_connections.inc()
        self.metrics.websocket_open.inc()
        try:
            await self._serve()
        except Exception:  # noqa: BLE001 - a server fault: tell the client, then close 1011
            log.exception("session=%s server fault", self.session_id)
            if self.session is None:
                await self._refuse("internal server error", ErrorCode.INTERNAL)
            else:
                self._end_with_error("internal server error", ErrorCode.INTERNAL, CLOSE_INTERNAL)
        finally:
            await self._finish()
            self.metrics.websocket_open.dec()

    async def _serve(self) -> None:
        ws = self.ws
        refusal, missing = auth.upgrade_refusal(ws, self.settings)
        if refusal is not None and self.settings.refuse_before_upgrade:
            headers = {"WWW-Authenticate": "Bearer"} if missing else None
            await self._deny_upgrade(refusal, ErrorCode.UNAUTHORIZED, 401 if missing else 403, headers)
            return
        if refusal is None:
            # Waiting for session.start is capped as for protocol 1 (app/unstarted.py): past it, 503 at once.
            busy = self.hub.unstarted.refusal(self.client_host)
            if busy is not None:
                await self._deny_upgrade(busy, ErrorCode.OVER_CAPACITY, 503, {"Retry-After": "1"})
                return
            self.hub.unstarted.add(self, self.client_host)
        await ws.accept()
        # Only session.start may carry a picture (image_reference), as only protocol 1's start may.
        limit_messages(self.ws, self.settings.ws_message_limit(self.hub.start_message_bytes))
        if refusal is not None:
            await self._refuse(refusal, ErrorCode.UNAUTHORIZED)
            return
        request = await self._await_start()
        if request is None:
            return
        no_video = FMP4.unavailable_reason()  # said before admission, not as a failure at every tick
        if no_video is not None:
            await self._refuse(f"this server cannot stream realtime video: {no_video}", ErrorCode.INVALID_MESSAGE)
            return
        limit_messages(self.ws, self.settings.ws_message_limit(MAX_CONTROL_MESSAGE_BYTES))
        start_image = None
        if request.image is not None:
            start_image = await self._start_image(*request.image)
            if start_image is None:
                return
        # Admitted, the session counts as live; it is registered with no await in between (SessionHub.admit).
        refusal = self.hub.admit(self)  # type: ignore[arg-type]
        if refusal is not None:
            log.info("session=%s not admitted: %s", self.session_id, refusal)
            await self._refuse(refusal, ErrorCode.OVER_CAPACITY)
            return
        card = self.hub.model_card
        session = Session(
            self.session_id,
            codec=fmp4_codec(request.fps),
            quality=self.settings.default_jpeg_quality(card),
            seed=request.seed,
            prompt=request.start.prompt,
            max_pending_ticks=self.settings.max_pending_ticks,
            start_image=start_image,
        )
        session.transition(SessionState.ACTIVE)
        self.session = session
        if request.num_frames is not None:
            self._chunks_target = chunks_for_frames(request.num_frames, card)
        self.hub.register(self)  # type: ignore[arg-type]
        self._writer = asyncio.create_task(self._write_loop(), name=f"writer-{self.session_id}")
        start_event = {"type": "video.start", "request_id": self.request_id, "format": OUTPUT_FORMAT}
        # ARStream's additions: the session id (as in /v1/stats and the logs) and the chunk size.
        start_event.update(
            config=request.config(), session_id=self.session_id, frames_per_chunk=int(card["frames_per_chunk"])
        )
        self.outbox.push_reply(dumps(start_event))
        log.info("session=%s started (realtime video, %s frames)", self.session_id, request.num_frames or "endless")
        self._progress_at = asyncio.get_running_loop().time()
        self._submit_ticks(session, first_controls=request.controls)
        await self._receive_loop(session)

    # ---- before the session exists -----------------------------------------------------

    async def _start_image(self, name: str | None, data: str | None) -> StartImage | None:
        """The start image ``image_reference`` asked for, or None after refusing (as protocol 1's start.image)."""
        # Admission is asked before a decode (a session that cannot start is not worth one), claimed after it.
        refusal = self.hub.admission_refusal() or self.hub.client_cap_refusal(self)  # type: ignore[arg-type]
        if refusal is not None:
            await self._refuse(refusal, ErrorCode.OVER_CAPACITY)
            return None
        transport = transport_control(self.ws.scope)
        try:
            return await self.hub.start_images.resolve(
                name=name, data=data, offered=self.hub.start_image_names, gone=transport.lost if transport else None
            )
        except ClientGone:
            return None  # _finish stops counting it as waiting to start
        except StartImageBusy as exc:
            await self._refuse(str(exc), ErrorCode.OVER_CAPACITY)
            return None
        except StartImageRefused as exc:
            await self._refuse(str(exc), ErrorCode.INVALID_IMAGE)
            return None

    async def _deny_upgrade(self, message: str, code: ErrorCode, status: int, headers: dict[str, str] | None) -> None:
        """Refuse with HTTP ``status`` before the upgrade; the body is the error event."""
        log.info("session=%s refused before the upgrade: %s", self.session_id, message)
        self.metrics.errors.labels(code=str(code)).inc()
        denial = JSONResponse(error_event(message, code), status_code=status, headers=headers)
        await self.ws.send_denial_response(denial)

    async def _refuse(self, message: str, code: ErrorCode) -> None:
        """Error then close, for a connection that never became a session (bounded by close_timeout_s)."""
        self.metrics.errors.labels(code=str(code)).inc()

        async def send_refusal() -> None:
            await self.ws.send_text(dumps(error_event(message, code)))
            await self.ws.close(ERROR_CLOSE_CODES.get(code, 1008))

        try:
            await asyncio.wait_for(send_refusal(), self.settings.close_timeout_s)
        except Exception:  # noqa: BLE001 - a peer that is gone or does not read is left to the transport
            log.debug("session=%s did not take its refusal", self.session_id)



    def _too_large(self, text: str, limit: int | None = None) -> bool:
        limit = limit or MAX_CONTROL_MESSAGE_BYTES
        return len(text) > limit or len(text.encode()) > limit

    async def _await_start(self) -> StartRequest | None:
        """The accepted ``session.start``, or None after refusing (vLLM-Omni ends the connection on a bad one)."""
        try:
            message = await asyncio.wait_for(self.ws.receive(), self.settings.start_timeout_s)
        except TimeoutError:
            await self._refuse("Timeout waiting for session.start", ErrorCode.START_REQUIRED)
            return None
        if message["type"] == "websocket.disconnect":
            return None
        text = message.get("text")
        if text is None:
            await self._refuse("the first message must be session.start, as JSON text", ErrorCode.START_REQUIRED)
            return None
        if self._too_large(text, self.hub.start_message_bytes):
            await self._refuse("session.start message too large", ErrorCode.MESSAGE_TOO_LARGE)
            return None
        try:
            parsed = loads_strict(text)
        except ValueError:
            await self._refuse("Invalid JSON in session.start", ErrorCode.START_REQUIRED)
            return None
        if not self.hub.ready:
            await self._refuse(self.hub.not_ready_reason, ErrorCode.OVER_CAPACITY)
            return None
        try:
            request = parse_start(parsed, self.hub.model_card)
            if request.controls is not None:
                self._validate_controls(request.controls)
        except RealtimeVideoError as exc:
            await self._refuse(exc.message, ErrorCode(exc.code) if exc.code else ErrorCode.INVALID_MESSAGE)
            return None
        return request

    # ---- generation: the server ticks on the client's behalf ------------------------------------

    def _submit_ticks(self, session: Session, *, first_controls: dict[str, Any] | None = None) -> None:
        """Keep the session's credits in flight until the frame budget is covered."""
        assert self.hub.worker is not None
        while (
            session.state is SessionState.ACTIVE
            and session.pending_ticks < session.max_pending_ticks
            and (self._chunks_target is None or self._ticks_submitted < self._chunks_target)
        ):
            tick = TickMessage(type="tick", tick_id=self._ticks_submitted, controls=first_controls)
            first_controls = None
            self.hub.worker.submit(session.accept_tick(tick))
            self._ticks_submitted += 1

    def on_outcome(self, outcome: TickOutcome) -> None:
        session = self.session
        if session is None or not session.live or outcome.job.session is not session:
            return
        if outcome.kind is OutcomeKind.CHUNK:
            self.metrics.chunk_compute_seconds.observe(outcome.compute_s)
            self.metrics.queue_wait_seconds.observe(outcome.queue_s)
            self.outbox.push(_Media(outcome))  # type: ignore[arg-type]
            return
        job = outcome.job
        log.warning("session=%s tick=%d %s: %s", self.session_id, job.tick_id, outcome.kind.value, outcome.error)
        if outcome.kind is OutcomeKind.INTERNAL:
            self._end_with_error("internal server error", ErrorCode.INTERNAL, CLOSE_INTERNAL)
        else:
            # vLLM-Omni ends a request whose generation failed; so does this dialect (its KV is already released).
            self._end_with_error(f"generation failed: {outcome.error}", ErrorCode.SESSION_FAILED, CLOSE_INTERNAL)

    def _chunk_metadata(self, outcome: TickOutcome, payload: bytes) -> dict[str, Any]:
        """``video.chunk_metadata``, with the interactions this chunk started, holds and ended."""
        started = [self._event_names.pop(i) for i in outcome.applied_event_ids if i in self._event_names]
        before = [name for _, name in sorted(set(self._active.values()))]
        for name in started:
            self._started_count += 1
            for field in self._event_fields.pop(name, ()):
                self._active[field] = (self._started_count, name)
        active = [name for _, name in sorted(set(self._active.values()))]  # in the order they started
        completed = [n for n in dict.fromkeys([*before, *started]) if n not in active]
        return {
            "type": "video.chunk_metadata",
            "request_id": self.request_id,
            "kind": "media",
            "num_frames": self._frames_in(outcome),
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

    def _frames_in(self, outcome: TickOutcome) -> int:
        card = self.hub.model_card
        if outcome.chunk_index == 0 and "first_chunk_frames" in card:
            return int(card["first_chunk_frames"])
        return int(card["frames_per_chunk"])

    # ---- the receive loop ---------------------------------------------------------------

    async def _receive_loop(self, session: Session) -> None:
        loop = asyncio.get_running_loop()
        stall_s = self.settings.idle_timeout_s
        while session.live:
            delay = self._budget.delay(loop.time())
            if delay > 0:
                await asyncio.sleep(delay)
            left = self._progress_at + stall_s - loop.time()
            if left <= 0:
                self._end_with_error(
                    f"Stall timeout: no generation progress and no session.ping for {stall_s:g} s",
                    ErrorCode.IDLE_TIMEOUT,
                    ERROR_CLOSE_CODES[ErrorCode.IDLE_TIMEOUT],
                )
                return
            try:
                if self.outbox.replies_full:
                    await asyncio.wait_for(self.outbox.wait_reply_space(), left)
                    continue
                message = await asyncio.wait_for(self.ws.receive(), left)
            except TimeoutError:
                continue
            if message["type"] == "websocket.disconnect":
                return
            if session.live:
                self._handle(session, message)

    def _reply_error(self, exc: RealtimeVideoError) -> None:
        self.metrics.errors.labels(code=str(exc.code)).inc()
        event = error_event(exc.message, exc.code, request_id=self.request_id, event_id=exc.event_id)
        self.outbox.push_reply(dumps(event))

    def _handle(self, session: Session, message: dict[str, Any]) -> None:
        try:
            text = message.get("text")
            if text is None:
                raise RealtimeVideoError(
                    "binary messages from the client are not part of this API", ErrorCode.INVALID_MESSAGE
                )
            if self._too_large(text):
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
                self._end(CLOSE_NORMAL, self._done_event(stopped=True))
            elif kind == "session.ping":
                self._progress_at = asyncio.get_running_loop().time()
                self.outbox.push_reply(dumps({"type": "session.pong"}))
            elif kind == "session.interaction":
                self._interact(session, parsed)
            else:
                raise RealtimeVideoError(f"Unknown message type: {kind}", ErrorCode.INVALID_MESSAGE)
        except RealtimeVideoError as exc:
            self._reply_error(exc)

    def _interact(self, session: Session, message: dict[str, Any]) -> None:
        interaction = parse_interaction(message, self.hub.model_card)
        name = interaction.event_id
        if name in self._names_seen:
            raise RealtimeVideoError("event_id_conflict", "event_id_conflict", event_id=name)
        if len(self._event_names) >= MAX_PENDING_INTERACTIONS:
            raise RealtimeVideoError(
                f"{len(self._event_names)} interactions are already waiting for the next chunk "
                f"(at most {MAX_PENDING_INTERACTIONS}); send this one after video.chunk_metadata starts them",
                "interaction_failed",
                event_id=name,
            )
        if interaction.controls is not None:
            try:
                self._validate_controls(interaction.controls)
            except RealtimeVideoError as exc:
                raise RealtimeVideoError(exc.message, "interaction_failed", event_id=name) from None
        event_id = (session.event_floor or 0) + 1
        try:
            session.accept_event(
                InputMessage(type="input", event_id=event_id, controls=interaction.controls, prompt=interaction.prompt),
                hold_chunks=interaction.hold_chunks,
                release=interaction.release,
                prompt_transition_chunks=interaction.prompt_transition_chunks,
            )
        except ProtocolError as exc:
            raise RealtimeVideoError(exc.message, "interaction_failed", event_id=name) from None
        self._names_seen.add(name)
        self._event_names[event_id] = name
        fields = ("controls",) * (interaction.controls is not None) + ("prompt",) * (interaction.prompt is not None)
        self._event_fields[name] = fields
        self.outbox.push_reply(
            dumps({"type": "session.interaction.queued", "request_id": self.request_id, "event_id": name})
        )

    def _validate_controls(self, controls: dict[str, Any]) -> None:
        limit = self.settings.max_control_items
        if count_exceeds(controls, limit):
            raise RealtimeVideoError(f"controls hold more than {limit} JSON values", ErrorCode.INVALID_CONTROLS)
        validator = self.hub.controls_validator
        error = None if validator is None else next(iter(validator.iter_errors(controls)), None)
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "controls"
            raise RealtimeVideoError(f"{where}: {error.message}", ErrorCode.INVALID_CONTROLS)

    # ---- ending -----------------------------------------------------------------------------

    def _done_event(self, *, stopped: bool) -> str:
        done = {"type": "session.done", "request_id": self.request_id, "chunks": self._chunks_sent, "stopped": stopped}
        return dumps(done)

    def _end(self, code: int, text: str | None) -> None:
        """Queue the last event and the close frame; drop queued ticks and release the KV now."""
        session = self.session
        if session is None or not session.live:
            return
        session.transition(SessionState.CLOSING)
        self.outbox.push(_End(code, text))  # type: ignore[arg-type]
        self._release()

    def _end_with_error(self, message: str, code: str, close_code: int) -> None:
        self.metrics.errors.labels(code=code).inc()
        self._end(close_code, dumps(error_event(message, code, request_id=self.request_id)))

    def close_for_shutdown(self) -> None:
        self._end_with_error("the server is shutting down", SERVER_SHUTDOWN, CLOSE_GOING_AWAY)

    async def wait_sent(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the writer to send everything queued, then stop it."""
        writer = self._writer
        if writer is None or writer.done():
            return
        done, _ = await asyncio.wait({writer}, timeout=timeout_s)
        if not done:
            writer.cancel()
            await asyncio.wait({writer})

    def _release(self) -> None:
        if self._released or self.session is None:
            return
        self._released = True
        assert self.hub.worker is not None
        dropped = self.hub.worker.drop_session(self.session_id)
        log.info("session=%s released (%d queued tick(s) dropped)", self.session_id, dropped)

    async def _finish(self) -> None:
        self.hub.unstarted.discard(self)  # refused, or gone before its session started
        session = self.session
        if session is None:
            return
        if session.state is not SessionState.CLOSING and session.state is not SessionState.CLOSED:
            session.transition(SessionState.CLOSING)
        self._release()
        self.hub.unregister(self)  # type: ignore[arg-type]
        await self.wait_sent(self.settings.shutdown_grace_s)
        if session.state is not SessionState.CLOSED:
            session.transition(SessionState.CLOSED)

    # ---- the writer -----------------------------------------------------------------------

    async def _write_loop(self) -> None:
        session = self.session
        assert session is not None
        try:
            while True:
                item: Any = await self.outbox.get()
                if isinstance(item, QueuedText):
                    await self.ws.send_text(item.text)
                elif isinstance(item, _Media):
                    await self._send_media(session, item.outcome)
                else:
                    if item.text is not None:
                        await self.ws.send_text(item.text)
                    await self.ws.close(item.code)
                    return
        except Exception as exc:  # noqa: BLE001 - a vanished client ends the writer quietly
            log.debug("session=%s writer stopped: %s", self.session_id, exc)
        finally:
            self.outbox.close()

    async def _send_media(self, session: Session, outcome: TickOutcome) -> None:
        (payload,) = outcome.frame_messages  # the fMP4 encoder makes one message per chunk
        await self.ws.send_text(dumps(self._chunk_metadata(outcome, payload)))
        await self.ws.send_bytes(payload)
        sent_at = time.perf_counter()
        for event in outcome.events:
            self.metrics.action_to_frame_seconds.observe(sent_at - event.arrived_at)
        self.metrics.frames_sent.inc(self._frames_in(outcome))
        self.metrics.bytes_sent.inc(len(payload))
        self.metrics.chunks.inc()
        self._chunks_sent += 1
        self._progress_at = asyncio.get_running_loop().time()
        session.release_credit()
        if not session.live:
            return
        if self._chunks_target is not None and self._chunks_sent >= self._chunks_target:
            log.info("session=%s done after %d chunk(s)", self.session_id, self._chunks_sent)
            self._end(CLOSE_NORMAL, self._done_event(stopped=False))
            return
        self._submit_ticks(session)


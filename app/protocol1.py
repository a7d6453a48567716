"""Protocol 1 (``WS /v1/sessions``, PROTOCOL.md) as a dialect of the one live session.

Its start is the handshake (:mod:`arstream.app.handshake`: ``start``, resume,
branch, watch); then ``ready``, and each message is answered at once (ack,
pong, error) while accepted ticks go to the worker. A tick's credit comes
back only when its last frame (or its error) has been written. A controller
can pass control to one of its viewers: the two live sessions swap roles.

Viewers get every chunk the controller gets (app/viewer_feed.py, to the
audience of app/viewers.py). What ``ready`` says to each role is app/protocol1_ready.py's.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from .dialect import ChunkSent, Dialect, Gate, OpeningPort, SessionPort, Started
from .handshake import Handshake
from .outbox import QueuedChunk, QueuedText, ViewerChunk
from .protocol import CLOSE_NORMAL, ClientMessage, CloseMessage, CloseReason, ErrorCode, InputMessage
from .protocol import PassControlMessage, PingMessage, ProtocolError, RecordMessage, TickMessage, WebRTCOfferMessage
from .protocol import ack_message, closed_message, controls_problem, dumps, error_message, moved_message
from .protocol import parse_client_message, pong_message, recording_message, role_message, too_large
from .protocol import with_prepared_prompt
from .protocol1_ready import ROLE_CONTROLLER, ROLE_VIEWER, send_ready
from .session import Session, TickJob
from .viewer_feed import ViewerFeed
from .webrtc import SessionVideo
from .writer import send_chunk_on_websocket
from .worker import OutcomeKind, TickOutcome

log = logging.getLogger("arstream.session")

PATH = "/v1/sessions"
BINARY_REFUSED = "binary messages from the client are not part of protocol 1"


class Protocol1(Dialect):
    """Protocol 1 on one socket; controller or viewer as its live session's role says."""

    can_move = True

    def __init__(self) -> None:
        super().__init__()
        self.session_id = "s-" + secrets.token_hex(8)
        self._viewers = ViewerFeed(TickOutcome.chunk_header)  # a controller's chunks for its viewers
        self._video = SessionVideo(self._accept_input, self._reply_error)  # this socket's WebRTC path, once offered

    # ---- start and ready -----------------------------------------------------------------------

    async def start(self, opening: OpeningPort) -> Started | None:
        return await Handshake(opening, self).open()

    def ready(self, live: SessionPort, started: Started) -> None:
        send_ready(live, started)

    # ---- messages in ------------------------------------------------------------------------------

    def text_in(self, live: SessionPort, text: str | None) -> TickJob | None:
        if text is None:
            self._reply_error(live, ProtocolError(ErrorCode.INVALID_MESSAGE, BINARY_REFUSED))
            return None
        limit = live.gate.settings.max_message_bytes
        if too_large(text, limit):
            live.fatal(ErrorCode.MESSAGE_TOO_LARGE, f"text messages are limited to {limit} bytes")
            return None
        try:
            parsed = parse_client_message(text)
            if live.watch is not None:
                self._as_viewer(live, parsed)
                return None
            return self._as_controller(live, parsed)
        except ProtocolError as exc:
            self._reply_error(live, exc)
            return None

    def _reply_error(self, live: SessionPort, error: ProtocolError) -> None:
        live.gate.metrics.errors.labels(code=str(error.code)).inc()
        self._reply(live, error_message(error.code, error.message, tick_id=error.tick_id))

    @staticmethod
    def _reply(live: SessionPort, payload: dict[str, Any]) -> None:
        """Queue an immediate reply (ack, pong, error)."""
        live.outbox.push_reply(dumps(payload))
        live.check_send_backlog()

    def _as_controller(self, live: SessionPort, parsed: ClientMessage) -> TickJob | None:
        """What the controller asked: a tick is returned for the live session to run; the rest is answered."""
        session = live.session
        assert session is not None
        if isinstance(parsed, TickMessage):
            parsed = with_prepared_prompt(parsed, live.gate.prompts, session.prompt_allowance)
            self._check_controls(live, parsed.controls, tick_id=parsed.tick_id)
            if self._viewers.held:  # offered once the tick is on its way: the viewers' writes go beside it
                asyncio.get_running_loop().call_soon(self._viewers.offer_held, live.gate)
            return session.accept_tick(parsed)
        if isinstance(parsed, InputMessage):
            duplicate = self._accept_input(live, parsed, latest_wins=False)
            self._reply(live, ack_message(parsed.event_id, duplicate=duplicate))
        elif isinstance(parsed, PingMessage):
            self._reply(live, pong_message(parsed.t))
        elif isinstance(parsed, CloseMessage):
            log.info("session=%s closed by the client", session.id)
            live.close(CLOSE_NORMAL, CloseReason.CLIENT)
        elif isinstance(parsed, PassControlMessage):
            self._pass_control(live, session, parsed.to)
        elif isinstance(parsed, RecordMessage):
            self._record(live, session, parsed.on)
        elif isinstance(parsed, WebRTCOfferMessage):
            self._video.offer(live, parsed.sdp)
        else:
            raise ProtocolError(ErrorCode.INVALID_MESSAGE, "the session has already started; start is sent once")
        return None

    def _as_viewer(self, live: SessionPort, parsed: ClientMessage) -> None:
        """A viewer may ping and close; what only the controller may send gets not_controller."""
        if isinstance(parsed, PingMessage):
            self._reply(live, pong_message(parsed.t))
        elif isinstance(parsed, CloseMessage):
            log.info("session=%s viewer %s closed by the client", self.session_id, getattr(live.watch, "viewer_id", ""))
            live.close(CLOSE_NORMAL, CloseReason.CLIENT)
        elif isinstance(parsed, WebRTCOfferMessage):
            self._video.offer(live, parsed.sdp)  # its frames on a track of its own, its chunk messages here
        elif isinstance(parsed, (TickMessage, InputMessage, PassControlMessage, RecordMessage)):
            detail = f"a viewer may not send {parsed.type}; the controller can pass control"
            tick_id = parsed.tick_id if isinstance(parsed, TickMessage) else None
            raise ProtocolError(ErrorCode.NOT_CONTROLLER, detail, tick_id=tick_id)
        else:
            raise ProtocolError(ErrorCode.INVALID_MESSAGE, "the session has already started; start is sent once")

    def _accept_input(self, live: SessionPort, message: InputMessage, *, latest_wins: bool) -> bool:
        """Stage an `input` (from the WebSocket, or latest-wins from a data channel); True: a recent duplicate."""
        session = live.session
        assert session is not None
        message = with_prepared_prompt(message, live.gate.prompts, session.prompt_allowance)
        self._check_controls(live, message.controls, tick_id=None)
        duplicate = session.accept_event(message, latest_wins=latest_wins)
        live.touch()
        return duplicate

    @staticmethod
    def _check_controls(live: SessionPort, controls: dict[str, Any] | None, *, tick_id: int | None) -> None:
        limit, validator = live.gate.settings.max_control_items, live.gate.controls_validator
        problem = None if controls is None else controls_problem(controls, limit, validator)
        if problem is not None:
            raise ProtocolError(ErrorCode.INVALID_CONTROLS, problem, tick_id=tick_id)

    def _record(self, live: SessionPort, session: Session, on: bool) -> None:
        """Record the session from its next chunk on, or stop (PROTOCOL.md, "Recording"), then say which."""
        gate = live.gate
        worker = gate.worker
        if gate.settings.record_dir is None or worker is None:
            raise ProtocolError(ErrorCode.INVALID_MESSAGE, "recording is off on this server (no --record-dir)")
        if on:
            session.record_to = gate.shares.token(session.id)
        elif session.record_to is not None:
            session.record_to = None
            worker.recording_pauses(session.id)  # after its chunks already on their way: the file ends there
        log.info("session=%s recording %s", session.id, "on" if on else "off")
        self._reply(live, recording_message(on))

    def _pass_control(self, live: SessionPort, session: Session, viewer_id: str) -> None:
        """Hand control to one of the session's viewers (the live session swaps the roles), then say so."""
        self._viewers.offer_held(live.gate)  # chunks before the pass go to the viewers as they were
        live.check_pass_control(viewer_id)  # control stays on a refusal, and so does the track
        self._video.stop_sending()  # the session's own codec again: this socket watches in it from now on
        passed, gate = live.pass_control(viewer_id), live.gate
        # how far back it can rewind and branch from, as `ready` says: the new controller's page shows that timeline
        controller = role_message(
            ROLE_CONTROLLER, last_tick_id=session.last_tick_id, resume=passed.resume, rewind_seconds=gate.rewind_seconds
        )
        passed.to.outbox.push(QueuedText(dumps(controller)))
        live.outbox.push(QueuedText(dumps(role_message(ROLE_VIEWER, viewer_id=passed.viewer_id))))
        gate.shares.audience_changed(session, gate.controller(session.id))

    # ---- outcomes -----------------------------------------------------------------------------------

    def outcome(self, live: SessionPort, outcome: TickOutcome) -> None:
        session, job = live.session, outcome.job
        assert session is not None
        if outcome.kind is OutcomeKind.CHUNK:
            live.outbox.push(QueuedChunk(outcome))
            live.check_send_backlog()
            if session.viewer_count:
                self._viewers.hold(live.gate, session, outcome)
        elif outcome.kind is OutcomeKind.REWIND_UNAVAILABLE:
            detail = f"tick {job.tick_id} was not run: {outcome.error}; the session is unchanged"
            self._tick_error(live, ErrorCode.REWIND_UNAVAILABLE, detail, job.tick_id)
            if job.close:
                session.keep_open()  # nothing ran, so no close either: a close comes after the tick's chunk
            return
        elif outcome.kind is OutcomeKind.INTERNAL:
            log.error("session=%s tick=%d %s", session.id, job.tick_id, outcome.error)
            live.fatal(ErrorCode.INTERNAL, "internal server error", tick_id=job.tick_id, returns_credit=True)
            return
        else:
            if outcome.kind is OutcomeKind.MODEL_FAILED:
                session.note_failure(job.tick_id)
                detail = f"the model failed on tick {job.tick_id} ({outcome.error}); its KV was released"
            else:
                detail = f"tick {job.tick_id} was not run: the session failed before it"
            self._tick_error(live, ErrorCode.SESSION_FAILED, detail + "; send a tick with reset: true", job.tick_id)
        if job.close:
            log.info("session=%s closing after tick %d (close: true)", session.id, job.tick_id)
            live.close(CLOSE_NORMAL, CloseReason.TICK_CLOSE)

    @staticmethod
    def _tick_error(live: SessionPort, code: ErrorCode, detail: str, tick_id: int) -> None:
        """A tick's error: it comes after the chunks before it, and gives the tick's credit back."""
        live.gate.metrics.errors.labels(code=str(code)).inc()
        live.outbox.push(QueuedText(dumps(error_message(code, detail, tick_id=tick_id)), returns_credit=True))

    async def send_chunk(self, live: SessionPort, outcome: TickOutcome) -> ChunkSent:
        header = outcome.chunk_header()
        on_track = await self._video.send_on_track(live, outcome, header) if self._video.offered else None
        return on_track if on_track is not None else await send_chunk_on_websocket(live, outcome, header)

    async def finished(self, live: SessionPort) -> None:
        await self._video.close()

    async def send_viewer_chunk_on_track(self, live: SessionPort, chunk: ViewerChunk, skipped: int) -> ChunkSent | None:
        return await self._video.send_viewer_chunk_on_track(live, chunk, skipped) if self._video.offered else None

    def chunk_sent(self, live: SessionPort) -> None:
        """Nothing follows a chunk here (the client ticks again); said here, a tick's walk skips dialect.py."""

    def error(self, code: str, message: str, *, tick_id: int | None = None) -> dict[str, Any]:
        return error_message(ErrorCode(code), message, tick_id=tick_id)

    def closed(self, gate: Gate, reason: CloseReason) -> str | None:
        self._viewers.offer_held(gate)  # the viewers get the chunks the controller got, then their close
        return dumps(closed_message(reason))

    def moved(self, resume: str, next_chunk_index: int) -> str:
        return dumps(moved_message(resume=resume, next_chunk_index=next_chunk_index))

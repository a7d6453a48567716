"""One WebSocket connection's live session: the receive loop, and the single writer that keeps frames whole.

:meth:`Connection.run` first runs the handshake (:mod:`arstream.app.handshake`:
auth, ``start``, admission, resume, refusals), then sends ``ready`` and runs a
receive loop that answers each message at once (ack, pong, error) and hands
accepted ticks to the worker. Everything the session sends goes through its
:class:`~arstream.app.outbox.Outbox` and one writer task, so immediate replies
keep their order and a chunk's frames are never interleaved with anything. A
tick's credit comes back only when its last frame (or its error) has been
written to the socket.

Bounds on the way out (docs/public.md): what is queued for the client and
not yet taken by it, in bytes, stays under ``max_send_buffer_bytes`` or the
client is dropped; a taken-over connection drops what it had queued and is
dropped ``close_timeout_s`` later if it does not take its close. Only ticks
and inputs keep a session from going idle (pings keep just the connection).
A viewer has no credits and never goes idle: one whose writer waits on it for
``viewer_stall_timeout_s`` is closed ``not_reading``, and one whose watch ended
is dropped ``close_timeout_s`` after its close, so no viewer outlives its session.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocket

from arstream.app import auth
from arstream.app.guard import transport_control
from arstream.app.handshake import Handshake, Watching, too_large
from arstream.app.limits import MessageBudget, count_exceeds
from arstream.app.outbox import REPLY_BACKLOG_LIMIT, Outbox, QueuedChunk, QueuedClose, QueuedText, ViewerChunk

__all__ = ["REPLY_BACKLOG_LIMIT", "Connection"]  # the reply bound is part of a connection's contract (tests use it)
from arstream.app.protocol import (
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    ERROR_CLOSE_CODES,
    ClientMessage,
    CloseMessage,
    CloseReason,
    ErrorCode,
    InputMessage,
    PassControlMessage,
    PingMessage,
    ProtocolError,
    TickMessage,
    ack_message,
    chunk_message,
    closed_message,
    dumps,
    error_message,
    excerpt,
    moved_message,
    parse_client_message,
    pong_message,
    ready_message,
    role_message,
)
from arstream.app.session import Session, SessionState
from arstream.app.viewers import AudienceFull, Format, shares_frames
from arstream.app.worker import OutcomeKind, TickOutcome

if TYPE_CHECKING:
    from arstream.app.hub import SessionHub

log = logging.getLogger("arstream.session")

CLOSE_POLICY_VIOLATION = 1008
ROLE_CONTROLLER = "controller"
ROLE_VIEWER = "viewer"
# A controller's chunks being encoded in its viewers' other formats at once; past it, those viewers skip one.
VIEWER_ENCODES_IN_FLIGHT = 2
# How long a chunk waits for the controller's next tick before it goes to the viewers anyway (_hold_for_viewers).
VIEWER_HOLD_S = 0.02


class Connection:
    """Serves one WebSocket for its whole life; :meth:`run` returns when it is closed."""

    def __init__(self, websocket: WebSocket, hub: SessionHub) -> None:
        self.ws = websocket
        self.hub = hub
        self.settings = hub.settings
        self.metrics = hub.metrics
        self.session: Session | None = None
        self.session_id = "s-" + secrets.token_hex(8)
        self.outbox = Outbox(REPLY_BACKLOG_LIMIT)
        self._writer: asyncio.Task[None] | None = None
        self._released = False
        self._disconnected = False
        # Being moved to a peer (app/migration.py): ticks are absorbed, not run.
        self.moving = False
        # Ticks handed to the worker whose outcome has not come back: while any is, the client waits on us.
        self._in_worker: set[int] = set()
        self._idle_since = 0.0  # loop time of the last message, or of the last outcome that left nothing queued
        self._budget = MessageBudget(
            self.settings.max_messages_per_s, self.settings.message_burst, asyncio.get_running_loop().time()
        )
        self.client_host = websocket.client.host if websocket.client else ""
        self.token_key = auth.token_key(auth.offered_token(websocket.headers, websocket.query_params))
        self.transport = transport_control(websocket.scope)
        self._handshake = Handshake(websocket, hub, self, budget=self._budget, transport=self.transport)
        # PROTOCOL.md, "Rewind, branch and watch": a connection controls its session or watches one.
        self.role = ROLE_CONTROLLER
        self.viewer_id: str | None = None
        self._watch_format: Format = ("", 0)  # a viewer's codec and quality
        self._watch_ended = False  # a viewer whose session ended (or who closed): its close is queued
        self._last_chunk_seq = -1  # a viewer's last chunk offered (Session.chunks_out): never an older one after it
        self._viewer_encodes = 0  # a controller's chunks being encoded for its viewers' formats
        # A controller's chunks not yet offered to its viewers (_hold_for_viewers), and the timer that will.
        self._held_for_viewers: list[tuple[Session, TickOutcome]] = []
        self._viewer_timer: asyncio.TimerHandle | None = None
        # A viewer's writer is on one item this long at most (viewer_stall_timeout_s), or it is not reading.
        self._stall_timer: asyncio.TimerHandle | None = None

    # ---- entry point -----------------------------------------------------------------

    async def run(self) -> None:
        self.metrics.websocket_connections.inc()
        self.metrics.websocket_open.inc()
        try:
            await self._serve()
        except Exception:  # noqa: BLE001 - a server fault: tell the client, then close 1011
            log.exception("session=%s server fault", self.session_id)
            if self.session is None:
                await self._handshake.refuse(ErrorCode.INTERNAL, "internal server error")
            else:
                self._fatal(ErrorCode.INTERNAL, "internal server error")
        finally:
            await self._finish()
            self.hub.closing.discard(self)
            self.metrics.websocket_open.dec()

    async def _serve(self) -> None:
        opened = await self._handshake.open()
        if opened is None:
            self._disconnected = self._handshake.disconnected
            return
        if isinstance(opened, Watching):
            await self._watch(opened)
            return
        session = opened.session
        self.session_id = session.id
        self.session = session
        upload_limit = self.settings.max_start_image_bytes if self.hub.start_image_names else None
        self.hub.register(self)
        self._writer = asyncio.create_task(self._write_loop(), name=f"writer-{self.session_id}")
        self.outbox.push(
            QueuedText(
                dumps(
                    ready_message(
                        session_id=self.session_id,
                        model_card=self.hub.model_card,
                        codec=session.codec,
                        max_pending_ticks=self.settings.max_pending_ticks,
                        max_message_bytes=self.settings.max_message_bytes,
                        idle_timeout_s=self.settings.idle_timeout_s,
                        resume=self.hub.resume.ticket(self, opened.next_chunk_index),
                        resumed=opened.resumed,
                        max_start_image_bytes=upload_limit,
                        share=self.hub.shares.token(session.id),
                        rewind_points=self.hub.rewind_points,
                        rewind_seconds=self.hub.rewind_seconds,
                        branched_from=opened.branched_from,
                    )
                ),
                is_reply=True,
            )
        )
        session.next_chunk_index = opened.next_chunk_index
        log.info("session=%s started codec=%s", self.session_id, session.codec)
        await self._receive_loop(session)

    async def _watch(self, watching: Watching) -> None:
        """Serve a viewer of another connection's session (PROTOCOL.md, "Rewind, branch and watch")."""
        controller = self.hub.connections.get(watching.session_id)
        session = controller.session if isinstance(controller, Connection) else None
        if session is None or not session.live:
            await self._handshake.refuse(
                ErrorCode.SHARE_FAILED, "the shared session is not live (ended, or its player is reconnecting)"
            )
            return
        self.role = ROLE_VIEWER
        try:
            self._watch_format = self.hub.shares.served_format(
                session.id, watching.format, (session.codec, session.quality)
            )
            self.viewer_id = self.hub.shares.join(session.id, self)
        except AudienceFull as exc:
            self.role = ROLE_CONTROLLER
            await self._handshake.refuse(ErrorCode.OVER_CAPACITY, str(exc))
            return
        self.session_id, self.session = session.id, session
        self.hub.unstarted.discard(self)
        self._writer = asyncio.create_task(self._write_loop(), name=f"writer-{self.viewer_id}")
        ready = ready_message(
            session_id=session.id,
            model_card=self.hub.model_card,
            codec=self._watch_format[0],
            max_pending_ticks=self.settings.max_pending_ticks,
            max_message_bytes=self.settings.max_message_bytes,
            idle_timeout_s=self.settings.idle_timeout_s,
            role=ROLE_VIEWER,
            viewer_id=self.viewer_id,
            quality=self._watch_format[1],
        )
        self.outbox.push(QueuedText(dumps(ready), is_reply=True))
        log.info("session=%s viewer %s joined codec=%s", session.id, self.viewer_id, self._watch_format[0])
        self._audience_changed(session)
        await self._receive_loop(session)

    # ---- watching (the registry's side of a viewer, app/viewers.py) ------------------------------

    @property
    def watch_format(self) -> Format:
        return self._watch_format

    def offer_chunk(self, chunk: ViewerChunk) -> None:
        if self._watch_ended or chunk.seq <= self._last_chunk_seq:
            return
        self._last_chunk_seq = chunk.seq
        self.outbox.push(chunk)
        self._check_send_backlog()

    def skip_chunk(self) -> None:
        self.outbox.chunks_skipped += 1

    def notify(self, message: dict[str, Any], *, latest_of: str | None = None) -> None:
        self.outbox.push(QueuedText(dumps(message), latest_of=latest_of))

    def end_watching(self, reason: CloseReason) -> None:
        if self.role == ROLE_VIEWER:
            self._close(CLOSE_GOING_AWAY if reason is CloseReason.SERVER_SHUTDOWN else CLOSE_NORMAL, reason)

    def _audience_changed(self, session: Session) -> None:
        """Viewers came or went, or control passed: say so to everyone, and re-plan the viewers' formats."""
        controller = self.hub.connections.get(session.id)
        in_charge = controller if isinstance(controller, Connection) else None
        self.hub.shares.announce(session.id, in_charge)
        session.viewer_formats = self.hub.shares.formats_needed(session.id, (session.codec, session.quality))

    def _leave_audience(self) -> None:
        session = self.session
        if session is not None and self.viewer_id is not None and self.hub.shares.leave(session.id, self.viewer_id):
            log.info("session=%s viewer %s left", session.id, self.viewer_id)
            self._audience_changed(session)

    def take_over(self) -> None:
        """Another connection resumed this session: end this one with taken_over (4003); the KV stays.

        Its peer may not be reading (why it was resumed elsewhere): what it had queued is dropped so the
        close goes out next, and the connection is dropped ``close_timeout_s`` later if it is still open.
        Its ticks were dropped from the worker: none of them will come back.
        """
        self._released = True  # the resuming connection holds the session's KV now
        self._in_worker.clear()
        self.outbox.drop_pending()
        self._fatal(ErrorCode.TAKEN_OVER, "another connection resumed this session", reason=CloseReason.TAKEN_OVER)
        if self.transport is not None:
            self.transport.drop_soon()

    # ---- the session's receive loop ---------------------------------------------------------

    @property
    def _live(self) -> bool:
        """Whether this connection still serves: its session is live (a controller), or it still watches."""
        if self.role == ROLE_VIEWER:
            return not self._watch_ended
        return self.session is not None and self.session.live

    async def _receive_loop(self, session: Session) -> None:
        loop = asyncio.get_running_loop()
        self._idle_since = loop.time()
        while self._live:
            message = await self._next_message()
            if message is None:
                if self._live:
                    self._fatal(
                        ErrorCode.IDLE_TIMEOUT,
                        f"no tick or input for {self.settings.idle_timeout_s} s while no tick was queued or running",
                        reason=CloseReason.IDLE_TIMEOUT,
                    )
                return
            if message["type"] == "websocket.disconnect":
                self._disconnected = True
                return
            if self._live:
                await self._handle(session, message)

    def _idle_left(self, now: float) -> float:
        """Seconds until the session is idle (PROTOCOL.md: no tick or input while no tick is queued or running).

        Pings do not count: they keep the connection, not the session's slot (a client that asks for
        nothing, or a non-reader whose pings are still being read, gives the slot back)."""
        if self._in_worker or self.role == ROLE_VIEWER:
            return self.settings.idle_timeout_s  # the client is waiting on the server, or watching
        return self._idle_since + self.settings.idle_timeout_s - now

    async def _next_message(self) -> dict[str, Any] | None:
        """The next message, or None once the session is idle.

        Every wait here is bounded by the idle deadline: the message rate
        budget (a client past it is read more slowly), room for replies (a
        client that does not read them is not read either, so it goes idle and
        is closed), and the message itself.
        """
        loop = asyncio.get_running_loop()
        delay = self._budget.delay(loop.time())
        if delay > 0:
            await asyncio.sleep(delay)
        while True:
            left = self._idle_left(loop.time())
            if left <= 0:
                return None
            try:
                if self.outbox.replies_full:
                    await asyncio.wait_for(self.outbox.wait_reply_space(), left)
                    continue
                return await asyncio.wait_for(self.ws.receive(), left)
            except TimeoutError:
                continue

    def _reply(self, payload: dict[str, Any]) -> None:
        self.outbox.push_reply(dumps(payload))
        self._check_send_backlog()

    def _check_send_backlog(self) -> None:
        """Drop a client that has left more than ``max_send_buffer_bytes`` untaken: it is not reading."""
        buffered = self.transport.buffered_bytes if self.transport is not None else 0
        backlog = self.outbox.bytes_queued + buffered
        limit = self.settings.max_send_buffer_bytes
        if backlog <= limit:
            return
        detail = f"a client left {backlog} bytes untaken (max_send_buffer_bytes {limit})"
        if self.role == ROLE_VIEWER:
            self._drop_viewer(detail)
            return
        log.warning("session=%s dropped: not reading, %s", self.session_id, detail)
        self.outbox.drop_pending()
        self._close(CLOSE_POLICY_VIOLATION, CloseReason.ERROR)
        if self.transport is not None:
            self.transport.drop_now("send_buffer", detail)

    def _drop_viewer(self, detail: str) -> None:
        """A viewer that does not read: what it had queued goes, `closed` (not_reading) and close 1008 go next,
        and its connection is dropped ``close_timeout_s`` later unless it takes them (docs/public.md)."""
        if self._watch_ended:
            return
        log.warning("session=%s viewer %s dropped: not reading, %s", self.session_id, self.viewer_id, detail)
        self.outbox.drop_pending()
        self._close(CLOSE_POLICY_VIOLATION, CloseReason.NOT_READING)

    def _watch_stall(self) -> None:
        """Arm the stall bound for the item a viewer's writer is about to send (disarmed once it is sent)."""
        if self.role == ROLE_VIEWER and not self._watch_ended:
            timeout = self.settings.viewer_stall_timeout_s
            self._stall_timer = asyncio.get_running_loop().call_later(
                timeout, self._drop_viewer, f"it took nothing for {timeout:g} s (viewer_stall_timeout_s)"
            )

    def _sent(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _reply_error(self, error: ProtocolError) -> None:
        self.metrics.errors.labels(code=str(error.code)).inc()
        self._reply(error_message(error.code, error.message, tick_id=error.tick_id))

    async def _handle(self, session: Session, message: dict[str, Any]) -> None:
        text = message.get("text")
        if text is None:
            if message.get("bytes") is not None:
                self._reply_error(
                    ProtocolError(ErrorCode.INVALID_MESSAGE, "binary messages from the client are not part of protocol 1")
                )
            return
        if too_large(text, self.settings.max_message_bytes):
            self._fatal(
                ErrorCode.MESSAGE_TOO_LARGE, f"text messages are limited to {self.settings.max_message_bytes} bytes"
            )
            return
        try:
            parsed = parse_client_message(text)
            if self.role == ROLE_VIEWER:
                self._handle_as_viewer(parsed)
            elif isinstance(parsed, TickMessage):
                self._validate_controls(parsed.controls, tick_id=parsed.tick_id)
                job = session.accept_tick(parsed)
                if self.moving:  # its state is on its way to a peer: keep the tick's controls, run nothing here
                    session.absorb_update(job)
                    session.release_credit()
                    return
                assert self.hub.worker is not None
                self.hub.worker.submit(job)
                self._in_worker.add(job.tick_id)
                self._offer_held()  # the forward runs now: the viewers' writes go beside it
                self._idle_since = asyncio.get_running_loop().time()  # accepted work: not idle
            elif isinstance(parsed, InputMessage):
                self._validate_controls(parsed.controls, tick_id=None)
                duplicate = session.accept_event(parsed)
                self._idle_since = asyncio.get_running_loop().time()
                self._reply(ack_message(parsed.event_id, duplicate=duplicate))
            elif isinstance(parsed, PingMessage):
                self._reply(pong_message(parsed.t))
            elif isinstance(parsed, CloseMessage):
                log.info("session=%s closed by the client", self.session_id)
                self._close(CLOSE_NORMAL, CloseReason.CLIENT)
            elif isinstance(parsed, PassControlMessage):
                self._pass_control(session, parsed.to)
            else:
                raise ProtocolError(ErrorCode.INVALID_MESSAGE, "the session has already started; start is sent once")
        except ProtocolError as exc:
            self._reply_error(exc)

    def _handle_as_viewer(self, parsed: ClientMessage) -> None:
        """A viewer may ping and close; what only the controller may send gets not_controller."""
        if isinstance(parsed, PingMessage):
            self._reply(pong_message(parsed.t))
        elif isinstance(parsed, CloseMessage):
            log.info("session=%s viewer %s closed by the client", self.session_id, self.viewer_id)
            self._close(CLOSE_NORMAL, CloseReason.CLIENT)
        elif isinstance(parsed, (TickMessage, InputMessage, PassControlMessage)):
            tick_id = parsed.tick_id if isinstance(parsed, TickMessage) else None
            raise ProtocolError(
                ErrorCode.NOT_CONTROLLER, f"a viewer may not send {parsed.type}; the controller can pass control", tick_id=tick_id
            )
        else:
            raise ProtocolError(ErrorCode.INVALID_MESSAGE, "the session has already started; start is sent once")

    def _pass_control(self, session: Session, viewer_id: str) -> None:
        """Hand control to one of the session's viewers; this connection becomes a viewer (PROTOCOL.md)."""
        target = self.hub.shares.viewers(session.id).get(viewer_id)
        if not isinstance(target, Connection) or target._watch_ended:
            raise ProtocolError(ErrorCode.UNKNOWN_VIEWER, f"no viewer {excerpt(viewer_id)} watches this session")
        if self.moving or session.state is not SessionState.ACTIVE and session.state is not SessionState.FAILED:
            raise ProtocolError(ErrorCode.INVALID_MESSAGE, "the session is closing or moving; control stays")
        # The session counts against the new controller's address and token from now on: their caps hold.
        refusal = self.hub.transfer_refusal(target, session.id)
        if refusal is not None:
            raise ProtocolError(
                ErrorCode.CONTROL_REFUSED, f"control stays: viewer {viewer_id}'s {refusal.removeprefix('this ')}"
            )
        self._offer_held()  # chunks before the pass go to the viewers as they were
        # Its queued ticks were this client's: they do not run for the next one (their controls are kept).
        assert self.hub.worker is not None
        for job in self.hub.worker.drop_ticks(session.id):
            session.absorb_update(job)
            session.release_credit()
        self._in_worker.clear()  # a running tick's chunk goes to the new controller, with its credit
        self.hub.shares.leave(session.id, viewer_id)
        target.role, target.viewer_id = ROLE_CONTROLLER, None
        target._idle_since = asyncio.get_running_loop().time()
        self.role, self._watch_format = ROLE_VIEWER, (session.codec, session.quality)
        session.codec, session.quality = target._watch_format
        self._last_chunk_seq = session.chunks_out
        self.hub.register(target)
        self.hub.resume.forget(self)
        self.viewer_id = self.hub.shares.join(session.id, self, cap=False)
        ticket = self.hub.resume.ticket(target, session.next_chunk_index)
        target.notify(role_message(ROLE_CONTROLLER, last_tick_id=session.last_tick_id, resume=ticket))
        self.notify(role_message(ROLE_VIEWER, viewer_id=self.viewer_id))
        log.info("session=%s control passed to %s; the controller became viewer %s", session.id, viewer_id, self.viewer_id)
        self._audience_changed(session)

    def _validate_controls(self, controls: dict[str, Any] | None, *, tick_id: int | None) -> None:
        if controls is None:
            return
        limit = self.settings.max_control_items
        if count_exceeds(controls, limit):
            # Refused before the schema walks it: a schema check costs time per item, on the event loop.
            raise ProtocolError(
                ErrorCode.INVALID_CONTROLS,
                f"controls hold more than {limit} JSON values (max_control_items)",
                tick_id=tick_id,
            )
        if self.hub.controls_validator is None:
            return
        error = next(iter(self.hub.controls_validator.iter_errors(controls)), None)
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "controls"
            raise ProtocolError(ErrorCode.INVALID_CONTROLS, f"{where}: {error.message}", tick_id=tick_id)

    # ---- outcomes from the worker (event loop) ------------------------------------------------

    def on_outcome(self, outcome: TickOutcome) -> None:
        if self._in_worker:
            self._in_worker.discard(outcome.job.tick_id)
            if not self._in_worker:
                self._idle_since = asyncio.get_running_loop().time()  # the idle clock starts again now
        session = self.session
        if session is None or not session.live or outcome.job.session is not session:
            return  # closing (its queued ticks were dropped), or a tick of the connection this one resumed
        job = outcome.job
        if outcome.kind is OutcomeKind.CHUNK:
            if outcome.restarted == "rewind":
                self.metrics.rewinds.inc()
            self.metrics.chunk_compute_seconds.observe(outcome.compute_s)
            self.metrics.queue_wait_seconds.observe(outcome.queue_s)
            session.next_chunk_index = outcome.chunk_index + 1
            self.outbox.push(QueuedChunk(outcome))
            self._check_send_backlog()
            self._hold_for_viewers(session, outcome)
        elif outcome.kind is OutcomeKind.REWIND_UNAVAILABLE:
            self.metrics.errors.labels(code=str(ErrorCode.REWIND_UNAVAILABLE)).inc()
            detail = f"tick {job.tick_id} was not run: {outcome.error}; the session is unchanged"
            message = error_message(ErrorCode.REWIND_UNAVAILABLE, detail, tick_id=job.tick_id)
            self.outbox.push(QueuedText(dumps(message), returns_credit=True))
            if job.close:
                session.keep_open()  # nothing ran, so no close either: a close comes after the tick's chunk
            return
        elif outcome.kind is OutcomeKind.INTERNAL:
            log.error("session=%s tick=%d %s", self.session_id, job.tick_id, outcome.error)
            self._fatal(ErrorCode.INTERNAL, "internal server error", tick_id=job.tick_id, returns_credit=True)
            return
        else:
            if outcome.kind is OutcomeKind.MODEL_FAILED:
                session.note_failure(job.tick_id)
                detail = f"the model failed on tick {job.tick_id} ({outcome.error}); its KV was released"
            else:
                detail = f"tick {job.tick_id} was not run: the session failed before it"
            self.metrics.errors.labels(code=str(ErrorCode.SESSION_FAILED)).inc()
            message = error_message(
                ErrorCode.SESSION_FAILED, detail + "; send a tick with reset: true", tick_id=job.tick_id
            )
            self.outbox.push(QueuedText(dumps(message), returns_credit=True))
        if job.close:
            log.info("session=%s closing after tick %d (close: true)", self.session_id, job.tick_id)
            self._close(CLOSE_NORMAL, CloseReason.TICK_CLOSE)

    def _hold_for_viewers(self, session: Session, outcome: TickOutcome) -> None:
        """Offer the chunk to the viewers once the controller has sent its next tick (or VIEWER_HOLD_S later).

        Writing a chunk to dozens of viewers takes the event loop a while; done right after the controller's
        own chunk, it would hold up the controller's next tick, which arrives a round trip later. Done when that
        tick is on its way to the worker, it runs beside the forward instead.
        """
        if not self.hub.shares.viewers(session.id):
            return
        self._held_for_viewers.append((session, outcome))
        if self._viewer_timer is None:
            self._viewer_timer = asyncio.get_running_loop().call_later(VIEWER_HOLD_S, self._offer_held)

    def _offer_held(self) -> None:
        """Offer the chunks held for the viewers now."""
        if self._viewer_timer is not None:
            self._viewer_timer.cancel()
            self._viewer_timer = None
        held, self._held_for_viewers = self._held_for_viewers, []
        for session, outcome in held:
            self._fan_out(session, outcome)

    def _fan_out(self, session: Session, outcome: TickOutcome) -> None:
        """Offer a chunk to the session's viewers: the controller's own frames where they can share them,
        one encode per other format in use (on the encoder threads; while two are still being encoded, the
        viewers of those formats skip the chunk, so a slow encode never piles up)."""
        viewers = self.hub.shares.viewers(session.id)
        if not viewers:
            return
        session.chunks_out += 1
        header = self._chunk_header(outcome)
        own = (outcome.codec, outcome.quality)
        shares = self.hub.shares
        if shares_frames(own, own):
            shares.offer(session.id, header, session.chunks_out, {own: outcome.frame_messages})
        formats = shares.formats_needed(session.id, own)
        if not formats:
            return
        if outcome.frames is None or self._viewer_encodes >= VIEWER_ENCODES_IN_FLIGHT or self.hub.worker is None:
            shares.skip(session.id, formats)
            return
        self._viewer_encodes += 1
        seq = session.chunks_out

        def deliver(encoded: dict[Format, tuple[bytes, ...]]) -> None:
            self._viewer_encodes -= 1
            shares.offer(session.id, header, seq, encoded)

        self.hub.worker.encode_for_viewers(
            session.id, outcome.frames, formats, chunk_index=outcome.chunk_index, tick_id=outcome.job.tick_id,
            deliver=deliver,
        )

    # ---- closing --------------------------------------------------------------------------

    def _close(self, code: int, reason: CloseReason) -> None:
        """Queue `closed` and the close frame; drop queued ticks and release the KV now.

        A viewer only closes its own connection; a controller's session ends, and its viewers with it.
        """
        if self.role == ROLE_VIEWER:
            if not self._watch_ended:
                self._watch_ended = True
                self.outbox.push(QueuedClose(code, reason))
                self._leave_audience()
                # Its last messages go out while it is counted (sessions.closing); a peer that does not take
                # them within close_timeout_s is dropped, so no viewer outlives its session.
                self.hub.closing.add(self)
                if self.transport is not None:
                    self.transport.drop_soon()
            return
        session = self.session
        if session is None or not session.live:
            return
        self._offer_held()  # the viewers get the chunks the controller got, then their close
        session.transition(SessionState.CLOSING)
        self.hub.closing.add(self)
        self.outbox.push(QueuedClose(code, reason))
        shutdown = reason is CloseReason.SERVER_SHUTDOWN
        self.hub.shares.end_viewers(session.id, CloseReason.SERVER_SHUTDOWN if shutdown else CloseReason.SESSION_ENDED)
        self._release()

    def _fatal(
        self,
        code: ErrorCode,
        message: str,
        *,
        tick_id: int | None = None,
        reason: CloseReason = CloseReason.ERROR,
        returns_credit: bool = False,
    ) -> None:
        self.metrics.errors.labels(code=str(code)).inc()
        if not self._live:
            return
        self.outbox.push(QueuedText(dumps(error_message(code, message, tick_id=tick_id)), returns_credit=returns_credit))
        self._close(ERROR_CLOSE_CODES[code], reason)

    def close_moved(self, token: str, next_chunk_index: int) -> None:
        """The session lives on a peer now (app/migration.py): tell the client its token, close, release here."""
        if self.session is not None and self.session.live:
            self.outbox.push(QueuedText(dumps(moved_message(resume=token, next_chunk_index=next_chunk_index))))
        self._close(CLOSE_GOING_AWAY, CloseReason.MOVED)

    def close_for_shutdown(self) -> None:
        self._close(CLOSE_GOING_AWAY, CloseReason.SERVER_SHUTDOWN)

    async def wait_sent(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the writer to send everything queued, then stop it."""
        writer = self._writer
        if writer is None or writer.done():
            return
        done, _ = await asyncio.wait({writer}, timeout=timeout_s)
        if not done:
            log.warning("session=%s client did not take its last messages within %.1f s", self.session_id, timeout_s)
            await self._stop_writer()

    async def _stop_writer(self) -> None:
        writer = self._writer
        if writer is not None and not writer.done():
            writer.cancel()
            await asyncio.wait({writer})

    def _release(self) -> None:
        if self._released or self.session is None:
            return
        self._released = True
        self.hub.resume.forget(self)
        assert self.hub.worker is not None
        dropped = self.hub.worker.drop_session(self.session_id)
        self.hub.shares.forget(self.session_id)
        log.info("session=%s released (%d queued tick(s) dropped)", self.session_id, dropped)

    async def _finish(self) -> None:
        self.hub.unstarted.discard(self)  # refused, or gone before its session started
        self.hub.drop_claim(self)  # gone between a branch's admission and its registration
        session = self.session
        if session is not None and self.role == ROLE_VIEWER:
            self._watch_ended = True
            self._leave_audience()
            if self._disconnected:
                await self._stop_writer()
            await self.wait_sent(self.settings.shutdown_grace_s)
        elif session is not None:
            if self._disconnected:
                log.info("session=%s disconnected", self.session_id)
            if not self._released and self.hub.resume.detach(self):
                self._released = True  # detached: kept with its KV for a resume, released by the registry
            if not self._released or self.hub.connections.get(session.id) is self:
                # Its viewers watched this connection (detached, they may watch again after the resume).
                self.hub.shares.end_viewers(session.id, CloseReason.SESSION_ENDED)
            if session.state is not SessionState.CLOSING and session.state is not SessionState.CLOSED:
                session.transition(SessionState.CLOSING)
            self._release()
            self.hub.unregister(self)
            if self._disconnected:
                await self._stop_writer()
            await self.wait_sent(self.settings.shutdown_grace_s)
            if session.state is not SessionState.CLOSED:
                session.transition(SessionState.CLOSED)

    # ---- the writer ---------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        session = self.session
        assert session is not None
        try:
            while True:
                item = await self.outbox.get()
                self._watch_stall()
                if isinstance(item, QueuedText):
                    await self.ws.send_text(item.text)
                    if item.returns_credit:
                        session.release_credit()
                elif isinstance(item, QueuedChunk):
                    await self._send_chunk(session, item.outcome)
                elif isinstance(item, ViewerChunk):
                    await self._send_viewer_chunk(item)
                else:
                    if item.reason is not None:
                        await self.ws.send_text(dumps(closed_message(item.reason)))
                    await self.ws.close(item.code, item.reason or "")  # the reason in the close frame too
                    return
                self._sent()
        except Exception as exc:  # noqa: BLE001 - a vanished client ends the writer quietly
            log.debug("session=%s writer stopped: %s", self.session_id, exc)
        finally:
            self._sent()
            self.outbox.close()

    @staticmethod
    def _chunk_header(outcome: TickOutcome) -> dict[str, Any]:
        return chunk_message(
            tick_id=outcome.job.tick_id,
            chunk_index=outcome.chunk_index,
            frames=len(outcome.frame_messages),
            applied_event_ids=outcome.applied_event_ids,
            restarted=outcome.restarted,
            queue_ms=outcome.queue_s * 1e3,
            compute_ms=outcome.compute_s * 1e3,
            encode_ms=outcome.encode_s * 1e3,
            rewind_points=outcome.rewind_points,
        )

    async def _send_viewer_chunk(self, chunk: ViewerChunk) -> None:
        skipped, self.outbox.chunks_skipped = self.outbox.chunks_skipped, 0
        await self.ws.send_text(dumps({**chunk.header, "skipped_before": skipped}) if skipped else chunk.text)
        for frame in chunk.frames:
            await self.ws.send_bytes(frame)
            self.metrics.frames_sent.inc()
            self.metrics.bytes_sent.inc(len(frame))

    async def _send_chunk(self, session: Session, outcome: TickOutcome) -> None:
        await self.ws.send_text(dumps(self._chunk_header(outcome)))
        for index, frame in enumerate(outcome.frame_messages):
            await self.ws.send_bytes(frame)
            if index == 0 and outcome.events:
                sent_at = time.perf_counter()
                for event in outcome.events:
                    self.metrics.action_to_frame_seconds.observe(sent_at - event.arrived_at)
            self.metrics.frames_sent.inc()
            self.metrics.bytes_sent.inc(len(frame))
        self.metrics.chunks.inc()
        session.release_credit()

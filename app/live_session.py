"""One socket's live session: the one lifecycle every wire dialect runs on.

A :class:`LiveSession` serves one WebSocket from its upgrade to its close.
Its :class:`~arstream.app.dialect.Dialect` says what the wire looks like
(protocol 1, vLLM-Omni's realtime video, ...); everything else is here, once:
the upgrade checks and refusals, the receive loop with its message budget
and idle clock, the :class:`~arstream.app.outbox.Outbox` and the one writer
task that keeps frames whole, the ticks in the worker, credits, release and
finish. The hub, the resume registry and the share registry hold live
sessions, and the worker delivers each tick's outcome straight to the live
session that serves the tick's :class:`~arstream.app.session.Session` now
(``Session.deliver``).

Roles (PROTOCOL.md, "Rewind, branch and watch"): a live session controls its
session, or watches one (:attr:`LiveSession.watch` is set). Passing control
swaps the two roles between two live sessions.

Bounds on the way out (docs/public.md): what is queued for the client and
not yet taken by it, in bytes, stays under ``max_send_buffer_bytes`` or the
client is dropped; a taken-over session drops what it had queued and is
dropped ``close_timeout_s`` later if it does not take its close. Only what the
dialect counts as progress (:meth:`LiveSession.touch`) and ticks the client
waits on keep a session from going idle. A viewer has no credits and never
goes idle: one whose writer waits on it for ``viewer_stall_timeout_s`` is
closed ``not_reading``, and one whose watch ended is dropped
``close_timeout_s`` after its close, so no viewer outlives its session.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import Message
from starlette.websockets import WebSocket

from . import auth
from .dialect import Dialect, Gate, SessionWorker
from .guard import limit_messages, transport_control
from .limits import TokenBucket, count_exceeds
from .outbox import REPLY_BACKLOG_LIMIT, Outbox, QueuedChunk, QueuedClose, QueuedText, ViewerChunk
from .protocol import CLOSE_GOING_AWAY, CLOSE_NORMAL, ERROR_CLOSE_CODES, CloseReason, ErrorCode, dumps
from .session import Session, SessionState
from .start_image import ClientGone, StartImageBusy, StartImageRefused
from .session import TickJob
from .worker import OutcomeKind, TickOutcome
from ..runner.types import StartImage

log = logging.getLogger("arstream.session")

CLOSE_POLICY_VIOLATION = 1008
Format = tuple[str, int]  # (codec, quality)


def too_large(text: str, limit: int) -> bool:
    """Whether a text message is over ``limit`` UTF-8 bytes."""
    # Characters first: the UTF-8 byte count is taken only of a text that could still be too large.
    return len(text) > limit or len(text.encode()) > limit


@dataclass
class Watch:
    """The viewer role: which viewer this is, the format it is served, and how far its watch went."""

    viewer_id: str
    format: Format
    ended: bool = False  # its session ended (or it closed): its close is queued
    last_seq: int = -1  # its last chunk offered (Session.chunks_out): never an older one after it


class LiveSession:
    """Serves one WebSocket for its whole life in one dialect; :meth:`run` returns when it is closed."""

    def __init__(self, websocket: WebSocket, gate: Gate, dialect: Dialect) -> None:
        self.ws = websocket
        self.gate = gate
        self.dialect = dialect
        self.settings = gate.settings
        self.metrics = gate.metrics
        self.session: Session | None = None
        self.session_id = dialect.session_id
        self.outbox = Outbox(REPLY_BACKLOG_LIMIT)
        self.client_host = websocket.client.host if websocket.client else ""
        self.token_key = auth.token_key(auth.offered_token(websocket.headers, websocket.query_params))
        self.transport = transport_control(websocket.scope)
        self.budget = TokenBucket(
            self.settings.max_messages_per_s, self.settings.message_burst, asyncio.get_running_loop().time()
        )
        self.watch: Watch | None = None  # set while this socket watches a session instead of controlling it
        self.disconnected = False  # the client went away (before or after its session started)
        # Being moved to a peer (app/migration.py): the dialect absorbs ticks instead of running them.
        self.moving = False
        self._writer: asyncio.Task[None] | None = None
        self._released = False
        # Ticks handed to the worker whose outcome the client waits on: while any is out, the session is not idle.
        self._in_worker: set[int] = set()
        self._idle_since = 0.0  # loop time of the last progress (touch), or of the last awaited outcome back
        self._stall_timer: asyncio.TimerHandle | None = None  # a viewer's writer is on one item this long at most

    @property
    def worker(self) -> SessionWorker:
        worker = self.gate.worker
        assert worker is not None, "a session is served only once the worker runs"
        return worker

    # ---- entry point -----------------------------------------------------------------

    async def run(self) -> None:
        self.metrics.websocket_connections.inc()
        self.metrics.websocket_open.inc()
        try:
            await self._serve()
        except Exception:  # noqa: BLE001 - a server fault: tell the client, then close 1011
            log.exception("session=%s server fault", self.session_id)
            if self.session is None:
                await self.refuse(ErrorCode.INTERNAL, "internal server error")
            else:
                self.fatal(ErrorCode.INTERNAL, "internal server error")
        finally:
            await self._finish()
            await self.dialect.finished(self)
            self.gate.closing.discard(self)
            self.metrics.websocket_open.dec()

    async def _serve(self) -> None:
        started = await self.dialect.start(self)
        if started is None:
            return
        session = started.session
        self.session, self.session_id = session, session.id
        if self.watch is None:
            session.deliver = self.on_outcome
            # Where the server ticks for the client, it runs only this far ahead of the socket (Dialect.chunks_ahead).
            session.chunks_ahead_limit = self.dialect.chunks_ahead
            session.next_chunk_index = started.next_chunk_index
            self.gate.register(self)
        else:
            self.gate.unstarted.discard(self)
        name = self.session_id if self.watch is None else self.watch.viewer_id
        self._writer = asyncio.create_task(self._write_loop(), name=f"writer-{name}")
        self.dialect.ready(self, started)
        await self._receive_loop()

    # ---- before the session starts ----------------------------------------------------------

    async def accept(self) -> bool:
        """Run the upgrade checks (auth, origin, the cap on sockets waiting to start) and accept the socket;
        False after refusing. An accepted socket counts as waiting to start until its session is registered."""
        refusal, missing_token = auth.upgrade_refusal(self.ws, self.settings)
        if refusal is not None and self.settings.refuse_before_upgrade:
            headers = {"WWW-Authenticate": "Bearer"} if missing_token else None
            status = 401 if missing_token else 403
            await self.deny_upgrade(ErrorCode.UNAUTHORIZED, refusal, status=status, headers=headers)
            return False
        if refusal is None:
            # Waiting to start is capped (app/unstarted.py); past the cap, a 503 that closes the connection at once.
            busy = self.gate.unstarted.refusal(self.client_host)
            if busy is not None:
                await self.deny_upgrade(ErrorCode.OVER_CAPACITY, busy, status=503, headers={"Retry-After": "1"})
                return False
            self.gate.unstarted.add(self, self.client_host)
        await self.ws.accept()
        if refusal is not None:
            log.info("session=%s refused: %s", self.session_id, refusal)
            await self.refuse(ErrorCode.UNAUTHORIZED, refusal)
            return False
        # Only the start message may carry a picture.
        self.limit_messages(self.gate.start_message_bytes)
        return True

    def limit_messages(self, max_bytes: int) -> None:
        """The largest message the transport reads from now on."""
        limit_messages(self.ws, self.settings.ws_message_limit(max_bytes))

    async def deny_upgrade(
        self, code: ErrorCode, refusal: str, *, status: int, headers: dict[str, str] | None = None
    ) -> None:
        """Refuse with HTTP ``status`` before the upgrade; the body is the dialect's error object."""
        log.info("session=%s refused before the upgrade: %s", self.session_id, refusal)
        self.metrics.errors.labels(code=str(code)).inc()
        body = self.dialect.error(code, refusal)
        await self.ws.send_denial_response(JSONResponse(body, status_code=status, headers=headers))

    async def refuse(self, code: ErrorCode, message: str) -> None:
        """Error then close, for a socket whose session never started (bounded by ``close_timeout_s``)."""
        self.metrics.errors.labels(code=str(code)).inc()
        await self.send_then_close([dumps(self.dialect.error(code, message))], ERROR_CLOSE_CODES.get(code, 1008))

    async def send_then_close(self, texts: list[str], close_code: int) -> None:
        """Send ``texts`` then the close frame, bounded by ``close_timeout_s``; nothing it sends later is read.

        A peer that does not read its refusal is left to the transport, which drops it (app/guard.py)."""

        async def send_refusal() -> None:
            for text in texts:
                await self.ws.send_text(text)
            await self.ws.close(close_code)

        try:
            await asyncio.wait_for(send_refusal(), self.settings.close_timeout_s)
            if self.transport is not None:
                self.transport.stop_reading()  # refused: nothing it sends now is parsed
        except TimeoutError:
            log.debug("session=%s did not take its refusal within %s s", self.session_id, self.settings.close_timeout_s)
        except Exception:  # noqa: BLE001 - the client may already be gone
            log.debug("session=%s gone before its refusal was sent", self.session_id)

    async def start_image(self, name: str | None, data: str | None) -> StartImage | None:
        """The start image a start asks for (decoded off the loop), or None after refusing (or if the client left)."""
        try:
            return await self.gate.start_images.resolve(
                name=name,
                data=data,
                offered=self.gate.start_image_names,
                gone=None if self.transport is None else self.transport.lost,
            )
        except ClientGone:
            self.disconnected = True  # no longer waiting to start: _finish stops counting it
        except StartImageBusy as exc:
            await self.refuse(ErrorCode.OVER_CAPACITY, str(exc))
        except StartImageRefused as exc:
            log.info("session=%s start image refused: %s", self.session_id, exc)
            await self.refuse(ErrorCode.INVALID_IMAGE, str(exc))
        return None

    def controls_problem(self, controls: dict[str, Any]) -> str | None:
        """What is wrong with ``controls`` (too many values, or not the model's schema), or None."""
        limit = self.settings.max_control_items
        if count_exceeds(controls, limit):
            # Refused before the schema walks it: a schema check costs time per item, on the event loop.
            return f"controls hold more than {limit} JSON values (max_control_items)"
        validator = self.gate.controls_validator
        error = None if validator is None else next(iter(validator.iter_errors(controls)), None)
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path) or "controls"
        return f"{where}: {error.message}"

    # ---- the receive loop ---------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        """Whether this socket still serves: its session is live (controlling), or it still watches."""
        if self.watch is not None:
            return not self.watch.ended
        return self.session is not None and self.session.live

    def touch(self) -> None:
        """The session made progress (what counts is the dialect's): its idle clock starts again."""
        self._idle_since = asyncio.get_running_loop().time()

    async def _receive_loop(self) -> None:
        self.touch()
        while self.serving:
            message = await self._next_message()
            if message is None:
                if self.serving:
                    detail = self.dialect.idle_detail.format(seconds=self.settings.idle_timeout_s)
                    self.fatal(
                        ErrorCode.IDLE_TIMEOUT,
                        detail,
                        reason=CloseReason.IDLE_TIMEOUT,
                        close_code=self.dialect.idle_close_code,
                    )
                return
            if message["type"] == "websocket.disconnect":
                self.disconnected = True
                return
            text = message.get("text")
            if self.serving and (text is not None or message.get("bytes") is not None):
                self.dialect.text_in(self, text)

    def _idle_left(self, now: float) -> float:
        """Seconds until the session is idle: no progress while no tick the client waits on is out.

        Pings do not count in protocol 1: they keep the connection, not the session's slot (a client that asks
        for nothing, or a non-reader whose pings are still being read, gives the slot back)."""
        if self._in_worker or self.watch is not None:
            return self.settings.idle_timeout_s  # the client is waiting on the server, or watching
        return self._idle_since + self.settings.idle_timeout_s - now

    async def _next_message(self) -> Message | None:
        """The next message, or None once the session is idle.

        Every wait here is bounded by the idle deadline: the message rate budget (a client past it is read more
        slowly), room for replies (a client that does not read them is not read either, so it goes idle and is
        closed), and the message itself.
        """
        loop = asyncio.get_running_loop()
        delay = self.budget.delay(loop.time())
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
                message = await asyncio.wait_for(self.ws.receive(), left)
                return message
            except TimeoutError:
                continue

    def reply(self, payload: dict[str, Any]) -> None:
        """Queue an immediate reply (ack, pong, error)."""
        self.outbox.push_reply(dumps(payload))
        self.check_send_backlog()

    def notify(self, message: dict[str, Any], *, latest_of: str | None = None) -> None:
        """Queue a message that is not a reply; with ``latest_of``, it replaces a queued one of that kind."""
        self.outbox.push(QueuedText(dumps(message), latest_of=latest_of))

    def check_send_backlog(self) -> None:
        """Drop a client that has left more than ``max_send_buffer_bytes`` untaken: it is not reading."""
        buffered = self.transport.buffered_bytes if self.transport is not None else 0
        backlog = self.outbox.bytes_queued + buffered
        limit = self.settings.max_send_buffer_bytes
        if backlog <= limit:
            return
        detail = f"a client left {backlog} bytes untaken (max_send_buffer_bytes {limit})"
        if self.watch is not None:
            self._drop_viewer(detail)
            return
        log.warning("session=%s dropped: not reading, %s", self.session_id, detail)
        self.outbox.drop_pending()
        self.close(CLOSE_POLICY_VIOLATION, CloseReason.ERROR)
        if self.transport is not None:
            self.transport.drop_now("send_buffer", detail)

    # ---- ticks and their outcomes ------------------------------------------------------------

    def submit(self, job: TickJob, *, client_waits: bool = True) -> None:
        """Hand an accepted tick to the worker; while one the client waits on is out, the session is not idle."""
        self.worker.submit(job)
        if client_waits:
            self._in_worker.add(job.tick_id)
            self.touch()

    def drop_queued_ticks(self) -> None:
        """Its queued ticks do not run (their controls are kept, their credits come back); a running tick's
        outcome still comes, to whoever serves the session then."""
        session = self.session
        assert session is not None
        for job in self.worker.drop_ticks(session.id):
            session.absorb_update(job)
            session.release_credit()
        self._in_worker.clear()

    def on_outcome(self, outcome: TickOutcome) -> None:
        """A tick of the session is done (delivered by the worker on the event loop, in order per session)."""
        if self._in_worker:
            self._in_worker.discard(outcome.job.tick_id)
            if not self._in_worker:
                self.touch()  # the idle clock starts again now
        session = self.session
        if session is None or not session.live or outcome.job.session is not session or self.watch is not None:
            return  # closing (its queued ticks were dropped), or a tick of the session this one resumed
        if outcome.kind is OutcomeKind.CHUNK:
            if outcome.restarted == "rewind":
                self.metrics.rewinds.inc()
            self.metrics.chunk_compute_seconds.observe(outcome.compute_s)
            self.metrics.queue_wait_seconds.observe(outcome.queue_s)
            session.next_chunk_index = outcome.chunk_index + 1
        self.dialect.outcome(self, outcome)

    def count_sent(self, frames: int, nbytes: int) -> None:
        self.metrics.frames_sent.inc(frames)
        self.metrics.bytes_sent.inc(nbytes)

    # ---- watching (the share registry's side of a viewer, app/viewers.py) --------------------------

    @property
    def viewer_id(self) -> str | None:
        return self.watch.viewer_id if self.watch is not None else None

    @property
    def watch_format(self) -> Format:
        assert self.watch is not None
        return self.watch.format

    def offer_chunk(self, chunk: ViewerChunk) -> None:
        watch = self.watch
        if watch is None or watch.ended or chunk.seq <= watch.last_seq:
            return
        watch.last_seq = chunk.seq
        self.outbox.push(chunk)
        self.check_send_backlog()

    def skip_chunk(self) -> None:
        self.outbox.chunks_skipped += 1

    def end_watching(self, reason: CloseReason) -> None:
        if self.watch is not None:
            self.close(CLOSE_GOING_AWAY if reason is CloseReason.SERVER_SHUTDOWN else CLOSE_NORMAL, reason)

    def audience_changed(self, session: Session) -> None:
        """Viewers came or went, or control passed: say so to everyone, and re-plan the viewers' formats."""
        shares = self.gate.shares
        shares.announce(session.id, self.gate.controller(session.id))
        session.viewer_formats = shares.formats_needed(session.id, (session.codec, session.quality))

    def _leave_audience(self) -> None:
        session, watch = self.session, self.watch
        if session is not None and watch is not None and self.gate.shares.leave(session.id, watch.viewer_id):
            log.info("session=%s viewer %s left", session.id, watch.viewer_id)
            self.audience_changed(session)

    def _drop_viewer(self, detail: str) -> None:
        """A viewer that does not read: what it had queued goes, `closed` (not_reading) and close 1008 go next,
        and its connection is dropped ``close_timeout_s`` later unless it takes them (docs/public.md)."""
        if self.watch is None or self.watch.ended:
            return
        log.warning("session=%s viewer %s dropped: not reading, %s", self.session_id, self.watch.viewer_id, detail)
        self.outbox.drop_pending()
        self.close(CLOSE_POLICY_VIOLATION, CloseReason.NOT_READING)

    # ---- closing --------------------------------------------------------------------------

    def close(self, code: int, reason: CloseReason) -> None:
        """Queue the dialect's last message and the close frame; drop queued ticks and release the KV now.

        A viewer only closes its own socket; a controller's session ends, and its viewers with it.
        """
        watch = self.watch
        if watch is not None:
            if not watch.ended:
                watch.ended = True
                self.outbox.push(self._close_item(code, reason))
                self._leave_audience()
                # Its last messages go out while it is counted (sessions.closing); a peer that does not take
                # them within close_timeout_s is dropped, so no viewer outlives its session.
                self.gate.closing.add(self)
                if self.transport is not None:
                    self.transport.drop_soon()
            return
        session = self.session
        if session is None or not session.live:
            return
        item = self._close_item(code, reason)  # the dialect's last words (it may still hand chunks to viewers)
        session.transition(SessionState.CLOSING)
        self.gate.closing.add(self)
        self.outbox.push(item)
        shutdown = reason is CloseReason.SERVER_SHUTDOWN
        self.gate.shares.end_viewers(session.id, CloseReason.SERVER_SHUTDOWN if shutdown else CloseReason.SESSION_ENDED)
        self._release()

    def _close_item(self, code: int, reason: CloseReason) -> QueuedClose:
        frame_reason = str(reason) if self.dialect.reason_in_close_frame else ""
        return QueuedClose(code, self.dialect.closed(self, reason), frame_reason)

    def fatal(
        self,
        code: str,
        message: str,
        *,
        tick_id: int | None = None,
        reason: CloseReason = CloseReason.ERROR,
        returns_credit: bool = False,
        close_code: int | None = None,
    ) -> None:
        """Queue the dialect's error and close (``close_code``, else the code's own)."""
        self.metrics.errors.labels(code=str(code)).inc()
        if not self.serving:
            return
        error = self.dialect.error(code, message, tick_id=tick_id)
        self.outbox.push(QueuedText(dumps(error), returns_credit=returns_credit))
        if close_code is None:
            close_code = ERROR_CLOSE_CODES.get(ErrorCode(code), CLOSE_POLICY_VIOLATION)
        self.close(close_code, reason)

    def take_over(self) -> None:
        """Another socket resumed this session: end this one with taken_over (4003); the KV stays.

        Its peer may not be reading (why it was resumed elsewhere): what it had queued is dropped so the
        close goes out next, and the socket is dropped ``close_timeout_s`` later if it is still open.
        Its ticks were dropped from the worker: none of them will come back.
        """
        self._released = True  # the resuming socket holds the session's KV now
        self._in_worker.clear()
        self.outbox.drop_pending()
        self.fatal(ErrorCode.TAKEN_OVER, "another connection resumed this session", reason=CloseReason.TAKEN_OVER)
        if self.transport is not None:
            self.transport.drop_soon()

    def close_moved(self, resume: str, next_chunk_index: int) -> None:
        """The session lives on a peer now (app/migration.py): tell the client its token, close, release here."""
        if self.session is not None and self.session.live:
            self.outbox.push(QueuedText(self.dialect.moved(resume, next_chunk_index)))
        self.close(CLOSE_GOING_AWAY, CloseReason.MOVED)

    def close_for_shutdown(self) -> None:
        self.close(CLOSE_GOING_AWAY, CloseReason.SERVER_SHUTDOWN)

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
        """The one release of a session's KV here: its ticket, its queued ticks, its share token."""
        if self._released or self.session is None:
            return
        self._released = True
        self.gate.resume.forget(self)
        dropped = self.worker.drop_session(self.session_id)
        self.gate.shares.forget(self.session_id)
        log.info("session=%s released (%d queued tick(s) dropped)", self.session_id, dropped)

    async def _finish(self) -> None:
        gate = self.gate
        gate.unstarted.discard(self)  # refused, or gone before its session started
        gate.drop_claim(self)  # gone between a branch's admission and its registration
        session = self.session
        if session is None:
            return
        if self.watch is not None:
            self.watch.ended = True
            self._leave_audience()
        else:
            if self.disconnected:
                log.info("session=%s disconnected", self.session_id)
            if not self._released and gate.resume.detach(self):
                self._released = True  # detached: kept with its KV for a resume, released by the registry
            if not self._released or gate.controller(session.id) is self:
                # Its viewers watched this socket (detached, they may watch again after the resume).
                gate.shares.end_viewers(session.id, CloseReason.SESSION_ENDED)
            if session.state is not SessionState.CLOSING and session.state is not SessionState.CLOSED:
                session.transition(SessionState.CLOSING)
            self._release()
            gate.unregister(self)
        if self.disconnected:
            await self._stop_writer()
        await self.wait_sent(self.settings.shutdown_grace_s)
        if self.watch is None and session.state is not SessionState.CLOSED:
            session.transition(SessionState.CLOSED)

    # ---- the writer ---------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        session = self.session
        assert session is not None
        try:
            while True:
                item = await self.outbox.get()
                self._arm_stall()
                if isinstance(item, QueuedText):
                    await self.ws.send_text(item.text)
                    if item.returns_credit:
                        session.release_credit()
                elif isinstance(item, QueuedChunk):
                    await self.dialect.send_chunk(self, item.outcome)
                    self.metrics.chunks.inc()
                    session.release_credit()
                    self.dialect.chunk_sent(self)
                elif isinstance(item, ViewerChunk):
                    await self._send_viewer_chunk(item)
                else:
                    if item.text is not None:
                        await self.ws.send_text(item.text)
                    await self.ws.close(item.code, item.reason)
                    return
                self._disarm_stall()
        except Exception as exc:  # noqa: BLE001 - a vanished client ends the writer quietly
            log.debug("session=%s writer stopped: %s", self.session_id, exc)
        finally:
            self._disarm_stall()
            self.outbox.close()

    async def _send_viewer_chunk(self, chunk: ViewerChunk) -> None:
        skipped, self.outbox.chunks_skipped = self.outbox.chunks_skipped, 0
        await self.ws.send_text(dumps({**chunk.header, "skipped_before": skipped}) if skipped else chunk.text)
        for frame in chunk.frames:
            await self.ws.send_bytes(frame)
            self.count_sent(1, len(frame))

    def _arm_stall(self) -> None:
        """Arm the stall bound for the item a viewer's writer is about to send (disarmed once it is sent)."""
        if self.watch is not None and not self.watch.ended:
            timeout = self.settings.viewer_stall_timeout_s
            self._stall_timer = asyncio.get_running_loop().call_later(
                timeout, self._drop_viewer, f"it took nothing for {timeout:g} s (viewer_stall_timeout_s)"
            )

    def _disarm_stall(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

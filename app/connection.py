"""One WebSocket connection: handshake, the receive loop, and the single writer that keeps frames whole.

Flow: auth and origin checks, then the ``start`` handshake (within
``start_timeout_s``), admission, ``ready``; then a receive loop that answers
each message at once (ack, pong, error) and hands accepted ticks to the
worker. Everything the session sends goes through its :class:`Outbox` and
one writer task, so immediate replies keep their order and a chunk's frames
are never interleaved with anything. A tick's credit comes back only when its
last frame (or its error) has been written to the socket.

Bounds on the way out (docs/public.md): what is queued for the client and
not yet taken by it, in bytes, stays under ``max_send_buffer_bytes`` or the
client is dropped; a taken-over connection drops what it had queued and is
dropped ``close_timeout_s`` later if it does not take its close. Only ticks
and inputs keep a session from going idle (pings keep just the connection).
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
from arstream.app.guard import transport_control
from arstream.app.protocol import (
    CLOSE_NORMAL,
    ERROR_CLOSE_CODES,
    CloseMessage,
    CloseReason,
    ErrorCode,
    InputMessage,
    PingMessage,
    ProtocolError,
    StartMessage,
    TickMessage,
    ack_message,
    chunk_message,
    closed_message,
    dumps,
    error_message,
    moved_message,
    parse_client_message,
    pong_message,
    ready_message,
)
from arstream.app.guard import limit_messages
from arstream.app.resume import Resumed, ResumeRefused, token_hint
from arstream.app.limits import MessageBudget, count_exceeds
from arstream.app.session import Session, SessionState
from arstream.app.start_image import StartImageRefused
from arstream.app.worker import OutcomeKind, TickOutcome
from arstream.runner.types import StartImage

if TYPE_CHECKING:
    from arstream.app.hub import SessionHub

log = logging.getLogger("arstream.session")

# Immediate replies queued behind a client that does not read, before the receive loop waits.
REPLY_BACKLOG_LIMIT = 64
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY_VIOLATION = 1008


@dataclass(frozen=True)
class _Text:
    text: str
    is_reply: bool = False
    returns_credit: bool = False


@dataclass(frozen=True)
class _Chunk:
    outcome: TickOutcome

    @property
    def size(self) -> int:
        return sum(len(frame) for frame in self.outcome.frame_messages)


@dataclass(frozen=True)
class _Close:
    code: int
    reason: CloseReason | None  # None: no `closed` message (the session never started)


_Item = _Text | _Chunk | _Close


class Outbox:
    """A session's send queue. Replies are bounded (the receive loop stops reading while it is full, and
    each message read adds at most one); chunks and their errors are bounded by credits."""

    def __init__(self, reply_limit: int = REPLY_BACKLOG_LIMIT) -> None:
        self._items: deque[_Item] = deque()
        self._reply_limit = reply_limit
        self._replies_queued = 0
        self._has_items = asyncio.Event()
        self._reply_space = asyncio.Event()
        self._reply_space.set()
        self._closed = False
        self.bytes_queued = 0  # text and frame bytes waiting for the writer

    def close(self) -> None:
        """The writer is gone: drop whatever comes next and wake anyone waiting for space."""
        self._closed = True
        self.drop_pending()

    def drop_pending(self) -> None:
        """Forget everything queued (the client is not going to take it) and wake anyone waiting for space."""
        self._items.clear()
        self._replies_queued = 0
        self.bytes_queued = 0
        self._reply_space.set()

    @property
    def replies_queued(self) -> int:
        return self._replies_queued

    def push(self, item: _Item) -> None:
        if self._closed:
            return
        if isinstance(item, _Text) and item.is_reply:
            self._replies_queued += 1
        self.bytes_queued += _size(item)
        self._items.append(item)
        self._has_items.set()

    @property
    def replies_full(self) -> bool:
        """The client has not taken ``reply_limit`` replies: read nothing more from it until it does."""
        return self._replies_queued >= self._reply_limit and not self._closed

    async def wait_reply_space(self) -> None:
        while self.replies_full:
            self._reply_space.clear()
            await self._reply_space.wait()

    def push_reply(self, text: str) -> None:
        # Never waits: the receive loop reads a message only when there is room for its one reply.
        self.push(_Text(text, is_reply=True))

    async def get(self) -> _Item:
        while not self._items:
            self._has_items.clear()
            await self._has_items.wait()
        item = self._items.popleft()
        self.bytes_queued -= _size(item)
        if isinstance(item, _Text) and item.is_reply:
            self._replies_queued -= 1
            self._reply_space.set()
        return item


def _size(item: _Item) -> int:
    """Bytes an outbox item will take on the wire (texts are ASCII: ``dumps`` escapes the rest)."""
    if isinstance(item, _Text):
        return len(item.text)
    return item.size if isinstance(item, _Chunk) else 0


class Connection:
    """Serves one WebSocket for its whole life; :meth:`run` returns when it is closed."""

    def __init__(self, websocket: WebSocket, hub: SessionHub) -> None:
        self.ws = websocket
        self.hub = hub
        self.settings = hub.settings
        self.metrics = hub.metrics
        self.session: Session | None = None
        self.session_id = "s-" + secrets.token_hex(8)
        self.outbox = Outbox()
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

    # ---- entry point -----------------------------------------------------------------

    async def run(self) -> None:
        self.metrics.websocket_connections.inc()
        self.metrics.websocket_open.inc()
        try:
            await self._serve()
        except Exception:  # noqa: BLE001 - a server fault: tell the client, then close 1011
            log.exception("session=%s server fault", self.session_id)
            if self.session is None:
                await self._refuse(ErrorCode.INTERNAL, "internal server error")
            else:
                self._fatal(ErrorCode.INTERNAL, "internal server error")
        finally:
            await self._finish()
            self.hub.closing.discard(self)
            self.metrics.websocket_open.dec()

    async def _serve(self) -> None:
        ws = self.ws
        refusal, missing_token = auth.upgrade_refusal(ws, self.settings)
        if refusal is not None and self.settings.refuse_before_upgrade:
            await self._deny_upgrade(
                ErrorCode.UNAUTHORIZED,
                refusal,
                status=401 if missing_token else 403,
                headers={"WWW-Authenticate": "Bearer"} if missing_token else None,
            )
            return
        if refusal is None:
            # Waiting for `start` is capped (app/unstarted.py); past the cap, a 503 that closes the connection at once.
            busy = self.hub.unstarted.refusal(self.client_host)
            if busy is not None:
                await self._deny_upgrade(ErrorCode.OVER_CAPACITY, busy, status=503, headers={"Retry-After": "1"})
                return
            self.hub.unstarted.add(self, self.client_host)
        await ws.accept()
        if refusal is not None:
            log.info("session=%s refused: %s", self.session_id, refusal)
            await self._refuse(ErrorCode.UNAUTHORIZED, refusal)
            return
        limit_messages(self.ws, self.settings.ws_message_limit(self.hub.start_message_bytes))
        opened = await self._open_session()
        if opened is None:
            return
        session, next_chunk_index, resumed = opened
        # only `start` may carry an image
        limit_messages(self.ws, self.settings.ws_message_limit(self.settings.max_message_bytes))
        self.session = session
        upload_limit = self.settings.max_start_image_bytes if self.hub.start_image_names else None
        self.hub.register(self)
        self._writer = asyncio.create_task(self._write_loop(), name=f"writer-{self.session_id}")
        self.outbox.push(
            _Text(
                dumps(
                    ready_message(
                        session_id=self.session_id,
                        model_card=self.hub.model_card,
                        codec=session.codec,
                        max_pending_ticks=self.settings.max_pending_ticks,
                        max_message_bytes=self.settings.max_message_bytes,
                        idle_timeout_s=self.settings.idle_timeout_s,
                        resume=self.hub.resume.ticket(self, next_chunk_index),
                        resumed=resumed,
                        max_start_image_bytes=upload_limit,
                    )
                ),
                is_reply=True,
            )
        )
        log.info("session=%s started codec=%s", self.session_id, session.codec)
        await self._receive_loop(session)

    async def _open_session(self) -> tuple[Session, int, bool] | None:
        """The session `start` asks for (new or resumed), its next chunk index and whether it was resumed;
        None after refusing the connection (or on disconnect).

        The `start` message, which may hold megabytes of image data, lives only as long as this call.
        """
        start = await self._await_start()
        if start is None:
            return None
        resume_token = start.resume or self.ws.query_params.get("resume")
        if resume_token is not None:
            resumed = await self._adopt(resume_token, start)  # a resumed session keeps its own start image
            if resumed is None:
                return None
            return resumed.session, resumed.next_chunk_index, True
        # Admission is asked before the image too: a model still loading offers no images yet, and a
        # session that cannot be admitted is not worth a decode. Admitted (claimed) after it, as a decode takes
        # time; the claim and the registration have no await between them (SessionHub.admit).
        if start.image is not None and not await self._admitted(claim=False):
            return None
        start_image: StartImage | None = None
        if start.image is not None:
            try:
                start_image = await self.hub.start_images.resolve(
                    name=start.image.name, data=start.image.data, offered=self.hub.start_image_names
                )
            except StartImageRefused as exc:
                log.info("session=%s start image refused: %s", self.session_id, exc)
                await self._refuse(ErrorCode.INVALID_IMAGE, str(exc))
                return None
        if not await self._admitted(claim=True):
            return None
        session = Session(
            self.session_id,
            codec=start.codec or self.settings.codec,
            quality=start.quality or self.settings.default_jpeg_quality(self.hub.model_card),
            seed=start.seed,
            prompt=start.prompt,
            max_pending_ticks=self.settings.max_pending_ticks,
            start_image=start_image,
        )
        session.transition(SessionState.ACTIVE)
        return session, 0, False

    async def _admitted(self, *, claim: bool) -> bool:
        """Whether a new session may start now; False after refusing with over_capacity.

        ``claim``: admit it (detached sessions give way, see SessionHub.admit); else only ask.
        """
        refusal = self.hub.admit(self) if claim else self.hub.admission_refusal() or self.hub.client_cap_refusal(self)
        if refusal is None:
            return True
        log.info("session=%s not admitted: %s", self.session_id, refusal)
        await self._refuse(ErrorCode.OVER_CAPACITY, refusal)
        return False



    async def _adopt(self, token: str, start: StartMessage) -> Resumed | None:
        """The session ``token`` resumes (PROTOCOL.md, "Resume ..."), or None after refusing with resume_failed."""
        url_token = self.ws.query_params.get("resume")
        try:
            if start.resume is not None and url_token is not None and url_token != start.resume:
                raise ResumeRefused("the URL's ?resume= and start.resume name different tokens")
            # A resume passes the same admission as a new session; refused, it spends nothing.
            refusal = self.hub.admit(self, resuming=self.hub.resume.lookup(token, self.token_key))
            if refusal is not None:
                hint = token_hint(token)
                log.info("session=%s resume with token %s not admitted: %s", self.session_id, hint, refusal)
                self.hub.metrics.resumes.labels(outcome="refused").inc()
                await self._refuse(ErrorCode.OVER_CAPACITY, refusal)
                return None
            resumed = await self.hub.resume.resume(token, self, codec=start.codec, quality=start.quality)
        except ResumeRefused as exc:
            log.info("session=%s resume with token %s refused: %s", self.session_id, token_hint(token), exc)
            self.hub.metrics.resumes.labels(outcome="refused").inc()
            await self._refuse(ErrorCode.RESUME_FAILED, str(exc))
            return None
        self.session_id = resumed.session.id
        self.hub.metrics.resumes.labels(outcome="resumed").inc()
        return resumed

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

    # ---- before the session exists -----------------------------------------------------

    async def _deny_upgrade(
        self, code: ErrorCode, refusal: str, *, status: int, headers: dict[str, str] | None = None
    ) -> None:
        """Refuse with HTTP ``status`` before the upgrade; the body is the error object."""
        log.info("session=%s refused before the upgrade: %s", self.session_id, refusal)
        self.metrics.errors.labels(code=str(code)).inc()
        body = error_message(code, refusal)
        await self.ws.send_denial_response(JSONResponse(body, status_code=status, headers=headers))

    async def _refuse(self, code: ErrorCode, message: str) -> None:
        """Error then close, for a connection that never became a session.

        Bounded by ``close_timeout_s``: a peer that does not read its refusal
        is left to the transport, which drops it (see :mod:`arstream.app.guard`).
        """
        self.metrics.errors.labels(code=str(code)).inc()

        async def send_refusal() -> None:
            await self.ws.send_text(dumps(error_message(code, message)))
            await self.ws.close(ERROR_CLOSE_CODES[code])

        try:
            await asyncio.wait_for(send_refusal(), self.settings.close_timeout_s)
            if self.transport is not None:
                self.transport.stop_reading()  # refused: nothing it sends now is parsed
        except TimeoutError:
            log.debug("session=%s did not take its refusal within %s s", self.session_id, self.settings.close_timeout_s)
        except Exception:  # noqa: BLE001 - the client may already be gone
            log.debug("session=%s gone before its refusal was sent", self.session_id)

    @staticmethod
    def _too_large(text: str, limit: int) -> bool:
        # Characters first: the UTF-8 byte count is taken only of a text that could still be too large.
        return len(text) > limit or len(text.encode()) > limit

    async def _await_start(self) -> StartMessage | None:
        """The `start` message, or None after refusing the connection (or on disconnect)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.start_timeout_s
        while True:
            delay = self._budget.delay(loop.time())
            if delay > 0:
                await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
            try:
                message = await asyncio.wait_for(self.ws.receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                await self._refuse(
                    ErrorCode.START_REQUIRED, f"no start message within {self.settings.start_timeout_s} s"
                )
                return None
            if message["type"] == "websocket.disconnect":
                self._disconnected = True
                return None
            text = message.get("text")
            if text is None:
                await self._refuse(ErrorCode.START_REQUIRED, "the first message must be a start text message")
                return None
            limit = self.hub.start_message_bytes
            if self._too_large(text, limit):
                with_image = " (max_message_bytes plus a base64 start image)" if self.hub.start_image_names else ""
                await self._refuse(ErrorCode.MESSAGE_TOO_LARGE, f"start messages are limited to {limit} bytes{with_image}")
                return None
            try:
                parsed = parse_client_message(text)
            except ProtocolError as exc:
                if exc.message_type == "start":
                    # A malformed start is still a start: say what is wrong and keep waiting.
                    self.metrics.errors.labels(code=str(exc.code)).inc()
                    try:
                        # Within the start deadline: a client that does not read its errors is not waited on.
                        await asyncio.wait_for(
                            self.ws.send_text(dumps(error_message(exc.code, exc.message))),
                            max(0.0, deadline - loop.time()),
                        )
                    except TimeoutError:
                        await self._refuse(
                            ErrorCode.START_REQUIRED, f"no start message within {self.settings.start_timeout_s} s"
                        )
                        return None
                    continue
                await self._refuse(ErrorCode.START_REQUIRED, f"the first message must be start ({exc.message})")
                return None
            if not isinstance(parsed, StartMessage):
                await self._refuse(ErrorCode.START_REQUIRED, f"the first message must be start, got {parsed.type}")
                return None
            return parsed

    # ---- the session's receive loop ---------------------------------------------------------

    async def _receive_loop(self, session: Session) -> None:
        loop = asyncio.get_running_loop()
        self._idle_since = loop.time()
        while session.live:
            message = await self._next_message()
            if message is None:
                if session.live:
                    self._fatal(
                        ErrorCode.IDLE_TIMEOUT,
                        f"no tick or input for {self.settings.idle_timeout_s} s while no tick was queued or running",
                        reason=CloseReason.IDLE_TIMEOUT,
                    )
                return
            if message["type"] == "websocket.disconnect":
                self._disconnected = True
                return
            if session.live:
                await self._handle(session, message)

    def _idle_left(self, now: float) -> float:
        """Seconds until the session is idle (PROTOCOL.md: no tick or input while no tick is queued or running).

        Pings do not count: they keep the connection, not the session's slot (a client that asks for
        nothing, or a non-reader whose pings are still being read, gives the slot back)."""
        if self._in_worker:
            return self.settings.idle_timeout_s  # the client is waiting on the server
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

    async def _reply(self, payload: dict[str, Any]) -> None:
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
        log.warning("session=%s dropped: not reading, %s", self.session_id, detail)
        self.outbox.drop_pending()
        self._close(CLOSE_POLICY_VIOLATION, CloseReason.ERROR)
        if self.transport is not None:
            self.transport.drop_now("send_buffer", detail)

    async def _reply_error(self, error: ProtocolError) -> None:
        self.metrics.errors.labels(code=str(error.code)).inc()
        await self._reply(error_message(error.code, error.message, tick_id=error.tick_id))

    async def _handle(self, session: Session, message: dict[str, Any]) -> None:
        text = message.get("text")
        if text is None:
            if message.get("bytes") is not None:
                await self._reply_error(
                    ProtocolError(ErrorCode.INVALID_MESSAGE, "binary messages from the client are not part of protocol 1")
                )
            return
        if self._too_large(text, self.settings.max_message_bytes):
            self._fatal(
                ErrorCode.MESSAGE_TOO_LARGE, f"text messages are limited to {self.settings.max_message_bytes} bytes"
            )
            return
        try:
            parsed = parse_client_message(text)
            if isinstance(parsed, TickMessage):
                self._validate_controls(parsed.controls, tick_id=parsed.tick_id)
                job = session.accept_tick(parsed)
                if self.moving:  # its state is on its way to a peer: keep the tick's controls, run nothing here
                    session.absorb_update(job)
                    session.release_credit()
                    return
                assert self.hub.worker is not None
                self.hub.worker.submit(job)
                self._in_worker.add(job.tick_id)
                self._idle_since = asyncio.get_running_loop().time()  # accepted work: not idle
            elif isinstance(parsed, InputMessage):
                self._validate_controls(parsed.controls, tick_id=None)
                duplicate = session.accept_event(parsed)
                self._idle_since = asyncio.get_running_loop().time()
                await self._reply(ack_message(parsed.event_id, duplicate=duplicate))
            elif isinstance(parsed, PingMessage):
                await self._reply(pong_message(parsed.t))
            elif isinstance(parsed, CloseMessage):
                log.info("session=%s closed by the client", self.session_id)
                self._close(CLOSE_NORMAL, CloseReason.CLIENT)
            else:
                raise ProtocolError(ErrorCode.INVALID_MESSAGE, "the session has already started; start is sent once")
        except ProtocolError as exc:
            await self._reply_error(exc)

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
            self.metrics.chunk_compute_seconds.observe(outcome.compute_s)
            self.metrics.queue_wait_seconds.observe(outcome.queue_s)
            self.outbox.push(_Chunk(outcome))
            self._check_send_backlog()
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
            self.outbox.push(_Text(dumps(message), returns_credit=True))
        if job.close:
            log.info("session=%s closing after tick %d (close: true)", self.session_id, job.tick_id)
            self._close(CLOSE_NORMAL, CloseReason.TICK_CLOSE)

    # ---- closing --------------------------------------------------------------------------

    def _close(self, code: int, reason: CloseReason) -> None:
        """Queue `closed` and the close frame; drop queued ticks and release the KV now."""
        session = self.session
        if session is None or not session.live:
            return
        session.transition(SessionState.CLOSING)
        self.hub.closing.add(self)
        self.outbox.push(_Close(code, reason))
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
        session = self.session
        if session is None or not session.live:
            return
        self.outbox.push(_Text(dumps(error_message(code, message, tick_id=tick_id)), returns_credit=returns_credit))
        self._close(ERROR_CLOSE_CODES[code], reason)

    def close_moved(self, token: str, next_chunk_index: int) -> None:
        """The session lives on a peer now (app/migration.py): tell the client its token, close, release here."""
        if self.session is not None and self.session.live:
            self.outbox.push(_Text(dumps(moved_message(resume=token, next_chunk_index=next_chunk_index))))
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
        log.info("session=%s released (%d queued tick(s) dropped)", self.session_id, dropped)

    async def _finish(self) -> None:
        self.hub.unstarted.discard(self)  # refused, or gone before its session started
        session = self.session
        if session is not None:
            if self._disconnected:
                log.info("session=%s disconnected", self.session_id)
            if not self._released and self.hub.resume.detach(self):
                self._released = True  # detached: kept with its KV for a resume, released by the registry
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
                if isinstance(item, _Text):
                    await self.ws.send_text(item.text)
                    if item.returns_credit:
                        session.release_credit()
                elif isinstance(item, _Chunk):
                    await self._send_chunk(session, item.outcome)
                else:
                    if item.reason is not None:
                        await self.ws.send_text(dumps(closed_message(item.reason)))
                    await self.ws.close(item.code)
                    return
        except Exception as exc:  # noqa: BLE001 - a vanished client ends the writer quietly
            log.debug("session=%s writer stopped: %s", self.session_id, exc)
        finally:
            self.outbox.close()

    async def _send_chunk(self, session: Session, outcome: TickOutcome) -> None:
        job = outcome.job
        header = chunk_message(
            tick_id=job.tick_id,
            chunk_index=outcome.chunk_index,
            frames=len(outcome.frame_messages),
            applied_event_ids=outcome.applied_event_ids,
            restarted=outcome.restarted,
            queue_ms=outcome.queue_s * 1e3,
            compute_ms=outcome.compute_s * 1e3,
            encode_ms=outcome.encode_s * 1e3,
        )
        await self.ws.send_text(dumps(header))
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

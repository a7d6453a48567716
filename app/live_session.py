"""One socket's live session: the one lifecycle every wire dialect runs on.

A :class:`LiveSession` serves one WebSocket from its upgrade to its close.
Its :class:`~arstream.app.dialect.Dialect` says what the wire looks like
(protocol 1, vLLM-Omni's realtime video, ...); everything else is here, once:
the receive loop with its message budget and idle clock, the
:class:`~arstream.app.outbox.Outbox` and the one writer task that keeps frames
whole, the ticks in the worker, credits, release and finish. Before its session
starts, the socket is an :class:`~arstream.app.opening.Opening` (the upgrade
checks and refusals). The dialect's hooks see a small port of it
(:class:`~arstream.app.dialect.SessionPort`), never the whole. The hub, the
resume registry and the share registry hold live sessions, and the worker
delivers each tick's outcome straight to the live session that serves the
tick's :class:`~arstream.app.session.Session` now (``Session.deliver``).

Roles (PROTOCOL.md, "Rewind, branch and watch"): a live session controls its
session, or watches one (its :attr:`LiveSession.watch` is a
:class:`~arstream.app.viewers.ViewerRole`). :class:`Phase` and its transition
table say where it is; passing control (:meth:`LiveSession.pass_control`)
swaps the two roles between two live sessions, here and nowhere else.

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
from dataclasses import replace
from enum import Enum
from typing import Any, Protocol

from starlette.types import Message
from starlette.websockets import WebSocket

from .dialect import Dialect, Gate, Passed, SessionWorker
from .limits import TokenBucket
from .opening import Opening
from .outbox import REPLY_BACKLOG_LIMIT, Outbox, QueuedClose, QueuedText
from .protocol import CLOSE_GOING_AWAY, ERROR_CLOSE_CODES, CloseReason, ErrorCode, ProtocolError, dumps, excerpt
from .resume import Holder
from .session import Session, SessionState, TickJob
from .viewers import CLOSE_POLICY_VIOLATION, ViewerRole
from .writer import Writer
from .worker import OutcomeKind, TickOutcome

log = logging.getLogger("arstream.session")


class Phase(Enum):
    """Where a live session is in its life."""

    OPENING = "opening"  # from the upgrade to its session's start (or its refusal)
    CONTROLLING = "controlling"  # it controls its session: ticks, inputs, outcomes
    WATCHING = "watching"  # it watches a session another socket controls
    CLOSING = "closing"  # its last messages and close frame go out
    CLOSED = "closed"


# Legal moves; anything else is a bug. CONTROLLING <-> WATCHING: control passed.
PHASES: dict[Phase, frozenset[Phase]] = {
    Phase.OPENING: frozenset({Phase.CONTROLLING, Phase.WATCHING, Phase.CLOSED}),
    Phase.CONTROLLING: frozenset({Phase.WATCHING, Phase.CLOSING, Phase.CLOSED}),
    Phase.WATCHING: frozenset({Phase.CONTROLLING, Phase.CLOSING, Phase.CLOSED}),
    Phase.CLOSING: frozenset({Phase.CLOSED}),
    Phase.CLOSED: frozenset(),
}


class Hall(Gate, Protocol):
    """The gate as a live session sees it: a dialect's gate, and the registry of the sessions served."""

    closing: set[LiveSession]  # ended sockets whose last bytes go out

    def controller(self, session_id: str) -> LiveSession | None: ...

    def register(self, live: LiveSession) -> None: ...

    def unregister(self, live: LiveSession) -> None: ...

    def transfer_refusal(self, holder: Holder, session_id: str) -> str | None: ...


class LiveSession:
    """Serves one WebSocket for its whole life in one dialect; :meth:`run` returns when it is closed."""

    def __init__(self, websocket: WebSocket, gate: Hall, dialect: Dialect) -> None:
        self.ws = websocket
        self.gate = gate
        self.dialect = dialect
        self.settings = gate.settings
        self.metrics = gate.metrics
        self.phase = Phase.OPENING
        self.session: Session | None = None
        self.session_id = dialect.session_id
        self.outbox = Outbox(REPLY_BACKLOG_LIMIT)
        loop_time = asyncio.get_running_loop().time()
        self.budget = TokenBucket(self.settings.max_messages_per_s, self.settings.message_burst, loop_time)
        self.opening = Opening(websocket, gate, dialect, self.budget)
        self.client_host, self.token_key, self.transport = (
            self.opening.client_host, self.opening.token_key, self.opening.transport,
        )
        self.watch: ViewerRole | None = None  # set while this socket watches a session instead of controlling it
        # Being moved to a peer (app/migration.py): a tick keeps its controls and runs nothing here.
        self.moving = False
        self._writer = Writer()
        self._released = False
        # Ticks handed to the worker whose outcome the client waits on: while any is out, the session is not idle.
        self._in_worker: set[int] = set()
        self._idle_since = 0.0  # loop time of the last progress (touch), or of the last awaited outcome back

    @property
    def worker(self) -> SessionWorker:
        worker = self.gate.worker
        assert worker is not None, "a session is served only once the worker runs"
        return worker

    def _enter(self, phase: Phase) -> None:
        if phase not in PHASES[self.phase]:
            raise RuntimeError(f"session={self.session_id}: a live session cannot go from {self.phase} to {phase}")
        self.phase = phase

    # ---- entry point -----------------------------------------------------------------

    async def run(self) -> None:
        self.metrics.websocket_connections.inc()
        self.metrics.websocket_open.inc()
        try:
            await self._serve()
        except Exception:  # noqa: BLE001 - a server fault: tell the client, then close 1011
            log.exception("session=%s server fault", self.session_id)
            if self.session is None:
                await self.opening.refuse(ErrorCode.INTERNAL, "internal server error")
            else:
                self.fatal(ErrorCode.INTERNAL, "internal server error")
        finally:
            await self._finish()
            await self.dialect.finished(self)
            self.gate.closing.discard(self)
            self.metrics.websocket_open.dec()

    async def _serve(self) -> None:
        started = await self.dialect.start(self.opening)
        if started is None:
            return
        session = started.session
        self.session, self.session_id = session, session.id
        if started.watch_format is None:
            self._enter(Phase.CONTROLLING)
            session.deliver = self.on_outcome
            # Where the server ticks for the client, it runs only this far ahead of the socket (Dialect.chunks_ahead).
            session.chunks_ahead_limit = self.dialect.chunks_ahead
            session.next_chunk_index = started.next_chunk_index
            self.gate.register(self)
            if started.resumable:
                started = replace(started, ticket=self.gate.resume.ticket(self, started.next_chunk_index))
        else:
            # A viewer from now on (the registry counts it as one); the dialect's start checked there is room.
            self.watch = self._viewer_role(session, started.watch_format)
            self._enter(Phase.WATCHING)
            self.gate.unstarted.discard(self.opening)
            self.watch.viewer_id = self.gate.shares.join(session.id, self.watch)
        name = self.session_id if self.watch is None else self.watch.viewer_id
        self._writer.start(self, session, name)
        self.dialect.ready(self, started)
        await self._receive_loop()

    def _viewer_role(self, session: Session, served: tuple[str, int], last_seq: int = -1) -> ViewerRole:
        timeout = self.settings.viewer_stall_timeout_s
        return ViewerRole(self, session.id, served, stall_timeout_s=timeout, last_seq=last_seq)

    # ---- the receive loop ---------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        """Whether this socket still serves: it controls its live session, or it still watches (only
        :meth:`close` ends either, and it moves the phase on)."""
        return self.phase is Phase.CONTROLLING or self.phase is Phase.WATCHING

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
                self.opening.disconnected = True
                return
            text = message.get("text")
            if self.serving and (text is not None or message.get("bytes") is not None):
                job = self.dialect.text_in(self, text)
                if job is not None:
                    self._run(job)

    def _run(self, job: TickJob) -> None:
        """Run a tick the client asked for; while the session moves to a peer, keep its controls and run nothing."""
        if self.moving:
            job.session.absorb_update(job)
            job.session.release_credit()
        else:
            self.submit(job)

    async def _next_message(self) -> Message | None:
        """The next message, or None once the session is idle: no progress while no tick the client waits on
        is out (pings do not count in protocol 1: they keep the connection, not the session's slot).

        Every wait here is bounded by the idle deadline: the message rate budget (a client past it is read more
        slowly), room for replies (a client that does not read them is not read either, so it goes idle and is
        closed), and the message itself.
        """
        loop = asyncio.get_running_loop()
        delay = self.budget.delay(loop.time())
        if delay > 0:
            await asyncio.sleep(delay)
        while True:
            if self._in_worker or self.watch is not None:
                left = self.settings.idle_timeout_s  # the client is waiting on the server, or watching
            else:
                left = self._idle_since + self.settings.idle_timeout_s - loop.time()
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
            self.watch.drop(detail)
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

    # ---- passing control -----------------------------------------------------------------------

    def check_pass_control(self, viewer_id: str) -> tuple[ViewerRole, LiveSession]:
        """The viewer that control would pass to, and its live session; raises ProtocolError (control stays)
        for an unknown viewer, a session closing or moving, or a viewer whose client is at its session caps."""
        gate, session = self.gate, self.session
        assert session is not None and self.watch is None
        role = gate.shares.viewers(session.id).get(viewer_id)
        target = role.socket if role is not None and not role.ended else None
        if role is None or not isinstance(target, LiveSession):
            raise ProtocolError(ErrorCode.UNKNOWN_VIEWER, f"no viewer {excerpt(viewer_id)} watches this session")
        if self.moving or session.state is not SessionState.ACTIVE and session.state is not SessionState.FAILED:
            raise ProtocolError(ErrorCode.INVALID_MESSAGE, "the session is closing or moving; control stays")
        # The session counts against the new controller's address and token from now on: their caps hold.
        refusal = gate.transfer_refusal(target, session.id)
        if refusal is not None:
            raise ProtocolError(
                ErrorCode.CONTROL_REFUSED, f"control stays: viewer {viewer_id}'s {refusal.removeprefix('this ')}"
            )
        return role, target

    def pass_control(self, viewer_id: str) -> Passed:
        """Hand control to one of the session's viewers: the two live sessions swap roles (PROTOCOL.md).

        Raises ProtocolError (control stays) as :meth:`check_pass_control` says. The dialect says so on the wire,
        then tells the audience."""
        role, target = self.check_pass_control(viewer_id)
        gate, session = self.gate, self.session
        assert session is not None
        # Its queued ticks were this client's: they do not run for the next one (their controls are kept);
        # a running tick's chunk goes to the new controller, with its credit.
        for job in self.worker.drop_ticks(session.id):
            session.absorb_update(job)
            session.release_credit()
        self._in_worker.clear()
        gate.shares.leave(session.id, viewer_id)
        role.give_up()
        target.watch = None
        target._enter(Phase.CONTROLLING)
        self.watch = self._viewer_role(session, (session.codec, session.quality), last_seq=session.chunks_out)
        self._enter(Phase.WATCHING)
        session.codec, session.quality = role.format
        target.touch()
        session.deliver = target.on_outcome
        gate.register(target)
        gate.resume.forget(self)
        self.watch.viewer_id = gate.shares.join(session.id, self.watch, cap=False)
        log.info("session=%s control passed to %s; the controller became viewer %s", session.id, viewer_id,
                 self.watch.viewer_id)
        return Passed(target, gate.resume.ticket(target, session.next_chunk_index), self.watch.viewer_id)

    def _leave_audience(self) -> None:
        session, watch = self.session, self.watch
        if session is not None and watch is not None and self.gate.shares.leave(session.id, watch.viewer_id):
            log.info("session=%s viewer %s left", session.id, watch.viewer_id)
            self.gate.shares.audience_changed(session, self.gate.controller(session.id))

    # ---- closing --------------------------------------------------------------------------

    def close(self, code: int, reason: CloseReason) -> None:
        """Queue the dialect's last message and the close frame; drop queued ticks and release the KV now.

        A viewer only closes its own socket; a controller's session ends, and its viewers with it.
        """
        watch = self.watch
        if watch is not None:
            if not watch.ended:
                watch.ended = True
                self._enter(Phase.CLOSING)
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
        self._enter(Phase.CLOSING)
        self.gate.closing.add(self)
        self.outbox.push(item)
        shutdown = reason is CloseReason.SERVER_SHUTDOWN
        self.gate.shares.end_viewers(session.id, CloseReason.SERVER_SHUTDOWN if shutdown else CloseReason.SESSION_ENDED)
        self._release()

    def _close_item(self, code: int, reason: CloseReason) -> QueuedClose:
        frame_reason = str(reason) if self.dialect.reason_in_close_frame else ""
        return QueuedClose(code, self.dialect.closed(self.gate, reason), frame_reason)

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
        if not await self._writer.wait_sent(timeout_s):
            log.warning("session=%s client did not take its last messages within %.1f s", self.session_id, timeout_s)

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
        gate.unstarted.discard(self.opening)  # refused, or gone before its session started
        gate.drop_claim(self.opening)  # gone between a branch's admission and its registration
        session = self.session
        if session is None:
            self._enter(Phase.CLOSED)
            return
        if self.watch is not None:
            self.watch.ended = True
            self._leave_audience()
        else:
            if self.opening.disconnected:
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
        if self.opening.disconnected:
            await self._writer.stop()
        await self.wait_sent(self.settings.shutdown_grace_s)
        if self.watch is None and session.state is not SessionState.CLOSED:
            session.transition(SessionState.CLOSED)
        self._enter(Phase.CLOSED)

"""Protocol 1's start: from the upgrade to an admitted session, or a refusal.

The upgrade checks (:meth:`Opening.accept`), the ``start`` message (within
``start_timeout_s``), admission, the start image, resuming a session
(``start.resume`` or ``?resume=``), branching one and watching one. What it
hands the dialect (:mod:`arstream.app.protocol1`) is a
:class:`~arstream.app.dialect.Started` (a viewer's with the format it is served); every refusal
is an `error` then a close, bounded by ``close_timeout_s``
(:meth:`Opening.refuse`).
"""

from __future__ import annotations

import asyncio
import logging

from ..runner.pool import PoolExhausted
from ..runner.types import RewindUnavailable, StartImage
from .dialect import Dialect, OpeningPort, Started
from .protocol import (
    CLOSE_GOING_AWAY,
    CloseReason,
    ErrorCode,
    ProtocolError,
    StartMessage,
    dumps,
    error_message,
    parse_client_message,
    too_large,
)
from .resume import Forward, Resumed, ResumeRefused, token_hint
from .session import Session, SessionState
from .transfers import branch_session
from .viewers import AudienceFull, ShareRefused

log = logging.getLogger("arstream.session")


class Handshake:
    """Runs one protocol 1 socket's start on its opening (who the gate admits: its id, address, token)."""

    def __init__(self, opening: OpeningPort, dialect: Dialect) -> None:
        self.ws = opening.ws
        self.opening = opening
        self.dialect = dialect
        self.gate = opening.gate
        self.settings = opening.gate.settings
        self.metrics = opening.gate.metrics

    async def open(self) -> Started | None:
        """Accept the WebSocket and open the session its `start` asks for; None after a refusal or disconnect."""
        if not await self.opening.accept():
            return None
        start = await self._await_start()
        if start is None:
            return None
        opened = await self._open_session(start)
        if opened is not None:
            self.opening.limit_messages(self.settings.max_message_bytes)  # only `start` may carry an image
        return opened

    async def _open_session(self, start: StartMessage) -> Started | None:
        """The session `start` asks for (new, resumed, branched, or one to watch); None after refusing.

        The `start` message, which may hold megabytes of image data, lives only as long as this call.
        """
        if start.watch is not None:
            return await self._watch(start)
        if start.branch is not None:
            return await self._branch(start)
        resume_token = start.resume or self.ws.query_params.get("resume")
        if resume_token is not None:
            resumed = await self.adopt(resume_token, start)  # a resumed session keeps its own start image
            if resumed is None:
                return None
            return Started(resumed.session, resumed.next_chunk_index, resumed=True)
        # Admission is asked before the image too: a model still loading offers no images yet, and a
        # session that cannot be admitted is not worth a decode. Admitted (claimed) after it, as a decode takes
        # time; the claim and the registration have no await between them (SessionHub.admit).
        if start.image is not None and not await self._admitted(claim=False):
            return None
        start_image: StartImage | None = None
        if start.image is not None:
            start_image = await self.opening.start_image(start.image.name, start.image.data)
            if start_image is None:
                return None
        if not await self._admitted(claim=True):
            return None
        codec, quality = self._default_format(start)
        session = Session(
            self.opening.session_id,
            codec=codec,
            quality=quality,
            seed=start.seed,
            prompt=self.gate.prompts.prepare(start.prompt),
            max_pending_ticks=self.settings.max_pending_ticks,
            start_image=start_image,
        )
        self._record(session, start)
        session.transition(SessionState.ACTIVE)
        return Started(session)

    def _record(self, session: Session, start: StartMessage) -> None:
        """Whether the session is recorded: the operator records all, or its start asks (and recording is on)."""
        if self.settings.record_dir is not None and (self.settings.record_all or start.record):
            session.record_to = self.gate.shares.token(session.id)

    def _default_format(self, start: StartMessage) -> tuple[str, int]:
        quality = start.quality or self.settings.default_jpeg_quality(self.gate.model_card)
        return start.codec or self.settings.codec, quality

    async def _shared_session(self, token: str) -> str | None:
        """The session a share token names (PROTOCOL.md, "Rewind, branch and watch"), or None after refusing
        with share_failed; the URL's ``?share=``, when given, must name the same token."""
        url_token = self.ws.query_params.get("share")
        try:
            if url_token is not None and url_token != token:
                raise ShareRefused("the URL's ?share= and the start message name different share tokens")
            return self.gate.shares.find(token)
        except ShareRefused as exc:
            log.info("session=%s share token %s refused: %s", self.opening.session_id, token_hint(token), exc)
            await self.opening.refuse(ErrorCode.SHARE_FAILED, str(exc))
            return None

    async def _watch(self, start: StartMessage) -> Started | None:
        """Watch another socket's session (PROTOCOL.md, "Rewind, branch and watch"): the live session joins its
        audience as it starts, served the format this returns."""
        assert start.watch is not None
        if self.settings.max_viewers_per_session == 0:
            await self.opening.refuse(ErrorCode.SHARE_FAILED, "watching is off on this server (max_viewers_per_session 0)")
            return None
        session_id = await self._shared_session(start.watch)
        if session_id is None:
            return None
        controller = self.gate.controller(session_id)
        session = controller.session if controller is not None else None
        if session is None or not session.live:
            await self.opening.refuse(
                ErrorCode.SHARE_FAILED, "the shared session is not live (ended, or its player is reconnecting)"
            )
            return None
        shares = self.gate.shares
        try:
            served = shares.served_format(session.id, self._default_format(start), (session.codec, session.quality))
            shares.check_room(session.id)
        except AudienceFull as exc:
            await self.opening.refuse(ErrorCode.OVER_CAPACITY, str(exc))
            return None
        return Started(session, watch_format=served)

    async def _branch(self, start: StartMessage) -> Started | None:
        """A new session from another's chunk boundary (PROTOCOL.md, "Rewind, branch and watch")."""
        assert start.branch is not None
        asked = start.branch.chunk  # None: the latest boundary, where the source is when the branch is made
        source_id = await self._shared_session(start.branch.share)
        if source_id is None:
            return None
        holder = self.gate.controller(source_id)  # connected, or else detached (or gone)
        source = holder.session if holder is not None else self.gate.resume.detached_session(source_id)
        if source is None:
            await self.opening.refuse(ErrorCode.SHARE_FAILED, "the shared session has ended")
            return None
        # The slot is claimed before the branch is made, and held until the session is registered: made first,
        # each branch of a burst would make room in the runner, which evicts its least recently used sessions,
        # ones that live connections hold.
        if not await self._admitted(claim=True, hold=True):
            return None
        worker = self.gate.worker
        assert worker is not None
        new_id = self.opening.session_id
        where = "its latest chunk" if asked is None else f"chunk {asked}"
        try:
            boundary = await branch_session(worker, source_id, asked, new_id)
        except (RewindUnavailable, PoolExhausted) as exc:
            self.gate.drop_claim(self.opening)
            if isinstance(exc, PoolExhausted):
                await self.opening.refuse(ErrorCode.OVER_CAPACITY, f"no room in the KV pool for a branch: {exc}")
            else:
                log.info("session=%s branch from %s refused: %s", new_id, where, exc)
                await self.opening.refuse(ErrorCode.SHARE_FAILED, f"cannot branch from {where}: {exc}")
            return None
        except BaseException:
            self.gate.drop_claim(self.opening)
            worker.drop_session(new_id)  # gone while the worker made it (cancelled): nothing of it stays
            raise
        self.metrics.branches.inc()
        codec, quality = self._default_format(start)
        session = Session(
            new_id,
            codec=codec,
            quality=quality,
            seed=source.seed,
            prompt=self.gate.prompts.prepare(start.prompt) if start.prompt is not None else source.prompt,
            max_pending_ticks=self.settings.max_pending_ticks,
            start_image=source.start_image,
        )
        self._record(session, start)
        session.transition(SessionState.ACTIVE)
        log.info("session=%s branched from %s at chunk %d", new_id, source_id, boundary)
        return Started(session, boundary, branched_from=boundary)

    async def _admitted(self, *, claim: bool, hold: bool = False) -> bool:
        """Whether a new session may start now; False after refusing with over_capacity.

        ``claim``: admit it (detached sessions give way, see SessionHub.admit); else only ask. ``hold``: keep
        the slot claimed across awaits until the session is registered (SessionHub.claim).
        """
        gate, live = self.gate, self.opening
        if claim:
            refusal = gate.claim(live) if hold else gate.admit(live)
        else:
            refusal = gate.admission_refusal() or gate.client_cap_refusal(live)
        if refusal is None:
            return True
        log.info("session=%s not admitted: %s", live.session_id, refusal)
        await self.opening.refuse(ErrorCode.OVER_CAPACITY, refusal)
        return False

    async def adopt(self, token: str, start: StartMessage) -> Resumed | None:
        """The session ``token`` resumes (PROTOCOL.md, "Resume ..."), or None after refusing with resume_failed.

        Also the realtime video dialect's resume (its ``session.start`` with ``resume``): a redirect and every
        refusal are in the live session's dialect."""
        url_token = self.ws.query_params.get("resume")
        live = self.opening
        try:
            if start.resume is not None and url_token is not None and url_token != start.resume:
                raise ResumeRefused("the URL's ?resume= and start.resume name different tokens")
            forward = await self._moved_to(token)
            if forward is not None:
                await self.redirect(forward)
                return None
            session_id = self.gate.resume.lookup(token, live.token_key)
            holder = self.gate.controller(session_id)
            held = holder.session if holder is not None else self.gate.resume.detached_session(session_id)
            if held is not None and not self.dialect.owns(held):
                raise ResumeRefused("the token names a session of another wire dialect: resume it where it started")
            # A resume passes the same admission as a new session; refused, it spends nothing.
            refusal = self.gate.admit(live, resuming=session_id)
            if refusal is not None:
                hint = token_hint(token)
                log.info("session=%s resume with token %s not admitted: %s", live.session_id, hint, refusal)
                self.metrics.resumes.labels(outcome="refused").inc()
                await self.opening.refuse(ErrorCode.OVER_CAPACITY, refusal)
                return None
            resumed = await self.gate.resume.resume(token, live, codec=start.codec, quality=start.quality)
        except ResumeRefused as exc:
            log.info("session=%s resume with token %s refused: %s", live.session_id, token_hint(token), exc)
            self.metrics.resumes.labels(outcome="refused").inc()
            await self.opening.refuse(ErrorCode.RESUME_FAILED, str(exc))
            return None
        self.metrics.resumes.labels(outcome="resumed").inc()
        return resumed

    async def _moved_to(self, token: str) -> Forward | None:
        """Where the session ``token`` names went, if a drain moved it (or is moving it now: wait for that).

        While the replica drains nothing is claimed here (the drain may be shipping the session), so a resume
        waits for the session's move to settle and then follows it; a session the drain could not move has
        ended, and the resume is refused saying so.
        """
        resume = self.gate.resume
        forward = resume.forwarded(token)
        if forward is not None or not self.gate.draining:
            return forward
        session_id = resume.lookup(token, self.opening.token_key)  # an unknown token is refused as ever
        await resume.until_gone(session_id, self.settings.drain_timeout_s)
        forward = resume.forwarded(token)
        if forward is None:
            raise ResumeRefused("this replica is draining and could not move the session to a peer; start a new one")
        return forward

    async def redirect(self, forward: Forward) -> None:
        """Answer a resume of a session that moved: `moved` with the peer's token, `closed` (moved), 1001."""
        log.info("session=%s resume answered with moved (%s)", self.opening.session_id, token_hint(forward.resume))
        self.metrics.resumes.labels(outcome="moved").inc()
        dialect = self.dialect
        texts = [dialect.moved(forward.resume, forward.next_chunk_index)]
        last = dialect.closed(self.gate, CloseReason.MOVED)
        await self.opening.send_then_close(texts if last is None else [*texts, last], CLOSE_GOING_AWAY)

    # ---- the start message ----------------------------------------------------------------

    async def _await_start(self) -> StartMessage | None:
        """The `start` message, or None after refusing the connection (or on disconnect)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.start_timeout_s
        while True:
            delay = self.opening.budget.delay(loop.time())
            if delay > 0:
                await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
            try:
                message = await asyncio.wait_for(self.ws.receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                await self.opening.refuse(
                    ErrorCode.START_REQUIRED, f"no start message within {self.settings.start_timeout_s} s"
                )
                return None
            if message["type"] == "websocket.disconnect":
                self.opening.disconnected = True
                return None
            text = message.get("text")
            if text is None:
                await self.opening.refuse(ErrorCode.START_REQUIRED, "the first message must be a start text message")
                return None
            limit = self.gate.start_message_bytes
            if too_large(text, limit):
                with_image = " (max_message_bytes plus a base64 start image)" if self.gate.start_image_names else ""
                detail = f"start messages are limited to {limit} bytes{with_image}"
                await self.opening.refuse(ErrorCode.MESSAGE_TOO_LARGE, detail)
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
                        await self.opening.refuse(
                            ErrorCode.START_REQUIRED, f"no start message within {self.settings.start_timeout_s} s"
                        )
                        return None
                    continue
                await self.opening.refuse(ErrorCode.START_REQUIRED, f"the first message must be start ({exc.message})")
                return None
            if not isinstance(parsed, StartMessage):
                await self.opening.refuse(ErrorCode.START_REQUIRED, f"the first message must be start, got {parsed.type}")
                return None
            return parsed


"""Resume after a dropped connection (PROTOCOL.md, "Resume after a dropped connection").

Every started session has one *ticket*: a one-use token that ``ready`` hands
the client. When the connection drops while the session is live, the session
is *detached*: the worker drops its queued ticks but keeps its KV and model
state, and the registry keeps its protocol state (the :class:`Session`) for
``resume_grace_s``. A new connection that presents the current token adopts
it (:meth:`ResumeRegistry.resume`); if the old connection is still open (a
half-open socket) it is taken over. Anything else ends as on close: grace
expiry, the server shutting down, or a new session needing the slot (the
longest-detached session goes first). Each of those releases the KV through
:meth:`ModelWorker.drop_session`, the one release path.

Tokens are ``<replica_id>.<32 random bytes, url-safe base64>``: the prefix
lets HAProxy route a resume to the replica that holds the session, the rest
is unguessable. The registry keeps only each token's SHA-256 digest, and logs
show :func:`token_hint` (the prefix and four characters), never a whole token.

Slots: detached sessions hold KV, so they count against session capacity,
and against their client address's and token's session caps; a resume in
progress keeps its slot too. Which detached session gives way to a new one is
the hub's policy (:meth:`arstream.app.hub.SessionHub.admit`); the registry
says who holds what (:meth:`ResumeRegistry.detached`, :attr:`ResumeRegistry.resuming`)
and releases (:meth:`ResumeRegistry.release`).

Moves (app/migration.py): a draining replica takes a detached session out of
its grace timer (:meth:`ResumeRegistry.hold_for_move`) while it ships it, and
a session that reached a peer leaves a *forward* behind
(:meth:`ResumeRegistry.forward`): for ``resume_grace_s`` its old token
answers with the peer's token (``moved``) instead of a refusal, so a client
that comes back here late still follows its world. :meth:`ResumeRegistry.until_gone`
lets a resume that arrives during a drain wait for the session's move to settle.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from collections.abc import Callable, Mapping
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .protocol import excerpt
from .session import Session, SessionState
from .transfers import park_session

if TYPE_CHECKING:
    from .worker import ModelWorker

log = logging.getLogger("arstream.resume")

TOKEN_RANDOM_BYTES = 32


class Holder(Protocol):
    """Whoever holds (or is about to hold) a session, as admission and the session caps count it."""

    @property
    def session_id(self) -> str: ...

    @property
    def client_host(self) -> str: ...

    @property
    def token_key(self) -> str | None: ...


class Connection(Holder, Protocol):
    """A started socket that holds a resumable session (:class:`arstream.app.live_session.LiveSession`)."""

    @property
    def session(self) -> Session | None: ...

    def take_over(self) -> None:
        """Another socket resumed the session: end this one (taken_over); the session's KV stays."""


class ResumeRefused(Exception):
    """A resume the server cannot honour; the message says why (sent with ``resume_failed``)."""


@dataclass(frozen=True)
class Resumed:
    """A session adopted by a resuming connection, and the index its next chunk will have."""

    session: Session
    next_chunk_index: int


@dataclass
class _Entry:
    """One resumable session: attached to a live connection, or detached and waiting."""

    digest: bytes
    owner: str | None  # the auth token that started the session (its key): a resume must present the same
    connection: Connection | None = None
    session: Session | None = None  # the detached session's protocol state
    timer: asyncio.TimerHandle | None = None
    # whose caps the detached session counts against: its last connection's address and token
    client_host: str = ""
    token_key: str | None = None


@dataclass(frozen=True)
class Forward:
    """Where a moved session went: the peer's resume token and the index of its next chunk there."""

    resume: str
    next_chunk_index: int
    until: float  # time.monotonic() after which the old token is unknown again


@dataclass(frozen=True)
class HeldForMove:
    """A detached session a drain is shipping: its protocol state and whose it is."""

    session: Session
    owner: str | None
    client_host: str


@dataclass(frozen=True)
class DetachedSession:
    """A detached session and the client it counts against."""

    session_id: str
    client_host: str
    token_key: str | None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def token_hint(token: str) -> str:
    """A token as logs may show it: its replica prefix and the first four random characters, escaped
    (a client chose them: a newline must not start a forged log line)."""
    prefix, dot, rest = token.partition(".")
    return f"{excerpt(prefix, 24)}.{excerpt(rest[:4])}…" if dot else f"{excerpt(token[:4])}…"


class ResumeRegistry:
    """Tickets and detached sessions of one server; lives on the event loop (no locking)."""

    def __init__(
        self,
        *,
        replica_id: str,
        grace_s: float,
        worker: Callable[[], ModelWorker | None],
        on_release: Callable[[str], None] | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.grace_s = grace_s
        self._worker = worker
        # Told the id of each session the registry releases (the share tokens go with it, app/viewers.py).
        self._on_release = on_release
        self._entries: dict[str, _Entry] = {}  # session id -> its entry
        self._by_digest: dict[bytes, str] = {}  # current token digest -> session id
        self._detached: dict[str, None] = {}  # detached session ids, longest-detached first
        # claimed, not yet attached to the new connection: session id -> the resuming connection
        self._resuming: dict[str, Holder] = {}
        self._closed = False  # shutting down: nothing is detached any more
        self._forwards: dict[bytes, Forward] = {}  # old token digest -> where its session moved
        self._unclaimed: set[bytes] = set()  # forwards no client has come back for yet
        self._forward_claimed = asyncio.Event()
        # Futures resolved when a session's entry goes (resumed, moved, released): resumes waiting on a drain.
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}

    @property
    def enabled(self) -> bool:
        return self.grace_s > 0

    @property
    def detached_count(self) -> int:
        return len(self._detached)

    @property
    def resuming(self) -> Mapping[str, Holder]:
        """Sessions being resumed (claimed, not yet attached), by id, with the connection resuming each."""
        return self._resuming

    def detached_session(self, session_id: str) -> Session | None:
        """The protocol state of a detached session, or None when it is not detached."""
        entry = self._entries.get(session_id) if session_id in self._detached else None
        return entry.session if entry is not None else None

    def detached(self) -> list[DetachedSession]:
        """The detached sessions, longest-detached first."""
        entries = ((session_id, self._entries[session_id]) for session_id in self._detached)
        return [DetachedSession(session_id, entry.client_host, entry.token_key) for session_id, entry in entries]

    # ---- tickets ------------------------------------------------------------------------

    def ticket(self, connection: Connection, next_chunk_index: int) -> dict[str, Any] | None:
        """A fresh ticket for the connection's session (for its `ready`); None when resume is off."""
        if not self.enabled:
            return None
        session_id = connection.session_id
        token = f"{self.replica_id}.{secrets.token_urlsafe(TOKEN_RANDOM_BYTES)}"
        self._forget_entry(session_id)
        entry = _Entry(digest=_digest(token), owner=connection.token_key, connection=connection)
        self._entries[session_id] = entry
        self._by_digest[entry.digest] = session_id
        grace = int(self.grace_s) if float(self.grace_s).is_integer() else self.grace_s
        return {"token": token, "grace_s": grace, "next_chunk_index": next_chunk_index}

    def forget(self, connection: Connection) -> None:
        """The session ended through ``connection`` (closed, failed, shut down): its ticket is void."""
        entry = self._entries.get(connection.session_id)
        if entry is not None and entry.connection is connection:
            self._forget_entry(connection.session_id)

    def _forget_entry(self, session_id: str) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._by_digest.pop(entry.digest, None)
            self._detached.pop(session_id, None)
            if entry.timer is not None:
                entry.timer.cancel()
        self._wake(session_id)

    def _wake(self, session_id: str) -> None:
        for waiter in self._waiters.pop(session_id, []):
            if not waiter.done():
                waiter.set_result(None)

    # ---- moves (app/migration.py) -------------------------------------------------------------

    def hold_for_move(self, session_id: str) -> HeldForMove | None:
        """A detached session a drain is about to ship: its grace timer stops (it must not be released
        mid-move) and it stays findable by its token; None when it is not detached (any more)."""
        entry = self._entries.get(session_id) if session_id in self._detached else None
        if entry is None or entry.session is None:
            return None
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        return HeldForMove(entry.session, entry.owner, entry.client_host)

    def forward(self, session_id: str, resume: str, next_chunk_index: int) -> None:
        """The session now lives on a peer under ``resume``: its current token answers with that for the
        grace period. A detached session's KV is released here; a live one's connection releases its own."""
        entry = self._entries.get(session_id)
        if entry is not None and self.grace_s > 0:
            now = time.monotonic()
            self._forwards = {d: f for d, f in self._forwards.items() if f.until > now}  # drop the expired
            self._forwards[entry.digest] = Forward(resume, next_chunk_index, now + self.grace_s)
            if session_id in self._detached:  # a live client is told at once; a detached one has to come back
                self._unclaimed.add(entry.digest)
        detached = session_id in self._detached
        self._forget_entry(session_id)
        if detached:
            self._drop(session_id)
        log.info("session=%s moved away; its token forwards to %s", session_id, token_hint(resume))

    def forwarded(self, token: str) -> Forward | None:
        """Where the session ``token`` named has moved, within the grace period; None otherwise."""
        digest = _digest(token)
        forward = self._forwards.get(digest)
        if forward is None or forward.until <= time.monotonic():
            return None
        if digest in self._unclaimed:
            self._unclaimed.discard(digest)
            self._forward_claimed.set()
        return forward

    async def until_forwards_claimed(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every detached client whose session moved has come back for its
        new token, or the forwards have expired: a drained replica that exits sooner would leave them a 503."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            now = time.monotonic()
            self._unclaimed = {d for d in self._unclaimed if d in self._forwards and self._forwards[d].until > now}
            if not self._unclaimed:
                return
            self._forward_claimed.clear()
            try:
                await asyncio.wait_for(self._forward_claimed.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return

    async def until_gone(self, session_id: str, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the session's ticket goes (moved, released, ended, claimed by a
        resume) and no resume of it is in progress."""
        await self._wait_while(
            session_id, lambda: session_id in self._entries or session_id in self._resuming, timeout_s
        )

    async def until_resumed(self, session_id: str, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until a resume of the session in progress has its connection, or failed."""
        await self._wait_while(session_id, lambda: session_id in self._resuming, timeout_s)

    async def _wait_while(self, session_id: str, held: Callable[[], bool], timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while held() and loop.time() < deadline:
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.setdefault(session_id, []).append(waiter)
            try:
                await asyncio.wait_for(asyncio.shield(waiter), max(0.0, deadline - loop.time()))
            except TimeoutError:
                pass
            finally:
                waiters = self._waiters.get(session_id, [])
                if waiter in waiters:
                    waiters.remove(waiter)

    # ---- detaching and releasing ------------------------------------------------------------

    def detach(self, connection: Connection) -> bool:
        """The connection dropped with its session live: keep the session for the grace period.

        Returns False (the caller releases the session) when it is not to be
        kept: resume is off, the server is shutting down, or the session was
        ending anyway (a close: true tick, a fatal error).
        """
        session = connection.session
        entry = self._entries.get(connection.session_id)
        if session is None or entry is None or entry.connection is not connection or self._closed:
            return False
        if session.state not in (SessionState.ACTIVE, SessionState.FAILED):
            return False
        worker = self._worker()
        assert worker is not None
        # The dropped ticks never run, but their controls and prompt were accepted: keep them.
        for job in worker.drop_ticks(session.id):
            session.absorb_update(job)
        park_session(worker, session.id)  # in host memory until it resumes, where there is park room
        loop = asyncio.get_running_loop()
        entry.connection = None
        entry.session = session
        entry.client_host, entry.token_key = connection.client_host, connection.token_key
        entry.timer = loop.call_later(self.grace_s, self._expire, session.id)
        self._detached[session.id] = None
        log.info("session=%s detached; resumable for %s s", session.id, self.grace_s)
        return True

    def hold_moved(self, session: Session, *, owner: str | None, client_host: str) -> str:
        """A session moved here from another replica: keep it detached for the grace period; return its token.

        The token carries this replica's prefix, so the client's reconnect with
        it is routed here; it resumes like any detached session, and is released
        like one when nobody comes for it. ``owner``: the key of the auth token
        that started it (a resume must present the same); ``client_host``: the
        client whose caps it counts against.
        """
        if not self.enabled or self._closed:
            raise ResumeRefused("this replica does not hold sessions for a resume (resume off or shutting down)")
        token = f"{self.replica_id}.{secrets.token_urlsafe(TOKEN_RANDOM_BYTES)}"
        self._forget_entry(session.id)
        entry = _Entry(digest=_digest(token), owner=owner, session=session, client_host=client_host, token_key=owner)
        entry.timer = asyncio.get_running_loop().call_later(self.grace_s, self._expire, session.id)
        self._entries[session.id] = entry
        self._by_digest[entry.digest] = session.id
        self._detached[session.id] = None
        log.info("session=%s moved here; resumable for %s s with token %s", session.id, self.grace_s, token_hint(token))
        return token

    def _expire(self, session_id: str) -> None:
        self.release(session_id, "its grace period ended")

    def release(self, session_id: str, why: str) -> None:
        """End a detached session (its token is void) and give its KV back; nothing if it is not detached."""
        if session_id not in self._detached:
            return
        self._forget_entry(session_id)
        self._drop(session_id)
        log.info("session=%s released while detached: %s", session_id, why)

    def _drop(self, session_id: str) -> None:
        """Give a session's KV back on the worker, and its share tokens with it."""
        worker = self._worker()
        assert worker is not None
        worker.drop_session(session_id)
        if self._on_release is not None:
            self._on_release(session_id)

    def release_all(self) -> None:
        """Server shutdown: release every detached session, and detach no more."""
        self._closed = True
        for session_id in list(self._detached):
            self.release(session_id, "the server is shutting down")

    # ---- resuming ---------------------------------------------------------------------------

    async def resume(
        self, token: str, connection: Holder, *, codec: str | None, quality: int | None
    ) -> Resumed:
        """Adopt the session that ``token`` names for ``connection``; raises :class:`ResumeRefused`.

        The token is spent at once (one use). A live holder is taken over. Then,
        at the worker's next chunk boundary, the session's queued ticks are gone
        and nothing of it runs, so its position is exact. Outcomes of the old
        connection's ticks never reach the new one: they belong to another
        :class:`Session` object, which ``LiveSession.on_outcome`` ignores.
        """
        session_id, entry = self._claim(token, connection.token_key)
        worker = self._worker()
        assert worker is not None
        self._resuming[session_id] = connection
        try:
            source = self._take(session_id, entry)
            for job in worker.drop_ticks(session_id):
                source.absorb_update(job)
            position = await worker.session_position(session_id)
            if position.evicted:
                raise ResumeRefused("the session's KV was evicted; start a new session")
            own_codec, own_quality = source.own_format
            session = source.carry_over(codec=codec or own_codec, quality=quality or own_quality, failed=position.failed)
        except BaseException:
            # Nobody holds a ticket for it any more: release it rather than leak its KV.
            self._drop(session_id)
            raise
        finally:
            self._resuming.pop(session_id, None)
            self._wake(session_id)
        log.info(
            "session=%s resumed with token %s at chunk %d", session_id, token_hint(token), position.next_chunk_index
        )
        return Resumed(session, position.next_chunk_index)

    def lookup(self, token: str, token_key: str | None) -> str:
        """The id of the session ``token`` would resume, spending nothing; raises :class:`ResumeRefused`.

        For admission: the caller checks its caps for that session, then calls
        :meth:`resume` without awaiting in between, so the answer still holds.
        """
        return self._find(token, token_key)[0]

    def _claim(self, token: str, token_key: str | None) -> tuple[str, _Entry]:
        """Spend ``token``: the session it names and that session's entry, or :class:`ResumeRefused`."""
        session_id, entry = self._find(token, token_key)
        self._forget_entry(session_id)
        return session_id, entry

    def _find(self, token: str, token_key: str | None) -> tuple[str, _Entry]:
        """The session ``token`` names and its entry, if it can be resumed now, else :class:`ResumeRefused`.

        ``token_key`` names the auth token the resuming connection presented: another tenant's is refused,
        and the resume token stays good for its owner."""
        if not self.enabled:
            raise ResumeRefused("resume is disabled on this server (resume_grace_s is 0)")
        prefix, dot, _ = token.partition(".")
        if not dot:
            raise ResumeRefused("malformed resume token (expected REPLICA.RANDOM)")
        if prefix != self.replica_id:
            raise ResumeRefused(
                f"the resume token belongs to replica '{excerpt(prefix, 24)}'; this is {self.replica_id!r}"
            )
        session_id = self._by_digest.get(_digest(token))
        if session_id is None:
            raise ResumeRefused("unknown resume token: expired, already used, or the session has ended")
        entry = self._entries[session_id]
        if entry.owner != token_key:
            raise ResumeRefused("a resume must present the auth token that started the session")
        if entry.session is None:
            holder = entry.connection
            session = holder.session if holder is not None else None
            # A session closing on its own (a close: true tick, a fatal error) keeps its connection.
            if session is None or session.state not in (SessionState.ACTIVE, SessionState.FAILED):
                raise ResumeRefused("the session is closing")
        return session_id, entry

    @staticmethod
    def _take(session_id: str, entry: _Entry) -> Session:
        """The session to carry over: the detached one, or the live one once its connection is taken over."""
        if entry.session is not None:
            return entry.session
        holder = entry.connection
        assert holder is not None and holder.session is not None
        log.info("session=%s taken over by a resuming connection", session_id)
        holder.take_over()
        return holder.session

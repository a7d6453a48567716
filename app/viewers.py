"""Watching a live session: share tokens, each session's viewers, and chunks fanned out to them.

A started session gets a *share token* (``ready.share``): a read-only
capability to watch it or branch from it, never to control it. Tokens look
like resume tokens, ``<replica_id>.<32 random bytes, url-safe base64>`` (the
prefix routes ``?share=`` to the replica that holds the session); the
registry finds them by SHA-256 digest and logs show only a
:func:`~arstream.app.resume.token_hint`. A token is good while its session
lives (across resumes); it is forgotten when the session is released.

Viewers of a session form its :class:`Audience`. Every chunk the controller
gets is offered to each viewer as a :class:`~arstream.app.outbox.ViewerChunk`:
viewers whose codec and quality match the controller's stateless encoding
(JPEG, raw) share its frame messages; every other format in use is encoded
once per chunk for all the viewers that asked for it (:meth:`ShareRegistry.formats_needed`),
as a stream of its own that starts at the chunk (for H.264: a keyframe first),
so a viewer can join, or skip chunks, anywhere. A viewer's outbox keeps at
most a couple of chunks; a viewer that falls behind has whole chunks skipped
and is told how many (``skipped_before``). Nothing a viewer does waits the
controller or the worker.

Each format encoded costs CPU time on every chunk, whether or not its viewers
read, so a session has at most ``max_viewer_encodings`` of them; a viewer that
asks for another is served the nearest one there is (:meth:`ShareRegistry.served_format`).
A viewer that takes nothing for ``viewer_stall_timeout_s`` is closed
``not_reading`` (:class:`ViewerRole`, the viewer role of a live session).

Viewers count in the transport's connection caps (``max_connections``,
``max_connections_per_client``) and in ``max_viewers_per_session``; they hold
no KV, so the session caps and admission do not count them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from . import wire
from .outbox import Outbox, ViewerChunk
from .protocol import CLOSE_GOING_AWAY, CLOSE_NORMAL, CloseReason, dumps, excerpt, viewers_message
from .resume import TOKEN_RANDOM_BYTES, token_hint
from .session import Session

log = logging.getLogger("arstream.viewers")

Format = tuple[str, int]  # (codec, quality)


class ShareRefused(Exception):
    """A share token the server cannot honour; the message says why (sent with ``share_failed``)."""


class Viewer(Protocol):
    """What the registry needs of a viewer (:class:`ViewerRole` in the server, fakes in unit tests)."""

    @property
    def viewer_id(self) -> str | None:
        """Its id in the audience (None: not watching)."""

    @property
    def watch_format(self) -> Format:
        """The codec and quality this viewer asked for."""

    def offer_chunk(self, chunk: ViewerChunk) -> None:
        """Queue a chunk of the watched session (older queued ones may be skipped)."""

    def skip_chunk(self) -> None:
        """A chunk went by that this viewer does not get (counted in the next one's ``skipped_before``)."""

    def notify(self, message: dict[str, Any], *, latest_of: str | None = None) -> None:
        """Queue a message; with ``latest_of``, it replaces a queued one of that kind."""

    def end_watching(self, reason: CloseReason) -> None:
        """The watched session ended: send `closed` with ``reason`` and close."""


class Notified(Protocol):
    """Whoever is told how many watch (a session's controller)."""

    def notify(self, message: dict[str, Any], *, latest_of: str | None = None) -> None: ...


class WatchingSocket(Notified, Protocol):
    """What the viewer role needs of the socket it is (:class:`arstream.app.live_session.LiveSession`)."""

    @property
    def outbox(self) -> Outbox: ...

    def check_send_backlog(self) -> None:
        """Drop the socket if it has left more than ``max_send_buffer_bytes`` untaken."""

    def close(self, code: int, reason: CloseReason) -> None:
        """Queue the last message and the close frame."""


CLOSE_POLICY_VIOLATION = 1008


class ViewerRole:
    """A live session's viewer role: which viewer it is, the format it is served, how far its watch went, and
    what only a viewer does (take the chunks offered, skip some, be closed when it stalls or stops reading).

    A role ends once: its session ended or it closed (:attr:`ended`, its close is queued), or its socket took
    control (the role is given up, and nothing it was armed with acts any more).
    """

    def __init__(
        self, socket: WatchingSocket, session_id: str, served: Format, *, stall_timeout_s: float, last_seq: int = -1
    ) -> None:
        self.socket = socket
        self.session_id = session_id
        self.format = served
        self.viewer_id = ""  # set when it joins the audience
        self.ended = False
        self.last_seq = last_seq  # its last chunk offered (Session.chunks_out): never an older one after it
        self.stall_timeout_s = stall_timeout_s
        self._stall_timer: asyncio.TimerHandle | None = None

    @property
    def watch_format(self) -> Format:
        return self.format

    def offer_chunk(self, chunk: ViewerChunk) -> None:
        if self.ended or chunk.seq <= self.last_seq:
            return
        self.last_seq = chunk.seq
        self.socket.outbox.push(chunk)
        self.socket.check_send_backlog()

    def skip_chunk(self) -> None:
        self.socket.outbox.chunks_skipped += 1

    def notify(self, message: dict[str, Any], *, latest_of: str | None = None) -> None:
        self.socket.notify(message, latest_of=latest_of)

    def end_watching(self, reason: CloseReason) -> None:
        if not self.ended:
            self.socket.close(CLOSE_GOING_AWAY if reason is CloseReason.SERVER_SHUTDOWN else CLOSE_NORMAL, reason)

    def give_up(self) -> None:
        """Its socket takes control: nothing of the role acts any more."""
        self.ended = True
        self.disarm_stall()

    def drop(self, detail: str) -> None:
        """A viewer that does not read: what it had queued goes, `closed` (not_reading) and close 1008 go next,
        and its connection is dropped ``close_timeout_s`` later unless it takes them (docs/public.md)."""
        if self.ended:
            return
        log.warning("session=%s viewer %s dropped: not reading, %s", self.session_id, self.viewer_id, detail)
        self.socket.outbox.drop_pending()
        self.socket.close(CLOSE_POLICY_VIOLATION, CloseReason.NOT_READING)

    def arm_stall(self) -> None:
        """Arm the stall bound for the item its writer is about to send (disarmed once it is sent)."""
        if not self.ended:
            timeout = self.stall_timeout_s
            self._stall_timer = asyncio.get_running_loop().call_later(
                timeout, self.drop, f"it took nothing for {timeout:g} s (viewer_stall_timeout_s)"
            )

    def disarm_stall(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None


V = TypeVar("V", bound=Viewer)  # what the registry holds: live sessions in the server, fakes in unit tests


@dataclass
class Audience(Generic[V]):
    """One shared session: its token and its viewers (in the order they joined)."""

    session_id: str
    token: str
    viewers: dict[str, V] = field(default_factory=dict)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def shares_frames(viewer: Format, controller: Format) -> bool:
    """Whether a viewer can take the controller's own frame messages: same format, and no stream state."""
    return viewer == controller and not wire.Codec.from_name(viewer[0]).stateful


def nearest_format(asked: Format, candidates: set[Format], controller: Format) -> Format:
    """The candidate nearest ``asked``: the same codec at the nearest quality, else the controller's own
    format, else the first in a fixed order."""
    same_codec = sorted((abs(quality - asked[1]), quality) for codec, quality in candidates if codec == asked[0])
    if same_codec:
        return (asked[0], same_codec[0][1])
    return controller if controller in candidates else min(candidates)


class ShareRegistry(Generic[V]):
    """Share tokens and audiences of one server; lives on the event loop (no locking)."""

    def __init__(self, *, replica_id: str, max_viewers_per_session: int, max_viewer_encodings: int) -> None:
        self.replica_id = replica_id
        self.max_viewers_per_session = max_viewers_per_session
        self.max_viewer_encodings = max_viewer_encodings
        self._audiences: dict[str, Audience[V]] = {}  # session id -> its audience
        self._by_digest: dict[bytes, str] = {}  # token digest -> session id

    @property
    def viewer_count(self) -> int:
        return sum(len(audience.viewers) for audience in self._audiences.values())

    def token(self, session_id: str) -> str:
        """The session's share token (made on first use; the same after a resume)."""
        audience = self._audiences.get(session_id)
        if audience is None:
            token = f"{self.replica_id}.{secrets.token_urlsafe(TOKEN_RANDOM_BYTES)}"
            audience = self._audiences[session_id] = Audience[V](session_id, token)
            self._by_digest[_digest(token)] = session_id
        return audience.token

    def find(self, token: str) -> str:
        """The id of the session ``token`` shares; raises :class:`ShareRefused`."""
        prefix, dot, _ = token.partition(".")
        if not dot:
            raise ShareRefused("malformed share token (expected REPLICA.RANDOM)")
        if prefix != self.replica_id:
            raise ShareRefused(f"the share token belongs to replica '{excerpt(prefix, 24)}'; this is {self.replica_id!r}")
        session_id = self._by_digest.get(_digest(token))
        if session_id is None:
            raise ShareRefused("unknown share token: the session has ended, or never was")
        return session_id

    def forget(self, session_id: str) -> None:
        """The session was released: its token is void (its viewers were ended already)."""
        audience = self._audiences.pop(session_id, None)
        if audience is not None:
            self._by_digest.pop(_digest(audience.token), None)
            for viewer in list(audience.viewers.values()):
                viewer.end_watching(CloseReason.SESSION_ENDED)
            log.info("session=%s share token %s void", session_id, token_hint(audience.token))

    # ---- viewers --------------------------------------------------------------------

    def viewers(self, session_id: str) -> Mapping[str, V]:
        audience = self._audiences.get(session_id)
        return audience.viewers if audience is not None else {}

    def join(self, session_id: str, viewer: V, *, cap: bool = True) -> str:
        """Add a viewer to the session's audience; returns its new viewer id. Raises :class:`ShareRefused`
        when the session is not shared, and :class:`AudienceFull` past ``max_viewers_per_session`` (with
        ``cap``; a controller that passed control becomes a viewer whatever the count)."""
        audience = self._audiences.get(session_id)
        if audience is None:
            raise ShareRefused("the session has ended")
        if cap:
            self.check_room(session_id)
        viewer_id = "v" + secrets.token_hex(6)
        audience.viewers[viewer_id] = viewer
        return viewer_id

    def leave(self, session_id: str, viewer_id: str) -> bool:
        """Take a viewer out of the audience; False if it was not in it."""
        audience = self._audiences.get(session_id)
        return audience is not None and audience.viewers.pop(viewer_id, None) is not None

    def end_viewers(self, session_id: str, reason: CloseReason) -> None:
        """The session's controller connection ended: every viewer gets `closed` (``reason``)."""
        audience = self._audiences.get(session_id)
        if audience is None:
            return
        viewers, audience.viewers = list(audience.viewers.values()), {}
        for viewer in viewers:
            viewer.end_watching(reason)

    def served_format(self, session_id: str, asked: Format, controller: Format) -> Format:
        """The format a new viewer that asked for ``asked`` is served: its own, unless that would be one more
        encode per chunk than ``max_viewer_encodings`` (each is CPU time on every chunk, whether or not its
        viewers read); then the nearest one already there (:func:`nearest_format`). Raises
        :class:`AudienceFull` when there is none (no encoding allowed, and the controller's frames are a
        stream of their own)."""
        encoded = self.formats_needed(session_id, controller)
        if shares_frames(asked, controller) or asked in encoded or len(encoded) < self.max_viewer_encodings:
            return asked
        candidates = set(encoded) | ({controller} if shares_frames(controller, controller) else set())
        if not candidates:
            raise AudienceFull(
                f"no format for another viewer: the session's viewers have {len(encoded)} encodings "
                f"(max_viewer_encodings {self.max_viewer_encodings}) and its player's {controller[0]} frames "
                "cannot be shared"
            )
        return nearest_format(asked, candidates, controller)

    def formats_needed(self, session_id: str, controller: Format) -> frozenset[Format]:
        """The formats the session's viewers need encoded apart from the controller's frames."""
        return frozenset(
            v.watch_format for v in self.viewers(session_id).values() if not shares_frames(v.watch_format, controller)
        )

    def offer(
        self, session_id: str, header: dict[str, Any], seq: int, encoded: Mapping[Format, tuple[bytes, ...]]
    ) -> None:
        """Offer chunk number ``seq`` to every viewer whose format is in ``encoded``."""
        text = dumps({**header, "skipped_before": 0})
        for viewer in list(self.viewers(session_id).values()):
            frames = encoded.get(viewer.watch_format)
            if frames is not None:
                viewer.offer_chunk(ViewerChunk(header, text, frames, seq))

    def skip(self, session_id: str, formats: frozenset[Format]) -> None:
        """A chunk was not encoded in ``formats``: their viewers count it as skipped."""
        for viewer in self.viewers(session_id).values():
            if viewer.watch_format in formats:
                viewer.skip_chunk()

    def check_room(self, session_id: str) -> None:
        """Raises :class:`AudienceFull` when the session has ``max_viewers_per_session`` viewers already."""
        audience = self._audiences.get(session_id)
        if audience is not None and len(audience.viewers) >= self.max_viewers_per_session:
            raise AudienceFull(
                f"the session already has {len(audience.viewers)} viewers "
                f"(max_viewers_per_session {self.max_viewers_per_session})"
            )

    def audience_changed(self, session: Session, controller: Notified | None) -> None:
        """Viewers came or went, or control passed: say so to everyone, and re-plan the viewers' formats."""
        self.announce(session.id, controller)
        session.viewer_formats = self.formats_needed(session.id, (session.codec, session.quality))
        session.viewer_count = len(self.viewers(session.id))

    def announce(self, session_id: str, controller: Notified | None) -> None:
        """Tell everyone how many viewers there are; the controller also gets their ids (to pass control)."""
        viewers = self.viewers(session_id)
        message = viewers_message(len(viewers))
        for viewer in viewers.values():
            viewer.notify(message, latest_of="viewers")
        if controller is not None:
            controller.notify(viewers_message(len(viewers), list(viewers)), latest_of="viewers")


class AudienceFull(ShareRefused):
    """The session has ``max_viewers_per_session`` viewers (refused with over_capacity)."""

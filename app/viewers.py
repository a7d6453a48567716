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
``not_reading`` (:mod:`arstream.app.live_session`).

Viewers count in the transport's connection caps (``max_connections``,
``max_connections_per_client``) and in ``max_viewers_per_session``; they hold
no KV, so the session caps and admission do not count them.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from . import wire
from .outbox import ViewerChunk
from .protocol import CloseReason, dumps, excerpt, viewers_message
from .resume import TOKEN_RANDOM_BYTES, token_hint

log = logging.getLogger("arstream.viewers")

Format = tuple[str, int]  # (codec, quality)


class ShareRefused(Exception):
    """A share token the server cannot honour; the message says why (sent with ``share_failed``)."""


class Viewer(Protocol):
    """What the registry needs of a watching socket (:class:`arstream.app.live_session.LiveSession` in its viewer role)."""

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
        if cap and len(audience.viewers) >= self.max_viewers_per_session:
            raise AudienceFull(
                f"the session already has {len(audience.viewers)} viewers "
                f"(max_viewers_per_session {self.max_viewers_per_session})"
            )
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

    def announce(self, session_id: str, controller: V | None) -> None:
        """Tell everyone how many viewers there are; the controller also gets their ids (to pass control)."""
        viewers = self.viewers(session_id)
        message = viewers_message(len(viewers))
        for viewer in viewers.values():
            viewer.notify(message, latest_of="viewers")
        if controller is not None:
            controller.notify(viewers_message(len(viewers), list(viewers)), latest_of="viewers")


class AudienceFull(ShareRefused):
    """The session has ``max_viewers_per_session`` viewers (refused with over_capacity)."""

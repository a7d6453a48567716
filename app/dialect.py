"""A wire dialect: what one WebSocket path says, over the one session lifecycle of :mod:`arstream.app.live_session`.

A :class:`~arstream.app.live_session.LiveSession` owns everything a started
session is on one socket (the session, its outbox and writer, in-flight ticks
and credits, the idle clock, budgets, release and finish). What differs
between protocol 1 (:mod:`arstream.app.protocol1`) and vLLM-Omni's realtime
video (:mod:`arstream.app.realtime_video`) is only the wire, and that is a
:class:`Dialect`: how a session starts, what a text message means, what
``ready``, a chunk, an error and the last message look like, and whether its
sessions can follow a move to a peer. Dialects are found by path in
:mod:`arstream.app.dialects`.

A dialect reaches admission and the registries through a :class:`Gate` (the
hub is one), never the hub itself: everything it may ask is named here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import asyncio

    import jsonschema
    import numpy as np

    from .live_session import LiveSession
    from .metrics import ServerMetrics
    from .resume import ResumeRegistry
    from .session import Session
    from .settings import Settings
    from .prompts import PromptPreparer
    from .start_image import StartImageResolver
    from .unstarted import UnstartedConnections
    from .viewers import ShareRegistry
    from .protocol import CloseReason
    from .session import TickJob
    from .worker import OnWorkerThread, TickOutcome


_T = TypeVar("_T")


@dataclass(frozen=True)
class Started:
    """A session a dialect's start admitted: the session (ACTIVE), and the index its next chunk will have."""

    session: Session
    next_chunk_index: int = 0
    resumed: bool = False
    branched_from: int | None = None  # the source's chunk boundary, for a branch


class SessionWorker(Protocol):
    """The worker's verbs a live session uses (:class:`arstream.app.worker.ModelWorker`)."""

    def submit(self, job: TickJob) -> None:
        """Queue an accepted tick; its outcome comes to ``job.session.deliver``."""

    def drop_session(self, session_id: str) -> int:
        """Release the session (its KV, its queued ticks); how many ticks were dropped."""

    def drop_ticks(self, session_id: str) -> tuple[TickJob, ...]:
        """Take the session's queued ticks back (they will not run); the session stays."""

    def call(self, function: Callable[[OnWorkerThread], _T], *, lane: str | None = None) -> asyncio.Future[_T]:
        """Run ``function`` on the worker's thread (a branch: app/transfers.py); its result resolves the future."""

    def encode_for_viewers(
        self,
        session_id: str,
        frames: np.ndarray,
        formats: frozenset[tuple[str, int]],
        *,
        chunk_index: int,
        tick_id: int,
        deliver: Callable[[dict[tuple[str, int], tuple[bytes, ...]]], None],
    ) -> None:
        """Encode a chunk once per format for the session's viewers, off the loop."""


class Gate(Protocol):
    """What a live session and its dialect may ask of the server (:class:`arstream.app.hub.SessionHub`)."""

    settings: Settings
    metrics: ServerMetrics
    ready: bool
    not_ready_reason: str
    draining: bool
    model_card: dict[str, Any]
    controls_validator: jsonschema.protocols.Validator | None
    start_image_names: tuple[str, ...]
    start_images: StartImageResolver
    prompts: PromptPreparer  # a prompt as the model reads it, prepared once as it arrives
    # the registries: who waits to start, who is closing, tickets and detached sessions, share tokens and viewers
    unstarted: UnstartedConnections
    closing: set[LiveSession]
    resume: ResumeRegistry
    shares: ShareRegistry[LiveSession]

    @property
    def worker(self) -> SessionWorker | None: ...

    @property
    def start_message_bytes(self) -> int: ...

    @property
    def rewind_points(self) -> int: ...

    @property
    def rewind_seconds(self) -> float: ...

    # ---- admission (SessionHub documents each) ----

    def admission_refusal(self, resuming: str | None = None) -> str | None: ...

    def client_cap_refusal(self, holder: LiveSession, resuming: str | None = None) -> str | None: ...

    def admit(self, holder: LiveSession, resuming: str | None = None) -> str | None: ...

    def claim(self, holder: LiveSession) -> str | None: ...

    def drop_claim(self, holder: LiveSession) -> None: ...

    def transfer_refusal(self, holder: LiveSession, session_id: str) -> str | None: ...

    # ---- the sessions served here ----

    def register(self, live: LiveSession) -> None: ...

    def unregister(self, live: LiveSession) -> None: ...

    def controller(self, session_id: str) -> LiveSession | None:
        """The live session that controls ``session_id`` here, or None."""

    def live_or_detached_session(self, session_id: str) -> Session | None: ...


class Dialect:
    """One socket's wire dialect; subclass it and override what your wire says (see the module docstring).

    One instance serves one socket. Every method gets the :class:`LiveSession` it speaks for.
    """

    # Whether its sessions can follow a drain to a peer (it has a message that says where they went).
    can_move = False
    # The error that ends a session idle for ``idle_timeout_s`` (formatted with ``seconds``).
    idle_detail = "no tick or input for {seconds} s while no tick was queued or running"
    # The close code of that end (None: ``idle_timeout``'s own, 4001).
    idle_close_code: int | None = None
    # Its sessions' chunks made and not yet written, at most, before the worker starts the next (None: no bound,
    # the client's own ticks in flight decide). A dialect whose server ticks for the client bounds it, so that an
    # input binds to a chunk that starts soon after it, not behind chunks made long before it is seen.
    chunks_ahead: int | None = None
    # Whether the close frame carries the close reason too (protocol 1's `closed` reason).
    reason_in_close_frame = True

    def __init__(self) -> None:
        self.session_id = ""  # set by the subclass: the id its sessions get (logs, /v1/stats)

    async def start(self, live: LiveSession) -> Started | None:
        """From the accepted socket to an admitted session (or None, after ``live.refuse`` or a disconnect)."""
        raise NotImplementedError

    def ready(self, live: LiveSession, started: Started) -> None:
        """The session is registered and its writer runs: queue what tells the client it started."""
        raise NotImplementedError

    def text_in(self, live: LiveSession, text: str | None) -> None:
        """A message from the client, read while the session is live (``None``: a binary message)."""
        raise NotImplementedError

    def outcome(self, live: LiveSession, outcome: TickOutcome) -> None:
        """A tick of the session is done (its bookkeeping is done): queue its chunk, or say what failed."""
        raise NotImplementedError

    async def send_chunk(self, live: LiveSession, outcome: TickOutcome) -> None:
        """On the writer: send one chunk (its credit comes back after), then :meth:`chunk_sent`."""
        raise NotImplementedError

    def chunk_sent(self, live: LiveSession) -> None:
        """A chunk and its credit are back (the server may tick on, or end a finite session)."""

    def error(self, code: str, message: str, *, tick_id: int | None = None) -> dict[str, Any]:
        """The dialect's error object."""
        raise NotImplementedError

    def closed(self, live: LiveSession, reason: CloseReason) -> str | None:
        """The session is closing with ``reason``: the last text before the close frame, or None."""
        return None

    def owns(self, session: Session) -> bool:
        """Whether ``session`` is one of this dialect's (a resume here may adopt it): protocol 1 keeps no state
        of its own (``Session.dialect_state``), other dialects say which is theirs."""
        return session.dialect_state is None

    def moved(self, resume: str, next_chunk_index: int) -> str:
        """The text that tells a client its session moved to a peer (only where :attr:`can_move`)."""
        raise NotImplementedError(f"{type(self).__name__} sessions cannot move")

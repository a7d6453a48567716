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

A dialect talks to two small ports, never to the live session itself: its start
gets an :class:`OpeningPort` (the socket before its session: accept, refuse,
the start image), every later hook a :class:`SessionPort` (the started session:
queue, submit, close, pass control). Both reach admission and the registries
through a :class:`Gate` (the hub is one): everything a dialect may ask is named here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .viewers import Notified

if TYPE_CHECKING:
    import asyncio

    import jsonschema
    import numpy as np
    from starlette.websockets import WebSocket

    from .limits import TokenBucket
    from .metrics import ServerMetrics
    from .outbox import Outbox, ViewerChunk
    from .protocol import CloseReason, ErrorCode
    from .resume import Holder, ResumeRegistry
    from .session import Session, TickJob
    from .settings import Settings
    from .prompts import PromptPreparer
    from .start_image import StartImageResolver
    from .unstarted import UnstartedConnections
    from .viewers import ShareRegistry, ViewerRole
    from .worker import OnWorkerThread, TickOutcome
    from ..runner.types import StartImage


_T = TypeVar("_T")


@dataclass(frozen=True)
class Started:
    """A session a dialect's start admitted: the session (ACTIVE), and the index its next chunk will have.

    With ``watch_format``, the socket watches the session (served in that format) instead of controlling it."""

    session: Session
    next_chunk_index: int = 0
    resumed: bool = False
    branched_from: int | None = None  # the source's chunk boundary, for a branch
    watch_format: tuple[str, int] | None = None
    resumable: bool = True  # whether the session gets a resume ticket (None where resume is off)
    ticket: dict[str, Any] | None = None  # its ticket, made by the live session as it registers it


@dataclass(frozen=True)
class Passed:
    """Control passed (:meth:`SessionPort.pass_control`): who controls now, its resume ticket, and the id the
    old controller watches under."""

    to: SessionPort
    resume: dict[str, Any] | None
    viewer_id: str


@dataclass(frozen=True)
class ChunkSent:
    """What :meth:`Dialect.send_chunk` sent of one chunk, by path: its video frames and the bytes of its binary
    WebSocket messages (``on_track``: the frames went on a WebRTC track, and no binary message carried them)."""

    frames: int
    websocket_bytes: int
    on_track: bool = False


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

    def recording_pauses(self, session_id: str) -> None:
        """The session stopped recording: its file ends after the chunks already on their way."""


class Controller(Notified, Protocol):
    """The socket that controls a session here, as a dialect sees it."""

    @property
    def session(self) -> Session | None: ...


class Gate(Protocol):
    """What a dialect may ask of the server (:class:`arstream.app.hub.SessionHub`)."""

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
    # the registries: who waits to start, tickets and detached sessions, share tokens and viewers
    unstarted: UnstartedConnections
    resume: ResumeRegistry
    shares: ShareRegistry[ViewerRole]

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

    def client_cap_refusal(self, holder: Holder, resuming: str | None = None) -> str | None: ...

    def admit(self, holder: Holder, resuming: str | None = None) -> str | None: ...

    def claim(self, holder: Holder) -> str | None: ...

    def drop_claim(self, holder: Holder) -> None: ...

    # ---- the sessions served here ----

    def controller(self, session_id: str) -> Controller | None:
        """The socket that controls ``session_id`` here, or None."""


class OpeningPort(Protocol):
    """What a dialect's start may do with the socket before its session starts (:class:`arstream.app.opening.Opening`).

    It is also who admission counts (a :class:`~arstream.app.resume.Holder`) until the session is registered."""

    ws: WebSocket
    gate: Gate
    budget: TokenBucket  # the client's message rate, from its upgrade on
    disconnected: bool  # the client went away (set by whoever reads its disconnect)

    @property
    def session_id(self) -> str: ...

    @property
    def client_host(self) -> str: ...

    @property
    def token_key(self) -> str | None: ...

    async def accept(self) -> bool:
        """Run the upgrade checks and accept the socket; False after refusing."""

    def limit_messages(self, max_bytes: int) -> None:
        """The largest message the transport reads from now on."""

    async def refuse(self, code: ErrorCode, message: str) -> None:
        """The dialect's error then a close (bounded by ``close_timeout_s``)."""

    async def send_then_close(self, texts: list[str], close_code: int) -> None:
        """Send ``texts`` then the close frame (bounded by ``close_timeout_s``)."""

    async def start_image(self, name: str | None, data: str | None) -> StartImage | None:
        """The start image asked for (decoded off the loop), or None after refusing (or if the client left)."""


class SessionPort(Protocol):
    """What a dialect's hooks may do with the started session they speak for (its live session)."""

    @property
    def gate(self) -> Gate: ...

    @property
    def session(self) -> Session | None: ...

    @property
    def ws(self) -> WebSocket: ...

    @property
    def outbox(self) -> Outbox: ...

    @property
    def watch(self) -> ViewerRole | None:
        """The viewer role while the socket watches its session; None while it controls it."""

    @property
    def moving(self) -> bool:
        """Its session's state is on its way to a peer (app/migration.py): nothing more runs here."""

    def submit(self, job: TickJob, *, client_waits: bool = True) -> None:
        """Hand an accepted tick to the worker (while one the client waits on is out, it is not idle)."""

    def touch(self) -> None:
        """The session made progress (what counts is the dialect's): its idle clock starts again."""

    def check_send_backlog(self) -> None:
        """Drop a client that has left more than ``max_send_buffer_bytes`` untaken."""

    def fatal(
        self,
        code: str,
        message: str,
        *,
        tick_id: int | None = None,
        reason: CloseReason = ...,
        returns_credit: bool = False,
        close_code: int | None = None,
    ) -> None:
        """Queue the dialect's error and close."""

    def close(self, code: int, reason: CloseReason) -> None:
        """Queue the dialect's last message and the close frame; end the session (or the watch)."""

    def check_pass_control(self, viewer_id: str) -> object:
        """Raises ProtocolError when control would stay (nothing changes either way)."""

    def pass_control(self, viewer_id: str) -> Passed:
        """Swap roles with viewer ``viewer_id``; raises ProtocolError when control stays."""


class Dialect:
    """One socket's wire dialect; subclass it and override what your wire says (see the module docstring).

    One instance serves one socket. Its start gets an :class:`OpeningPort`, every later hook a :class:`SessionPort`.
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

    async def start(self, opening: OpeningPort) -> Started | None:
        """From the accepted socket to an admitted session (or None, after ``opening.refuse`` or a disconnect)."""
        raise NotImplementedError

    def ready(self, port: SessionPort, started: Started) -> None:
        """The session is registered and its writer runs: queue what tells the client it started."""
        raise NotImplementedError

    def text_in(self, port: SessionPort, text: str | None) -> TickJob | None:
        """A message from the client, read while the session is live (``None``: a binary message); returns the
        tick it asks for (the live session runs it), or None once it is answered."""
        raise NotImplementedError

    def outcome(self, port: SessionPort, outcome: TickOutcome) -> None:
        """A tick of the session is done (its bookkeeping is done): queue its chunk, or say what failed."""
        raise NotImplementedError

    async def send_chunk(self, port: SessionPort, outcome: TickOutcome) -> ChunkSent:
        """On the writer: send one chunk; returns what it sent, by path (the writer counts the frames and the
        bytes). Its credit comes back after, then :meth:`chunk_sent`."""
        raise NotImplementedError

    def chunk_sent(self, port: SessionPort) -> None:
        """A chunk and its credit are back (the server may tick on, or end a finite session)."""

    async def send_viewer_chunk_on_track(self, port: SessionPort, chunk: ViewerChunk, skipped: int) -> ChunkSent | None:
        """On a viewer's writer: send a watched chunk some other way than as binary frames on the WebSocket
        (its `chunk` message still on the socket); None: the writer sends it on the WebSocket."""
        return None

    def error(self, code: str, message: str, *, tick_id: int | None = None) -> dict[str, Any]:
        """The dialect's error object."""
        raise NotImplementedError

    def closed(self, gate: Gate, reason: CloseReason) -> str | None:
        """The session is closing with ``reason`` (or a resume is answered with a move): the last text before
        the close frame, or None."""
        return None

    async def finished(self, live: SessionPort) -> None:
        """The socket's session has ended, whatever ended it: let go of what the dialect holds beside it."""

    def owns(self, session: Session) -> bool:
        """Whether ``session`` is one of this dialect's (a resume here may adopt it): protocol 1 keeps no state
        of its own (``Session.dialect_state``), other dialects say which is theirs."""
        return session.dialect_state is None

    def moved(self, resume: str, next_chunk_index: int) -> str:
        """The text that tells a client its session moved to a peer (only where :attr:`can_move`)."""
        raise NotImplementedError(f"{type(self).__name__} sessions cannot move")

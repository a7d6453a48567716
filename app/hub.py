"""The app-wide session hub: it assembles one app's parts and holds the sessions served.

One hub per app. It starts the :class:`~arstream.app.worker.ModelWorker` (which loads and warms the model on its
thread, app/model_loading.py), admits sessions up to the runtime's capacity (the per-client caps and make-room:
app/client_caps.py), and closes every session with ``server_shutdown`` when the server stops. It is the
:class:`~arstream.app.dialect.Gate` of every live session; metrics, ``/v1/stats`` (app/metrics.py) and the
balancer's agent check (app/balancer.py) read it through small views.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jsonschema

from .admission import RealtimeCapacity, admission_policy, chunk_period_s, realtime_capacity
from .client_caps import SessionCaps
from .guard import FloodBans, RefusalLog, TrustedProxies
from .metrics import ServerMetrics, stats_document
from .resume import Holder, ResumeRegistry
from .model_loading import CardRefused, load_failure, load_runtime, park_idle_sessions, read_card
from .prompts import PromptPreparer
from .protocol import ErrorCode
from .settings import Settings
from .start_image import StartImageResolver
from .unstarted import UnstartedConnections
from .viewers import ShareRegistry, ViewerRole
from .worker import ModelWorker
from ..runner.contract import ARPipeline
from ..runner.stats import RunnerStats

if TYPE_CHECKING:
    from .live_session import LiveSession

log = logging.getLogger("arstream.hub")


WORKER_STOP_TIMEOUT_S = 10.0


class SessionHub:
    """State shared by every connection of one app."""

    def __init__(self, settings: Settings, pipeline: ARPipeline | None = None) -> None:
        self.settings = settings
        self._pipeline = pipeline
        self.admission = admission_policy(settings.admission)
        # The live sessions served here that control their session, by session id.
        self.connections: dict[str, LiveSession] = {}
        # Live sessions that have ended (closed, taken over, timed out; viewers too) while their last bytes go out.
        self.closing: set[LiveSession] = set()
        # Sessions admitted and still being made (a branch, which waits on the worker), by id: they hold a slot
        # from admission on, so that a burst of branches cannot each make room in the runner (LRU eviction).
        self.claims: dict[str, Holder] = {}
        self.worker: ModelWorker | None = None
        self.ready = False
        self.not_ready_reason = "the model is loading and warming up"
        self.load_error: BaseException | None = None
        # why the replica over several devices stopped serving (a rank lost; runner/distributed/), if it did
        self.replica_lost: str | None = None
        self.request_exit: Callable[[], None] | None = None
        self.shutting_down = False
        # Moving its sessions to peers (app/migration.py): admits nothing new, loaded but not ready (/readyz).
        self.draining = False
        self.model_card: dict[str, Any] = {}
        self.controls_validator: jsonschema.protocols.Validator | None = None
        # The start images the model card offers (first: the default); empty: it takes none.
        self.start_image_names: tuple[str, ...] = ()
        self.start_images = StartImageResolver(
            max_bytes=settings.max_start_image_bytes, max_pixels=settings.max_start_image_pixels,
            max_jpeg_scans=settings.max_start_image_jpeg_scans, timeout_s=settings.start_image_timeout_s,
            nice=settings.encoder_nice,
        )
        self.prompts = PromptPreparer()  # the model's prepare_prompt, run as each prompt arrives
        self.trusted_proxies = TrustedProxies(settings.forwarded_allow_ips)
        self.refusals = RefusalLog()  # transport refusals, logged once per kind and interval (shared with the guard)
        self.flood_bans = FloodBans(settings.frame_flood_ban_s, self.trusted_proxies)  # shared with the guard
        self.unstarted = UnstartedConnections(settings, self.flood_bans, self.refusals)
        self.shares = ShareRegistry[ViewerRole](
            replica_id=settings.replica_id, max_viewers_per_session=settings.max_viewers_per_session,
            max_viewer_encodings=settings.max_viewer_encodings,
        )
        self.resume = ResumeRegistry(
            replica_id=settings.replica_id, grace_s=settings.resume_grace_s, worker=lambda: self.worker,
            on_release=self.shares.forget,
        )
        held = (self.connections, self.claims)
        self.caps = SessionCaps(settings, self.trusted_proxies, self.resume, held, lambda: self.session_capacity)
        self.metrics = ServerMetrics(
            stats=lambda: self._runner_stats, connected=lambda: len(self.connections),
            detached=lambda: self.resume.detached_count,
        )
        self._loaded: asyncio.Event | None = None
        self._park_clock: asyncio.Task[None] | None = None  # --park-after-s on a server with no ticks

    async def start(self) -> None:
        """Start the worker; the model loads in the background while /readyz says 503."""
        self._loaded = asyncio.Event()
        settings = self.settings
        self.worker = ModelWorker(
            lambda: load_runtime(settings, self._pipeline, self._compiling), loop=asyncio.get_running_loop(),
            on_ready=self._on_model_ready, max_pending_ticks=settings.max_pending_ticks,
            encode_threads=settings.encode_threads, encoder_nice=settings.encoder_nice,
            batch_wait_fraction=settings.batch_wait_fraction,
        )
        self.worker.on_replica_lost = self._on_replica_lost
        self.worker.start()

    def _on_replica_lost(self, reason: str) -> None:
        """A device of this replica is gone: not ready from now on, and the server exits non-zero."""
        if self.replica_lost is not None:
            return
        self.replica_lost = reason
        self.ready, self.not_ready_reason = False, reason
        for connection in list(self.connections.values()):  # idle ones too: each session ends with the reason
            connection.fatal(ErrorCode.SESSION_FAILED, reason)
        log.error("%s: the server stops (exit code 1) for its supervisor to start it again", reason)
        if self.request_exit is not None:
            self.request_exit()

    def _compiling(self) -> None:
        self.not_ready_reason = "compiling the model's forward (--compile); the log says how far"

    def _on_model_ready(self, error: BaseException | None) -> None:
        assert self._loaded is not None and self.worker is not None
        try:
            if error is not None:
                raise CardRefused(load_failure(self.settings, error)) from error
            offer = read_card(self.worker.model_card or {})
        except CardRefused as refused:
            self.load_error = error or refused
            self.not_ready_reason = str(refused)
            log.error("%s", self.not_ready_reason)
        else:
            if offer.start_image_names:
                self.start_images.set_frame(int(offer.card["width"]), int(offer.card["height"]))
            self.controls_validator, self.start_image_names = offer.controls_validator, offer.start_image_names
            assert self.worker.prepare_prompt is not None
            self.prompts.use(self.worker.prepare_prompt)
            self.model_card, self.ready, self.not_ready_reason = offer.card, True, ""
            if self.settings.park_after_s is not None and self.settings.park_budget_bytes > 0:
                self._park_clock = asyncio.create_task(park_idle_sessions(self.worker, self.settings.park_after_s))
        self._loaded.set()

    async def wait_loaded(self) -> None:
        """Until the model is ready or failed to load (check ``load_error``)."""
        assert self._loaded is not None, "the hub has not started"
        await self._loaded.wait()

    async def close_sessions(self) -> None:
        """Send ``closed`` (server_shutdown) to every session and wait, bounded, for each to go out."""
        self.shutting_down = True
        if not self.ready:
            self.not_ready_reason = "the server is shutting down"
        self.ready = False
        connections = list(self.connections.values())
        for connection in connections:
            connection.close_for_shutdown()
        self.resume.release_all()
        if connections:
            await asyncio.gather(*(c.wait_sent(self.settings.shutdown_grace_s) for c in connections))

    async def stop(self) -> None:
        if self._park_clock is not None:
            self._park_clock.cancel()
        await self.close_sessions()
        self.start_images.close()
        if self.worker is not None:
            await asyncio.to_thread(self.worker.stop, WORKER_STOP_TIMEOUT_S)

    @property
    def _runner_stats(self) -> RunnerStats | None:
        return self.worker.runner_stats if self.worker else None  # None before the model is loaded

    @property
    def rewind_points(self) -> int:
        """Most chunk boundaries a session keeps (``ready.rewind_points``): 0 before loading, or with no rewind."""
        return self._runner_stats.rewind_points if self._runner_stats is not None else 0

    @property
    def rewind_seconds(self) -> float:
        """How far back those boundaries reach, in seconds of play (``ready.rewind_seconds``)."""
        return self._runner_stats.rewind_seconds if self._runner_stats is not None else 0.0

    @property
    def start_message_bytes(self) -> int:
        """The largest `start`: room for a base64 start image when the model offers start images."""
        return self.settings.max_start_message_bytes if self.start_image_names else self.settings.max_message_bytes

    @property
    def session_capacity(self) -> int:
        """Sessions served at once: the runtime's KV capacity, capped by ``--max-sessions``."""
        stats, cap = self._runner_stats, self.settings.max_sessions
        if stats is None:
            return 0
        return stats.session_capacity if cap is None else min(cap, stats.session_capacity)

    def admission_refusal(self, resuming: str | None = None) -> str | None:
        """Why a new session, or the resume of session ``resuming``, cannot start now; None when it can."""
        if self.shutting_down:
            return "the server is shutting down"
        if self.draining:
            return "the server is draining: its sessions are moving to other replicas"
        if not self.ready:
            return self.not_ready_reason
        live = len(self.caps.live_holders(resuming))
        return self.admission.refusal(live, self.session_capacity, self.realtime_capacity)

    def realtime_capacity(self) -> RealtimeCapacity | None:
        """How many sessions can each get the model's fps at the measured round times (None before loading)."""
        worker, stats = self.worker, self._runner_stats
        if worker is None or stats is None or not self.model_card:
            return None
        period, batch_limit, capacity = chunk_period_s(self.model_card), stats.batch_limit, self.session_capacity
        estimates = worker.round_times.estimates()
        return realtime_capacity(estimates, chunk_period_s=period, batch_limit=batch_limit, kv_capacity=capacity)

    def client_cap_refusal(self, connection: Holder, resuming: str | None = None) -> str | None:
        """Why ``connection``'s client address or token may not hold one more live session, or None."""
        return self.caps.refusal(connection, resuming)

    def admit(self, connection: Holder, resuming: str | None = None) -> str | None:
        """Admit ``connection``'s new session, or its resume of session ``resuming``: None, or why not.

        Admitted, the session is counted as live, and detached sessions give way until every bound holds again
        (:meth:`SessionCaps.make_room`). Call it with no await before the session is registered (or claimed),
        so that the counts hold.
        """
        refusal = self.admission_refusal(resuming) or self.client_cap_refusal(connection, resuming)
        if refusal is None:
            self.caps.make_room(connection, resuming)
        return refusal

    def claim(self, connection: Holder) -> str | None:
        """Admit ``connection``'s new session and hold its slot across the awaits before it is registered (a
        branch is made on the worker first): None, or why not. Ends at :meth:`register` or :meth:`drop_claim`."""
        refusal = self.admit(connection)
        if refusal is None:
            self.claims[connection.session_id] = connection
        return refusal

    def drop_claim(self, connection: Holder) -> None:
        if self.claims.get(connection.session_id) is connection:
            del self.claims[connection.session_id]

    def transfer_refusal(self, connection: Holder, session_id: str) -> str | None:
        """Why live session ``session_id`` may not pass to ``connection``'s client (pass_control), or None.

        The session counts against its new holder from then on (PROTOCOL.md): the per-client caps apply as to a
        resume of it, and its own detached sessions give way. It adds nothing to the pool or realtime admission."""
        return self.caps.transfer_refusal(connection, session_id)

    def controller(self, session_id: str) -> LiveSession | None:
        """The live session that controls ``session_id`` here, or None."""
        return self.connections.get(session_id)

    def register(self, connection: LiveSession) -> None:
        """``connection``'s session is live (admitted with :meth:`admit`): it waits to start no more."""
        self.unstarted.discard(connection.opening)
        self.drop_claim(connection.opening)
        self.connections[connection.session_id] = connection

    def unregister(self, connection: LiveSession) -> None:
        # A resumed session is registered under the same id by its new connection.
        if self.connections.get(connection.session_id) is connection:
            del self.connections[connection.session_id]

    def free_slots(self) -> int:
        """Sessions the replica would admit now: its KV slots (or realtime capacity) less those held or resuming."""
        slots = self.admission.slots(self.session_capacity, self.realtime_capacity)
        return max(0, slots - len(self.connections) - len(self.resume.resuming))

    def stats(self) -> dict[str, Any] | None:
        """The /v1/stats document (PROTOCOL.md, built by app/metrics.py), or None before the model is loaded."""
        return stats_document(self)

"""The app-wide session hub: model readiness, admission, the sessions served, stats and shutdown.

One hub per app. It starts the :class:`~arstream.app.worker.ModelWorker` (which loads
and warms the model on its own thread), admits live sessions up to the
runtime's session capacity, and closes every session with ``server_shutdown``
when the server stops. It is the :class:`~arstream.app.dialect.Gate` of every
live session; the worker hands outcomes to the sessions themselves.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import jsonschema
import torch

from .admission import RealtimeCapacity, admission_policy, chunk_period_s, realtime_capacity
from .guard import FloodBans, RefusalLog, TrustedProxies
from .metrics import ServerMetrics
from .resume import DetachedSession, ResumeRegistry
from .plan import check_plan_fits
from .settings import Settings
from .prompts import PromptPreparer
from .start_image import StartImageResolver, offered_start_images
from .session import Session
from .unstarted import UnstartedConnections
from .viewers import ShareRegistry
from .transfers import park_idle
from .worker import ModelWorker
from ..models.registry import load_pipeline
from ..runner.contract import ARPipeline, SupportsCompile
from ..runner.vllm_omni.native import NativePipeline
from ..runner.runtimes import Runtime, build_runtime
from ..runner.types import ParkingPolicy, UnsupportedConfiguration

if TYPE_CHECKING:
    from .live_session import LiveSession

log = logging.getLogger("arstream.hub")


WORKER_STOP_TIMEOUT_S = 10.0


# Whoever holds a session, live or detached, as the session caps count it: its client address and token.
SessionHolder: TypeAlias = "LiveSession | DetachedSession"


@dataclass(frozen=True)
class ClientCap:
    """One per-client session cap: on one client address, or on one auth token."""

    what: str  # "client address" or "token", for messages
    setting: str
    limit: int
    client_host: str | None
    token_key: str | None

    def covers(self, holder: SessionHolder) -> bool:
        if self.client_host is not None:
            return holder.client_host == self.client_host
        return holder.token_key == self.token_key


def same_client(detached: DetachedSession, connection: LiveSession) -> bool:
    """Whether a detached session was held by ``connection``'s client address or auth token."""
    if detached.client_host == connection.client_host:
        return True
    return connection.token_key is not None and detached.token_key == connection.token_key


def compile_forward(pipeline: ARPipeline | NativePipeline) -> None:
    """``--compile``: the pipeline's forward wrapped for compilation, or a refusal naming the models that have one."""
    if not isinstance(pipeline, SupportsCompile):
        name = pipeline.model_card().get("name") if isinstance(pipeline, ARPipeline) else pipeline.name
        raise UnsupportedConfiguration(f"--compile: model {name!r} has no compiled forward (matrix-game-2, longlive do)")
    pipeline.compile_forward()


class SessionHub:
    """State shared by every connection of one app."""

    def __init__(self, settings: Settings, pipeline: ARPipeline | None = None) -> None:
        self.settings = settings
        self._pipeline = pipeline
        self.admission = admission_policy(settings.admission)
        # The live sessions served here that control their session, by session id.
        self.connections: dict[str, LiveSession] = {}
        # Live sessions that have ended (closed, taken over, timed out) while their last bytes go out,
        # and viewers whose watch has ended, while theirs do.
        self.closing: set[LiveSession] = set()
        # Sessions admitted and still being made (a branch, which waits on the worker), by id: they hold a slot
        # from admission on, so that a burst of branches cannot each make room in the runner (LRU eviction).
        self.claims: dict[str, LiveSession] = {}
        self.worker: ModelWorker | None = None
        self.ready = False
        self.not_ready_reason = "the model is loading and warming up"
        self.load_error: BaseException | None = None
        self.shutting_down = False
        # Moving its sessions to peers (app/migration.py, a drain or SIGTERM): admits nothing new. Readiness
        # (/readyz, the agent check) reads it: a draining replica is loaded but not ready.
        self.draining = False
        self.model_card: dict[str, Any] = {}
        self.controls_validator: jsonschema.protocols.Validator | None = None
        # The start images the model card offers (first: the default); empty: it takes none.
        self.start_image_names: tuple[str, ...] = ()
        self.start_images = StartImageResolver(
            max_bytes=settings.max_start_image_bytes,
            max_pixels=settings.max_start_image_pixels,
            max_jpeg_scans=settings.max_start_image_jpeg_scans,
            timeout_s=settings.start_image_timeout_s,
            nice=settings.encoder_nice,
        )
        self.prompts = PromptPreparer()  # the model's prepare_prompt, run as each prompt arrives
        self.trusted_proxies = TrustedProxies(settings.forwarded_allow_ips)
        self.refusals = RefusalLog()  # transport refusals, logged once per kind and interval (shared with the guard)
        self.flood_bans = FloodBans(settings.frame_flood_ban_s, self.trusted_proxies)  # shared with the guard
        self.unstarted = UnstartedConnections(settings, self.flood_bans, self.refusals)
        self.shares: ShareRegistry[LiveSession] = ShareRegistry(
            replica_id=settings.replica_id,
            max_viewers_per_session=settings.max_viewers_per_session,
            max_viewer_encodings=settings.max_viewer_encodings,
        )
        self.resume = ResumeRegistry(
            replica_id=settings.replica_id,
            grace_s=settings.resume_grace_s,
            worker=lambda: self.worker,
            on_release=self.shares.forget,
        )
        self.metrics = ServerMetrics(
            stats=lambda: self.worker.runner_stats if self.worker else None,
            connected=lambda: len(self.connections),
            detached=lambda: self.resume.detached_count,
        )
        self._loaded: asyncio.Event | None = None
        self._park_clock: asyncio.Task[None] | None = None  # --park-after-s on a server with no ticks

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start the worker; the model loads in the background while /readyz says 503."""
        self._loaded = asyncio.Event()
        self.worker = ModelWorker(
            self._build_runtime,
            loop=asyncio.get_running_loop(),
            on_ready=self._on_model_ready,
            max_pending_ticks=self.settings.max_pending_ticks,
            encode_threads=self.settings.encode_threads,
            encoder_nice=self.settings.encoder_nice,
            batch_wait_fraction=self.settings.batch_wait_fraction,
        )
        self.worker.start()

    def _build_runtime(self) -> Runtime:
        """Runs on the worker thread: load the pipeline, build the runtime and its pool, warm up."""
        settings = self.settings
        torch.set_num_threads(settings.resolved_torch_threads())
        pipeline: ARPipeline | NativePipeline
        if self._pipeline is not None:
            pipeline = self._pipeline
        else:
            check_plan_fits(settings)
            pipeline = load_pipeline(settings.model, settings.device, **settings.model_options)
        runtime = build_runtime(
            settings.runtime,
            pipeline,
            device=settings.device,
            kv_budget_bytes=settings.resolved_kv_budget_bytes(),
            memory_fraction=settings.memory_fraction,
            max_batch_sessions=settings.resolved_max_batch_sessions(),
            rewind_seconds=settings.rewind_seconds,
            rewind_budget_bytes=settings.rewind_budget_bytes(),
            split_decode=settings.resolved_decode_overlap(),
            parking=ParkingPolicy(  # parking (runner/parking.py)
                settings.park_budget_bytes, settings.park_after_s, settings.park_spill_dir, settings.park_spill_budget_bytes
            ),
        )
        if settings.compile:
            compile_forward(pipeline)
            self.not_ready_reason = "compiling the model's forward (--compile); the log says how far"
        warmed = runtime.warmup()
        log.info("model %s warmed up with %d chunk(s)", runtime.model_card().get("name"), warmed)
        return runtime

    def _on_model_ready(self, error: BaseException | None) -> None:
        assert self._loaded is not None and self.worker is not None
        if error is not None:
            self.load_error = error
            # A TypeError from the loader is a keyword it does not take: an option the user gave.
            options = f" with --model-options {json.dumps(self.settings.model_options)}" if isinstance(error, TypeError) else ""
            self.not_ready_reason = f"the model failed to load{options}: {error}"
        else:
            card = self.worker.model_card or {}
            try:
                schema = card.get("controls", {})
                validator_class = jsonschema.validators.validator_for(schema)
                validator_class.check_schema(schema)
                self.controls_validator = validator_class(schema)
                self.start_image_names = offered_start_images(card)
                if self.start_image_names:
                    self.start_images.set_frame(int(card["width"]), int(card["height"]))
                self.model_card = card
                assert self.worker.prepare_prompt is not None
                self.prompts.use(self.worker.prepare_prompt)
                self.ready = True
                self.not_ready_reason = ""
            except jsonschema.SchemaError as exc:
                self.load_error = exc
                self.not_ready_reason = f"the model card's controls schema is invalid: {exc.message}"
            except ValueError as exc:
                self.load_error = exc
                self.not_ready_reason = str(exc)
        if self.load_error is not None:
            log.error("%s", self.not_ready_reason)
        elif self.settings.park_after_s is not None and self.settings.park_budget_bytes > 0:
            self._park_clock = asyncio.get_running_loop().create_task(self._park_idle_sessions(self.settings.park_after_s))
        self._loaded.set()

    async def _park_idle_sessions(self, after_s: float) -> None:
        """The worker parks idle sessions after each job; this asks it to on a quiet server too (no ticks at all)."""
        while self.worker is not None:
            await asyncio.sleep(max(0.25, after_s / 4))
            park_idle(self.worker)

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

    # ---- sessions --------------------------------------------------------------------

    @property
    def rewind_points(self) -> int:
        """Most chunk boundaries a session keeps (``ready.rewind_points``): 0 before loading, or when the runtime
        keeps none (vllm-omni, a model without rewind)."""
        stats = self.worker.runner_stats if self.worker else None
        return stats.rewind_points if stats is not None else 0

    @property
    def rewind_seconds(self) -> float:
        """How far back those boundaries reach, in seconds of play (``ready.rewind_seconds``)."""
        stats = self.worker.runner_stats if self.worker else None
        return stats.rewind_seconds if stats is not None else 0.0

    def live_or_detached_session(self, session_id: str) -> Session | None:
        """The protocol state of a session this replica holds (connected or detached), or None."""
        connection = self.connections.get(session_id)
        if connection is not None:
            return connection.session
        return self.resume.detached_session(session_id)

    @property
    def start_message_bytes(self) -> int:
        """The largest `start`: room for a base64 start image when the model offers start images."""
        return self.settings.max_start_message_bytes if self.start_image_names else self.settings.max_message_bytes

    @property
    def session_capacity(self) -> int:
        """Sessions served at once: the runtime's KV capacity, capped by ``--max-sessions``."""
        stats = self.worker.runner_stats if self.worker else None
        if stats is None:
            return 0
        cap = self.settings.max_sessions
        return stats.session_capacity if cap is None else min(cap, stats.session_capacity)

    # A new session and a resume pass the same checks (docs/public.md, "Sessions, resumes and detached
    # sessions"): the pool, realtime admission and the per-client caps count every live session (connected,
    # or being resumed) except the one being resumed, which never counts against itself. Detached sessions
    # hold KV and count too, but give way to an admitted session (see admit).

    def _live_holders(self, resuming: str | None = None) -> list[SessionHolder]:
        """Connections holding a live session or resuming one, except those of session ``resuming``."""
        holders: list[SessionHolder] = [c for sid, c in self.connections.items() if sid != resuming]
        holders += [c for sid, c in self.resume.resuming.items() if sid != resuming]
        holders += [c for sid, c in self.claims.items() if sid != resuming]
        return holders

    def admission_refusal(self, resuming: str | None = None) -> str | None:
        """Why a new session, or the resume of session ``resuming``, cannot start now; None when it can."""
        if self.shutting_down:
            return "the server is shutting down"
        if self.draining:
            return "the server is draining: its sessions are moving to other replicas"
        if not self.ready:
            return self.not_ready_reason
        live = len(self._live_holders(resuming))
        return self.admission.refusal(live, self.session_capacity, self.realtime_capacity)

    def realtime_capacity(self) -> RealtimeCapacity | None:
        """How many sessions can each get the model's fps at the measured round times (None before loading)."""
        worker = self.worker
        stats = worker.runner_stats if worker else None
        if worker is None or stats is None or not self.model_card:
            return None
        return realtime_capacity(
            worker.round_times.estimates(),
            chunk_period_s=chunk_period_s(self.model_card),
            batch_limit=stats.batch_limit,
            kv_capacity=self.session_capacity,
        )

    def _client_caps(self, connection: LiveSession) -> list[ClientCap]:
        """The session caps ``connection``'s client is under: its address's and its token's, where set.

        Addresses of trusted proxies (``forwarded_allow_ips``) are not capped:
        behind one, uvicorn has already put the forwarded client address in
        the connection's scope, and a proxy's own address stands for everyone.
        """
        caps = []
        per_client = self.settings.max_sessions_per_client
        if per_client is not None and connection.client_host not in self.trusted_proxies:
            host = connection.client_host
            caps.append(ClientCap("client address", "max_sessions_per_client", per_client, host, None))
        per_token = self.settings.max_sessions_per_token
        if per_token is not None and connection.token_key is not None:
            caps.append(ClientCap("token", "max_sessions_per_token", per_token, None, connection.token_key))
        return caps

    def client_cap_refusal(self, connection: LiveSession, resuming: str | None = None) -> str | None:
        """Why ``connection``'s client address or token may not hold one more live session, or None."""
        holders = self._live_holders(resuming)
        for cap in self._client_caps(connection):
            count = sum(1 for holder in holders if cap.covers(holder))
            if count >= cap.limit:
                return f"this {cap.what} already holds {count} sessions ({cap.setting} {cap.limit})"
        return None

    def admit(self, connection: LiveSession, resuming: str | None = None) -> str | None:
        """Admit ``connection``'s new session, or its resume of session ``resuming``: None, or why not.

        Admitted, the session is counted as live, and detached sessions give
        way until every bound holds again: first the client's own caps (its
        address's, then its token's live and detached sessions within the cap;
        its longest-detached session goes), then the pool (the client's own
        detached sessions first, then anyone's, longest-detached first). So one
        client's churn releases its own detached sessions, never another's while
        its own exist. A live session never gives way. Call it with no await
        before the session is registered (or claimed), so that the counts hold.
        """
        refusal = self.admission_refusal(resuming) or self.client_cap_refusal(connection, resuming)
        if refusal is None:
            self._make_room(connection, resuming)
        return refusal

    def claim(self, connection: LiveSession) -> str | None:
        """Admit ``connection``'s new session and hold its slot across the awaits before it is registered
        (a branch is made on the worker first): None, or why not. The claim ends at :meth:`register`, or at
        :meth:`drop_claim` when the session is not made after all."""
        refusal = self.admit(connection)
        if refusal is None:
            self.claims[connection.session_id] = connection
        return refusal

    def drop_claim(self, connection: LiveSession) -> None:
        if self.claims.get(connection.session_id) is connection:
            del self.claims[connection.session_id]

    def transfer_refusal(self, connection: LiveSession, session_id: str) -> str | None:
        """Why live session ``session_id`` may not pass to ``connection``'s client (pass_control), or None.

        The session counts against its new holder's address and token from then on (PROTOCOL.md), so the
        per-client caps apply as to a resume of it: it does not count against itself, and the new holder's
        own detached sessions give way. It adds nothing to the pool or to realtime admission."""
        refusal = self.client_cap_refusal(connection, resuming=session_id)
        if refusal is None:
            self._make_room(connection, session_id)
        return refusal

    def _make_room(self, connection: LiveSession, resuming: str | None) -> None:
        holders = self._live_holders(resuming)
        detached = [d for d in self.resume.detached() if d.session_id != resuming]
        for cap in self._client_caps(connection):
            live = sum(1 for holder in holders if cap.covers(holder))
            own = [d for d in detached if cap.covers(d)]
            while own and live + len(own) + 1 > cap.limit:
                oldest = own.pop(0)
                detached.remove(oldest)
                self.resume.release(oldest.session_id, f"its {cap.what} started another session ({cap.setting})")
        excess = len(holders) + 1 + len(detached) - self.session_capacity
        if excess > 0:
            # sorted() keeps the longest-detached first within the client's own and within the rest
            by_owner = sorted(detached, key=lambda d: not same_client(d, connection))
            for released in by_owner[:excess]:
                self.resume.release(released.session_id, "a new session needed its slot")

    def controller(self, session_id: str) -> LiveSession | None:
        """The live session that controls ``session_id`` here, or None."""
        return self.connections.get(session_id)

    def register(self, connection: LiveSession) -> None:
        """``connection``'s session is live (admitted with :meth:`admit`): it waits to start no more."""
        self.unstarted.discard(connection)
        self.drop_claim(connection)
        self.connections[connection.session_id] = connection

    def unregister(self, connection: LiveSession) -> None:
        # A resumed session is registered under the same id by its new connection.
        if self.connections.get(connection.session_id) is connection:
            del self.connections[connection.session_id]

    # ---- stats -----------------------------------------------------------------------

    def start_images_held(self, live: list[Session]) -> dict[str, int]:
        """Uploaded start images the live and detached sessions hold: how many pictures, and their bytes
        (a branch shares its source's picture: counted once); and uploads waiting for or in their decode."""
        detached = (self.resume.detached_session(d.session_id) for d in self.resume.detached())
        held = {
            id(session.start_image.pixels): session.start_image.pixels.nbytes
            for session in (*live, *detached)
            if session is not None and session.start_image is not None and session.start_image.pixels is not None
        }
        return {"held": len(held), "bytes": sum(held.values()), "decoding": self.start_images.decoding}

    def stats(self) -> dict[str, Any] | None:
        """The /v1/stats document (PROTOCOL.md), or None before the model is loaded."""
        worker = self.worker
        runner_stats = worker.runner_stats if worker else None
        if worker is None or runner_stats is None:
            return None
        p50, p99 = worker.times.compute_ms_percentiles()
        capacity = self.realtime_capacity()
        sessions = [c.session for c in self.connections.values() if c.session is not None]
        return {
            "start_images": self.start_images_held(sessions),
            "kv": {
                "blocks_total": runner_stats.blocks_total,
                "blocks_free": runner_stats.blocks_free,
                "blocks_used": runner_stats.blocks_used,
                "block_bytes": runner_stats.block_bytes,
                "pool_bytes": runner_stats.pool_bytes,
                "session_capacity": self.session_capacity,
                "sessions_resident": runner_stats.sessions_resident,
                "sink_frames": runner_stats.sink_frames,
                "window_frames": runner_stats.window_frames,
                "frames_per_chunk": runner_stats.frames_per_chunk,
                "scratch_blocks": runner_stats.scratch_blocks,
            },
            "sessions": {
                "connected": len(sessions),
                "viewers": self.shares.viewer_count,
                "detached": self.resume.detached_count,
                "closing": len(self.closing),
                "realtime_capacity": None if capacity is None else capacity.sessions,
                "active": sum(1 for s in sessions if s.pending_ticks > 0),
                "evictions_total": runner_stats.evictions_total,
                "failures_total": runner_stats.failures_total,
                "pending_ticks": sum(s.pending_ticks for s in sessions),
                "replies_queued": sum(c.outbox.replies_queued for c in self.connections.values()),
            },
            "parking": runner_stats.parking(),  # runner/parking.py
            # where each of the model's components lives and its bytes (the model card's, as loaded)
            "components": self.model_card.get("components", []),
            "queue": {"depth": worker.queue_depth},
            "chunks": {
                "total": runner_stats.chunks_total,
                "compute_ms_p50": None if p50 is None else round(p50, 3),
                "compute_ms_p99": None if p99 is None else round(p99, 3),
                # worker rounds (runner calls) since start-up, warm-up included, and the sessions they served
                "rounds_total": worker.round_times.rounds_total,
                "round_sessions_total": worker.round_times.round_sessions_total,
            },
            # per round: the DiT forward, the decode (apart from it with --decode-overlap) and the time both ran
            "phases": {"decode_overlap": worker.decode_overlap, **worker.times.phases_summary()},
        }

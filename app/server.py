"""``arstream serve``: the FastAPI app factory, its HTTP routes and WebSocket endpoint, and the CLI.

Routes (PROTOCOL.md, "Endpoints"): ``WS /v1/sessions``, ``WS /v1/realtime/video``, ``GET /v1/stats``,
``/metrics``, ``/v1/model``, ``/v1/models``, ``/healthz``, ``/readyz``, ``/servingz`` and the demo page at
``/`` (the repository's ``static/`` directory).

:class:`ARStreamServer` is uvicorn's server with two changes. SIGTERM drains
when the replica knows its peers and the cluster secret (docs/deployment.md,
"Drain"): it stops admitting, moves every session to peers with room, logs
the drain's report (one ``ARSTREAM_DRAIN_REPORT {json}`` line on standard
output) and exits; a second SIGTERM, or ``--drain-timeout-s``, ends what is
left. And on shutdown it first sends every open session ``closed``
(``server_shutdown``) and a close frame, then lets uvicorn close what is left.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import socket
import sys
import time
from types import FrameType
from typing import Any
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request, WebSocket
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from .address import display_host, network_lines, refusal_before_loading
from .codecs import FMP4, offered_codecs
from .balancer import BALANCER_HEADER, BalancerLedger, start_agent
from .dialects import DIALECTS, DialectFactory
from .guard import protocol_classes, quiet_resource_errors, redact_uvicorn_logs
from .http_policy import HostCheck, SecurityHeaders, allowed_host_patterns
from .hub import SessionHub
from .memory import keep_freed_memory
from .metrics import ReplicaCollector
from .migration import Migration, add_cluster_routes
from .peers import own_urls
from .protocol_schema import SCHEMA_PATH, protocol_schema
from . import webrtc_track
from .recorder import Recordings
from .live_session import LiveSession
from .realtime_video import PATH as REALTIME_VIDEO_PATH
from .settings import Settings, add_serve_arguments, settings_from_args
from ..cli import main_for
from ..runner.contract import ARPipeline

log = logging.getLogger("arstream.server")

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
NOT_FOUND_PAGE = "not-found.html"
LISTENING_MARKER = "ARSTREAM_LISTENING"
AGENT_MARKER = "ARSTREAM_AGENT"
DRAIN_REPORT_MARKER = "ARSTREAM_DRAIN_REPORT"


def openai_model_list(card: dict[str, Any], created: int) -> dict[str, Any]:
    """``GET /v1/models`` as OpenAI's API (and vLLM's) answers it: the one served model, named as its card names it."""
    name = card["name"]
    entry = {"id": name, "object": "model", "created": created, "owned_by": "arstream", "root": name, "parent": None}
    return {"object": "list", "data": [entry]}


RECORDINGS_PATH = "/v1/recordings"


def open_recordings(settings: Settings, hub: SessionHub) -> Recordings | None:
    """The recording directory (swept of what an earlier process left), or None when recording is off."""
    if settings.record_dir is None:
        return None
    recordings = Recordings(
        Path(settings.record_dir), session_bytes=settings.record_session_bytes,
        total_bytes=settings.record_total_bytes, retention_s=settings.record_retention_s,
        quality=settings.record_quality, metrics=hub.metrics,
    )
    if recordings.swept:
        log.info("recordings: swept %d session folder(s) an earlier process left in %s", recordings.swept,
                 settings.record_dir)
    return recordings


def create_app(settings: Settings, pipeline: ARPipeline | None = None) -> FastAPI:
    """An app serving ``pipeline`` (or the one ``settings.model`` names, loaded at startup)."""
    hub = SessionHub(settings, pipeline)
    started_at = int(time.time())
    schema = protocol_schema()
    recordings = open_recordings(settings, hub)
    balancers = BalancerLedger()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await hub.start()
        if hub.worker is not None:
            hub.worker.delivery.recorder = recordings
        # Listening while the model loads, so that HAProxy hears "down" rather than nothing.
        agent = None
        if settings.agent_port is not None:
            agent = await start_agent(hub, balancers, settings.host, settings.agent_port)
        app.state.agent = agent
        try:
            yield
        finally:
            await hub.stop()
            if agent is not None:
                agent.close()

    # No /docs, /redoc or /openapi.json: the public contract is PROTOCOL.md, and a schema page is surface for nothing.
    app = FastAPI(
        title="ARStream", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.hub = hub
    app.state.refusals = hub.refusals
    app.state.flood_bans = hub.flood_bans
    app.state.agent = None
    hub.metrics.registry.register(ReplicaCollector(hub))
    app.add_middleware(SecurityHeaders)
    app.add_middleware(HostCheck, patterns=allowed_host_patterns(settings))

    def serve_in(dialect: DialectFactory) -> Callable[[WebSocket], Awaitable[None]]:
        async def serve_socket(websocket: WebSocket) -> None:
            # HAProxy sends every dialect through its sessions backend, so each counts against its slots here.
            live = LiveSession(websocket, hub, dialect())
            admitted = lambda: hub.controller(live.session_id) is live  # noqa: E731
            with balancers.connection(websocket.headers.get(BALANCER_HEADER), admitted):
                await live.run()

        return serve_socket

    for path, dialect in DIALECTS.items():  # protocol 1, vLLM-Omni's realtime video, ... (app/dialects.py)
        app.add_api_websocket_route(path, serve_in(dialect))

    @app.get("/v1/stats")
    async def stats() -> JSONResponse:
        document = hub.stats()
        if document is None:
            return JSONResponse({"ready": False, "reason": hub.not_ready_reason}, status_code=503)
        return JSONResponse({**document, "runtime": hub.settings.runtime})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(hub.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/model")
    async def model() -> JSONResponse:
        if not hub.model_card:
            return JSONResponse({"ready": False, "reason": hub.not_ready_reason}, status_code=503)
        return JSONResponse(hub.model_card)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        # The OpenAI-style list vLLM's (and vLLM-Omni's) clients read the served model's name from.
        if not hub.model_card:
            return JSONResponse({"ready": False, "reason": hub.not_ready_reason}, status_code=503)
        return JSONResponse(openai_model_list(hub.model_card, started_at))

    @app.get(SCHEMA_PATH)
    async def protocol_schema_document() -> JSONResponse:
        # Protocol 1's JSON messages as JSON Schema, from the same models the server parses and builds with.
        return JSONResponse(schema)

    @app.get(RECORDINGS_PATH)
    async def recording_list(share: str | None = None) -> JSONResponse:
        # A session's recordings, for the holder of its share token (PROTOCOL.md, "Recording").
        if recordings is None:
            return JSONResponse({"error": "recording is off on this server (no --record-dir)"}, status_code=404)
        if not share:
            return JSONResponse({"error": "give the session's share token as ?share="}, status_code=401)
        files = await asyncio.to_thread(recordings.files, share)
        return JSONResponse(
            {"recordings": [{"name": f.name, "bytes": f.bytes, "complete": f.complete} for f in files]}
        )

    @app.get(RECORDINGS_PATH + "/{name}")
    async def recording_file(name: str, share: str | None = None) -> Response:
        if recordings is None:
            return JSONResponse({"error": "recording is off on this server (no --record-dir)"}, status_code=404)
        if not share:
            return JSONResponse({"error": "give the session's share token as ?share="}, status_code=401)
        path = recordings.file(share, name)
        if path is None:
            return JSONResponse({"error": "no such recording for this token"}, status_code=404)
        return FileResponse(path, media_type="video/mp4", filename=name)

    @app.get("/v1/codecs")
    async def codecs() -> JSONResponse:
        # What a `start` may name here, with its ARF1 header id: the page builds its codec menu from it.
        return JSONResponse({"codecs": offered_codecs(), "default": hub.settings.codec})

    @app.get("/healthz")
    async def healthz(request: Request) -> JSONResponse:
        # HAProxy's health checks say which balancer process is checking (app/balancer.py).
        if request.client is not None:
            balancers.heard(request.client.host, request.headers.get(BALANCER_HEADER))
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        refusal = hub.admission_refusal()
        if refusal is not None:
            return JSONResponse({"ready": False, "reason": refusal}, status_code=503)
        return JSONResponse({"ready": True})

    @app.get("/servingz")
    async def servingz() -> JSONResponse:
        # Kubernetes' readinessProbe (docs/kubernetes.md): loaded and not draining or shutting down. Unlike
        # /readyz a full replica still serves: its sessions and their resumes go on, and a pod marked unready
        # for being full would hold up a rolling update and count against the disruption budget. Fullness
        # is the balancer's business (the agent check's maxconn).
        if hub.ready and not (hub.draining or hub.shutting_down):
            return JSONResponse({"serving": True})
        return JSONResponse({"serving": False, "reason": hub.admission_refusal()}, status_code=503)

    # Private routes for the cluster (drain, moved sessions); off without a cluster secret.
    app.state.migration = add_cluster_routes(app, hub)

    @app.exception_handler(StarletteHTTPException)
    async def friendly_not_found(request: Request, exc: StarletteHTTPException) -> Response:
        """A browser that asks for a page that is not there gets a page with a way back to ``/``; APIs keep JSON."""
        page = STATIC_DIR / NOT_FOUND_PAGE
        if exc.status_code == 404 and "text/html" in request.headers.get("accept", "") and page.is_file():
            return HTMLResponse(page.read_text(), status_code=404)
        return await http_exception_handler(request, exc)

    if STATIC_DIR.is_dir():
        # Last, so the API routes win.
        app.mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="static")
    else:
        log.warning("no demo page: %s is missing", STATIC_DIR)

        @app.get("/")
        async def no_demo_page() -> JSONResponse:
            return JSONResponse({"detail": f"the demo page is not installed ({STATIC_DIR} is missing)"}, 404)

    return app


class ARStreamServer(uvicorn.Server):
    """uvicorn's server, closing sessions with ``server_shutdown`` before connections are cut."""

    def __init__(self, config: uvicorn.Config, hub: SessionHub) -> None:
        super().__init__(config)
        self.hub = hub
        migration = getattr(getattr(config.app, "state", None), "migration", None)
        self.migration: Migration | None = migration
        if migration is not None:
            migration.request_exit = lambda: setattr(self, "should_exit", True)
        hub.request_exit = lambda: setattr(self, "should_exit", True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sigterm_drain: asyncio.Future[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        app = self.config.app
        self._loop = asyncio.get_running_loop()
        if isinstance(app, FastAPI):
            quiet_resource_errors(self._loop, app.state.refusals)
        await super().startup(sockets)
        if self.migration is not None and self.servers:
            self.migration.own_urls = own_urls(self.config.host, self.bound_port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """SIGTERM drains when this replica can (see the module docstring); a second SIGTERM cuts it short."""
        migration, loop = self.migration, self._loop
        if sig != signal.SIGTERM or migration is None or loop is None or not migration.drains_on_sigterm:
            super().handle_exit(sig, frame)
            return
        if self._sigterm_drain is None and self.hub.ready and not self.should_exit:
            log.info("SIGTERM: draining (a second SIGTERM ends the sessions not moved yet)")
            loop.call_soon_threadsafe(self._begin_sigterm_drain, migration)
        elif self._sigterm_drain is not None:
            log.info("second SIGTERM: ending the sessions not moved yet")
            loop.call_soon_threadsafe(migration.cut_short, "a second SIGTERM ended the drain")
        else:
            super().handle_exit(sig, frame)  # not serving sessions yet (loading): nothing to move

    def _begin_sigterm_drain(self, migration: Migration) -> None:
        if self._sigterm_drain is None:
            self._sigterm_drain = asyncio.ensure_future(self._drain_then_exit(migration))

    async def _drain_then_exit(self, migration: Migration) -> None:
        try:
            report = await migration.drain()
            print(f"{DRAIN_REPORT_MARKER} {json.dumps(report.as_json())}", flush=True)
            await migration.linger()
        except Exception:  # noqa: BLE001 - whatever went wrong, SIGTERM still stops the server
            log.exception("the SIGTERM drain failed")
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # stop accepting before saying goodbye
        await self.hub.close_sessions()
        await super().shutdown(sockets)
        # A peer that never read what it was sent keeps its transport waiting to flush: cut it.
        for connection in list(self.server_state.connections):
            connection.transport.abort()
        await asyncio.sleep(0.05)  # let the aborted transports report connection_lost before the loop closes
        # uvicorn re-raises the stop signal after serving; a completed graceful stop exits 0 instead.
        self._captured_signals.clear()

    @property
    def bound_port(self) -> int:
        """The port actually listened on (differs from the configured one with port 0)."""
        for server in self.servers:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        raise RuntimeError("the server is not listening")


def uvicorn_config(app: FastAPI, settings: Settings, **overrides: object) -> uvicorn.Config:
    """One worker, no per-message deflate, a frame limit just above the protocol's message limit, and the
    transport bounds of :mod:`arstream.app.guard` (connection caps, request heads, closes)."""
    http_protocol, ws_protocol, guard = protocol_classes(settings, app.state.refusals, app.state.flood_bans)
    app.state.guard = guard
    if settings.max_unstarted_connections >= guard.max_total:
        log.warning(
            "max_unstarted_connections %d is not below the %d connections allowed in all (max_connections): "
            "connections waiting to start a session can take every one, health checks included",
            settings.max_unstarted_connections,
            guard.max_total,
        )
    options: dict[str, object] = {
        "http": http_protocol,
        "ws": ws_protocol,
        "forwarded_allow_ips": settings.forwarded_allow_ips or [],
        "server_header": False,
        "host": settings.host,
        "port": settings.port,
        "workers": 1,
        "lifespan": "on",
        "ws_per_message_deflate": False,
        "ws_max_size": settings.ws_max_size,
        "log_level": settings.log_level,
        "timeout_graceful_shutdown": settings.shutdown_grace_s + 1.0,
    }
    options.update(overrides)
    config = uvicorn.Config(app, **options)  # type: ignore[arg-type]
    redact_uvicorn_logs()  # after uvicorn has configured its loggers
    return config


def build_server(settings: Settings, pipeline: ARPipeline | None = None, **config_overrides: object) -> ARStreamServer:
    app = create_app(settings, pipeline)
    return ARStreamServer(uvicorn_config(app, settings, **config_overrides), app.state.hub)


class HeldRunningLine(logging.Filter):
    """Holds back uvicorn's "Uvicorn running on ..." until the model is ready, so a server whose model fails to
    load never says it is running (the failure is its one line); released, the line is logged as it was."""

    PREFIX = "Uvicorn running on"

    def __init__(self) -> None:
        super().__init__()
        self.held: logging.LogRecord | None = None
        self.released = False

    @classmethod
    def install(cls) -> HeldRunningLine:
        logger = logging.getLogger("uvicorn.error")
        for old in [f for f in logger.filters if isinstance(f, cls)]:
            logger.removeFilter(old)
        held = cls()
        logger.addFilter(held)
        return held

    def filter(self, record: logging.LogRecord) -> bool:
        if self.released or not record.getMessage().startswith(self.PREFIX):
            return True
        self.held = record
        return False

    def release(self) -> None:
        self.released = True
        if self.held is not None:
            logging.getLogger("uvicorn.error").handle(self.held)


async def serve(server: ARStreamServer) -> int:
    """Run until stopped; print the listening line once the port is bound and the model is ready."""
    running_line = HeldRunningLine.install()
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if serving.done():
        await serving
        return 1
    loaded = asyncio.create_task(server.hub.wait_loaded())
    await asyncio.wait({serving, loaded}, return_when=asyncio.FIRST_COMPLETED)
    if loaded.done() and server.hub.load_error is None:
        # Everything made so far (imports, the model, its warm-up) lives as long as the server: moving it out
        # of the collector's reach takes a full collection from ~100 ms to ~3 ms, a pause every session felt.
        # The optional pages' check (an import of PyAV, cached) runs first: once the address is out, clients measure
        # this process, and what it loaded then would look like their cost.
        FMP4.unavailable_reason()
        gc.freeze()
        url = f"http://{display_host(server.config.host)}:{server.bound_port}"
        agent = server.config.app.state.agent if isinstance(server.config.app, FastAPI) else None
        if agent is not None:
            agent_port = agent.sockets[0].getsockname()[1]
            print(f"{AGENT_MARKER} {display_host(server.config.host)}:{agent_port}", flush=True)
        print(f"{LISTENING_MARKER} {url}", flush=True)
        print(f"ARStream demo: open {url}/ in a browser", flush=True)
        token_required = server.hub.settings.auth_token is not None
        for line in network_lines(server.config.host, server.bound_port, token_required=token_required):
            print(line, flush=True)
        if server.hub.model_card.get("weights") == "random":  # the page says so too: the picture is not broken
            print(f"Model {server.hub.model_card.get('name')}: random weights (a test set-up), so its pictures are "
                  "noise; docs/models.md says how to load a checkpoint.", flush=True)  # fmt: skip
        capacity = capacity_line(server.hub.stats(), server.hub.rewind_seconds)
        if capacity:
            print(capacity, flush=True)
        note_optional_pages()  # after the address: a plain start opens with where to go, not with what is missing
        note_webrtc_unavailable(server.hub.settings)
        running_line.release()
    elif loaded.done():  # the hub has logged why, in one line
        server.should_exit = True
    else:
        loaded.cancel()
    await serving
    return 1 if server.hub.load_error is not None or server.hub.replica_lost is not None else 0


add_arguments = add_serve_arguments  # the options live with the settings, so `serve --help` needs no torch


def capacity_line(stats: dict[str, Any] | None, rewind_seconds: float) -> str | None:
    """How many sessions this server holds, in plain words, from its /v1/stats document (None before it has one).

    With parking on, the sessions held are the KV pool's slots plus the parked ones in host memory: both are said,
    so the figure matches ``/v1/stats`` ``kv.session_capacity``.
    """
    if stats is None:
        return None
    kv, parking = stats["kv"], stats.get("parking") or {}
    held, parked = int(kv["session_capacity"]), int(parking.get("park_capacity", 0))
    each = f", each able to rewind {rewind_seconds:g} s" if rewind_seconds else ""
    if not parked:
        return f"Sessions: room for {held} at once{each}."
    return (
        f"Sessions: room for {held} at once{each}: {held - parked} playing in the model's memory and "
        f"{parked} more parked in host memory while idle (parking; restored on their next chunk)."
    )


def note_webrtc_unavailable(settings: Settings) -> None:
    """``--webrtc`` asked for on an install without aiortc: said once at start, since otherwise only each offer's
    refusal (and /v1/stats) would tell the operator why every page plays on the WebSocket."""
    if settings.webrtc and not webrtc_track.AVAILABLE:
        log.warning("--webrtc is on, but aiortc is not installed: every offer is refused and frames stay on the "
                    "WebSocket; pip install 'arstream[webrtc]'")


def note_optional_pages() -> None:
    """Say at start which optional page this install leaves out, and what to install for it.

    INFO, not WARNING: the README's install has no PyAV on purpose and the main page plays without it, so
    this is the first line a stranger reads, and it should read as a choice, not as a fault.
    """
    if FMP4.unavailable_reason() is not None:
        log.info(
            "optional: the realtime video page (/realtime-video.html, %s) needs %s; the main page does not",
            REALTIME_VIDEO_PATH,
            FMP4.needs,
        )


def run(args: argparse.Namespace) -> int:
    # Every setting and the address are checked before a port is bound or a model loaded (the CLI has
    # checked them once already, before importing this module and torch; `python -m` comes straight here).
    refused = refusal_before_loading(args)
    if refused is not None:
        return refused
    settings = settings_from_args(args)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if settings.keep_freed_memory:
        keep_freed_memory()
    server = build_server(settings)
    return asyncio.run(serve(server))


main = main_for("serve")

if __name__ == "__main__":
    sys.exit(main())

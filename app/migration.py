"""Drain: move every session of a replica to its peers, so a rolling restart loses no world.

Two routes on the replica's private side, both off unless ``cluster_secret``
is set, and both requiring it as a bearer token (a replica never accepts
state from anyone else; HAProxy does not route ``/v1/cluster/`` from outside):

- ``POST /v1/cluster/import`` (peer side): the body is a session snapshot
  (:mod:`arstream.runner.snapshot`, protocol state in its ``session``
  section). The replica checks model and config, that it has room and is not
  draining itself, makes the session resident on its worker and holds it
  detached (:meth:`ResumeRegistry.hold_moved`) under a fresh resume token with
  its own replica prefix, and answers ``{"resume": TOKEN, "next_chunk_index": K, "recording_kept": bool}``
  (a recorded session's files come as ``recording/part-NNNN.mp4`` tensors, written to this replica's
  recording directory as they arrive: app/recorder.py; ``recording_kept`` tells the sender it may delete its copy).
  A refusal (401 secret, 429 after too many wrong secrets from one address,
  409 model/config/room, 400 malformed: past the header's bounds or a
  `session` section a replica would not make, 413 too large, 503 not ready,
  503 with ``Retry-After`` while ``--max-parallel-imports`` stream already)
  leaves its pool as it was. The snapshot is read as it arrives
  (runner/snapshot_stream.py): its header is checked before any tensor is
  allocated, then each piece is written straight into the session's pool
  blocks (runner/snapshot_import.py). An upload that ends early (the sender
  gone, or a piece not all there within ``--import-piece-timeout-s``: 408,
  app/import_limits.py; a corrupt piece, a header that lies: 400) releases
  every block it took; nothing is held for resume.
- ``POST /v1/cluster/drain`` (operator side, ``arstream drain URL --to PEER``; SIGTERM runs the same drain,
  app/server.py): the replica stops admitting (``SessionHub.draining``), then moves every session it holds:
  live ones at a chunk boundary (the connection stops running ticks, their controls are kept, the worker
  exports the session after the chunks already queued have reached the client), ones with `ready` but no
  tick (nothing resident: an unstarted snapshot), detached ones (held out of their grace timer while they
  are shipped) and ones being resumed when the drain began (moved once the resume has its connection). Each
  snapshot goes to the first peer that takes it; a live client gets ``moved`` with the peer's token and is
  closed (``closed``: ``moved``); the old token forwards to the new one (app/resume.py), so a client coming
  back here gets ``moved`` too; the session is then released here. A session no peer takes ends as on
  shutdown (``server_shutdown``), as does what is left at ``drain_timeout_s`` or a second SIGTERM. The
  report lists every session once, moved or ended with the reason. With ``exit`` the server then stops,
  once each moved detached session's client has come back for its token (at most until the deadline).
- ``GET /v1/cluster/sessions/{id}`` (``arstream drain --which``): whether this replica holds that session.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from .live_session import LiveSession
from .guard import BAN_TABLE_PRUNE_AT, socket_peer_host
from .import_limits import IMPORT_RETRY_AFTER_S, ImportSlots, paced_pieces
from .limits import TokenBucket
from .peers import configured_peers
from .portable_session import PortableSessionError, validated_session
from .protocol import MAX_ERROR_MESSAGE_CHARS, excerpt
from .recorder import FILE_PATTERN, IncomingRecording, Recordings
from .resume import ResumeRefused
from .session import Session, SessionState
from .transfers import Receiving, export_plan, import_step, read_parts, receiving
from .wire import DRAIN_PATH, HOLDER_PATH, PROTOCOL_VERSION
from ..runner.snapshot import SnapshotError, SnapshotRefused, check_identity
from ..runner.snapshot_import import SessionImport, TensorEntry
from ..runner.snapshot_stream import (
    PIECE_BYTES, Part, Seal, SnapshotPlan, SnapshotReader, SnapshotTooLarge, TensorPlan, Write,
)
from ..runner.types import StartImage

if TYPE_CHECKING:
    from .hub import SessionHub
    from .worker import ModelWorker
    from ..runner.capabilities import SupportsExport

log = logging.getLogger("arstream.migration")

IMPORT_PATH = "/v1/cluster/import"
# A snapshot's bytes beyond the session's own resident bytes (headers, JSON state, model tensors the spec does not count).
SNAPSHOT_SLACK_BYTES = 64 * 1024 * 1024
PEER_TIMEOUT_S = 60.0
# Wrong cluster secrets one address may send at once, then how many per second (SecretGate).
CLUSTER_AUTH_BURST = 5
CLUSTER_AUTH_RATE_PER_S = 0.1


class ImportRefused(Exception):
    """A session this replica will not take; ``status`` is the HTTP status the peer gets."""

    def __init__(self, status: int, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s  # a refusal of the moment: the sender may try again then


@dataclass
class MoveReport:
    """What became of one session in a drain: moved (to ``peer``) or ended (``reason``)."""

    session_id: str
    moved: bool
    kind: str = "live"  # live (streaming), ready (no tick yet), detached, resuming (a resume in flight at the start)
    peer: str | None = None
    reason: str = ""
    snapshot_bytes: int = 0
    move_ms: float = 0.0  # from the move's start to the peer's answer (export + transfer + import)
    export_ms: float = 0.0  # of which: until the snapshot's bytes were ready (chunk boundary, export, serialise)


@dataclass
class DrainReport:
    moved: int = 0
    ended: int = 0
    sessions: list[MoveReport] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"moved": self.moved, "ended": self.ended, "sessions": [asdict(s) for s in self.sessions]}


class SecretGate:
    """The cluster secret's check, with a price on guessing: each socket peer address has
    ``CLUSTER_AUTH_BURST`` wrong tries, then one per ``1 / CLUSTER_AUTH_RATE_PER_S`` seconds; meanwhile every
    wrong secret from it gets 429. Keyed on the socket's own peer, not the forwarded client address: behind
    a trusted proxy that is whatever the sender claims, so a fresh claim per try would escape the count and a
    claim of a replica's address would spend that replica's tries. The right secret is compared first and
    costs nothing, so no flood of wrong ones from an address can keep a peer (or a drain) out."""

    def __init__(self, secret: str | None) -> None:
        self.secret = secret
        self._tries: dict[str, TokenBucket] = {}  # socket peer address -> its budget of wrong secrets

    def refusal(self, request: Request) -> JSONResponse | None:
        """404 when cluster routes are off, None for the right secret, else 429 past the address's tries or 401.
        Each says what is missing (issue 36: an operator reads them through `arstream drain`)."""
        if self.secret is None:
            off = (
                "cluster routes are off on this replica: it was started without a cluster secret "
                "(set ARSTREAM_CLUSTER_SECRET, or pass --cluster-secret, to the same value on every replica, "
                "and restart it)"
            )
            return JSONResponse({"detail": off}, status_code=404)
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.encode(), self.secret.encode()):
            return None
        host = socket_peer_host(request.scope)
        now = time.monotonic()
        budget = self._tries.get(host)
        if budget is None:
            if len(self._tries) >= BAN_TABLE_PRUNE_AT:  # forget addresses whose budget has refilled
                self._tries = {h: b for h, b in self._tries.items() if not b.full(now)}
            budget = self._tries[host] = TokenBucket(CLUSTER_AUTH_RATE_PER_S, CLUSTER_AUTH_BURST, now)
        if not budget.try_spend(now):
            wait_s = 1.0 / CLUSTER_AUTH_RATE_PER_S
            return JSONResponse(
                {"detail": f"too many wrong cluster secrets from this address; one try per {wait_s:g} s"},
                status_code=429,
                headers={"retry-after": f"{wait_s:.0f}"},
            )
        what = "a different cluster secret" if scheme.lower() == "bearer" else "no cluster secret"
        return JSONResponse(
            {"detail": f"this replica's cluster secret was not given: the request carried {what} "
             "(arstream drain reads ARSTREAM_CLUSTER_SECRET or --cluster-secret)"},
            status_code=401,
        )


class Migration:
    """Both sides of moving sessions between replicas, for one hub."""

    def __init__(self, hub: SessionHub) -> None:
        self.hub = hub
        self.settings = hub.settings
        self._drain: asyncio.Task[DrainReport] | None = None
        self._cut: asyncio.Event | None = None  # set to end a drain early (a second SIGTERM)
        self._stop_reason = ""
        self._deadline = 0.0  # loop time the current drain ends by
        self.report: DrainReport | None = None  # the last drain's
        self.importing: set[str] = set()  # ids of the sessions being taken now (their bytes arriving)
        self.import_slots = ImportSlots(self.settings.max_parallel_imports)  # app/import_limits.py
        self.moves: dict[str, asyncio.Task[MoveReport]] = {}  # the current (or last) drain's, by session id
        # This replica's own base URLs (set by the server once bound): never a peer of its own drain.
        self.own_urls: set[str] = set()
        # Set by the server (ARStreamServer): stops it once a drain with ``exit`` has finished.
        self.request_exit: Callable[[], None] | None = None

    # ---- peer side: taking a session -----------------------------------------------------------

    def _not_taking(self) -> ImportRefused | None:
        hub = self.hub
        if hub.draining or hub.shutting_down or not hub.ready or hub.worker is None or hub.worker.model_card is None:
            return ImportRefused(503, hub.admission_refusal() or "this replica is not ready")
        return None

    async def take(self, body: AsyncIterator[bytes]) -> dict[str, Any]:
        """Take a moved session as its bytes arrive: each piece goes straight into the session's pool blocks
        (runner/snapshot_import.py), so this side holds a piece or two, never the snapshot. Returns its resume
        ticket for the client, or raises :class:`ImportRefused`; however the stream ends early (refused, cut,
        stalled, corrupt, a header that lies), what the import made is released: pool and registry as before."""
        refusal = self._not_taking()
        if refusal is not None:
            raise refusal  # before a byte is read: the sender learns at once
        with self.import_slots.claim() as claimed:
            if not claimed:
                raise ImportRefused(503, self.import_slots.refusal(), retry_after_s=IMPORT_RETRY_AFTER_S)
            return await self._take(body)

    async def _take(self, body: AsyncIterator[bytes]) -> dict[str, Any]:
        """:meth:`take` within one of the import slots."""
        worker = self.hub.worker
        assert worker is not None
        try:  # on the worker's thread: the first move hashes the model's weights
            mine = await receiving(worker)
        except SnapshotRefused as exc:
            raise ImportRefused(409, str(exc)) from None
        except RuntimeError:  # the worker stopped meanwhile
            raise ImportRefused(503, self.hub.admission_refusal() or "this replica is not ready") from None
        # A recorded session's files travel in its snapshot too, up to this replica's per-session recording budget.
        max_bytes = mine.session_bytes + SNAPSHOT_SLACK_BYTES + self.settings.record_session_bytes
        reader = SnapshotReader(max_bytes, check=partial(self._check_header, mine), hold=False)
        piece_timeout_s = self.settings.import_piece_timeout_s
        pieces = paced_pieces(body, lambda: reader.header is not None, piece_timeout_s)
        incoming: Incoming | None = None
        try:
            try:
                async for piece in pieces:
                    # Off the event loop: the header's parse (up to 1 MiB of JSON) and the digest of each piece.
                    writes = await asyncio.to_thread(reader.feed, piece)
                    if incoming is None and reader.header is not None:
                        incoming = self._incoming(mine, reader)
                        self.importing.add(incoming.session_id)
                        await import_step(worker, incoming.job, incoming.job.begin)
                    if writes:
                        assert incoming is not None  # bytes to write come only after the header
                        writes = await incoming.write_recording(writes)
                    if writes:
                        assert incoming is not None
                        await import_step(worker, incoming.job, partial(_write_all, incoming.job, writes))
                reader.finish()
                if incoming is None:
                    raise SnapshotError("the session snapshot ended early, before its header")
                extras = await import_step(worker, incoming.job, incoming.job.finish)
            except (ImportRefused, SnapshotError):
                # The rest is read and dropped (within the size bound), so the sender gets this answer rather
                # than a connection cut in the middle of its upload.
                await _drop_rest(pieces, max_bytes)
                raise
        except SnapshotTooLarge as exc:
            raise ImportRefused(413, str(exc)) from None
        except SnapshotRefused as exc:
            raise ImportRefused(409, str(exc)) from None
        except SnapshotError as exc:
            raise ImportRefused(400, str(exc)) from None
        except TimeoutError:
            raise ImportRefused(
                408, f"a {PIECE_BYTES}-byte piece did not all come within {piece_timeout_s:g} s (import_piece_timeout_s)"
            ) from None
        except ClientDisconnect:
            raise ImportRefused(400, f"the sender went away after {reader.received} bytes") from None
        finally:
            if incoming is not None:
                self.importing.discard(incoming.session_id)
                if not incoming.job.finished and incoming.recording is not None:
                    incoming.recording.discard()
                if not incoming.job.finished:
                    # After every step already queued (the worker runs them in order), even when this was cancelled.
                    _quietly(import_step(worker, incoming.job, incoming.job.abort))
        try:
            session = incoming.session
            session.start_image = carried_start_image(reader.header or {}, extras, self.settings.max_start_image_pixels)
            token = self.hub.resume.hold_moved(
                session, owner=incoming.portable.get("owner"), client_host=str(incoming.portable.get("client_host", ""))
            )
        except (ResumeRefused, ValueError) as exc:
            worker.drop_session(incoming.session_id)
            if incoming.recording is not None:
                incoming.recording.discard()
            raise ImportRefused(409 if isinstance(exc, ResumeRefused) else 400, str(exc)) from None
        kept = self._go_on_recording(session, incoming)
        return {
            "resume": token, "next_chunk_index": incoming.next_chunk_index, "session_id": incoming.session_id,
            "recording_kept": kept,
        }

    def _go_on_recording(self, session: Session, incoming: Incoming) -> bool:
        """A moved session that was recorded goes on recording here (where this replica records), in its files
        that came with it, under the share token it has here; whether those files were kept."""
        recorder = self.recorder
        if not incoming.portable.get("record") or recorder is None:
            if incoming.recording_names:
                log.info("session=%s: its recording did not move (recording is off here)", session.id)
            return False
        session.record_to = self.hub.shares.token(session.id)
        if incoming.recording is None:
            return not incoming.recording_names
        incoming.recording.keep(session.id, session.record_to)
        return True

    @property
    def recorder(self) -> Recordings | None:
        worker = self.hub.worker
        return None if worker is None else worker.delivery.recorder

    def _incoming(self, mine: Receiving, reader: SnapshotReader) -> Incoming:
        """What a session's header and table say it is, checked before anything is allocated for it."""
        header = reader.header
        assert header is not None
        portable = self._check_header(mine, header)
        try:
            session_id = str(portable["id"])
            if session_id in self.importing or session_id in self.hub.connections:
                raise ImportRefused(409, f"session {session_id!r} is already on this replica")
            session = Session.from_portable(
                portable, session_id=session_id, max_pending_ticks=self.settings.max_pending_ticks
            )
            image = next((t for t in reader.tensors if t.name == START_IMAGE_TENSOR), None)
            check_start_image(header, image, self.settings.max_start_image_pixels)
            next_chunk = int(header["kv"]["chunks_committed"])
            files = carried_recording(reader.tensors)
        except (KeyError, TypeError, ValueError) as exc:
            raise ImportRefused(400, f"malformed session snapshot: {type(exc).__name__}: {exc}") from None
        extras = {START_IMAGE_TENSOR: image.nbytes} if image is not None else {}
        names = {index: RECORDING_PREFIX + name for index, name in files.items()}
        job = SessionImport(
            session_id, header, reader.tensors, protocol_version=PROTOCOL_VERSION, extras=extras,
            elsewhere=names.values(),
        )
        recorder = self.recorder
        recording = None
        if files and portable.get("record") and recorder is not None:
            recording = recorder.receive({name: reader.tensors[index].nbytes for index, name in files.items()})
        return Incoming(job, session, portable, next_chunk, files, recording)

    def _check_header(self, mine: Receiving, header: dict[str, Any]) -> dict[str, Any]:
        """The session section of a snapshot this replica takes now (model, config, room, a `session` it would
        make); ImportRefused if not. Asked as soon as the header has come (before the tensors arrive) and again
        before the import."""
        hub = self.hub
        refusal = self._not_taking()
        if refusal is not None:
            raise refusal
        try:
            check_identity(mine.identity, header)
            portable = validated_session(header.get("session"))
        except SnapshotRefused as exc:
            raise ImportRefused(409, str(exc)) from None
        except PortableSessionError as exc:
            raise ImportRefused(400, str(exc)) from None
        # Sessions whose bytes are arriving hold their slot too (they are resident here from their header on).
        held = len(hub.connections) + len(hub.resume.resuming) + hub.resume.detached_count + len(self.importing)
        if held >= hub.session_capacity:
            raise ImportRefused(409, f"no room: {held} of {hub.session_capacity} session slots are held")
        return portable

    def holding(self, session_id: str) -> str | None:
        """How this replica holds ``session_id``: "live", "detached", "resuming", or None when it does not."""
        hub = self.hub
        connection = hub.connections.get(session_id)
        if connection is not None and connection.session is not None and connection.session.live:
            return "live"
        if hub.resume.detached_session(session_id) is not None:
            return "detached"
        return "resuming" if session_id in hub.resume.resuming else None

    # ---- draining side: moving sessions away ---------------------------------------------------

    @property
    def drains_on_sigterm(self) -> bool:
        """Whether SIGTERM drains (a cluster secret and peers to ask) rather than ending every session."""
        settings = self.settings
        return settings.cluster_secret is not None and bool(settings.cluster_peers or settings.cluster_peers_file)

    def cut_short(self, reason: str) -> None:
        """End the drain now (a second SIGTERM): the sessions not moved yet end with ``reason``."""
        if self._cut is not None and not self._cut.is_set():
            self._stop_reason = reason
            self._cut.set()

    async def linger(self) -> None:
        """After a drain, before exiting: stay until every moved detached session's client has come back for its
        new token (it would get a 503 from a replica that is gone), at most until the drain's deadline; a
        second SIGTERM ends the wait."""
        left = self._deadline - asyncio.get_running_loop().time()
        if left <= 0 or self._cut is None or self._cut.is_set():
            return
        claimed = asyncio.ensure_future(self.hub.resume.until_forwards_claimed(left))
        cut = asyncio.ensure_future(self._cut.wait())
        await asyncio.wait({claimed, cut}, return_when="FIRST_COMPLETED")
        claimed.cancel()
        cut.cancel()

    async def drain_then_exit(self) -> None:
        """What ``POST /v1/cluster/drain`` with ``exit`` does after answering: linger, then stop the server."""
        await self.linger()
        if self.request_exit is not None:
            asyncio.get_running_loop().call_later(0.1, self.request_exit)  # after the report has gone out

    async def drain(self, peers: list[str] | None = None) -> DrainReport:
        """Stop admitting, move every session to a peer (or end it); one drain at a time.

        ``peers``: base URLs; None: this replica's ``--cluster-peers`` (and ``--cluster-peers-file``), DNS
        names resolved to every address they have now, this replica left out.
        """
        if self._drain is None or self._drain.done() and self._drain.cancelled():
            self._drain = asyncio.create_task(self._drain_all(peers))
        return await asyncio.shield(self._drain)

    async def _drain_all(self, given: list[str] | None) -> DrainReport:
        hub = self.hub
        hub.draining = True
        hub.metrics.drains.inc()
        loop = asyncio.get_running_loop()
        deadline = self._deadline = loop.time() + self.settings.drain_timeout_s
        self._cut = asyncio.Event()
        self._stop_reason = f"the drain's time ran out (drain_timeout_s {self.settings.drain_timeout_s:g})"
        peers = given if given else await configured_peers(self.settings, own=self.own_urls)
        log.info("draining: moving every session to %s", ", ".join(peers) or "no peer (none configured or resolved)")
        moves = self.moves = {}
        # TLS only matters for https:// peers; loading the CA bundle otherwise costs a drain ~0.3 s for nothing.
        tls = any(peer.startswith("https://") for peer in peers)
        async with httpx.AsyncClient(timeout=PEER_TIMEOUT_S, verify=tls) as client:
            # Until no session is left unsettled: a resume in flight at the start turns into a live session.
            while self._collect(client, peers, moves) or any(not t.done() for t in moves.values()):
                pending: set[asyncio.Future[Any]] = {t for t in moves.values() if not t.done()}
                cut = asyncio.ensure_future(self._cut.wait())
                await asyncio.wait(pending | {cut}, timeout=max(0.0, deadline - loop.time()), return_when="FIRST_COMPLETED")
                cut.cancel()
                if self._cut.is_set() or loop.time() >= deadline:
                    break
            for task in moves.values():
                task.cancel()  # a move cancelled ends its session (_settled); finished ones ignore this
            outcomes = await asyncio.gather(*moves.values())
        report = DrainReport(sessions=list(outcomes))
        report.moved = sum(1 for s in report.sessions if s.moved)
        report.ended = len(report.sessions) - report.moved
        for outcome in report.sessions:
            hub.metrics.drained_sessions.labels(kind=outcome.kind, outcome="moved" if outcome.moved else "ended").inc()
        log.info("drained: %d session(s) moved, %d ended", report.moved, report.ended)
        self.report = report
        return report

    def _collect(self, client: httpx.AsyncClient, peers: list[str], moves: dict[str, asyncio.Task[MoveReport]]) -> bool:
        """Start a move for every session held here that has none yet: live, ready, detached, being resumed.
        Returns whether any was started."""
        hub = self.hub
        started = len(moves)
        for connection in list(hub.connections.values()):
            session = connection.session
            sid = connection.session_id
            if sid in moves or session is None or not session.live:
                continue
            if not connection.dialect.can_move:
                # A dialect with no `moved` message (realtime video): its sessions end as on shutdown.
                connection.close_for_shutdown()
                moves[sid] = _settled_now(MoveReport(sid, False, kind="live", reason="its dialect cannot follow a move"))
                continue
            kind = "live" if session.last_tick_id is not None else "ready"
            moves[sid] = self._start(kind, sid, self._move_live(client, connection, peers, kind), connection)
        for detached in hub.resume.detached():
            sid = detached.session_id
            if sid not in moves:
                moves[sid] = self._start("detached", sid, self._move_detached(client, sid, peers), None)
        for sid in list(hub.resume.resuming):
            if sid not in moves:
                moves[sid] = self._start("resuming", sid, self._move_resumed(client, sid, peers), None)
        return len(moves) > started

    def _start(
        self, kind: str, session_id: str, move: Coroutine[Any, Any, MoveReport], connection: LiveSession | None
    ) -> asyncio.Task[MoveReport]:
        return asyncio.create_task(self._settled(kind, session_id, move, connection), name=f"move-{session_id}")

    async def _settled(
        self, kind: str, session_id: str, move: Coroutine[Any, Any, MoveReport], connection: LiveSession | None
    ) -> MoveReport:
        """The move's report; a move that fails or is cut short ends its session here, with the reason."""
        try:
            return await move
        except asyncio.CancelledError:
            reason = self._stop_reason
        except Exception as exc:  # noqa: BLE001 - a session that cannot move ends as on shutdown
            log.error("session=%s move failed", session_id, exc_info=exc)
            reason = f"the move failed: {type(exc).__name__}: {exc}"
        self._end(session_id, connection, reason)
        return MoveReport(session_id, False, kind=kind, reason=reason)

    def _end(self, session_id: str, connection: LiveSession | None, reason: str) -> None:
        """A session that did not move ends here: its client gets `closed` (server_shutdown), its KV goes back."""
        hub = self.hub
        holder = connection if connection is not None else hub.connections.get(session_id)
        if holder is not None:
            holder.close_for_shutdown()
        hub.resume.release(session_id, f"the drain could not move it: {reason}")  # nothing if it is not detached
        log.info("session=%s not moved (%s); ended", session_id, reason)

    async def _move_live(
        self, client: httpx.AsyncClient, connection: LiveSession, peers: list[str], kind: str
    ) -> MoveReport:
        session = connection.session
        worker = self.hub.worker
        assert session is not None and worker is not None
        started = time.perf_counter()
        if session.state is not SessionState.ACTIVE:
            reason = f"the session was {session.state.value}"  # failed or closing on its own: nothing worth moving
            self._end(session.id, connection, reason)
            return MoveReport(session.id, False, kind=kind, reason=reason)
        connection.moving = True
        for job in worker.drop_ticks(session.id):
            session.absorb_update(job)
        shipped = await self._ship(client, session, connection.token_key, connection.client_host, peers)
        if shipped.ticket is None:
            self._end(session.id, connection, shipped.reason)
            return shipped.report(session.id, kind, started)
        token, next_chunk = str(shipped.ticket["resume"]), int(shipped.ticket["next_chunk_index"])
        self.hub.resume.forward(session.id, token, next_chunk)  # a reconnect with its old token follows too
        connection.close_moved(token, next_chunk)
        return shipped.report(session.id, kind, started)

    async def _move_detached(self, client: httpx.AsyncClient, session_id: str, peers: list[str]) -> MoveReport:
        started = time.perf_counter()
        held = self.hub.resume.hold_for_move(session_id)
        if held is None:  # released meanwhile (its grace ran out)
            return MoveReport(session_id, False, kind="detached", reason="it was released before its move began")
        shipped = await self._ship(client, held.session, held.owner, held.client_host, peers)
        if shipped.ticket is None:
            self._end(session_id, None, shipped.reason)
        else:
            # Its client comes back here with the old token: it gets `moved` with the peer's.
            self.hub.resume.forward(session_id, str(shipped.ticket["resume"]), int(shipped.ticket["next_chunk_index"]))
        return shipped.report(session_id, "detached", started)

    async def _move_resumed(self, client: httpx.AsyncClient, session_id: str, peers: list[str]) -> MoveReport:
        """A resume in flight when the drain began: once it has its connection, move it like any live session."""
        await self.hub.resume.until_resumed(session_id, self.settings.drain_timeout_s)
        connection = self.hub.connections.get(session_id)
        if connection is not None and connection.dialect.can_move and connection.session is not None and connection.session.live:
            return await self._move_live(client, connection, peers, "resuming")
        return MoveReport(session_id, False, kind="resuming", reason="its resume failed, which ended it")

    async def _ship(
        self, client: httpx.AsyncClient, session: Session, owner: str | None, client_host: str, peers: list[str]
    ) -> Shipped:
        """Export the session at its next chunk boundary and post it to the first peer that takes it."""
        worker = self.hub.worker
        assert worker is not None
        started = time.perf_counter()
        try:
            plan = await export_plan(worker, session.id)
        except SnapshotError as exc:
            return Shipped(None, f"export failed: {exc}")
        # After the export resolved, every earlier chunk has reached the client: the protocol state is final.
        # Whose session it is travels too: a resume must present the same auth token (by its key), and the
        # session counts against the same client's caps on the peer.
        plan.header["session"] = {**session.portable_state(), "owner": owner, "client_host": client_host}
        carry_start_image(plan, session.start_image)
        recorder = self.recorder
        if recorder is not None and session.record_to is not None:
            carry_recording(plan, recorder.hand_over(session.id, session.record_to))
        size = plan.nbytes
        export_ms = (time.perf_counter() - started) * 1e3
        loop = asyncio.get_running_loop()
        while True:
            refusals: list[str] = []
            later: list[float] = []  # when peers busy with other imports said to try again
            for peer in peers:
                try:
                    response = await client.post(
                        peer.rstrip("/") + IMPORT_PATH,
                        content=_pieces(worker, plan),  # streamed: the file is never whole on this side
                        headers={
                            "authorization": f"Bearer {self.settings.cluster_secret}",
                            "content-type": "application/octet-stream",
                            "content-length": str(size),
                        },
                    )
                except httpx.HTTPError as exc:
                    refusals.append(f"{peer}: {type(exc).__name__}: {exc}")
                    if isinstance(exc, CUT_OFF):
                        # Reached, then cut off mid-upload: how a refusal before the body reads from this side
                        # (the peer answers and closes without reading the rest), so again, like a busy peer.
                        later.append(IMPORT_RETRY_AFTER_S)
                    continue
                if response.status_code != 200:
                    refusals.append(f"{peer}: {response.status_code} {_detail(response)}")
                    later += _busy_retry_after(response)
                    continue
                log.info("session=%s moved to %s (%d bytes)", session.id, peer, size)
                ticket = response.json()
                if recorder is not None and session.record_to is not None and ticket.get("recording_kept"):
                    recorder.moved_away(session.id, session.record_to)  # the recording lives on with its session
                return Shipped(ticket, "", peer, size, export_ms)
            # A peer at its --max-parallel-imports takes it once another import has landed: again, within the drain.
            if not later or loop.time() + min(later) >= self._deadline:
                break
            await asyncio.sleep(min(later))
        reason = "no peer took it: " + ("; ".join(refusals) or "no peer given")
        return Shipped(None, reason, None, size, export_ms)


# Errors of a peer that took the connection and then cut the upload short (not one that could not be reached).
CUT_OFF = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


async def _pieces(worker: ModelWorker, plan: SnapshotPlan) -> AsyncIterator[bytes]:
    """The plan's bytes in pieces, the next piece read on the worker while this one is sent, then their digest
    (the file's last tensor: runner/snapshot_stream.py), hashed off the event loop."""
    seal = Seal()
    head = plan.head()
    seal.add(head)
    yield head
    pieces = plan.pieces()
    ahead: asyncio.Future[bytes] | None = read_parts(worker, pieces[0]) if pieces else None
    for index in range(len(pieces)):
        assert ahead is not None
        piece = await ahead
        ahead = read_parts(worker, pieces[index + 1]) if index + 1 < len(pieces) else None
        await asyncio.to_thread(seal.add, piece)
        yield piece
    yield seal.digest()


async def _drop_rest(pieces: AsyncIterator[bytearray], limit: int) -> None:
    """Read what is left of a refused upload and drop it, up to ``limit`` bytes; quietly stop if it cannot be read."""
    dropped = 0
    try:
        async for piece in pieces:
            dropped += len(piece)
            if dropped > limit:
                return
    except (Exception, TimeoutError):  # noqa: BLE001 - the refusal is what the sender gets, not this
        return


def _write_all(job: SessionImport, writes: list[Write], runner: SupportsExport) -> None:
    for write in writes:
        job.write(runner, write.index, write.offset, write.as_tensor())


def _quietly(future: asyncio.Future[Any]) -> None:
    """Nobody waits for this step (an abort after the request ended): its error, if any, is logged, not raised."""

    def logged(done: asyncio.Future[Any]) -> None:
        if not done.cancelled() and done.exception() is not None:
            log.warning("releasing a cut-short import failed: %s", done.exception())

    future.add_done_callback(logged)


@dataclass(frozen=True)
class Incoming:
    """A session whose snapshot is arriving: its import, the session it becomes, and whose it is."""

    job: SessionImport
    session: Session
    portable: dict[str, Any]
    next_chunk_index: int
    recording_names: dict[int, str] = field(default_factory=dict)  # table index -> file name, of its recording
    recording: IncomingRecording | None = None  # where those files go here; None: dropped (no room, not recording)

    @property
    def session_id(self) -> str:
        return self.job.session_id

    async def write_recording(self, writes: list[Write]) -> list[Write]:
        """Write the recording's bytes among ``writes`` to disk (off the event loop); returns the others."""
        if not self.recording_names:
            return writes
        mine = [write for write in writes if write.index in self.recording_names]
        if mine and self.recording is not None:
            await asyncio.to_thread(self._write_files, self.recording, mine)
        return [write for write in writes if write.index not in self.recording_names]

    def _write_files(self, recording: IncomingRecording, writes: list[Write]) -> None:
        for write in writes:
            recording.write(self.recording_names[write.index], write.offset, write.data)


@dataclass(frozen=True)
class Shipped:
    """What one shipment came to: the peer's ticket (None: no peer took it, ``reason`` says why)."""

    ticket: dict[str, Any] | None
    reason: str
    peer: str | None = None
    snapshot_bytes: int = 0
    export_ms: float = 0.0

    def report(self, session_id: str, kind: str, started: float) -> MoveReport:
        return MoveReport(
            session_id,
            self.ticket is not None,
            kind=kind,
            peer=self.peer,
            reason=self.reason,
            snapshot_bytes=self.snapshot_bytes,
            move_ms=(time.perf_counter() - started) * 1e3,
            export_ms=self.export_ms,
        )


def _settled_now(report: MoveReport) -> asyncio.Task[MoveReport]:
    async def settled() -> MoveReport:
        return report

    return asyncio.create_task(settled())


_exits: set[asyncio.Future[None]] = set()  # drains' exits in progress (a task must be referenced until done)

START_IMAGE_TENSOR = "start_image/pixels"


def carry_start_image(plan: SnapshotPlan, image: StartImage | None) -> None:
    """Put the session's start image in its snapshot: a reset on the peer starts from the same picture, and a
    session moved before its first chunk starts from it there."""
    if image is None:
        return
    plan.header["start_image"] = {"digest": image.digest, "name": image.name}
    if image.pixels is not None:
        plan.add_tensor(START_IMAGE_TENSOR, torch.from_numpy(np.array(image.pixels, dtype=np.uint8, copy=True)))


def check_start_image(header: dict[str, Any], pixels: TensorEntry | None, max_pixels: int) -> None:
    """The start image a snapshot says it carries (:func:`carry_start_image`), checked like an upload from its
    header and table alone, before a byte of it is taken; ValueError if bad."""
    meta = header.get("start_image")
    if meta is None:
        if pixels is not None:
            raise ValueError("start image pixels without their start_image section")
        return
    if not isinstance(meta, dict) or not isinstance(meta.get("digest"), str):
        raise ValueError("the start_image section must be an object with a digest")
    name = meta.get("name")
    if name is not None and not isinstance(name, str):
        raise ValueError("the start image's name must be a string")
    if pixels is None:
        return
    if pixels.dtype != torch.uint8 or len(pixels.shape) != 3 or pixels.shape[2] != 3:
        raise ValueError(f"start image pixels must be uint8 [H, W, 3], got {pixels.dtype} {list(pixels.shape)}")
    if pixels.shape[0] * pixels.shape[1] > max_pixels:
        raise ValueError(f"the start image has over max_start_image_pixels {max_pixels} pixels")


def carried_start_image(
    header: dict[str, Any], tensors: dict[str, torch.Tensor], max_pixels: int
) -> StartImage | None:
    """The start image a snapshot carries (its header's section, its pixels from ``tensors``); ValueError if bad."""
    pixels = tensors.get(START_IMAGE_TENSOR)
    check_start_image(header, None if pixels is None else TensorEntry.of(START_IMAGE_TENSOR, pixels), max_pixels)
    meta = header.get("start_image")
    if meta is None:
        return None
    return StartImage(digest=meta["digest"], name=meta.get("name"), pixels=None if pixels is None else pixels.numpy())


RECORDING_PREFIX = "recording/"


def carry_recording(plan: SnapshotPlan, files: list[Path]) -> None:
    """Put a recorded session's files in its snapshot, one uint8 tensor each (``recording/part-0000.mp4``), read
    from disk a piece at a time as the snapshot is sent."""
    for path in files:
        size = path.stat().st_size
        parts: list[Part] = [partial(_file_span, path, offset, PIECE_BYTES) for offset in range(0, size, PIECE_BYTES)]
        plan.tensors.append(TensorPlan(RECORDING_PREFIX + path.name, torch.uint8, (size,), parts))


def _file_span(path: Path, offset: int, length: int) -> torch.Tensor:
    with path.open("rb") as file:
        file.seek(offset)
        data = bytearray(file.read(length))
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def carried_recording(tensors: list[TensorEntry]) -> dict[int, str]:
    """The recording files a snapshot carries (:func:`carry_recording`), by table index, checked from its table
    alone: a file's name, a flat uint8 tensor; ValueError if not. (Their bytes count against the snapshot's size
    bound; whether this replica keeps them is its recording budgets' call, :meth:`Recordings.receive`.)"""
    files: dict[int, str] = {}
    for index, entry in enumerate(tensors):
        if not entry.name.startswith(RECORDING_PREFIX):
            continue
        name = entry.name[len(RECORDING_PREFIX):]
        if not FILE_PATTERN.match(name) or entry.dtype != torch.uint8 or len(entry.shape) != 1:
            raise ValueError(f"{entry.name[:80]!r} is not a recording file (recording/part-NNNN.mp4, flat uint8)")
        files[index] = name
    return files


def _busy_retry_after(response: httpx.Response) -> list[float]:
    """``[seconds]`` for a peer's refusal of the moment (503 with Retry-After: its import slots are taken)."""
    value = response.headers.get("retry-after", "")
    if response.status_code != 503 or not value.isdigit():
        return []
    return [float(value)]


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail", ""))
    except ValueError:
        return response.text[:200]


def add_cluster_routes(app: FastAPI, hub: SessionHub) -> Migration:
    """``POST /v1/cluster/import`` and ``POST /v1/cluster/drain`` (see the module docstring)."""
    migration = Migration(hub)
    settings = hub.settings
    gate = SecretGate(settings.cluster_secret)

    @app.post(IMPORT_PATH)
    async def import_session(request: Request) -> JSONResponse:
        refusal = gate.refusal(request)
        if refusal is not None:
            return refusal
        try:
            ticket = await migration.take(request.stream())
        except ImportRefused as exc:
            # The reason may quote what the sender wrote: escaped and bounded, in the log and the answer alike.
            detail = excerpt(str(exc), MAX_ERROR_MESSAGE_CHARS)
            log.info("refused a moved session: %s", detail)
            # A refusal may come before the body is read: the connection closes with it, or the body's unread
            # bytes would be read as the sender's next request on the same connection.
            headers = {"connection": "close"}
            if exc.retry_after_s is not None:
                headers["retry-after"] = str(exc.retry_after_s)
            return JSONResponse({"detail": detail}, status_code=exc.status, headers=headers)
        return JSONResponse(ticket)

    @app.post(DRAIN_PATH)
    async def drain(request: Request) -> JSONResponse:
        refusal = gate.refusal(request)
        if refusal is not None:
            return refusal
        try:
            options = await request.json() if await request.body() else {}
            peers = options.get("peers") or None  # None: this replica's --cluster-peers
            exit_after = bool(options.get("exit", True))
            if peers is not None and (not isinstance(peers, list) or not all(isinstance(p, str) for p in peers)):
                raise ValueError("peers must be a list of URLs")
        except (ValueError, AttributeError) as exc:
            return JSONResponse({"detail": f"bad drain request: {exc}"}, status_code=400)
        report = await migration.drain(peers)
        if exit_after:
            exiting = asyncio.ensure_future(migration.drain_then_exit())
            exiting.add_done_callback(_exits.discard)
            _exits.add(exiting)
        return JSONResponse(report.as_json())

    @app.get(HOLDER_PATH + "/{session_id}")
    async def holds(request: Request, session_id: str) -> JSONResponse:
        # `arstream drain --which SESSION`: does this replica hold the session, and how?
        refusal = gate.refusal(request)
        if refusal is not None:
            return refusal
        held = migration.holding(session_id)
        body = {"session_id": session_id, "replica": settings.replica_id, "held": held}
        return JSONResponse(body, status_code=200 if held is not None else 404)

    return migration

"""Drain: move a replica's live sessions to peers, so a rolling restart loses no world.

Two routes on the replica's private side, both off unless ``cluster_secret``
is set, and both requiring it as a bearer token (a replica never accepts
state from anyone else; HAProxy does not route ``/v1/cluster/`` from outside):

- ``POST /v1/cluster/import`` (peer side): the body is a session snapshot
  (:mod:`arstream.runner.snapshot`, protocol state in its ``session``
  section). The replica checks model and config, that it has room and is not
  draining itself, makes the session resident on its worker and holds it
  detached (:meth:`ResumeRegistry.hold_moved`) under a fresh resume token with
  its own replica prefix, and answers ``{"resume": TOKEN, "next_chunk_index": K}``.
  A refusal (401 secret, 429 after too many wrong secrets from one address,
  409 model/config/room, 400 malformed: past the header's bounds or a
  `session` section a replica would not make, 503 not ready) leaves its pool
  as it was.
- ``POST /v1/cluster/drain`` (operator side, ``arstream drain URL --to PEER``):
  the replica stops admitting, then moves each live session at a chunk
  boundary: its connection stops running ticks (their controls are kept), the
  worker exports it after the chunks already queued have reached the client,
  the snapshot goes to the first peer that takes it, and the client gets
  ``moved`` with the peer's token and is closed (``closed``: ``moved``); the
  session is then released here. A session no peer takes ends as on shutdown
  (``server_shutdown``). Answers with a report once none is left or
  ``drain_timeout_s`` has passed, and then (``exit``) stops the server.

Detached sessions are not moved: their clients hold tokens for this replica,
so they end at shutdown as before.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from arstream.app.connection import Connection
from arstream.app.drain import DRAIN_PATH
from arstream.app.guard import BAN_TABLE_PRUNE_AT
from arstream.app.limits import MessageBudget
from arstream.app.portable_session import PortableSessionError, validated_session
from arstream.app.protocol import MAX_ERROR_MESSAGE_CHARS, excerpt
from arstream.app.resume import ResumeRefused
from arstream.app.session import Session, SessionState
from arstream.app.wire import PROTOCOL_VERSION
from arstream.runner.snapshot import SessionSnapshot, SnapshotError, SnapshotRefused, check_compatible, read_header

if TYPE_CHECKING:
    from arstream.app.hub import SessionHub

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

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class MoveReport:
    """What became of one session in a drain."""

    session_id: str
    moved: bool
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
    """The cluster secret's check, with a price on guessing: each client address has
    ``CLUSTER_AUTH_BURST`` wrong tries, then one per ``1 / CLUSTER_AUTH_RATE_PER_S`` seconds; meanwhile every
    request from it gets 429 and the secret is not even compared. The right secret costs nothing."""

    def __init__(self, secret: str | None) -> None:
        self.secret = secret
        self._tries: dict[str, MessageBudget] = {}  # client address -> its budget of wrong secrets

    def refusal(self, request: Request) -> JSONResponse | None:
        """404 when cluster routes are off, 429 past the address's tries, 401 for a wrong secret, else None."""
        if self.secret is None:
            off = "cluster routes are off on this replica (no cluster_secret)"
            return JSONResponse({"detail": off}, status_code=404)
        host = request.client.host if request.client is not None else ""
        now = time.monotonic()
        budget = self._tries.get(host)
        if budget is not None and not budget.has_token(now):
            wait_s = 1.0 / CLUSTER_AUTH_RATE_PER_S
            return JSONResponse(
                {"detail": f"too many wrong cluster secrets from this address; one try per {wait_s:g} s"},
                status_code=429,
                headers={"retry-after": f"{wait_s:.0f}"},
            )
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.encode(), self.secret.encode()):
            return None
        if budget is None:
            if len(self._tries) >= BAN_TABLE_PRUNE_AT:  # forget addresses whose budget has refilled
                self._tries = {h: b for h, b in self._tries.items() if not b.full(now)}
            budget = self._tries[host] = MessageBudget(CLUSTER_AUTH_RATE_PER_S, CLUSTER_AUTH_BURST, now)
        budget.try_spend(now)
        return JSONResponse({"detail": "wrong or missing cluster secret"}, status_code=401)


class Migration:
    """Both sides of moving sessions between replicas, for one hub."""

    def __init__(self, hub: SessionHub) -> None:
        self.hub = hub
        self.settings = hub.settings
        self._drain: asyncio.Task[DrainReport] | None = None
        # Set by the server (ARStreamServer): stops it once a drain with ``exit`` has finished.
        self.request_exit: Callable[[], None] | None = None

    # ---- peer side: taking a session -----------------------------------------------------------

    def _max_snapshot_bytes(self) -> int:
        worker = self.hub.worker
        plan = getattr(worker.runner, "plan", None) if worker is not None else None
        per_session = plan.per_session_bytes if plan is not None else 0
        return per_session + SNAPSHOT_SLACK_BYTES

    async def accept(self, data: bytes) -> dict[str, Any]:
        """Take a moved session; its resume ticket for the client, or :class:`ImportRefused`."""
        hub = self.hub
        worker = hub.worker
        if hub.draining or hub.shutting_down or not hub.ready or worker is None or worker.runner is None:
            raise ImportRefused(503, hub.admission_refusal() or "this replica is not ready")
        try:
            # Off the event loop: a header is bounded (runner/snapshot_header.py), but parsing it still takes a while.
            header = await asyncio.to_thread(read_header, data)
            check_compatible(worker.runner, header, PROTOCOL_VERSION)  # type: ignore[arg-type]
            portable = validated_session(header.get("session"))
        except SnapshotRefused as exc:
            raise ImportRefused(409, str(exc)) from None
        except (SnapshotError, PortableSessionError) as exc:
            raise ImportRefused(400, str(exc)) from None
        held = len(hub.connections) + len(hub.resume.resuming) + hub.resume.detached_count
        if held >= hub.session_capacity:
            raise ImportRefused(409, f"no room: {held} of {hub.session_capacity} session slots are held")
        try:
            snapshot = await asyncio.to_thread(SessionSnapshot.from_bytes, data)
            session_id = str(portable["id"])
            if session_id in hub.connections or worker.runner.is_resident(session_id):
                raise ImportRefused(409, f"session {session_id!r} is already on this replica")
            session = Session.from_portable(
                portable, session_id=session_id, max_pending_ticks=self.settings.max_pending_ticks
            )
        except (SnapshotError, KeyError, TypeError, ValueError) as exc:
            raise ImportRefused(400, f"malformed session snapshot: {type(exc).__name__}: {exc}") from None
        try:
            await worker.import_session(session_id, snapshot)
        except SnapshotRefused as exc:
            raise ImportRefused(409, str(exc)) from None
        except SnapshotError as exc:
            raise ImportRefused(400, str(exc)) from None
        try:
            token = hub.resume.hold_moved(
                session, owner=portable.get("owner"), client_host=str(portable.get("client_host", ""))
            )
        except ResumeRefused as exc:
            worker.drop_session(session_id)
            raise ImportRefused(409, str(exc)) from None
        return {"resume": token, "next_chunk_index": snapshot.next_chunk_index, "session_id": session_id}

    # ---- draining side: moving sessions away ---------------------------------------------------

    async def drain(self, peers: list[str]) -> DrainReport:
        """Stop admitting, move every live session to a peer (or end it); one drain at a time."""
        if self._drain is None or self._drain.done() and self._drain.cancelled():
            self._drain = asyncio.create_task(self._drain_all(peers))
        return await asyncio.shield(self._drain)

    async def _drain_all(self, peers: list[str]) -> DrainReport:
        hub = self.hub
        hub.draining = True
        hub.metrics.drains.inc()
        report = DrainReport()
        live = [c for c in hub.connections.values() if c.session is not None and c.session.live]
        # Protocol 1 sessions move; the realtime video dialect's have no `moved` message: they end as on shutdown.
        connections = [c for c in live if isinstance(c, Connection)]
        for other in live:
            if not isinstance(other, Connection):
                other.close_for_shutdown()
                report.sessions.append(MoveReport(other.session_id, False, reason="its dialect cannot follow a move"))
        log.info("draining: moving %d session(s) to %s", len(connections), ", ".join(peers) or "no peer")
        # TLS only matters for https:// peers; loading the CA bundle otherwise costs a drain ~0.3 s for nothing.
        tls = any(peer.startswith("https://") for peer in peers)
        async with httpx.AsyncClient(timeout=PEER_TIMEOUT_S, verify=tls) as client:
            moves = [asyncio.create_task(self._move(client, c, peers)) for c in connections]
            done, pending = await asyncio.wait(moves, timeout=self.settings.drain_timeout_s) if moves else (set(), set())
            for task in pending:
                task.cancel()
            for connection, task in zip(connections, moves):
                if task in done and task.exception() is None:
                    outcome = task.result()
                else:
                    error = task.exception() if task in done else None
                    if error is not None:
                        log.error("session=%s move failed", connection.session_id, exc_info=error)
                    reason = f"the move failed: {error!r}" if error is not None else "the drain's time ran out"
                    outcome = MoveReport(connection.session_id, False, reason=reason)
                    connection.close_for_shutdown()
                report.sessions.append(outcome)
        report.moved = sum(1 for s in report.sessions if s.moved)
        report.ended = len(report.sessions) - report.moved
        log.info("drained: %d session(s) moved, %d ended", report.moved, report.ended)
        return report

    async def _move(self, client: httpx.AsyncClient, connection: Connection, peers: list[str]) -> MoveReport:
        session = connection.session
        worker = self.hub.worker
        assert session is not None and worker is not None
        started = time.perf_counter()
        if session.state is not SessionState.ACTIVE:
            connection.close_for_shutdown()  # failed or closing on its own: nothing worth moving
            return MoveReport(session.id, False, reason=f"the session was {session.state.value}")
        connection.moving = True
        for job in worker.drop_ticks(session.id):
            session.absorb_update(job)
        try:
            snapshot = await worker.export_session(session.id)
        except Exception as exc:  # noqa: BLE001 - a session that cannot move ends as on shutdown
            connection.close_for_shutdown()
            return MoveReport(session.id, False, reason=f"export failed: {exc}")
        # After the export resolved, every earlier chunk has reached this connection: the protocol state is final.
        # Whose session it is travels too: a resume must present the same auth token (by its key), and the
        # session counts against the same client's caps on the peer.
        snapshot.header["session"] = {
            **session.portable_state(),
            "owner": connection.token_key,
            "client_host": connection.client_host,
        }
        data = await asyncio.to_thread(snapshot.to_bytes)
        export_ms = (time.perf_counter() - started) * 1e3
        refusals: list[str] = []
        for peer in peers:
            try:
                response = await client.post(
                    peer.rstrip("/") + IMPORT_PATH,
                    content=data,
                    headers={
                        "authorization": f"Bearer {self.settings.cluster_secret}",
                        "content-type": "application/octet-stream",
                    },
                )
            except httpx.HTTPError as exc:
                refusals.append(f"{peer}: {type(exc).__name__}: {exc}")
                continue
            if response.status_code != 200:
                refusals.append(f"{peer}: {response.status_code} {_detail(response)}")
                continue
            ticket = response.json()
            connection.close_moved(str(ticket["resume"]), int(ticket["next_chunk_index"]))
            move_ms = (time.perf_counter() - started) * 1e3
            log.info("session=%s moved to %s in %.0f ms (%d bytes)", session.id, peer, move_ms, len(data))
            return MoveReport(
                session.id, True, peer=peer, snapshot_bytes=len(data), move_ms=move_ms, export_ms=export_ms
            )
        connection.close_for_shutdown()
        reason = "no peer took it: " + ("; ".join(refusals) or "no peer given")
        log.info("session=%s not moved (%s); ended", session.id, reason)
        return MoveReport(session.id, False, reason=reason, snapshot_bytes=len(data))


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
        limit = migration._max_snapshot_bytes()
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                return JSONResponse({"detail": f"a session snapshot here is at most {limit} bytes"}, status_code=413)
        try:
            ticket = await migration.accept(bytes(body))
        except ImportRefused as exc:
            # The reason may quote what the sender wrote: escaped and bounded, in the log and the answer alike.
            detail = excerpt(str(exc), MAX_ERROR_MESSAGE_CHARS)
            log.info("refused a moved session: %s", detail)
            return JSONResponse({"detail": detail}, status_code=exc.status)
        return JSONResponse(ticket)

    @app.post(DRAIN_PATH)
    async def drain(request: Request) -> JSONResponse:
        refusal = gate.refusal(request)
        if refusal is not None:
            return refusal
        try:
            options = await request.json() if await request.body() else {}
            peers = options.get("peers") or [p.strip() for p in settings.cluster_peers.split(",") if p.strip()]
            exit_after = bool(options.get("exit", True))
            if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
                raise ValueError("peers must be a list of URLs")
        except (ValueError, AttributeError) as exc:
            return JSONResponse({"detail": f"bad drain request: {exc}"}, status_code=400)
        report = await migration.drain(peers)
        if exit_after and migration.request_exit is not None:
            asyncio.get_running_loop().call_later(0.1, migration.request_exit)
        return JSONResponse(report.as_json())

    return migration

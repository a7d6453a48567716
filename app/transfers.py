"""Exports, imports, branches and parking: the runtime calls that are not ticks, each on the model worker's thread.

The worker owns the runtime, the pool and the device (app/worker.py); nothing
else touches them. Everything here is a function handed to
:meth:`ModelWorker.call`, which runs it at the next chunk boundary and
resolves a future on the event loop. A runtime that cannot export its sessions
(:class:`~arstream.runner.capabilities.SupportsExport`) refuses moves and
branches with :class:`SnapshotRefused`; one that does not park
(:class:`~arstream.runner.capabilities.SupportsParking`) ignores parking.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from .wire import PROTOCOL_VERSION
from .worker import OnWorkerThread
from ..runner.capabilities import SupportsExport
from ..runner.runtimes import park_idle as park_idle_now
from ..runner.runtimes import park_session as park_session_now
from ..runner.snapshot import SessionSnapshot, identity, session_bytes, transferable, unstarted_snapshot
from ..runner.snapshot_import import SessionImport, import_session as import_whole
from ..runner.snapshot_stream import Part, SnapshotPlan, piece_bytes, plan_export, plan_of

_T = TypeVar("_T")


class RunsCalls(Protocol):
    """A model worker, as these functions use it: :meth:`ModelWorker.call` and nothing else."""

    def call(self, function: Callable[[OnWorkerThread], _T], *, lane: str | None = None) -> asyncio.Future[_T]: ...


@dataclass(frozen=True)
class Receiving:
    """What this replica checks an incoming snapshot against, taken on the worker's thread."""

    identity: dict[str, Any]  # runner/snapshot.py's identity (its config hash reads the weights once)
    session_bytes: int  # a resident session's bytes at most (the pool's plan)


def receiving(worker: RunsCalls) -> asyncio.Future[Receiving]:
    """This replica's identity and a session's size, for an incoming move: :class:`SnapshotRefused` when the
    runtime cannot take sessions. Hashing the weights (the first time) runs on the worker's thread, never on
    the event loop."""

    def take(on: OnWorkerThread) -> Receiving:
        runtime = transferable(on.runtime)
        return Receiving(identity(runtime, PROTOCOL_VERSION), session_bytes(runtime))

    return worker.call(take)


def export_plan(worker: RunsCalls, session_id: str) -> asyncio.Future[SnapshotPlan]:
    """Resolves with the session's snapshot as a plan to read in pieces (runner/snapshot_stream.py), taken
    at its next chunk boundary; nothing is copied yet. The session must run no tick until its parts are
    read (:func:`read_parts`).

    It resolves through the session's lane, after the outcomes of its earlier
    ticks: the client has every chunk before the snapshot's ``next_chunk_index``.
    Raises :class:`SnapshotError` through the future when the session cannot be
    exported (evicted, a model without the hook). A session that had ``ready``
    but no chunk yet has nothing resident: its plan is an unstarted snapshot
    (the peer starts its rollout).
    """

    def plan(on: OnWorkerThread) -> SnapshotPlan:
        runtime = transferable(on.runtime)
        if not runtime.sessions.holds(session_id) and session_id not in on.produced:
            return plan_of(unstarted_snapshot(runtime, protocol_version=PROTOCOL_VERSION))
        return plan_export(runtime, session_id, protocol_version=PROTOCOL_VERSION)

    return worker.call(plan, lane=session_id)


def read_parts(worker: RunsCalls, parts: Sequence[Part]) -> asyncio.Future[bytes]:
    """A piece of a plan's bytes (``parts`` in order), read on the worker between forwards: it owns the
    device and the pool."""
    return worker.call(lambda _on: b"".join(piece_bytes(part()) for part in parts))


def import_session(worker: RunsCalls, session_id: str, snapshot: SessionSnapshot) -> asyncio.Future[None]:
    """Resolves once ``snapshot`` is resident as ``session_id``; :class:`SnapshotRefused` when it does not fit."""

    def adopt(on: OnWorkerThread) -> None:
        import_whole(transferable(on.runtime), session_id, snapshot, protocol_version=PROTOCOL_VERSION)
        if snapshot.resident:
            on.produced.add(session_id)  # its chunks were produced elsewhere: a later eviction says so
        on.restart_stream(session_id)

    return worker.call(adopt)


def import_step(
    worker: RunsCalls, job: SessionImport, step: Callable[[SupportsExport], _T]
) -> asyncio.Future[_T]:
    """One step of a streamed import (``job.begin``, ``write``, ``finish``, ``abort``: runner/snapshot_import.py)
    on the worker. While the import holds the session resident, its chunks count as produced elsewhere, as
    for :func:`import_session`."""

    def run(on: OnWorkerThread) -> _T:
        try:
            return step(transferable(on.runtime))
        finally:
            if job.holds and job.session_id not in on.produced:
                on.produced.add(job.session_id)
                on.restart_stream(job.session_id)
            elif not job.holds and job.held:
                on.produced.discard(job.session_id)

    return worker.call(run)


def branch_session(worker: RunsCalls, source_id: str, boundary: int | None, new_session_id: str) -> asyncio.Future[int]:
    """Resolves to the boundary once ``new_session_id`` is resident, continuing from ``source_id``'s chunk
    boundary ``boundary`` (None: where the source is now); :class:`RewindUnavailable` when the boundary is
    not held, the runtime's capacity error when there is no room."""

    def branch(on: OnWorkerThread) -> int:
        index = on.runtime.branch_session(source_id, boundary, new_session_id)
        # From a later boundary it has a history: an eviction before its next chunk says so. From boundary 0 it
        # has none to lose: its first chunk goes on with the source's rollout from its start, no restart.
        if index > 0:
            on.produced.add(new_session_id)
        on.restart_stream(new_session_id)
        return index

    return worker.call(branch)


def park_session(worker: RunsCalls, session_id: str) -> None:
    """Park the session's device state in host memory at the next chunk boundary (it detached), where the
    runtime parks (runner/session_parking.py). Nobody waits for it."""
    _unawaited(worker.call(lambda on: park_session_now(on.runtime, session_id)))


def park_idle(worker: RunsCalls) -> None:
    """Park the sessions idle past ``--park-after-s`` at the next chunk boundary, whether or not a tick comes."""
    _unawaited(worker.call(lambda on: park_idle_now(on.runtime)))


def _unawaited(future: asyncio.Future[None]) -> None:
    """Nobody waits for ``future``: its error (a worker that is stopping) is read, so nothing reports it unread."""
    future.add_done_callback(lambda done: None if done.cancelled() else done.exception())

"""The model worker: one thread owns the runner, the pipeline and the device.

The event loop never runs model code. It hands the worker accepted ticks
(:meth:`ModelWorker.submit`) and session releases (:meth:`ModelWorker.drop_session`);
the worker answers with :class:`TickOutcome` objects through
``loop.call_soon_threadsafe``.

Scheduling: control jobs (releases) run first at every chunk boundary, so a
session that went away frees its KV before anyone else's chunk needs room.
Which ticks run next is :mod:`arstream.app.scheduler`'s decision (lanes, round
robin, the straggler wait), made under the worker's lock with the time passed
in. A round is the next tick of each of up to ``runtime.batch_limit``
sessions (the ``max_batch_sessions`` setting, when the model batches), handed
to :meth:`Runtime.execute` together, which runs sessions with equally long
histories as one forward; every tick still gets its own outcome, and a model
failure fails only its own session.

The worker runs forwards and nothing else: every outcome goes to the
:class:`~arstream.app.encoding.EncoderPool`, whose threads encode frames and
deliver to the event loop while the next forward runs, in order per session
(each session's lane carries its chunks, its errors and its position reports).
Each round's wall time is recorded per number of sessions in it, for realtime
admission (:mod:`arstream.app.admission`).

Decode overlap (``decode_overlap``, a runtime with ``split_decode``): a
round's forward returns latents, which :class:`~arstream.app.decode_stage.DecodeStage`
decodes on its own thread while the next round's forward runs. The worker
joins that decode after the next forward and sends its outcomes before
anything of the next round, so every session's chunks stay in order; a decode
failure releases that session (fail closed, every block back) and its next
chunk, already forwarded, is dropped. Control jobs (releases, snapshots,
positions) and idle waits join the decode first. :attr:`ModelWorker.phases`
sums DiT, decode and overlap time per round. The queue is bounded by
the sessions' credits (sessions x ``max_pending_ticks``); the event loop
enforces the credits and the worker checks the bound.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .admission import RoundTimes
from .decode_stage import DecodedRound, DecodeStage, RoundPhases, overlap_s
from .encoding import EncoderPool
from .recorder import Recordings
from .scheduler import RoundScheduler, Run, TickLanes
from .session import ChunkInputs, PendingEvent, TickJob, restart_reason
from .wire import PROTOCOL_VERSION
from ..measure import percentile
from ..runner.runtimes import Runtime, SplitDecodeRuntime, park_idle, park_session
from ..runner.snapshot import SessionSnapshot, import_session, transferable, unstarted_snapshot
from ..runner.snapshot_import import SessionImport
from ..runner.snapshot_stream import Part, SnapshotPlan, piece_bytes, plan_export, plan_of
from ..runner.stats import RunnerStats
from ..runner.types import ChunkResult, RewindUnavailable, TickFailure, TickRequest

if TYPE_CHECKING:
    from ..runner.runner import ARRunner  # a streamed import's steps take the transferable runner

log = logging.getLogger("arstream.worker")

COMPUTE_TIMES_KEPT = 4096
VIEWERS_LANE_SUFFIX = "#viewers"  # the encoder lane of a session's viewers' formats (never a session id)
_T = TypeVar("_T")


class OutcomeKind(Enum):
    CHUNK = "chunk"
    MODEL_FAILED = "model_failed"  # this tick's forward raised; the runner released the session
    REWIND_UNAVAILABLE = "rewind_unavailable"  # its rewind_to names a boundary not held: nothing ran
    SKIPPED_FAILED = "skipped_failed"  # queued behind a failed tick and not a reset: not run
    INTERNAL = "internal"  # a server fault after the forward (e.g. encoding)


@dataclass(frozen=True)
class TickOutcome:
    """What became of one tick; delivered on the event loop."""

    job: TickJob
    kind: OutcomeKind
    chunk_index: int = 0
    frame_messages: tuple[bytes, ...] = ()
    events: tuple[PendingEvent, ...] = ()
    restarted: str | None = None
    queue_s: float = 0.0
    compute_s: float = 0.0
    encode_s: float = 0.0
    error: str = ""
    # The format of frame_messages, and the chunk's pixels, kept only when its session's viewers need
    # other formats (Session.viewer_formats).
    codec: str = ""
    quality: int = 0
    frames: np.ndarray | None = None
    rewind_points: tuple[int, ...] | None = None  # boundaries a later rewind_to may name, oldest first (None: off)

    @property
    def applied_event_ids(self) -> list[int]:
        return [e.event_id for e in self.events]


@dataclass(frozen=True)
class SessionPosition:
    """Where a session's rollout stands at a chunk boundary (for a resume ticket)."""

    next_chunk_index: int
    failed: bool  # its last forward failed: only a tick with reset: true runs next
    evicted: bool  # it had produced chunks and the pool reclaimed its KV


def _resolve(future: asyncio.Future[SessionPosition], position: SessionPosition) -> None:
    if not future.done():  # the waiter may have been cancelled
        future.set_result(position)


class _Handoff:
    """Calls from the encoder threads run on the event loop in arrival order, many per loop wake-up.

    A round of 16 sessions yields 16 outcomes within a few milliseconds; one
    ``call_soon_threadsafe`` for all that are waiting spares the loop 15 wake-ups.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._waiting: list[Callable[[], None]] = []

    def call(self, function: Callable[[], None]) -> None:
        with self._lock:
            self._waiting.append(function)
            if len(self._waiting) > 1:
                return  # a drain is already scheduled and will take this one too
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for function in waiting:
            try:
                function()
            except Exception:  # noqa: BLE001 - as call_soon would: log it, and still run the others
                log.exception("delivering a worker result failed")


@dataclass(frozen=True)
class _Decoding:
    """A chunk handed to the decode stage, with what its outcome needs."""

    job: TickJob
    inputs: ChunkInputs
    restarted: str | None
    queue_s: float
    forward_s: float


class QueueBoundExceeded(RuntimeError):
    """More ticks were queued than the sessions' credits allow (a server bug)."""


def deliver_to_session(outcome: TickOutcome) -> None:
    """Hand an outcome to whoever serves its session now (``Session.deliver``; nobody: it is dropped)."""
    deliver = outcome.job.session.deliver
    if deliver is not None:
        deliver(outcome)


class ModelWorker:
    """Runs every runner call on one thread; see the module docstring."""

    def __init__(
        self,
        build_runner: Callable[[], Runtime],
        *,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[TickOutcome], None] = deliver_to_session,
        on_ready: Callable[[BaseException | None], None],
        max_pending_ticks: int,
        encode_threads: int | None = None,
        encoder_nice: int = 0,
        batch_wait_fraction: float = 0.0,
    ) -> None:
        self._build_runner = build_runner
        self._loop = loop
        self._deliver = deliver
        self._on_ready = on_ready
        self._max_pending_ticks = max_pending_ticks
        self._cond = threading.Condition()
        # Each session's queued ticks and the round-robin line (guarded by _cond).
        self._lanes: TickLanes[TickJob] = TickLanes()
        self._scheduler = RoundScheduler(batch_wait_fraction)
        self._controls: deque[Callable[[], None]] = deque()
        self._stopping = False
        self.runner: Runtime | None = None
        self.runner_stats: RunnerStats | None = None
        self.model_card: dict[str, Any] | None = None
        # Worker-thread bookkeeping per session id: had a failed forward / chunks generated.
        self._failed: set[str] = set()
        # sessions that have produced a chunk in this connection (an evicted restart says so)
        self._produced: set[str] = set()
        self._times_lock = threading.Lock()
        self._compute_times: deque[float] = deque(maxlen=COMPUTE_TIMES_KEPT)
        self.round_times = RoundTimes()
        self.phases = RoundPhases()
        self._decode_stage: DecodeStage[_Decoding] | None = None
        self._encoders = EncoderPool(encode_threads, nice=encoder_nice)
        self.recorder: Recordings | None = None  # set by the server when it records (--record-dir)
        self._handoff = _Handoff(loop)
        self._thread = threading.Thread(target=self._main, name="arstream-model-worker", daemon=True)

    # ---- event-loop side ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Ticks queued and not yet running."""
        return self._lanes.queued

    def submit(self, job: TickJob) -> None:
        """Queue an accepted tick behind the session's earlier ones."""
        with self._cond:
            if self._stopping:
                return
            queued = self._lanes.lane_length(job.session.id)
            if queued >= self._max_pending_ticks:
                raise QueueBoundExceeded(
                    f"session {job.session.id} already has {queued} queued ticks "
                    f"(max_pending_ticks={self._max_pending_ticks})"
                )
            self._lanes.push(job.session.id, job)
            if job.session.chunks_ahead_limit is not None:
                job.session.on_credit_returned = self._wake
            self._cond.notify()

    def drop_session(self, session_id: str) -> int:
        """Drop the session's queued ticks and release its KV on the worker; returns ticks dropped."""
        with self._cond:
            dropped = len(self._take_lane(session_id))
            self._controls.append(lambda: self._release(session_id))
            self._cond.notify()
        return dropped

    def drop_ticks(self, session_id: str) -> tuple[TickJob, ...]:
        """Take the session's queued ticks out of line and keep its KV (a detached session); returns them."""
        with self._cond:
            return self._take_lane(session_id)

    def _take_lane(self, session_id: str) -> tuple[TickJob, ...]:
        """Remove the session's queued ticks (call with the lock held)."""
        self._scheduler.forget(session_id)
        return self._lanes.take_lane(session_id)

    def park_session(self, session_id: str) -> None:
        """Park the session's device state in host memory at the next chunk boundary (it detached; runner/parking.py)."""
        with self._cond:
            self._controls.append(lambda: park_session(self.runner, session_id))
            self._cond.notify()

    def park_idle(self) -> None:
        """Park the sessions idle past ``--park-after-s`` at the next chunk boundary, whether or not a tick comes."""
        with self._cond:
            self._controls.append(lambda: park_idle(self.runner))
            self._cond.notify()

    def session_position(self, session_id: str) -> asyncio.Future[SessionPosition]:
        """Resolves on the event loop with where the session stands once none of its ticks is running.

        It is a control job: it runs at the next chunk boundary, and the outcomes of
        the session's earlier ticks reach the event loop before it resolves. It is
        asked for on resume, so the session's next chunk also starts a new video
        stream (a keyframe) that the resuming client can decode from.
        """
        future: asyncio.Future[SessionPosition] = self._loop.create_future()

        def report() -> None:
            assert self.runner is not None
            position = SessionPosition(
                next_chunk_index=self.runner.next_chunk_index(session_id),
                failed=session_id in self._failed,
                evicted=session_id in self._produced
                and session_id not in self._failed
                and not self.runner.is_resident(session_id),
            )
            # Through the session's lane: after the outcomes of its earlier ticks, before any later chunk.
            self._encoders.restart_stream(session_id)
            self._encoders.submit(session_id, lambda: self._handoff.call(lambda: _resolve(future, position)))

        with self._cond:
            if self._stopping:
                future.set_exception(RuntimeError("the model worker is stopping"))
                return future
            self._controls.append(report)
            self._cond.notify()
        return future

    def export_plan(self, session_id: str) -> asyncio.Future[SnapshotPlan]:
        """Resolves with the session's snapshot as a plan to read in pieces (runner/snapshot_stream.py), taken
        at its next chunk boundary; nothing is copied yet. The session must run no tick until its parts are
        read (:meth:`read_part`).

        Like :meth:`session_position`, it resolves through the session's lane, after
        the outcomes of its earlier ticks: the client has every chunk before the
        snapshot's ``next_chunk_index``. Raises :class:`SnapshotError` through the
        future when the session cannot be exported (evicted, a model without the hook).
        A session that had ``ready`` but no chunk yet has nothing resident: its plan
        is an unstarted snapshot (the peer starts its rollout).
        """

        def plan(runner: Runtime) -> SnapshotPlan:
            transfer = transferable(runner)
            if not transfer.is_resident(session_id) and session_id not in self._produced:
                return plan_of(unstarted_snapshot(transfer, protocol_version=PROTOCOL_VERSION))
            return plan_export(transfer, session_id, protocol_version=PROTOCOL_VERSION)

        return self._control(plan, lane=session_id)

    def read_parts(self, parts: Sequence[Part]) -> asyncio.Future[bytes]:
        """A piece of a plan's bytes (``parts`` in order), read on the worker between forwards: it owns the
        device and the pool."""
        return self._control(lambda _runner: b"".join(piece_bytes(part()) for part in parts), lane=None)

    def import_session(self, session_id: str, snapshot: SessionSnapshot) -> asyncio.Future[None]:
        """Resolves once ``snapshot`` is resident as ``session_id``; :class:`SnapshotRefused` when it does not fit."""

        def adopt(runner: Runtime) -> None:
            import_session(transferable(runner), session_id, snapshot, protocol_version=PROTOCOL_VERSION)
            if snapshot.resident:
                self._produced.add(session_id)  # its chunks were produced elsewhere: a later eviction says so
            self._encoders.restart_stream(session_id)

        return self._control(adopt, lane=None)

    def import_step(self, job: SessionImport, step: Callable[[ARRunner], _T]) -> asyncio.Future[_T]:
        """One step of a streamed import (``job.begin``, ``write``, ``finish``, ``abort``: runner/snapshot_import.py)
        on the worker, which owns the pool. While the import holds the session resident, its chunks count as
        produced elsewhere, as for :meth:`import_session`."""

        def run(runner: Runtime) -> _T:
            try:
                return step(transferable(runner))
            finally:
                if job.holds and job.session_id not in self._produced:
                    self._produced.add(job.session_id)
                    self._encoders.restart_stream(job.session_id)
                elif not job.holds and job.held:
                    self._produced.discard(job.session_id)

        return self._control(run, lane=None)

    def branch_session(self, source_id: str, boundary: int | None, new_session_id: str) -> asyncio.Future[int]:
        """Resolves to the boundary once ``new_session_id`` is resident, continuing from ``source_id``'s chunk
        boundary ``boundary`` (None: where the source is now); :class:`RewindUnavailable` when the boundary is
        not held, the runtime's capacity error when there is no room."""

        def branch(runner: Runtime) -> int:
            index = runner.branch_session(source_id, boundary, new_session_id)
            # From a later boundary it has a history: an eviction before its next chunk says so. From boundary 0 it
            # has none to lose: its first chunk goes on with the source's rollout from its start, no restart.
            if index > 0:
                self._produced.add(new_session_id)
            self._encoders.restart_stream(new_session_id)
            return index

        return self._control(branch, lane=None)

    def _control(self, function: Callable[[Runtime], _T], *, lane: str | None) -> asyncio.Future[_T]:
        """Run ``function(runner)`` on the worker at the next chunk boundary; its result or error resolves the future."""
        future: asyncio.Future[_T] = self._loop.create_future()

        def job() -> None:
            assert self.runner is not None
            result: _T | None = None
            error: Exception | None = None
            try:
                result = function(self.runner)
            except Exception as exc:  # noqa: BLE001 - handed to the waiter
                error = exc

            def settle() -> None:
                if future.done():  # the waiter gave up
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)  # type: ignore[arg-type]

            if lane is None:
                self._handoff.call(settle)
            else:
                self._encoders.submit(lane, lambda: self._handoff.call(settle))

        with self._cond:
            if self._stopping or self.runner is None:
                future.set_exception(RuntimeError("the model worker is not running"))
                return future
            self._controls.append(job)
            self._cond.notify()
        return future

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
        """Encode a chunk once in each of ``formats`` (codec, quality) for the session's viewers; ``deliver``
        gets them on the event loop. On a lane of their own: the session's next chunk never waits for them."""

        def encode() -> None:
            encoded: dict[tuple[str, int], tuple[bytes, ...]] = {}
            for codec, quality in formats:
                try:
                    encoded[(codec, quality)] = tuple(
                        self._encoders.encode_standalone(
                            frames, codec=codec, quality=quality, chunk_index=chunk_index, tick_id=tick_id
                        )
                    )
                except Exception:  # noqa: BLE001 - its viewers miss this chunk; the session goes on
                    log.exception("session=%s chunk %d: encoding %s for viewers failed", session_id, chunk_index, codec)
            self._handoff.call(lambda: deliver(encoded))

        self._encoders.submit(session_id + VIEWERS_LANE_SUFFIX, encode)

    @property
    def decode_overlap(self) -> bool:
        """Whether decodes run on the decode stage, beside the next forward."""
        return self._decode_stage is not None

    def phases_summary(self) -> dict[str, float | int]:
        with self._times_lock:
            return self.phases.summary()

    def phase_seconds(self) -> tuple[int, float, float, float]:
        """(rounds, DiT s, decode s, overlap s) since start-up, for /metrics."""
        with self._times_lock:
            p = self.phases
            return p.rounds_total, p.dit_seconds_total, p.decode_seconds_total, p.overlap_seconds_total

    def compute_ms_percentiles(self) -> tuple[float | None, float | None]:
        with self._times_lock:
            times = list(self._compute_times)
        if not times:
            return None, None
        return percentile(times, 50) * 1e3, percentile(times, 99) * 1e3

    def stop(self, timeout_s: float) -> None:
        """Finish the running job and queued releases, drop queued ticks, end the thread."""
        with self._cond:
            self._stopping = True
            self._lanes.clear()
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("model worker still busy after %.1f s; leaving it (daemon thread)", timeout_s)
        if self._decode_stage is not None and not self._thread.is_alive():
            self._decode_stage.shutdown()
        # Sessions are closed by now: what the encoders still hold would be dropped on delivery.
        self._encoders.shutdown(wait=not self._thread.is_alive())

    # ---- worker thread ------------------------------------------------------------

    def _main(self) -> None:
        try:
            self.runner = self._build_runner()
            self.runner.on_evict = self._on_evict
            self.model_card = self.runner.model_card()
            if isinstance(self.runner, SplitDecodeRuntime) and self.runner.split_decode:
                self._decode_stage = DecodeStage(self.runner, self.runner.device, on_done=self._wake)
            # Warm-up's round time per batch size: realtime admission's first figures.
            warmup_round_s = self.runner.warmup_round_s
            for sessions, seconds in warmup_round_s.items():
                self.round_times.record(sessions, seconds)
            # What a first round from idle waits against, until rounds are measured.
            self._scheduler.last_round_s = warmup_round_s.get(1, 0.0)
            self._publish_stats()
        except BaseException as exc:  # noqa: BLE001 - reported to the event loop, which decides to exit
            # The hub says why in one line; the traceback is for debugging (a bad --model-options is no bug).
            log.debug("model failed to load", exc_info=True)
            self._loop.call_soon_threadsafe(self._on_ready, exc)
            return
        self._loop.call_soon_threadsafe(self._on_ready, None)
        while True:
            with self._cond:
                work = self._next_work()
            if work is None:
                return
            try:
                if isinstance(work, list):
                    self._run_jobs(work)
                else:
                    work()
            except BaseException:  # noqa: BLE001 - the worker must outlive any one job
                log.exception("worker job failed")
            finally:
                park_idle(self.runner)  # sessions idle past --park-after-s go to host memory (runner/parking.py)
                self._publish_stats()

    def _next_work(self) -> Callable[[], None] | list[TickJob] | None:
        """Wait for the next control job or round of ticks (call with the lock held); None when stopping."""
        assert self.runner is not None
        # A decode in flight is joined before a control job (it sees whole chunks, after their outcomes), before
        # stopping, and once it is done while no round is ready (its chunks must not wait for the next tick; until
        # then a tick that arrives still gets its forward beside the decode: the stage's end wakes this wait).
        while True:
            stage = self._decode_stage
            decoding = stage is not None and stage.busy
            if self._controls:
                return self._join_decode if decoding else self._controls.popleft()
            if self._stopping:
                return self._join_decode if decoding else None
            step = self._scheduler.next_round(self._startable(), self.runner.batch_limit, now=time.monotonic())
            if isinstance(step, Run):
                return self._lanes.take_round(step.sessions)
            if stage is not None and stage.done:
                return self._join_decode
            self._cond.wait(step.seconds)

    def _startable(self) -> tuple[str, ...]:
        """The sessions in line whose next chunk may start now (call with the lock held).

        A tick's chunk binds the session's newest controls and events when it starts (Session.take_chunk_inputs),
        so a session with enough chunks made and not yet written (Session.chunks_ahead_limit) waits here, its
        ticks queued, rather than run ahead of its socket with what it knew then; a credit back wakes the worker.
        """
        lanes = self._lanes
        return tuple(s for s in lanes.line if lanes.front(s).session.may_start_chunk(lanes.lane_length(s)))

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _publish_stats(self) -> None:
        if self.runner is not None:
            self.runner_stats = self.runner.stats()

    def _on_evict(self, session_id: str) -> None:
        log.info("session=%s evicted from the KV pool (least recently used, no connection holds it)", session_id)

    def _release(self, session_id: str) -> None:
        assert self.runner is not None
        self._failed.discard(session_id)
        self._produced.discard(session_id)
        if self.runner.is_resident(session_id):
            self.runner.close_session(session_id)
            log.info("session=%s released its KV", session_id)
        self._encoders.restart_stream(session_id)
        if self.recorder is not None:
            recorder = self.recorder
            self._encoders.submit(session_id, lambda: recorder.finish(session_id))

    def _send(self, outcome: TickOutcome) -> None:
        """Deliver on the event loop, after the session's earlier outcomes."""
        self._encoders.submit(outcome.job.session.id, lambda: self._handoff.call(lambda: self._deliver(outcome)))

    def _run_jobs(self, jobs: list[TickJob]) -> None:
        """Run one round's ticks (distinct sessions) through the runner together; one outcome per tick."""
        assert self.runner is not None
        started = time.perf_counter()
        runnable: list[tuple[TickJob, ChunkInputs, TickRequest]] = []
        for job in jobs:
            session = job.session
            if session.id in self._failed and not job.reset:
                session.absorb_update(job)
                queue_s = started - job.accepted_at
                skipped = TickOutcome(job, OutcomeKind.SKIPPED_FAILED, queue_s=queue_s, error="the session had failed")
                self._send(skipped)
                continue
            inputs: ChunkInputs = session.take_chunk_inputs(job)
            tick = TickRequest(
                session_id=session.id,
                request_id=job.tick_id,
                controls=inputs.controls,
                prompt=inputs.prompt,
                prompt_transition_chunks=inputs.prompt_transition_chunks,
                seed=session.seed,
                reset=job.reset,
                close=job.close,
                applied_event_ids=inputs.applied_event_ids,
                start_image=session.start_image,
                rewind_to=job.rewind_to,
            )
            runnable.append((job, inputs, tick))
        if not runnable:
            return
        produced_before = {job.session.id: job.session.id in self._produced for job, _, _ in runnable}
        try:
            results = self.runner.execute([tick for _, _, tick in runnable])
        except Exception as exc:  # noqa: BLE001 - model errors come back per tick; this is a server fault
            log.exception("runner failed outside any one forward")
            self._join_decode()
            for job, _, _ in runnable:
                error = f"runner failed: {type(exc).__name__}: {exc}"
                self._send(TickOutcome(job, OutcomeKind.INTERNAL, queue_s=started - job.accepted_at, error=error))
            return
        forward_s = time.perf_counter() - started
        # The previous round's decode ran beside this forward: its outcomes go first (each session's in order).
        self._join_decode(beside=(started, started + forward_s),
                          later_events={job.session.id: inputs.events for job, inputs, _ in runnable})
        round_s = time.perf_counter() - started
        self.round_times.record(len(runnable), round_s)
        with self._cond:
            self._scheduler.round_ran([job.session.id for job, _, _ in runnable], round_s)
        # Before any outcome leaves, so a client that has its chunk sees the pool as that round left it.
        self._publish_stats()
        decoding: list[tuple[_Decoding, ChunkResult]] = []
        for (job, inputs, _tick), result in zip(runnable, results):
            queue_s = started - job.accepted_at
            if isinstance(result, ChunkResult) and result.pending is not None and job.session.id in self._failed:
                # Its previous chunk's decode failed while this forward ran: the session is gone, this chunk too.
                self._send(TickOutcome(job, OutcomeKind.SKIPPED_FAILED, queue_s=queue_s, error="the session had failed"))
                continue
            if isinstance(result, TickFailure) and isinstance(result.error, RewindUnavailable):
                # Nothing ran and the session is as it was: only this tick is refused.
                job.session.restore_events(inputs.events)
                refused = TickOutcome(job, OutcomeKind.REWIND_UNAVAILABLE, queue_s=queue_s, error=str(result.error))
                self._send(refused)
                continue
            if isinstance(result, TickFailure):
                self._model_failed(job, inputs, result, queue_s)
                continue
            self._failed.discard(job.session.id)
            self._produced.add(job.session.id)
            restarted = restart_reason(
                reset=job.reset,
                new_rollout=result.new_rollout,
                produced_before=produced_before[job.session.id],
                rewound=result.restarted == "rewind",
            )
            if result.pending is not None:
                decoding.append((_Decoding(job, inputs, restarted, queue_s, forward_s), result))
                continue
            with self._times_lock:
                self._compute_times.append(result.compute_s)
            self._encode_and_send(job, inputs, result, restarted, queue_s)
        if decoding and self._decode_stage is not None:
            self._decode_stage.submit([item for item, _ in decoding], [result for _, result in decoding])
        else:
            with self._times_lock:
                self.phases.record(forward_s, 0.0, 0.0)

    def _join_decode(
        self, beside: tuple[float, float] | None = None, later_events: dict[str, tuple[PendingEvent, ...]] | None = None
    ) -> None:
        """Wait for the decode in flight and send its outcomes; release every session whose decode failed.

        ``beside``: the forward that ran meanwhile (for the overlap figure). ``later_events``: the events
        of each session's tick in that forward, put back behind a failed chunk's own.
        """
        stage = self._decode_stage
        decoded: DecodedRound[_Decoding] | None = None if stage is None else stage.join()
        if decoded is None:
            return
        assert self.runner is not None and isinstance(self.runner, SplitDecodeRuntime)
        forward_s = decoded.items[0].forward_s if decoded.items else 0.0
        shared = 0.0 if beside is None else overlap_s((decoded.started, decoded.ended), beside)
        with self._times_lock:
            self.phases.record(forward_s, decoded.decode_s, shared)
        for item, result in zip(decoded.items, decoded.results):
            if isinstance(result, TickFailure):
                self.runner.fail_session(item.job.session.id)
                item.job.session.restore_events((later_events or {}).get(item.job.session.id, ()))
                self._model_failed(item.job, item.inputs, result, item.queue_s)
                continue
            with self._times_lock:
                self._compute_times.append(result.compute_s)
            self._encode_and_send(item.job, item.inputs, result, item.restarted, item.queue_s)
        # Rewind points taken while that decode ran get its decoder state, before the next decode changes it.
        self.runner.complete_boundaries()
        self._publish_stats()

    def _record(self, session_id: str, share_token: str, result: ChunkResult, restarted: str | None) -> None:
        """Append the chunk to the session's recording (on its encoder lane, in order); a failure costs the
        recording, never the session."""
        assert self.recorder is not None
        fps = float((self.model_card or {}).get("fps") or 16)
        try:
            self.recorder.write(
                session_id, share_token, result.frames, chunk_index=result.chunk_index, restarted=restarted, fps=fps
            )
        except Exception:  # noqa: BLE001 - a disk or encoder fault: the chunk is not recorded, play goes on
            log.exception("session=%s chunk %d not recorded", session_id, result.chunk_index)
            self.recorder.metrics.dropped("error")

    def _model_failed(self, job: TickJob, inputs: ChunkInputs, failure: TickFailure, queue_s: float) -> None:
        """The runner failed closed for this tick's session; the client hears session_failed."""
        session = job.session
        self._failed.add(session.id)
        session.restore_events(inputs.events)
        error = failure.error
        log.warning("session=%s tick=%d model failed: %s", session.id, job.tick_id, error)
        message = f"{type(error).__name__}: {error}"
        self._send(TickOutcome(job, OutcomeKind.MODEL_FAILED, queue_s=queue_s, error=message))

    def _encode_and_send(
        self, job: TickJob, inputs: ChunkInputs, result: ChunkResult, restarted: str | None, queue_s: float
    ) -> None:
        """Queue the chunk on the session's encoder lane; the worker moves on to the next forward."""
        session = job.session
        # Read now, on the worker: a resume may change the codec before the lane runs this.
        codec, quality = session.codec, session.quality
        keep_frames = bool(session.viewer_formats)
        self._encoders.submit(
            session.id,
            lambda: self._encode_and_deliver(job, inputs, result, restarted, queue_s, codec, quality, keep_frames),
        )

    def _encode_and_deliver(
        self,
        job: TickJob,
        inputs: ChunkInputs,
        result: ChunkResult,
        restarted: str | None,
        queue_s: float,
        codec: str,
        quality: int,
        keep_frames: bool = False,
    ) -> None:
        """Runs on an encoder thread, in the session's lane."""
        session = job.session
        encode_started = time.perf_counter()
        try:
            messages = self._encoders.encode(
                session.id,
                result.frames,
                codec=codec,
                quality=quality,
                chunk_index=result.chunk_index,
                tick_id=job.tick_id,
            )
        except Exception as exc:  # noqa: BLE001 - a server fault: the session ends with `internal`
            log.exception("session=%s tick=%d frame encoding failed", session.id, job.tick_id)
            failed = TickOutcome(job, OutcomeKind.INTERNAL, queue_s=queue_s, error=f"frame encoding failed: {exc}")
            self._handoff.call(lambda: self._deliver(failed))
            return
        if self.recorder is not None and session.record_to is not None:
            self._record(session.id, session.record_to, result, restarted)
        chunk = TickOutcome(
            job,
            OutcomeKind.CHUNK,
            chunk_index=result.chunk_index,
            frame_messages=tuple(messages),
            events=inputs.events,
            restarted=restarted,
            queue_s=queue_s,
            compute_s=result.compute_s,
            encode_s=time.perf_counter() - encode_started,
            codec=codec,
            quality=quality,
            frames=result.frames if keep_frames else None,
            rewind_points=result.rewind_held,
        )
        self._handoff.call(lambda: self._deliver(chunk))

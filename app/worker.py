"""The model worker: one thread owns the runtime, the pipeline and the device.

The event loop never runs model code and never touches the runtime. Its verbs
here are three: :meth:`ModelWorker.submit` (an accepted tick),
:meth:`ModelWorker.drop_session` (a release) and :meth:`ModelWorker.call`,
which runs a function on this thread at the next chunk boundary and resolves a
future on the loop: exports, imports, branches and parking go through it
(app/transfers.py). Outcomes go to app/delivery.py, whose encoder threads
encode frames and hand each :class:`TickOutcome` to the loop while the next
forward runs, in order per session.

Scheduling: control jobs (releases, calls) run first at every chunk boundary,
so a session that went away frees its KV before anyone else's chunk needs
room. Which ticks run next is :mod:`arstream.app.scheduler`'s decision, made
under the worker's lock. A round is the next tick of each of up to
``runtime.batch_limit`` sessions, handed to :meth:`Runtime.execute` together;
every tick gets its own outcome, and a model failure fails only its session.
Each round's wall time is recorded per number of sessions in it, for realtime
admission (:mod:`arstream.app.admission`). The queue is bounded by the
sessions' credits (sessions x ``max_pending_ticks``).

Decode overlap (a runtime with ``split_decode``): a round's forward returns
latents, which :class:`~arstream.app.decode_stage.DecodeStage` decodes while
the next round's forward runs. The worker joins that decode after the next
forward and sends its outcomes before anything of the next round; a decode
failure releases that session (fail closed) and its next chunk is dropped.
Control jobs and idle waits join the decode first.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .admission import RoundTimes
from .decode_stage import DecodedRound, Decoding, DecodeStage, WorkerTimes, overlap_s
from .delivery import Delivery, OutcomeKind, SessionPosition, TickOutcome, deliver_to_session
from .scheduler import RoundScheduler, Run, TickLanes
from .session import ChunkInputs, PendingEvent, TickJob, restart_reason, tick_request
from ..runner.capabilities import SupervisesRanks
from ..runner.runtimes import Runtime, SplitDecodeRuntime, park_idle
from ..runner.stats import RunnerStats
from ..runner.types import ChunkResult, ReplicaLost, RewindUnavailable, TickFailure, TickRequest

# The outcome types are app/delivery.py's; the worker's callers have always found them here.
__all__ = [
    "ModelWorker", "OnWorkerThread", "OutcomeKind", "QueueBoundExceeded", "SessionPosition", "TickOutcome",
    "deliver_to_session",
]

log = logging.getLogger("arstream.worker")

COMPUTE_TIMES_KEPT = 4096
_T = TypeVar("_T")


@dataclass(frozen=True)
class OnWorkerThread:
    """What a function that :meth:`ModelWorker.call` runs is handed, on the worker's thread."""

    runtime: Runtime
    produced: set[str]  # sessions whose chunks were produced, here or elsewhere (its KV gone: it was evicted)
    restart_stream: Callable[[str], None]  # the session's next chunk starts a new video stream (a keyframe)


class QueueBoundExceeded(RuntimeError):
    """More ticks were queued than the sessions' credits allow (a server bug)."""


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
        self._on_ready = on_ready
        # told (on the event loop) when the runtime lost a device of its replica: the server then stops
        self.on_replica_lost: Callable[[str], None] | None = None
        self._max_pending_ticks = max_pending_ticks
        self._cond = threading.Condition()
        # Each session's queued ticks and the round-robin line (guarded by _cond).
        self._lanes: TickLanes[TickJob] = TickLanes()
        self._scheduler = RoundScheduler(batch_wait_fraction)
        self._controls: deque[Callable[[], None]] = deque()
        self._stopping = False
        self.runtime: Runtime | None = None
        self.runner_stats: RunnerStats | None = None
        self.model_card: dict[str, Any] | None = None
        self.prepare_prompt: Callable[[str], str] | None = None  # the model's, published once it is loaded
        # Worker-thread bookkeeping per session id: its last forward failed (only a reset runs next) / its chunks
        # were produced, here or elsewhere (an import, a branch: its KV gone without a release was evicted).
        self._failed: set[str] = set()
        self._produced: set[str] = set()
        self.times = WorkerTimes(COMPUTE_TIMES_KEPT)
        self.round_times = RoundTimes()
        self._decode_stage: DecodeStage[Decoding] | None = None
        self.delivery = Delivery(loop, deliver, encode_threads=encode_threads, encoder_nice=encoder_nice)
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

    def session_position(self, session_id: str) -> asyncio.Future[SessionPosition]:
        """Resolves with where the session stands once none of its ticks is running: a call through the
        session's lane, so the outcomes of its earlier ticks reach the loop first. It is asked for on resume,
        so the session's next chunk also starts a new video stream (a keyframe) the client can decode from."""

        def report(on: OnWorkerThread) -> SessionPosition:
            on.restart_stream(session_id)
            return SessionPosition(
                next_chunk_index=on.runtime.next_chunk_index(session_id),
                failed=session_id in self._failed,
                evicted=session_id in on.produced
                and session_id not in self._failed
                and not on.runtime.is_resident(session_id),
            )

        return self.call(report, lane=session_id)

    def call(self, function: Callable[[OnWorkerThread], _T], *, lane: str | None = None) -> asyncio.Future[_T]:
        """Run ``function`` on the worker's thread at the next chunk boundary (a control job, after the decode in
        flight); its result or error resolves the future on the event loop. It is handed the runtime and the
        worker's record of produced sessions (:class:`OnWorkerThread`): the one way anything else reaches them
        (app/transfers.py: exports, imports, branches, parking).

        ``lane``: resolve through that session's encoder lane, after the outcomes of its earlier ticks (the
        client then has every chunk before it); None: as soon as it has run.
        """
        future: asyncio.Future[_T] = self._loop.create_future()

        def job() -> None:
            assert self.runtime is not None
            result: _T | None = None
            error: Exception | None = None
            try:
                result = function(OnWorkerThread(self.runtime, self._produced, self.delivery.encoders.restart_stream))
            except Exception as exc:  # noqa: BLE001 - handed to the waiter
                error = exc

            def settle() -> None:
                if future.done():  # the waiter gave up
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)  # type: ignore[arg-type]

            self.delivery.after_lane(lane, settle)

        with self._cond:
            if self._stopping or self.runtime is None:
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
        """Encode a chunk once in each of ``formats`` for the session's viewers (app/delivery.py)."""
        self.delivery.encode_for_viewers(
            session_id, frames, formats, chunk_index=chunk_index, tick_id=tick_id, deliver=deliver
        )

    def recording_pauses(self, session_id: str) -> None:
        """The session stopped recording: its file ends after its chunks already on their lane (app/delivery.py)."""
        self.delivery.recording_pauses(session_id)

    @property
    def decode_overlap(self) -> bool:
        """Whether decodes run on the decode stage, beside the next forward."""
        return self._decode_stage is not None

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
        self.delivery.encoders.shutdown(wait=not self._thread.is_alive())

    # ---- worker thread ------------------------------------------------------------

    def _main(self) -> None:
        try:
            self.runtime = self._build_runner()
            self.runtime.on_evict = lambda session_id: log.info(
                "session=%s evicted from the KV pool (least recently used, no connection holds it)", session_id
            )
            self.model_card = self.runtime.model_card()
            self.delivery.fps = float(self.model_card.get("fps") or 16)
            self.prepare_prompt = self.runtime.prepare_prompt  # thread-safe: the hub runs it as prompts arrive
            if isinstance(self.runtime, SupervisesRanks):
                self.runtime.on_rank_lost = self._rank_lost
            if isinstance(self.runtime, SplitDecodeRuntime) and self.runtime.split_decode:
                self._decode_stage = DecodeStage(self.runtime, self.runtime.device, on_done=self._wake)
            # Warm-up's round time per batch size: realtime admission's first figures.
            warmup_round_s = self.runtime.warmup_round_s
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
                park_idle(self.runtime)  # sessions idle past --park-after-s go to host memory (runner/parking.py)
                self._publish_stats()

    def _rank_lost(self, reason: str) -> None:
        """From the runtime's watchdog: a rank of the replica exited or hung. Fail the replica on this thread at
        the next chunk boundary (an idle one has no tick to find out with)."""
        log.error("%s", reason)
        with self._cond:
            self._controls.append(self._check_ranks)
            self._cond.notify()

    def _check_ranks(self) -> None:
        assert isinstance(self.runtime, SupervisesRanks)
        try:
            self.runtime.check_ranks()
        except ReplicaLost as lost:
            if self.on_replica_lost is not None:
                self._loop.call_soon_threadsafe(self.on_replica_lost, str(lost))

    def _next_work(self) -> Callable[[], None] | list[TickJob] | None:
        """Wait for the next control job or round of ticks (call with the lock held); None when stopping."""
        assert self.runtime is not None
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
            step = self._scheduler.next_round(self._startable(), self.runtime.batch_limit, now=time.monotonic())
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
        if self.runtime is not None:
            self.runner_stats = self.runtime.stats()

    def _release(self, session_id: str) -> None:
        assert self.runtime is not None
        self._failed.discard(session_id)
        self._produced.discard(session_id)
        if self.runtime.is_resident(session_id):
            self.runtime.close_session(session_id)
            log.info("session=%s released its KV", session_id)
        self.delivery.encoders.restart_stream(session_id)
        self.delivery.recording_ends(session_id)

    def _run_jobs(self, jobs: list[TickJob]) -> None:
        """Run one round's ticks (distinct sessions) through the runner together; one outcome per tick."""
        assert self.runtime is not None
        started = time.perf_counter()
        runnable: list[tuple[TickJob, ChunkInputs, TickRequest]] = []
        for job in jobs:
            session = job.session
            if session.id in self._failed and not job.reset:
                session.absorb_update(job)
                queue_s = started - job.accepted_at
                skipped = TickOutcome(job, OutcomeKind.SKIPPED_FAILED, queue_s=queue_s, error="the session had failed")
                self.delivery.send(skipped)
                continue
            inputs: ChunkInputs = session.take_chunk_inputs(job)
            tick = tick_request(job, inputs)
            runnable.append((job, inputs, tick))
        if not runnable:
            return
        produced_before = {job.session.id: job.session.id in self._produced for job, _, _ in runnable}
        try:
            results = self.runtime.execute([tick for _, _, tick in runnable])
        except Exception as exc:  # noqa: BLE001 - model errors come back per tick; this is a server fault
            log.exception("runner failed outside any one forward")
            self._join_decode()
            for job, _, _ in runnable:
                error = f"runner failed: {type(exc).__name__}: {exc}"
                self.delivery.send(TickOutcome(job, OutcomeKind.INTERNAL, queue_s=started - job.accepted_at, error=error))
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
        decoding: list[tuple[Decoding, ChunkResult]] = []
        for (job, inputs, _tick), result in zip(runnable, results):
            queue_s = started - job.accepted_at
            if isinstance(result, ChunkResult) and result.pending is not None and job.session.id in self._failed:
                # Its previous chunk's decode failed while this forward ran: the session is gone, this chunk too.
                self.delivery.send(TickOutcome(job, OutcomeKind.SKIPPED_FAILED, queue_s=queue_s, error="the session had failed"))
                continue
            if isinstance(result, TickFailure) and isinstance(result.error, RewindUnavailable):
                # Nothing ran and the session is as it was: only this tick is refused.
                job.session.restore_events(inputs.events)
                refused = TickOutcome(job, OutcomeKind.REWIND_UNAVAILABLE, queue_s=queue_s, error=str(result.error))
                self.delivery.send(refused)
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
                decoding.append((Decoding(job, inputs, restarted, queue_s, forward_s), result))
                continue
            self.times.chunk(result.compute_s)
            self.delivery.encode_and_send(job, inputs, result, restarted, queue_s)
        if decoding and self._decode_stage is not None:
            self._decode_stage.submit([item for item, _ in decoding], [result for _, result in decoding])
        else:
            self.times.round(forward_s, 0.0, 0.0)

    def _join_decode(
        self, beside: tuple[float, float] | None = None, later_events: dict[str, tuple[PendingEvent, ...]] | None = None
    ) -> None:
        """Wait for the decode in flight and send its outcomes; release every session whose decode failed.

        ``beside``: the forward that ran meanwhile (for the overlap figure). ``later_events``: the events
        of each session's tick in that forward, put back behind a failed chunk's own.
        """
        stage = self._decode_stage
        decoded: DecodedRound[Decoding] | None = None if stage is None else stage.join()
        if decoded is None:
            return
        assert self.runtime is not None and isinstance(self.runtime, SplitDecodeRuntime)
        forward_s = decoded.items[0].forward_s if decoded.items else 0.0
        shared = 0.0 if beside is None else overlap_s((decoded.started, decoded.ended), beside)
        self.times.round(forward_s, decoded.decode_s, shared)
        for item, result in zip(decoded.items, decoded.results):
            if isinstance(result, TickFailure):
                self.runtime.fail_session(item.job.session.id)
                item.job.session.restore_events((later_events or {}).get(item.job.session.id, ()))
                self._model_failed(item.job, item.inputs, result, item.queue_s)
                continue
            self.times.chunk(result.compute_s)
            self.delivery.encode_and_send(item.job, item.inputs, result, item.restarted, item.queue_s)
        # Rewind points taken while that decode ran get its decoder state, before the next decode changes it.
        self.runtime.complete_boundaries()
        self._publish_stats()

    def _model_failed(self, job: TickJob, inputs: ChunkInputs, failure: TickFailure, queue_s: float) -> None:
        """The runner failed closed for this tick's session; the client hears session_failed."""
        session = job.session
        self._failed.add(session.id)
        session.restore_events(inputs.events)
        error = failure.error
        log.warning("session=%s tick=%d model failed: %s", session.id, job.tick_id, error)
        if isinstance(error, ReplicaLost) and self.on_replica_lost is not None:
            self._loop.call_soon_threadsafe(self.on_replica_lost, str(error))
        message = f"{type(error).__name__}: {error}"
        self.delivery.send(TickOutcome(job, OutcomeKind.MODEL_FAILED, queue_s=queue_s, error=message))
